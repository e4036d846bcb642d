// Embedding: a lookup table of num_embeddings rows of embedding_dim (torch.nn.Embedding).
#pragma once

#include "booster/nn/module.h"
#include "booster/tensor/random.h"

namespace booster::nn {

class Embedding : public Module {
 public:
  // weight ~ N(0, 1) from gen (the default generator when null), as PyTorch.
  Embedding(int64_t num_embeddings, int64_t embedding_dim, Generator* gen = nullptr);

  // indices: integer tensor of any shape; returns indices.shape + [embedding_dim].
  Tensor forward(const Tensor& indices) override;
  std::string name() const override { return "Embedding"; }
  std::string extra_repr() const override { return str(num_embeddings, ", ", embedding_dim); }

  int64_t num_embeddings, embedding_dim;
  Tensor weight;  // [num_embeddings, embedding_dim]
};

}  // namespace booster::nn
