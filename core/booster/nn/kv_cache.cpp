// The key/value cache and the attention over it (kv_cache.h, Note [Key/value cache]).
#include "booster/nn/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "booster/common/error.h"
#include "booster/ops/ops.h"
#include "booster/tensor/grad_mode.h"

namespace booster::nn {

std::pair<Tensor, Tensor> LayerKVCache::append(const Tensor& k, const Tensor& v) {
  BOOSTER_CHECK(k.dim() == 4 && v.shape() == k.shape(), ShapeError,
                "KVCache: expected keys and values [B, kv_heads, T, head_dim] of one shape, got ", k.shape(), " and ",
                v.shape());
  BOOSTER_CHECK(k.dtype() == v.dtype() && k.device() == v.device(), DTypeError,
                "KVCache: keys and values must share dtype and device, got ", k.dtype(), " on ", k.device(), " and ",
                v.dtype(), " on ", v.device());
  const int64_t T = k.size(2), needed = length_ + T;
  if (k_.defined()) {
    BOOSTER_CHECK(k.size(0) == k_.size(0) && k.size(1) == k_.size(1) && k.size(3) == k_.size(3) &&
                      k.dtype() == k_.dtype() && k.device() == k_.device(),
                  ShapeError, "KVCache: new keys ", k.shape(), " (", k.dtype(), " on ", k.device(),
                  ") do not match the cached ", k_.shape(), " (", k_.dtype(), " on ", k_.device(),
                  "); clear() the cache or make a new one for another batch");
  }
  NoGradGuard no_grad;  // the cache is inference state: nothing flows back through it
  if (!k_.defined() || needed > k_.size(2)) {
    // Geometric growth (Note [Key/value cache]): the hint on the first append, at least twice the old size after.
    const int64_t old = k_.defined() ? k_.size(2) : 0;
    const int64_t capacity = std::max({needed, 2 * old, capacity_hint_});
    const Shape shape = {k.size(0), k.size(1), capacity, k.size(3)};
    Tensor nk = Tensor::empty(shape, k.dtype(), k.device()), nv = Tensor::empty(shape, v.dtype(), v.device());
    if (length_ > 0) {
      nk.narrow(2, 0, length_).copy_(k_.narrow(2, 0, length_));
      nv.narrow(2, 0, length_).copy_(v_.narrow(2, 0, length_));
    }
    k_ = nk;
    v_ = nv;
  }
  k_.narrow(2, length_, T).copy_(k.detach());
  v_.narrow(2, length_, T).copy_(v.detach());
  length_ = needed;
  return {k_.narrow(2, 0, length_), v_.narrow(2, 0, length_)};
}

KVCache::KVCache(int64_t layers, int64_t capacity_hint) {
  BOOSTER_CHECK(layers > 0 && capacity_hint >= 0, ValueError, "KVCache: expected a positive number of layers and a ",
                "capacity >= 0, got ", layers, " and ", capacity_hint);
  layers_.assign(size_t(layers), LayerKVCache(capacity_hint));
}

LayerKVCache& KVCache::layer(int64_t i) {
  BOOSTER_CHECK(i >= 0 && i < num_layers(), ValueError, "KVCache: layer ", i, " of a cache of ", num_layers(),
                " layers; was the cache made for another model?");
  return layers_[size_t(i)];
}

void KVCache::clear() {
  for (LayerKVCache& l : layers_) l.clear();
}

Tensor cached_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t start) {
  BOOSTER_CHECK(q.dim() == 4 && k.dim() == 4 && v.shape() == k.shape() && q.size(0) == k.size(0) &&
                    q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
                ShapeError, "cached_attention: expected q [B, heads, L, E] and k, v [B, kv_heads, S, E] with heads a ",
                "multiple of kv_heads, got ", q.shape(), ", ", k.shape(), " and ", v.shape());
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3), KVH = k.size(1), S = k.size(2);
  BOOSTER_CHECK(start >= 0 && start + L == S, ShapeError, "cached_attention: ", L, " new queries from position ", start,
                " need ", start + L, " cached keys, got ", S);
  const int64_t rep = H / KVH;
  if (L == 1) {
    // One new position attends to every key: no mask. Grouped heads fold into the query length.
    if (rep == 1) return scaled_dot_product_attention(q, k, v, false);
    const Tensor y = scaled_dot_product_attention(q.reshape({B, KVH, rep, E}), k, v, false);
    return y.reshape({B, H, 1, E});
  }
  auto repeat = [&](const Tensor& t) {
    return rep == 1 ? t : t.unsqueeze(2).expand({B, KVH, rep, S, E}).reshape({B, H, S, E});
  };
  const Tensor kr = repeat(k), vr = repeat(v);
  if (start == 0) return scaled_dot_product_attention(q, kr, vr, true);  // the top-left mask is the right one
  // A chunk after a prefix: the bottom-right aligned mask, written out.
  std::vector<float> mask(size_t(L * S), 0.0f);
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = start + i + 1; j < S; ++j) mask[size_t(i * S + j)] = -std::numeric_limits<float>::infinity();
  const Tensor m = from_vector(mask, {L, S}).to(q.device(), q.dtype());
  const Tensor scores = matmul(q, kr.transpose(2, 3)) * (1.0 / std::sqrt(double(E)));
  return matmul(softmax(scores + m, -1), vr);
}

}  // namespace booster::nn
