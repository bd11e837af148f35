// add (residual += delta) and silu_mul (out = silu(gate) * up): element-wise over [T, D] rows whose
// dimension 0 may be strided; 16-byte vectors where alignment allows.
#include "ops/cuda/backend.cuh"

namespace ocria_rt {
namespace cuda {
namespace {

// grid (column blocks, T): residual[t, c] += delta[t, c].
template <class T, int V>
__global__ void add_kernel(T* __restrict__ res, int64_t ldr, const T* __restrict__ delta, int64_t ldd, int D) {
  const int64_t t = blockIdx.y;
  for (int c = (blockIdx.x * blockDim.x + threadIdx.x) * V; c < D; c += gridDim.x * blockDim.x * V) {
    Pack<T, V> a = load_pack<T, V>(res + t * ldr + c);
    const Pack<T, V> d = load_pack<T, V>(delta + t * ldd + c);
#pragma unroll
    for (int e = 0; e < V; ++e) a.v[e] = from_float<T>(to_float(a.v[e]) + to_float(d.v[e]));
    store_pack(res + t * ldr + c, a);
  }
}

// out[t, c] = silu(gate) * up, gate_up in the GLU layout (ops.h): gate at column
// c / G * 2G + c % G, up G columns later (G = kGluGroup; V divides G, so a vector stays in one group).
template <class T, int V>
__global__ void silu_mul_kernel(const T* __restrict__ gu, int64_t ldg, T* __restrict__ out, int64_t ldo, int I) {
  static_assert(kGluGroup % V == 0, "a vector must not straddle two GLU groups");
  constexpr int G = int(kGluGroup);
  const int64_t t = blockIdx.y;
  for (int c = (blockIdx.x * blockDim.x + threadIdx.x) * V; c < I; c += gridDim.x * blockDim.x * V) {
    const int gc = c / G * 2 * G + c % G;
    const Pack<T, V> g = load_pack<T, V>(gu + t * ldg + gc);
    const Pack<T, V> u = load_pack<T, V>(gu + t * ldg + gc + G);
    Pack<T, V> o;
#pragma unroll
    for (int e = 0; e < V; ++e) o.v[e] = from_float<T>(silu(to_float(g.v[e])) * to_float(u.v[e]));
    store_pack(out + t * ldo + c, o);
  }
}

dim3 grid_for(int64_t cols, int V, int64_t rows, int threads) {
  int64_t blocks = (cols / V + threads - 1) / threads;
  return dim3(unsigned(blocks < 1 ? 1 : blocks > 64 ? 64 : blocks), unsigned(rows));
}

int64_t stride_of(const Tensor& t) { return t.ndim <= 1 ? t.numel() : t.row_stride; }

template <class T>
void launch_add(const Tensor& res, const Tensor& delta, int64_t T_, int64_t D, cudaStream_t s) {
  constexpr int V = vec16<T>();
  const int64_t ldr = stride_of(res), ldd = stride_of(delta);
  if (vec_ok(res.data, ldr, D, V, sizeof(T)) && vec_ok(delta.data, ldd, D, V, sizeof(T)))
    add_kernel<T, V><<<grid_for(D, V, T_, 256), 256, 0, s>>>(res.ptr<T>(), ldr, delta.ptr<const T>(), ldd, int(D));
  else
    add_kernel<T, 1><<<grid_for(D, 1, T_, 256), 256, 0, s>>>(res.ptr<T>(), ldr, delta.ptr<const T>(), ldd, int(D));
  check_launch("add_kernel");
}

template <class T>
void launch_silu_mul(const Tensor& gu, const Tensor& out, int64_t T_, int64_t I, cudaStream_t s) {
  constexpr int V = vec16<T>();
  const int64_t ldg = gu.row_stride, ldo = out.row_stride;
  if (vec_ok(gu.data, ldg, I, V, sizeof(T)) && vec_ok(out.data, ldo, I, V, sizeof(T)))
    silu_mul_kernel<T, V><<<grid_for(I, V, T_, 256), 256, 0, s>>>(gu.ptr<const T>(), ldg, out.ptr<T>(), ldo, int(I));
  else
    silu_mul_kernel<T, 1><<<grid_for(I, 1, T_, 256), 256, 0, s>>>(gu.ptr<const T>(), ldg, out.ptr<T>(), ldo, int(I));
  check_launch("silu_mul_kernel");
}

}  // namespace
}  // namespace cuda

void CudaBackend::add(const Tensor& residual, const Tensor& delta) {
  using namespace cuda;
  const char* op = "add";
  require_float(residual, op, "residual");
  require_tensor(delta, residual.dtype, op, "delta");
  const int64_t T = residual.ndim <= 1 ? 1 : residual.dim(0);
  const int64_t D = residual.ndim <= 1 ? residual.numel() : residual.row_size();
  OCRIA_RT_REQUIRE(delta.numel() == T * D && (delta.ndim <= 1 ? 1 : delta.dim(0)) == T, op,
          "residual " + residual.shape_str() + " vs delta " + delta.shape_str());
  OCRIA_RT_REQUIRE(T <= 65535, op, "too many rows");
  if (T == 0 || D == 0) return;
  activate();
  if (residual.dtype == DType::BF16)
    launch_add<bf16>(residual, delta, T, D, stream_);
  else
    launch_add<float>(residual, delta, T, D, stream_);
}

void CudaBackend::silu_mul(const Tensor& gate_up, const Tensor& out) {
  using namespace cuda;
  const char* op = "silu_mul";
  require_float(gate_up, op, "gate_up");
  require_tensor(out, gate_up.dtype, op, "out");
  OCRIA_RT_REQUIRE(gate_up.ndim == 2 && out.ndim == 2 && gate_up.dim(0) == out.dim(0) && gate_up.dim(1) == 2 * out.dim(1) &&
                       out.dim(1) % kGluGroup == 0,
                   op, "gate_up " + gate_up.shape_str() + " vs out " + out.shape_str() +
                           " (gate_up [T, 2I], out [T, I], I a multiple of 8)");
  const int64_t T = out.dim(0), I = out.dim(1);
  OCRIA_RT_REQUIRE(T <= 65535, op, "too many rows");
  if (T == 0 || I == 0) return;
  activate();
  if (out.dtype == DType::BF16)
    launch_silu_mul<bf16>(gate_up, out, T, I, stream_);
  else
    launch_silu_mul<float>(gate_up, out, T, I, stream_);
}

namespace cuda {
namespace {

// out = gelu(x): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) or the exact 0.5 x (1 + erf(x / sqrt 2)).
template <bool TANH>
__global__ void gelu_kernel(const bf16* __restrict__ x, int64_t ldx, bf16* __restrict__ out, int64_t ldo, int D) {
  const int64_t t = blockIdx.y;
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < D; c += gridDim.x * blockDim.x) {
    const float v = __bfloat162float(x[t * ldx + c]);
    const float g = TANH ? 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)))
                         : 0.5f * v * (1.0f + erff(v * 0.70710678118f));
    out[t * ldo + c] = __float2bfloat16_rn(g);
  }
}

}  // namespace
}  // namespace cuda

void CudaBackend::gelu(const Tensor& x, const Tensor& out, bool tanh_approximation) {
  using namespace cuda;
  const char* op = "gelu";
  require_tensor(x, DType::BF16, op, "x");
  require_tensor(out, DType::BF16, op, "out");
  OCRIA_RT_REQUIRE(x.ndim == 2 && out.ndim == 2 && x.dim(0) == out.dim(0) && x.dim(1) == out.dim(1), op,
          "x " + x.shape_str() + " vs out " + out.shape_str());
  const int64_t T = x.dim(0), D = x.dim(1);
  if (T == 0 || D == 0) return;
  OCRIA_RT_REQUIRE(T <= 65535, op, "too many rows");
  activate();
  const dim3 grid = grid_for(D, 1, T, 256);
  if (tanh_approximation)
    gelu_kernel<true><<<grid, 256, 0, stream_>>>(x.ptr<const bf16>(), x.row_stride, out.ptr<bf16>(), out.row_stride, int(D));
  else
    gelu_kernel<false><<<grid, 256, 0, stream_>>>(x.ptr<const bf16>(), x.row_stride, out.ptr<bf16>(), out.row_stride, int(D));
  check_launch("gelu_kernel");
}

}  // namespace ocria_rt
