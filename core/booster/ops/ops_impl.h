// Helpers shared by the op implementations (not part of the public API).
#pragma once

#include "booster/tensor/tensor.h"

namespace booster {

// The broadcast of two shapes (NumPy rules); throws ShapeError naming `op` and both shapes.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
// Throws DeviceError naming `op` when a and b live on different devices.
void check_same_device(const Tensor& a, const Tensor& b, const char* op);

}  // namespace booster
