// Note [Packed sequences] in packing.h.
#include "booster/nn/packing.h"

#include <algorithm>
#include <vector>

#include "booster/common/error.h"
#include "booster/nn/llama.h"
#include "booster/ops/ops.h"

namespace booster::nn {

namespace {
thread_local const SequenceLayout* current_layout = nullptr;
}  // namespace

Tensor pack_sequences(const Tensor& ids, const Tensor& segments) {
  BOOSTER_CHECK(ids.shape() == segments.shape() && (ids.dim() == 1 || ids.dim() == 2), ShapeError,
                "pack_sequences: ids ", ids.shape(), " and segments ", segments.shape(),
                " must both be [B, T] (or [T])");
  const int64_t dim = ids.dim() - 1;
  return stack({ids.to(DType::Int64), segments.to(DType::Int64)}, dim).contiguous();
}

bool is_packed(const Tensor& x) { return x.dim() == 3 && x.size(1) == 2 && !is_floating(x.dtype()); }

std::pair<Tensor, SequenceLayout> unpack_sequences(const Tensor& x) {
  BOOSTER_CHECK(is_packed(x), ShapeError, "unpack_sequences: expected a packed input, integer [B, 2, T], got ",
                x.dtype(), " ", x.shape());
  const Tensor ids = x.select(1, 0).contiguous();
  SequenceLayout layout;
  layout.segments = x.select(1, 1).contiguous();
  // Positions restart where the document id changes.
  const Tensor seg = layout.segments.cpu().to(DType::Int64).contiguous();
  const int64_t B = seg.size(0), T = seg.size(1);
  Tensor pos = Tensor::empty({B, T}, DType::Int64);
  const int64_t* s = seg.data<int64_t>();
  int64_t* p = pos.data<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      p[b * T + t] = t > 0 && s[b * T + t] == s[b * T + t - 1] ? p[b * T + t - 1] + 1 : 0;
  layout.positions = pos.to(x.device());
  return {ids, layout};
}

const SequenceLayout* current_sequence_layout() { return current_layout; }

SequenceLayoutScope::SequenceLayoutScope(SequenceLayout layout) : layout_(std::move(layout)), previous_(current_layout) {
  current_layout = &layout_;
}

SequenceLayoutScope::~SequenceLayoutScope() { current_layout = previous_; }

Tensor rotate_at_positions(RotaryEmbedding& rotary, const Tensor& x, const Tensor& positions) {
  const int64_t head_dim = rotary.head_dim;
  BOOSTER_CHECK(x.dim() == 4 && x.size(3) == head_dim && positions.dim() == 2 && positions.size(0) == x.size(0) &&
                    positions.size(1) == x.size(1),
                ShapeError, "rotate_at_positions: expected x [B, T, heads, ", head_dim, "] and positions [B, T], got ",
                x.shape(), " and ", positions.shape());
  const int64_t B = x.size(0), T = x.size(1), half = head_dim / 2;
  // Positions within a document are below T: the table of the first T positions holds them all.
  auto [cos, sin] = rotary.cos_sin(T, x.device(), x.dtype());
  const Tensor flat = positions.reshape({B * T}).to(x.device());
  const Tensor c = index_select(cos, 0, flat).view({B, T, 1, head_dim});
  const Tensor s = index_select(sin, 0, flat).view({B, T, 1, head_dim});
  const Tensor swapped = cat({x.narrow(3, half, half), x.narrow(3, 0, half)}, 3);  // cat(x2, x1), as apply
  return x * c + swapped * s;
}

}  // namespace booster::nn
