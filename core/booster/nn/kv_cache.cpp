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

Tensor cached_attention(const Tensor& q, const Tensor& k_all, const Tensor& v_all, int64_t start, int64_t window) {
  BOOSTER_CHECK(q.dim() == 4 && k_all.dim() == 4 && v_all.shape() == k_all.shape() && q.size(0) == k_all.size(0) &&
                    q.size(3) == k_all.size(3) && k_all.size(1) > 0 && q.size(1) % k_all.size(1) == 0,
                ShapeError, "cached_attention: expected q [B, heads, L, E] and k, v [B, kv_heads, S, E] with heads a ",
                "multiple of kv_heads, got ", q.shape(), ", ", k_all.shape(), " and ", v_all.shape());
  BOOSTER_CHECK(window >= 0, ValueError, "cached_attention: the sliding window must be >= 0 (0: none), got ", window);
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3), KVH = k_all.size(1);
  BOOSTER_CHECK(start >= 0 && start + L == k_all.size(2), ShapeError, "cached_attention: ", L,
                " new queries from position ", start, " need ", start + L, " cached keys, got ", k_all.size(2));
  // Keys before the first query's window are never attended (Note [Key/value cache]): they are left out.
  const int64_t first = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
  const Tensor k = first > 0 ? k_all.narrow(2, first, k_all.size(2) - first) : k_all;
  const Tensor v = first > 0 ? v_all.narrow(2, first, v_all.size(2) - first) : v_all;
  const int64_t S = k.size(2), offset = start - first;
  const int64_t rep = H / KVH;
  if (L == 1) {
    // One new position attends to every key left: no mask. Grouped heads fold into the query length.
    if (rep == 1) return scaled_dot_product_attention(q, k, v, false);
    const Tensor y = scaled_dot_product_attention(q.reshape({B, KVH, rep, E}), k, v, false);
    return y.reshape({B, H, 1, E});
  }
  auto repeat = [&](const Tensor& t) {
    return rep == 1 ? t : t.unsqueeze(2).expand({B, KVH, rep, S, E}).reshape({B, H, S, E});
  };
  const Tensor kr = repeat(k), vr = repeat(v);
  if (offset == 0 && window == 0) return scaled_dot_product_attention(q, kr, vr, true);  // top-left is right
  // A chunk after a prefix, or windowed: the bottom-right aligned causal mask (and the window).
  AttentionMask mask;
  mask.window = window;
  mask.query_offset = offset;
  return scaled_dot_product_attention(q, kr, vr, true, std::nullopt, mask);
}

}  // namespace booster::nn
