// Stopping a run cleanly on SIGINT (Ctrl-C), SIGTERM (a cluster's preemption) and SIGHUP (a closed terminal).
//
//   trainer::StopOnSignal stop;                       // handlers installed while it lives
//   for (...) {
//     ...train one step...
//     if (stop.agreed(booster.process_group())) { booster.save_state(root); break; }
//   }
//
// Note [Stopping on a signal]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The first SIGINT, SIGTERM or SIGHUP only records the signal; the loop finishes its step, saves a checkpoint
// and exits non-zero (the Trainer throws InterruptedError; `booster train` exits 128 + the signal, as a
// shell reports a process killed by it). A second one exits at once (status 128 + signal) without
// saving: the user asked twice. Copies of one request that arrive within a second of it (a cluster's
// SIGTERM to every process, which the launcher forwards again; Ctrl-C to a terminal's process group)
// are that one request, not a second. Under several processes the ranks must stop after the same step, or
// the collective save would hang: agreed() all-reduces every rank's request (a max of one int) so that
// one rank's signal (mpirun forwards SIGTERM to all, a terminal's Ctrl-C reaches all, a scheduler may
// signal one) stops every rank together. SIGHUP (a closed terminal or ssh session) is a request as
// SIGTERM is, and so is SIGUSR1 (a scheduler's warning before it ends a job). `booster run` asks every
// rank to stop with a real-time signal per original (launcher_signal), which mpirun passes on and the
// handler takes as the original, so the ranks report the Ctrl-C, SIGTERM or SIGHUP booster run got
// (Note [Signals under booster run] in cli/run.cpp). The handlers are those of the process: the
// outermost StopOnSignal installs them, and its destructor puts back those that were there before.
//
// A run is not only its loop: reading the data, building the model and loading a checkpoint come
// before it, the last evaluation and save after it. `booster train` holds a StopOnSignal for the whole
// command, and the Trainer's own nests in it: a nested one installs nothing and keeps the request, so
// a signal while the ranks are starting stops the run before its first step (fit() looks before it),
// one during the last step, evaluation or save is seen once they are done, and its line says the run is
// complete rather than how to resume it (nothing is left to train), and one after fit() is seen by the
// command; none is lost, and none ends the run with status 0 or without a line saying so.
#pragma once

#include "booster/distributed/process_group.h"

namespace booster::trainer {

class StopOnSignal {
 public:
  // `announce`: the first signal prints one line saying the run will stop after this step (rank 0 says
  // it; the others stay quiet).
  explicit StopOnSignal(bool announce = true);
  ~StopOnSignal();
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;

  // The signal this process received (SIGINT, SIGTERM, SIGHUP, SIGUSR1), 0 for none.
  int requested() const;
  // The signal any rank of `group` received, 0 for none. Collective: every rank calls it at the same point.
  int agreed(distributed::ProcessGroup& group) const;
  // "SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1".
  static const char* signal_name(int signal);
  // The signal `booster run` sends mpirun to forward for `original` (SIGINT, SIGTERM or SIGHUP; 0 for
  // another): SIGRTMIN + 4, 5 or 6, which every rank's handler takes as `original`.
  static int launcher_signal(int original);
  // Whether a training loop runs, which stops after its step; else the run stops at its next safe point
  // (before the first step, after the last is saved). Only the first signal's announcement differs.
  static void set_in_loop(bool in_loop);
};

}  // namespace booster::trainer
