// What this build of the library contains and what it finds on this machine, for `booster --version`
// and for tests that print why they were skipped. It asks every backend (CUDA, NCCL, MPI, the CPU
// kernels), so it sits at the top, beside the Booster.
//
//   {"cuda": {"compiled": true, "device_count": 1, "devices": ["NVIDIA H100 80GB HBM3"], "reason": ""},
//    "nccl": true, "mpi": true}
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace booster {

// Never throws, also without a driver or GPU ("reason" then says why CUDA is unusable).
nlohmann::json build_info();
// One line: "CUDA: compiled in, 1 device (NVIDIA H100 80GB HBM3); NCCL: yes; MPI: yes".
std::string build_info_line();

}  // namespace booster
