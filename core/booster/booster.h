// The whole public API in one include, as <torch/torch.h>: the Booster and its plugin SDKs, tensors
// and ops, autograd and autocast, nn, optim and LR schedulers, data, mixed precision, distributed
// process groups, checkpoints and configs. Installed under <prefix>/include; link booster::core
// (find_package(booster)). Kernels and backend loops are private and not installed.
#pragma once

// Tensors, ops, autograd, autocast.
#include "booster/autocast/autocast.h"
#include "booster/autograd/autograd.h"
#include "booster/booster/build_info.h"
#include "booster/common/error.h"
#include "booster/common/error_context.h"
#include "booster/common/threads.h"
#include "booster/ops/ops.h"
#include "booster/tensor/deferred.h"
#include "booster/tensor/dtype.h"
#include "booster/tensor/half.h"
#include "booster/tensor/random.h"
#include "booster/tensor/tensor.h"

// Models and training parts.
#include "booster/data/data.h"
#include "booster/nn/nn.h"
#include "booster/optim/lr_scheduler.h"
#include "booster/optim/optimizer.h"

// Mixed precision: the strategy interface, the registry and the building blocks of the precision SDK.
#include "booster/mixed_precision/dynamic_grad_scaler.h"
#include "booster/mixed_precision/grad_scaler.h"
#include "booster/mixed_precision/loss_scaler.h"
#include "booster/mixed_precision/master_weight_optimizer.h"
#include "booster/mixed_precision/mixed_precision.h"
#include "booster/mixed_precision/precision_strategy.h"

// Processes, checkpoints, configs.
#include "booster/checkpoint/checkpoint.h"
#include "booster/checkpoint/safetensors.h"
#include "booster/config/config.h"
#include "booster/config/memory_estimate.h"
#include "booster/config/option_reader.h"
#include "booster/config/training.h"
#include "booster/distributed/device_mesh.h"
#include "booster/distributed/process_group.h"

// The Booster, the compatibility matrix and the plugin boundary (parallel plugins, the loader, ABI).
#include "booster/booster/booster.h"
#include "booster/booster/compat.h"
#include "booster/trainer/main_process.h"
#include "booster/trainer/progress.h"
#include "booster/trainer/signals.h"
#include "booster/trainer/trainer.h"
#include "booster/plugin/abi.h"
#include "booster/plugin/data_parallel.h"
#include "booster/plugin/loader.h"
#include "booster/plugin/parallel_plugin.h"
