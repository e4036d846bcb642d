// The data layer: datasets, samplers, the DataLoader (PyTorch's torch.utils.data semantics), the
// readers of data files (Fashion-MNIST's IDX, NumPy's .npy/.npz, CSV, token files) with the data sets
// built on them, and the SentencePiece tokenizer.
#pragma once

#include "booster/data/csv.h"
#include "booster/data/dataloader.h"
#include "booster/data/dataset.h"
#include "booster/data/fashion_mnist.h"
#include "booster/data/file_dataset.h"
#include "booster/data/npy.h"
#include "booster/data/sampler.h"
#include "booster/data/synthetic.h"
#include "booster/data/tokenizer.h"
#include "booster/data/tokens.h"
