// `booster doctor --config FILE [--steps N]`: N training steps of the config's run with the tracer
// taking per-module statistics at every step, then, on stdout, the per-module table, the findings, the
// recommendation and, as the last line, the whole report as JSON (`booster plot --doctor` draws it).
// Nothing is written to disk and no checkpoint is read: the run starts from the config's model.
#include <iostream>
#include <vector>

#include "booster/diagnostics/doctor.h"
#include "commands.h"

namespace booster::cli {

using nlohmann::json;

int doctor(const json& config, BoosterComponents components, int64_t steps) {
  std::vector<diagnostics::ModuleStats> totals;
  TrainingHooks hooks;
  hooks.adjust = [steps](TrainerOptions& o) {
    // Every epoch has at least one step, so `steps` epochs hold them all; max_steps stops there.
    o.max_steps = steps;
    o.epochs = std::max<int64_t>(o.epochs, steps);
    o.run_dir.reset();
    o.checkpoint_dir.reset();
    o.checkpoint_every = 0;
    o.resume.clear();
    o.diagnostics.every = 1;
    o.diagnostics.name_nonfinite = true;
  };
  hooks.evaluate = false;
  hooks.before_fit = [&](Trainer& trainer) {
    trainer.on_diagnostics([&](int64_t, const diagnostics::Tracer& tracer) {
      const std::vector<diagnostics::ModuleStats>& step = tracer.modules();
      if (totals.empty()) totals = step;
      else
        for (size_t m = 0; m < totals.size(); ++m) totals[m].merge(step[m]);
    });
  };
  hooks.after_fit = [&](Booster& booster, Trainer& trainer, const FitResult& result, bool is_rank0) {
    diagnostics::DoctorInput input;
    input.format = diagnostics::compute_format(config.at("mixed_precision"), config.at("plugin"));
    // The precision that ran, as the start line and the summary name it (a plugin that controls
    // precision, low_level_zero, names its own: "fp16 (low_level_zero's own)").
    input.precision = trainer::running_precision(booster);
    input.loss_scale = booster.precision().loss_scale();
    input.steps = result.steps;
    input.modules = totals;
    input.skipped = trainer.skipped_steps();
    const diagnostics::Diagnosis diagnosis = diagnostics::diagnose(input);
    if (!is_rank0) return kExitOk;
    std::cout << "precision doctor: " << input.precision << " (" << input.format << "), " << result.steps
              << " steps, loss scale " << input.loss_scale << "\n\n"
              << diagnostics::format_table(input.modules) << "\n";
    if (const std::string note = diagnostics::cpu_time_note(input.format, config.at("device").get<std::string>());
        !note.empty())
      std::cout << "note: " << note << "\n";
    for (const std::string& finding : diagnosis.findings) std::cout << "finding: " << finding << "\n";
    std::cout << "recommendation: " << diagnosis.recommendation << "\n";
    std::cout << diagnostics::doctor_report(input, diagnosis).dump() << std::endl;
    return kExitOk;
  };
  return run_training(config, std::move(components), hooks);
}

}  // namespace booster::cli
