#include "booster/nn/embedding.h"

#include "booster/nn/init.h"
#include "booster/ops/ops.h"

namespace booster::nn {

Embedding::Embedding(int64_t num, int64_t dim, Generator* gen) : num_embeddings(num), embedding_dim(dim) {
  BOOSTER_CHECK(num > 0 && dim > 0, ValueError, "Embedding: num_embeddings and embedding_dim must be positive, got ",
                num, " and ", dim);
  weight = register_parameter("weight", Tensor::empty({num, dim}));
  init::normal_(weight, 0.0, 1.0, gen ? *gen : default_generator());
}

Tensor Embedding::forward(const Tensor& indices) {
  BOOSTER_CHECK(indices.dtype() == DType::Int64 || indices.dtype() == DType::Int32, DTypeError,
                "Embedding: expected int64 or int32 indices, got ", indices.dtype());
  return embedding(weight, indices);
}

}  // namespace booster::nn
