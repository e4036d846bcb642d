// The data layer: datasets, samplers, the DataLoader (PyTorch's torch.utils.data semantics).
#pragma once

#include "booster/data/dataloader.h"
#include "booster/data/dataset.h"
#include "booster/data/fashion_mnist.h"
#include "booster/data/sampler.h"
#include "booster/data/synthetic.h"
