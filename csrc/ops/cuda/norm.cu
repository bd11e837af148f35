// rms_norm: zero-centred RMSNorm over the last dimension, one block per row,
//   out = x * rsqrt(mean(x^2) + eps) * (1 + w) (or without a weight: * 1), fp32 math; 16-byte vectors
//   where alignment allows.
#include <algorithm>

#include "ops/cuda/backend.cuh"

namespace ocria_rt {
namespace cuda {
namespace {

// Row r of a tensor laid out as v.
template <class T> __device__ __forceinline__ T* row_ptr(T* base, int64_t r, const RowView& v) {
  return base + (r / v.inner) * v.outer_stride + (r % v.inner) * v.cols;
}

// Row packs a thread keeps in registers between the two passes, with their (1 + w): rows of up to
// kNormHeld * 512 * V elements (all of the text decoder's) are read once; longer rows run on in a loop
// that reads x and w again.
constexpr int kNormHeld = 2;
constexpr int kNormMaxThreads = 512;

// The weights are read-only and, in decode, long evicted from L2 by the weight stream: their loads
// are issued before pdl_wait() so that their latency overlaps the kernels before this one. w.ptr null:
// no weight (the unit scale).
template <class T, int V>
__global__ void __launch_bounds__(kNormMaxThreads)
    rms_norm_kernel(const T* __restrict__ x, RowView xv, T* __restrict__ out, RowView ov, ParamView w, float eps) {
  __shared__ float red[32];
  pdl_launch_dependents();
  const int64_t r = blockIdx.x;
  const int D = int(xv.cols), step = blockDim.x * V, c0 = threadIdx.x * V;
  const T* xr = row_ptr(x, r, xv);
  T* orow = row_ptr(out, r, ov);
  const bool has_w = w.ptr != nullptr;
  float w1[kNormHeld][V];  // 1 + w of the held packs
#pragma unroll
  for (int j = 0; j < kNormHeld; ++j)
#pragma unroll
    for (int e = 0; e < V; ++e) w1[j][e] = c0 + j * step < D && has_w ? 1.0f + w[c0 + j * step + e] : 1.0f;
  pdl_wait();  // x comes from earlier kernels

  // Pass 1: sum of squares.
  auto load_row = [&](int c) { return load_pack<T, V>(xr + c); };
  float ss = 0.0f;
  auto add_squares = [&](const Pack<T, V>& a) {
#pragma unroll
    for (int e = 0; e < V; ++e) ss = fmaf(to_float(a.v[e]), to_float(a.v[e]), ss);
  };
  Pack<T, V> held[kNormHeld];
#pragma unroll
  for (int j = 0; j < kNormHeld; ++j)
    if (c0 + j * step < D) {
      held[j] = load_row(c0 + j * step);
      add_squares(held[j]);
    }
  for (int c = c0 + kNormHeld * step; c < D; c += step) add_squares(load_row(c));
  ss = block_sum(ss, red);
  const float inv = rsqrtf(ss / float(D) + eps);

  // Pass 2: out = x * inv * (1 + w).
  auto store_norm = [&](int c, const Pack<T, V>& a, const float (&w1c)[V]) {
    Pack<T, V> o;
#pragma unroll
    for (int e = 0; e < V; ++e) o.v[e] = from_float<T>(to_float(a.v[e]) * inv * w1c[e]);
    store_pack(orow + c, o);
  };
#pragma unroll
  for (int j = 0; j < kNormHeld; ++j)
    if (c0 + j * step < D) store_norm(c0 + j * step, held[j], w1[j]);
  for (int c = c0 + kNormHeld * step; c < D; c += step) {
    float w1c[V];
#pragma unroll
    for (int e = 0; e < V; ++e) w1c[e] = has_w ? 1.0f + w[c + e] : 1.0f;
    store_norm(c, load_row(c), w1c);
  }
}

template <class T>
void launch_rms_norm(const Tensor& x, const Tensor& out, ParamView w, int64_t D, float eps, const LaunchCtx& ctx,
                     const char* op) {
  RowView xv = row_view(x, D, op, "x"), ov = row_view(out, D, op, "out");
  OCRIA_RT_REQUIRE(xv.rows == ov.rows, op, "x " + x.shape_str() + " and out " + out.shape_str() + " differ in rows");
  if (xv.rows == 0 || D == 0) return;
  OCRIA_RT_REQUIRE(xv.rows <= 0x7fffffff, op, "too many rows");
  constexpr int V = vec16<T>();
  const bool vec =
      vec_ok(x.data, xv.outer_stride, D, V, sizeof(T)) && vec_ok(out.data, ov.outer_stride, D, V, sizeof(T));
  // A thread per v-element pack of the row, in whole warps, 32 to kNormMaxThreads of them.
  auto launch = [&](auto kernel, int v) {
    const int64_t threads = std::clamp<int64_t>((D / v + 31) / 32 * 32, 32, kNormMaxThreads);
    launch_pdl(ctx, "rms_norm_kernel", kernel, unsigned(xv.rows), int(threads), 0, x.ptr<const T>(), xv, out.ptr<T>(),
               ov, w, eps);
  };
  if (vec)
    launch(rms_norm_kernel<T, V>, V);
  else
    launch(rms_norm_kernel<T, 1>, 1);
}

}  // namespace
}  // namespace cuda

void CudaBackend::rms_norm(const Tensor& x, const Tensor& weight, const Tensor& out, float eps) {
  using namespace cuda;
  const char* op = "rms_norm";
  require_float(x, op, "x");
  require_tensor(out, x.dtype, op, "out");
  OCRIA_RT_REQUIRE(x.ndim >= 1, op, "x must have at least one dimension");
  const ParamView w = weight.defined() ? param_view(weight, op, "weight") : ParamView{};
  const int64_t D = weight.defined() ? weight.numel() : x.dim(x.ndim - 1);
  activate();
  if (x.dtype == DType::BF16)
    launch_rms_norm<bf16>(x, out, w, D, eps, launch_ctx(), op);
  else
    launch_rms_norm<float>(x, out, w, D, eps, launch_ctx(), op);
}

namespace cuda {
namespace {

// LayerNorm (vision encoder): one warp per row, two passes over the row (mean, then variance) in fp32.
template <class T>
__global__ void layer_norm_kernel(const T* __restrict__ x, int64_t ldx, T* __restrict__ out, int64_t ldo, int64_t rows,
                                  int D, ParamView w, ParamView b, float eps) {
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const T* xr = x + r * ldx;
  float sum = 0.0f;
  for (int c = lane; c < D; c += 32) sum += to_float(xr[c]);
  const float mean = warp_sum(sum) / float(D);
  float var = 0.0f;
  for (int c = lane; c < D; c += 32) {
    const float d = to_float(xr[c]) - mean;
    var = fmaf(d, d, var);
  }
  const float inv = rsqrtf(warp_sum(var) / float(D) + eps);
  for (int c = lane; c < D; c += 32) out[r * ldo + c] = from_float<T>((to_float(xr[c]) - mean) * inv * w[c] + b[c]);
}

}  // namespace
}  // namespace cuda

void CudaBackend::layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out, float eps) {
  using namespace cuda;
  const char* op = "layer_norm";
  require_tensor(x, activation_dtype(), op, "x");
  require_tensor(out, activation_dtype(), op, "out");
  const ParamView w = param_view(weight, op, "weight"), b = param_view(bias, op, "bias");
  const int64_t D = weight.numel();
  OCRIA_RT_REQUIRE(x.ndim == 2 && out.ndim == 2 && x.dim(1) == D && out.dim(1) == D && out.dim(0) == x.dim(0), op,
          "x " + x.shape_str() + ", out " + out.shape_str() + ", weight " + weight.shape_str());
  OCRIA_RT_REQUIRE(bias.numel() == D, op, "bias must have as many elements as weight");
  const int64_t rows = x.dim(0);
  if (rows == 0) return;
  activate();
  constexpr int kWarps = 4;
  layer_norm_kernel<bf16><<<unsigned((rows + kWarps - 1) / kWarps), kWarps * 32, 0, stream_>>>(
      x.ptr<const bf16>(), x.row_stride, out.ptr<bf16>(), out.row_stride, rows, int(D), w, b, eps);
  check_launch("layer_norm_kernel");
}

}  // namespace ocria_rt
