// Which physical GPU a device index is, whatever CUDA_VISIBLE_DEVICES renumbered: its PCI bus id
// ("0000:3b:00.0"), so ranks can tell whether they share one (Note [Staged collectives]).
#pragma once

#include <string>

namespace booster::cuda {

// "" without CUDA, without a GPU, or for an index out of range.
std::string pci_bus_id(int index);

}  // namespace booster::cuda
