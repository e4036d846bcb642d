// Everything in booster::nn: Module, the layers, the models, make_model and the model registry.
#pragma once

#include "booster/nn/activation.h"
#include "booster/nn/activation_checkpoint.h"
#include "booster/nn/container.h"
#include "booster/nn/cnn.h"
#include "booster/nn/conv.h"
#include "booster/nn/dropout.h"
#include "booster/nn/embedding.h"
#include "booster/nn/init.h"
#include "booster/nn/linear.h"
#include "booster/nn/loss.h"
#include "booster/nn/model_registry.h"
#include "booster/nn/models.h"
#include "booster/nn/module.h"
#include "booster/nn/normalization.h"
#include "booster/nn/tensor_parallel.h"
#include "booster/nn/transformer.h"
