// The differentiable op library: what models are written with.
//
// Every op here (1) consults autocast (booster/autocast/autocast.h) where it is entered, (2) checks
// shapes and dtypes and throws typed errors naming the op and the values, (3) allocates its output and
// calls a kernel registered for the device (booster/kernels/kernels.h), and (4) records its backward
// when an input requires grad. Kernels know nothing of autograd, autocast or the booster.
#pragma once

#include <cstdint>
#include <array>
#include <optional>
#include <vector>

#include "booster/tensor/random.h"
#include "booster/tensor/tensor.h"

namespace booster {

// ---------------------------------------------------------------- creation
Tensor zeros(const Shape& shape, DType dtype = DType::Float32, Device device = Device::cpu());
Tensor ones(const Shape& shape, DType dtype = DType::Float32, Device device = Device::cpu());
Tensor full(const Shape& shape, double value, DType dtype = DType::Float32, Device device = Device::cpu());
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor full_like(const Tensor& t, double value);
Tensor empty_like(const Tensor& t);
// [start, end) with step; float32 unless dtype says otherwise.
Tensor arange(double start, double end, double step = 1.0, DType dtype = DType::Int64);
Tensor arange(int64_t end, DType dtype = DType::Int64);
// Uniform in [0, 1), standard normal, integers in [low, high). Same seed, same numbers everywhere.
Tensor rand(const Shape& shape, Generator* gen = nullptr, DType dtype = DType::Float32);
Tensor randn(const Shape& shape, Generator* gen = nullptr, DType dtype = DType::Float32);
Tensor randint(int64_t low, int64_t high, const Shape& shape, Generator* gen = nullptr,
               DType dtype = DType::Int64);
Tensor randperm(int64_t n, Generator* gen = nullptr);
// From host values; the vector's size must equal the shape's element count.
Tensor from_vector(const std::vector<float>& values, const Shape& shape, DType dtype = DType::Float32);
Tensor from_vector(const std::vector<double>& values, const Shape& shape, DType dtype = DType::Float64);
Tensor from_vector(const std::vector<int64_t>& values, const Shape& shape, DType dtype = DType::Int64);
Tensor scalar_tensor(double value, DType dtype = DType::Float32, Device device = Device::cpu());

// ---------------------------------------------------------------- elementwise (broadcasting)
Tensor add(const Tensor& a, const Tensor& b, double alpha = 1.0);  // a + alpha * b
Tensor sub(const Tensor& a, const Tensor& b, double alpha = 1.0);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double s);
Tensor mul(const Tensor& a, double s);
Tensor rsub(const Tensor& a, double s);  // s - a
Tensor rdiv(const Tensor& a, double s);  // s / a
Tensor pow(const Tensor& a, double exponent);
Tensor pow(const Tensor& a, const Tensor& exponent);
Tensor neg(const Tensor& a);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);
Tensor sqrt(const Tensor& a);
Tensor rsqrt(const Tensor& a);
Tensor abs(const Tensor& a);
Tensor clamp(const Tensor& a, std::optional<double> min, std::optional<double> max);
Tensor relu(const Tensor& a);
// approximate: "none" (erf form) or "tanh", as torch.nn.functional.gelu.
Tensor gelu(const Tensor& a, const std::string& approximate = "none");
Tensor tanh(const Tensor& a);
Tensor sigmoid(const Tensor& a);
// x * sigmoid(x) (torch.nn.functional.silu, Swish-1): Llama's gate activation, one pass.
Tensor silu(const Tensor& a);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
// Comparisons give bool tensors and have no gradient.
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor isfinite(const Tensor& a);
// cond ? a : b, broadcasting all three; cond is bool.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
// a with value wherever mask (bool, broadcastable to a) is true.
Tensor masked_fill(const Tensor& a, const Tensor& mask, double value);

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a);
Tensor operator+(const Tensor& a, double s);
Tensor operator+(double s, const Tensor& a);
Tensor operator-(const Tensor& a, double s);
Tensor operator-(double s, const Tensor& a);
Tensor operator*(const Tensor& a, double s);
Tensor operator*(double s, const Tensor& a);
Tensor operator/(const Tensor& a, double s);
Tensor operator/(double s, const Tensor& a);

// ---------------------------------------------------------------- float8 (Note [Float8 formats])
// x * scale rounded to `dtype` (DType::Float8E4M3FN or Float8E5M2); with `saturate`, values beyond
// the format's largest finite value (infinities too) become that value instead of NaN/infinity.
// x is float32, float16 or bfloat16; no gradient (a cast for storage and GEMM inputs).
Tensor to_float8(const Tensor& x, DType dtype, float scale = 1.0f, bool saturate = false);
// float(q) * scale_inv as `out_dtype` (float32, float16 or bfloat16).
Tensor from_float8(const Tensor& q, float scale_inv = 1.0f, DType out_dtype = DType::Float32);
// The scaled float8 GEMM (torch._scaled_mm's layout): a [n, k] and b [m, k], quantized as
// fp8(x * scale_a) and fp8(x * scale_b) (not both e5m2), give (a . b^T) / (scale_a * scale_b) [n, m]
// as `out_dtype` (float32 or bfloat16), accumulated in float32. On a GPU with float8 tensor cores
// (sm_89+) and sizes that are multiples of 16, cuBLASLt's float8 GEMM; elsewhere a float32 GEMM of the
// dequantized values (exact products, float32 sums: the same numerics up to the order of the sums).
// No gradient.
Tensor float8_mm(const Tensor& a, const Tensor& b, float scale_a, float scale_b, DType out_dtype = DType::Float32);

// ---------------------------------------------------------------- reductions
// Empty dims means all. Sums of float16/bfloat16 accumulate in float32 and return the input dtype.
Tensor sum(const Tensor& a, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& a, const std::vector<int64_t>& dims = {}, bool keepdim = false);
// Max over one dim; the gradient flows to the first maximal element. NaN counts as the maximum (the
// first NaN), as torch.max.
Tensor max(const Tensor& a, int64_t dim, bool keepdim = false);
Tensor max(const Tensor& a);  // over all elements: NaN if one is; ties (or the NaNs) share the gradient
Tensor argmax(const Tensor& a, int64_t dim, bool keepdim = false);  // int64, no gradient
// Variance over dims (unbiased like torch.var by default).
Tensor var(const Tensor& a, const std::vector<int64_t>& dims, bool unbiased = true, bool keepdim = false);

// ---------------------------------------------------------------- linear algebra
// 1-D/2-D/batched with broadcasting batch dims, as torch.matmul.
Tensor matmul(const Tensor& a, const Tensor& b);
// x [..., in] @ weight[out, in]^T + bias[out]. On a GPU, row_multiple > 1 lays the output's rows
// round_up(out, row_multiple) elements apart (a strided view; the padding is never read): 16-bit GEMMs
// whose rows are 16-byte aligned run on the fast tensor-core kernels (a GPT's lm_head, vocab 50257).
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(), int64_t row_multiple = 1);
Tensor bmm(const Tensor& a, const Tensor& b);

// ---------------------------------------------------------------- joining and indexing
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);
// Pieces of `split_size` along dim (the last may be smaller), as torch.split.
std::vector<Tensor> split(const Tensor& a, int64_t split_size, int64_t dim = 0);
std::vector<Tensor> chunk(const Tensor& a, int64_t chunks, int64_t dim = 0);
// Rows of weight picked by integer indices of any shape: out shape = indices.shape + [dim].
Tensor embedding(const Tensor& weight, const Tensor& indices);
// out[i] = a[i][index[i]] along dim (index has a's shape except along dim).
Tensor gather(const Tensor& a, int64_t dim, const Tensor& index);
Tensor index_select(const Tensor& a, int64_t dim, const Tensor& index);

// ---------------------------------------------------------------- neural-network functions
Tensor softmax(const Tensor& a, int64_t dim);
Tensor log_softmax(const Tensor& a, int64_t dim);
Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight = Tensor(),
                  const Tensor& bias = Tensor(), double eps = 1e-5);
// x [N, C] or [N, C, L]. In training, uses batch statistics and updates running_* in place with
// momentum (unbiased variance, as PyTorch); in eval, uses running statistics.
Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                  const Tensor& weight, const Tensor& bias, bool training, double momentum = 0.1,
                  double eps = 1e-5);
// ---------------------------------------------------------------- convolution and pooling (NCHW)
// As torch.nn.functional: x [N, C, H, W]; weight [out, in / groups, kh, kw]; bias [out] or undefined.
// Output size floor((H + 2 padding - dilation (k - 1) - 1) / stride) + 1 per spatial dim. A stride of
// {0, 0} for a pool means the kernel size (torch's default). Note [Convolution as gather + GEMM].
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(), std::array<int64_t, 2> stride = {1, 1},
              std::array<int64_t, 2> padding = {0, 0}, std::array<int64_t, 2> dilation = {1, 1}, int64_t groups = 1);
// Padding counts as -inf; at most half the kernel.
Tensor max_pool2d(const Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride = {0, 0},
                  std::array<int64_t, 2> padding = {0, 0}, std::array<int64_t, 2> dilation = {1, 1});
// Padding counts as zeros in the mean (torch's count_include_pad=True).
Tensor avg_pool2d(const Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride = {0, 0},
                  std::array<int64_t, 2> padding = {0, 0});
Tensor adaptive_avg_pool2d(const Tensor& x, std::array<int64_t, 2> output_size);

// Zeroes elements with probability p and scales the rest by 1/(1-p); identity when !training.
Tensor dropout(const Tensor& a, double p, bool training, Generator* gen = nullptr);
// q, k, v: [..., L, E]. softmax(q k^T * scale + causal mask) v; scale defaults to 1/sqrt(E).
// On a GPU, float16/bfloat16 inputs with head size 16, 32, 64 or 128 take the fused (flash) kernel, which
// keeps no [L, S] probabilities and writes its output in the layout [..., L, H, E] (returned as the
// [..., H, L, E] view, so merging heads back is free); everything else, the unfused kernel.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    bool is_causal = false, std::optional<double> scale = std::nullopt);
// Which keys a query may attend beyond the causal mask (Note [Attention masks] in nn_functional.cpp).
// Query i sits at key position query_offset + i (0 in training; the cached length when new queries
// meet a key/value cache, which aligns the causal mask to the bottom right). Key j is attended when
//   (!is_causal || j <= query_offset + i)                                         causal
//   && (window == 0 || query_offset + i - j < window)                             sliding window
//   && (!segments.defined() || segments[b, j] == segments[b, query_offset + i])   packed documents
// window: Mistral's / Hugging Face's sliding_window (a query sees itself and window - 1 keys before it).
// segments: int32 or int64 [B, S] document ids, B the first batch dim of q (heads share a row): a query
// attends only keys of its own document (block-diagonal with is_causal: sequence packing).
struct AttentionMask {
  int64_t window = 0;
  Tensor segments;
  int64_t query_offset = 0;
  bool any() const { return window > 0 || segments.defined() || query_offset != 0; }
};
// As above, under `mask` as well. A mask with window, segments or offset needs query_offset + L <= S
// (so every query sees at least its own position); the fused and unfused kernels both take it.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool is_causal,
                                    std::optional<double> scale, const AttentionMask& mask);
// Whether scaled_dot_product_attention may use a fused kernel (on by default), as PyTorch's
// torch.backends.cuda.enable_flash_sdp: off, it always computes the unfused softmax(q k^T) v.
void set_flash_attention_enabled(bool enabled);
bool flash_attention_enabled();

enum class Reduction { None, Mean, Sum };
Reduction reduction_from_string(const std::string& s);
// logits [N, C] (or [N, C, d...]), target int64 class indices [N] (or [N, d...]).
Tensor cross_entropy(const Tensor& logits, const Tensor& target, Reduction reduction = Reduction::Mean,
                     int64_t ignore_index = -100, double label_smoothing = 0.0);
Tensor nll_loss(const Tensor& log_probs, const Tensor& target, Reduction reduction = Reduction::Mean,
                int64_t ignore_index = -100);
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::Mean);

}  // namespace booster
