// Which process of a job prints: Accelerate's accelerator.is_main_process and accelerator.print.
//
//   if (booster::is_main_process()) save_plot(...);        // once per job, not once per rank
//   booster::print_main("step ", step, " loss ", loss);   // a line on stdout from rank 0 only
//
// Under `booster run -n N` (or any mpirun) every rank runs the same program, so a plain print appears
// N times. The main process is rank 0 of the job: of the default process group once it has several
// processes, else as the launcher numbered the processes (OMPI_COMM_WORLD_RANK, PMI_RANK, torchrun's RANK), which holds
// before MPI starts and for the single-process plugin started N times. Without a launcher it is this
// process. Neither function communicates: call them from any rank at any time.
#pragma once

#include <string>

#include "booster/common/error.h"

namespace booster {

// True on rank 0 of the job, and in a process started without a launcher.
bool is_main_process();

// Writes `line` and a newline to stdout, in one write, on the main process only.
void print_main_line(const std::string& line);

// print_main_line of the arguments streamed one after another (booster::str).
template <class... Args>
void print_main(const Args&... args) {
  if (is_main_process()) print_main_line(str(args...));
}

}  // namespace booster
