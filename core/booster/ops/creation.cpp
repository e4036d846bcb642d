// Tensor creation: constants, ranges, seeded random numbers, host vectors.
#include <cmath>

#include "booster/common/error_context.h"
#include "booster/ops/ops.h"

namespace booster {

Tensor zeros(const Shape& shape, DType dtype, Device device) { return full(shape, 0.0, dtype, device); }
Tensor ones(const Shape& shape, DType dtype, Device device) { return full(shape, 1.0, dtype, device); }

Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  BOOSTER_OP_CONTEXT("full");  // Note [Error context]
  Tensor t = Tensor::empty(shape, dtype, device);
  t.fill_(value);
  return t;
}

Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), t.dtype(), t.device()); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), t.dtype(), t.device()); }
Tensor full_like(const Tensor& t, double value) { return full(t.shape(), value, t.dtype(), t.device()); }
Tensor empty_like(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), t.device()); }

Tensor scalar_tensor(double value, DType dtype, Device device) { return full({}, value, dtype, device); }

namespace {

// Fills a float64 host buffer with f(i) and converts it to the requested dtype.
template <class F>
Tensor generate(const Shape& shape, DType dtype, F&& f) {
  Tensor host = Tensor::empty(shape, DType::Float64);
  double* p = host.data<double>();
  for (int64_t i = 0; i < host.numel(); ++i) p[i] = f(i);
  return host.to(dtype);
}

Generator& gen_or_default(Generator* g) { return g ? *g : default_generator(); }

}  // namespace

Tensor arange(double start, double end, double step, DType dtype) {
  BOOSTER_OP_CONTEXT("arange");
  BOOSTER_CHECK(step != 0, ValueError, "arange: step must be nonzero");
  const double span = (end - start) / step;
  BOOSTER_CHECK(span >= 0, ValueError, "arange: step ", step, " does not move from ", start, " towards ", end);
  const int64_t n = int64_t(std::ceil(span));
  return generate({n}, dtype, [&](int64_t i) { return start + double(i) * step; });
}

Tensor arange(int64_t end, DType dtype) { return arange(0.0, double(end), 1.0, dtype); }

Tensor rand(const Shape& shape, Generator* gen, DType dtype) {
  BOOSTER_OP_CONTEXT("rand");
  Generator& g = gen_or_default(gen);
  if (dtype == DType::Float64) return generate(shape, dtype, [&](int64_t) { return g.uniform(); });
  return generate(shape, dtype, [&](int64_t) { return double(g.uniform_float()); });
}

Tensor randn(const Shape& shape, Generator* gen, DType dtype) {
  BOOSTER_OP_CONTEXT("randn");
  Generator& g = gen_or_default(gen);
  return generate(shape, dtype, [&](int64_t) { return g.normal(); });
}

Tensor randint(int64_t low, int64_t high, const Shape& shape, Generator* gen, DType dtype) {
  BOOSTER_OP_CONTEXT("randint");
  Generator& g = gen_or_default(gen);
  Tensor t = Tensor::empty(shape, DType::Int64);
  int64_t* p = t.data<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = g.randint(low, high);
  return t.to(dtype);
}

Tensor randperm(int64_t n, Generator* gen) {
  BOOSTER_OP_CONTEXT("randperm");
  Generator& g = gen_or_default(gen);
  Tensor t = arange(n);
  int64_t* p = t.data<int64_t>();
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[i], p[g.randint(0, i + 1)]);  // Fisher-Yates
  return t;
}

namespace {
template <class T>
Tensor from_host(const std::vector<T>& values, const Shape& shape, DType dtype) {
  BOOSTER_CHECK(int64_t(values.size()) == numel_of(shape), ShapeError, "from_vector: ", values.size(),
                " values do not fill shape ", shape, " (", numel_of(shape), " elements)");
  Tensor t = Tensor::empty(shape, dtype_of<T>::value);
  std::copy(values.begin(), values.end(), t.data<T>());
  return t.to(dtype);
}
}  // namespace

Tensor from_vector(const std::vector<float>& v, const Shape& s, DType d) { return from_host(v, s, d); }
Tensor from_vector(const std::vector<double>& v, const Shape& s, DType d) { return from_host(v, s, d); }
Tensor from_vector(const std::vector<int64_t>& v, const Shape& s, DType d) { return from_host(v, s, d); }

}  // namespace booster
