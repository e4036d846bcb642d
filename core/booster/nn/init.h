// Parameter initialisation, in place and outside autograd (torch.nn.init). Every draw comes from the
// given Generator, so a model built from one seed is the same on every machine.
#pragma once

#include "booster/tensor/random.h"
#include "booster/tensor/tensor.h"

namespace booster::nn::init {

// U(low, high) for every element.
void uniform_(const Tensor& t, double low, double high, Generator& gen);
// N(mean, std^2) for every element.
void normal_(const Tensor& t, double mean, double std, Generator& gen);
void zeros_(const Tensor& t);
void ones_(const Tensor& t);

// fan_in of a weight [out, in, ...]: in times the receptive field, as torch.nn.init.
int64_t fan_in(const Tensor& weight);

}  // namespace booster::nn::init
