// is_main_process and print_main (main_process.h).
#include "booster/trainer/main_process.h"

#include <cstdio>
#include <iostream>

#include "booster/trainer/progress.h"

namespace booster {

bool is_main_process() { return trainer::process_rank() == 0; }

void print_main_line(const std::string& line) {
  if (!is_main_process()) return;
  std::cout << line + "\n";
  std::cout.flush();
}

}  // namespace booster
