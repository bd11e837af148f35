// The ops of calibration (ocria_rt.quantize) on the GPU, so that neither logits nor activations cross
// the bus:
//  kl_divergence           one block per row, three passes over V (the maxima; the log-sum-exps; the KL
//                          sum), the sums in double: a KL of 1e-6 next to logits of 10 keeps its digits.
//  accumulate_input_stats  per-column |x| maxima and Kahan sums of |x| and x^2 (32 columns a block, 8
//                          row groups); X^T X on and below the diagonal with BF16 tensor cores (WMMA,
//                          fp32 accumulation over the rows of one call, 64 x 64 output tiles of the lower
//                          triangle, four warps of 32 x 32 each), Kahan-added into the fp32 accumulator.
#include <mma.h>

#include <algorithm>
#include <cmath>

#include "ops/cuda/backend.cuh"

namespace ocria_rt {
namespace cuda {
namespace {

constexpr int kKlThreads = 256;

__device__ float kl_block_max(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x >> 5) ? red[lane] : -INFINITY;
  return warp_max(v);
}

__device__ double kl_block_sum(double v, double* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x >> 5) ? red[lane] : 0.0;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <class T>
__global__ void __launch_bounds__(kKlThreads) kl_divergence_kernel(const T* __restrict__ reference, int64_t ldr,
                                                                    const T* __restrict__ logits, int64_t ldl, int V,
                                                                    float* __restrict__ out) {
  __shared__ float redf[32];
  __shared__ double redd[32];
  const T* p = reference + blockIdx.x * ldr;
  const T* q = logits + blockIdx.x * ldl;
  float mp = -INFINITY, mq = -INFINITY;
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    mp = fmaxf(mp, to_float(p[v]));
    mq = fmaxf(mq, to_float(q[v]));
  }
  mp = kl_block_max(mp, redf);
  mq = kl_block_max(mq, redf);
  double sp = 0.0, sq = 0.0;
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    sp += exp(double(to_float(p[v])) - double(mp));
    sq += exp(double(to_float(q[v])) - double(mq));
  }
  const double lp = double(mp) + log(kl_block_sum(sp, redd)), lq = double(mq) + log(kl_block_sum(sq, redd));
  double kl = 0.0;  // sum_v p_v (log p_v - log q_v)
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    const double a = to_float(p[v]), b = to_float(q[v]);
    kl += exp(a - lp) * ((a - b) - (lp - lq));
  }
  kl = kl_block_sum(kl, redd);
  if (threadIdx.x == 0) out[blockIdx.x] = float(kl);
}

// sum + v with the lost low-order part kept in comp (Kahan); the sum is sum - comp.
__device__ __forceinline__ void kahan_add(float* sum, float* comp, float v) {
  const float y = v - *comp, t = *sum + y;
  *comp = (t - *sum) - y;
  *sum = t;
}

constexpr int kStatColumns = 32, kStatGroups = 8;

// abs_max [K], sums [4, K] (sum |x|, compensation, sum x^2, compensation); a block per 32 columns.
template <class T>
__global__ void __launch_bounds__(kStatColumns* kStatGroups) column_stats_kernel(const T* __restrict__ x, int64_t ldx,
                                                                                int rows, int K, float* abs_max,
                                                                                float* sums) {
  __shared__ float max_part[kStatGroups][kStatColumns];
  __shared__ double abs_part[kStatGroups][kStatColumns], sq_part[kStatGroups][kStatColumns];
  const int c = threadIdx.x % kStatColumns, g = threadIdx.x / kStatColumns, k = blockIdx.x * kStatColumns + c;
  float m = 0.0f;
  double sa = 0.0, sq = 0.0;
  if (k < K)
    for (int t = g; t < rows; t += kStatGroups) {
      const float v = fabsf(to_float(x[t * ldx + k]));
      m = fmaxf(m, v);
      sa += v;
      sq += double(v) * v;
    }
  max_part[g][c] = m;
  abs_part[g][c] = sa;
  sq_part[g][c] = sq;
  __syncthreads();
  if (g != 0 || k >= K) return;
  for (int i = 1; i < kStatGroups; ++i) {
    m = fmaxf(m, max_part[i][c]);
    sa += abs_part[i][c];
    sq += sq_part[i][c];
  }
  abs_max[k] = fmaxf(abs_max[k], m);
  kahan_add(sums + k, sums + K + k, float(sa));
  kahan_add(sums + 2 * K + k, sums + 3 * K + k, float(sq));
}

constexpr int kGramTile = 64;  // output tile of a block; each of its 4 warps computes 32 x 32

// X^T X of x [rows, K] bf16 (row stride ld, rows a multiple of 16 with zeros past the data, K a multiple
// of 16), the 64 x 64 tiles on or below the diagonal (blockIdx.x enumerates them row by row), its
// elements i >= j Kahan-added into gram [2, K, K].
__global__ void __launch_bounds__(128) gram_kernel(const bf16* __restrict__ x, int64_t ld, int rows, int K, float* gram) {
  using namespace nvcuda;
  __shared__ float tile[4][16 * 16];
  int bi = int((sqrt(8.0 * blockIdx.x + 1.0) - 1.0) / 2.0);  // tile row of the triangle's linear index
  while ((bi + 1) * (bi + 2) / 2 <= int(blockIdx.x)) ++bi;
  while (bi * (bi + 1) / 2 > int(blockIdx.x)) --bi;
  const int bj = int(blockIdx.x) - bi * (bi + 1) / 2;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int i0 = bi * kGramTile + (warp >> 1) * 32, j0 = bj * kGramTile + (warp & 1) * 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b) wmma::fill_fragment(acc[a][b], 0.0f);
  bool live[2][2];  // the 16 x 16 fragments in range with an element on or below the diagonal
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b) {
      const int ri = i0 + 16 * a, cj = j0 + 16 * b;
      live[a][b] = ri < K && cj < K && ri + 15 >= cj;
    }
  for (int t0 = 0; t0 < rows; t0 += 16) {
    // A(i, t) = x[t, i]: column-major at x + t0 ld + i; B(t, j) = x[t, j]: row-major at x + t0 ld + j
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major> fa[2];
    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb[2];
    for (int a = 0; a < 2; ++a)
      if (i0 + 16 * a < K) wmma::load_matrix_sync(fa[a], x + t0 * ld + i0 + 16 * a, unsigned(ld));
    for (int b = 0; b < 2; ++b)
      if (j0 + 16 * b < K) wmma::load_matrix_sync(fb[b], x + t0 * ld + j0 + 16 * b, unsigned(ld));
    for (int a = 0; a < 2; ++a)
      for (int b = 0; b < 2; ++b)
        if (live[a][b]) wmma::mma_sync(acc[a][b], fa[a], fb[b], acc[a][b]);
  }
  float* sum = gram;
  float* comp = gram + int64_t(K) * K;
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b) {
      if (!live[a][b]) continue;
      wmma::store_matrix_sync(tile[warp], acc[a][b], 16, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 256; e += 32) {
        const int i = i0 + 16 * a + e / 16, j = j0 + 16 * b + e % 16;
        if (i >= j) kahan_add(sum + int64_t(i) * K + j, comp + int64_t(i) * K + j, tile[warp][e]);
      }
      __syncwarp();
    }
}

// The same for any K and dtype, a thread per element i >= j (small or odd shapes).
template <class T>
__global__ void gram_simple_kernel(const T* __restrict__ x, int64_t ldx, int rows, int K, float* gram) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (e >= int64_t(K) * K) return;
  const int i = int(e / K), j = int(e % K);
  if (i < j) return;
  float dot = 0.0f;
  for (int t = 0; t < rows; ++t) dot += to_float(x[t * ldx + i]) * to_float(x[t * ldx + j]);
  kahan_add(gram + e, gram + int64_t(K) * K + e, dot);
}

}  // namespace
}  // namespace cuda

void CudaBackend::kl_divergence(const Tensor& reference, const Tensor& logits, const Tensor& out) {
  using namespace cuda;
  const char* op = "kl_divergence";
  require_float(reference, op, "reference");
  require_tensor(logits, reference.dtype, op, "logits");
  require_tensor(out, DType::F32, op, "out");
  OCRIA_RT_REQUIRE(reference.ndim == 2 && logits.ndim == 2 && logits.dim(0) == reference.dim(0) &&
                       logits.dim(1) == reference.dim(1) && out.numel() == reference.dim(0),
                   op, "reference " + reference.shape_str() + ", logits " + logits.shape_str() + " and out " +
                           out.shape_str() + " do not match");
  const int64_t R = reference.dim(0), V = reference.dim(1);
  OCRIA_RT_REQUIRE(V > 0 && V <= (int64_t(1) << 30), op, "vocabulary size " + std::to_string(V) + " out of range");
  activate();
  for (int64_t r0 = 0; r0 < R; r0 += 65535) {
    const unsigned rows = unsigned(std::min<int64_t>(65535, R - r0));
    if (reference.dtype == DType::BF16)
      kl_divergence_kernel<bf16><<<rows, kKlThreads, 0, stream_>>>(
          reference.ptr<const bf16>() + r0 * reference.row_stride, reference.row_stride,
          logits.ptr<const bf16>() + r0 * logits.row_stride, logits.row_stride, int(V), out.ptr<float>() + r0);
    else
      kl_divergence_kernel<float><<<rows, kKlThreads, 0, stream_>>>(
          reference.ptr<const float>() + r0 * reference.row_stride, reference.row_stride,
          logits.ptr<const float>() + r0 * logits.row_stride, logits.row_stride, int(V), out.ptr<float>() + r0);
    check_launch("kl_divergence_kernel");
  }
}

void CudaBackend::accumulate_input_stats(const Tensor& x, const Tensor& abs_max, const Tensor& sums, const Tensor& gram) {
  using namespace cuda;
  const char* op = "accumulate_input_stats";
  require_float(x, op, "x");
  require_tensor(abs_max, DType::F32, op, "abs_max");
  require_tensor(sums, DType::F32, op, "sums");
  OCRIA_RT_REQUIRE(x.ndim == 2, op, "x must be [T, K]");
  const int64_t T = x.dim(0), K = x.dim(1);
  OCRIA_RT_REQUIRE(abs_max.numel() == K && sums.numel() == 4 * K && sums.contiguous(), op,
                   "abs_max must be [K] and sums [4, K] for x " + x.shape_str());
  OCRIA_RT_REQUIRE(!gram.defined() || (gram.dtype == DType::F32 && gram.numel() == 2 * K * K && gram.contiguous()), op,
                   "gram must be F32 [2, K, K] for x " + x.shape_str());
  OCRIA_RT_REQUIRE(T <= (int64_t(1) << 30) && K <= (int64_t(1) << 16), op, "x " + x.shape_str() + " is too large");
  if (T == 0) return;
  activate();
  const unsigned stat_blocks = unsigned((K + kStatColumns - 1) / kStatColumns);
  if (x.dtype == DType::BF16)
    column_stats_kernel<bf16><<<stat_blocks, kStatColumns * kStatGroups, 0, stream_>>>(
        x.ptr<const bf16>(), x.row_stride, int(T), int(K), abs_max.ptr<float>(), sums.ptr<float>());
  else
    column_stats_kernel<float><<<stat_blocks, kStatColumns * kStatGroups, 0, stream_>>>(
        x.ptr<const float>(), x.row_stride, int(T), int(K), abs_max.ptr<float>(), sums.ptr<float>());
  check_launch("column_stats_kernel");
  if (!gram.defined()) return;
  const size_t row_bytes = size_t(K) * sizeof(bf16);
  if (x.dtype == DType::BF16 && K % 16 == 0 && workspace_bytes_ >= 16 * row_bytes) {
    // The rows go through the workspace in pieces of a multiple of 16, the last one padded with zeros.
    const int64_t piece = std::min<int64_t>(int64_t(workspace_bytes_ / row_bytes) / 16 * 16, (T + 15) / 16 * 16);
    const int64_t nb = (K + kGramTile - 1) / kGramTile;
    for (int64_t t0 = 0; t0 < T; t0 += piece) {
      const int64_t n = std::min(piece, T - t0), padded = (n + 15) / 16 * 16;
      check_cuda(cudaMemcpy2DAsync(workspace_, row_bytes, x.ptr<const bf16>() + t0 * x.row_stride,
                                   size_t(x.row_stride) * sizeof(bf16), row_bytes, size_t(n), cudaMemcpyDeviceToDevice,
                                   stream_),
                 "cudaMemcpy2DAsync (accumulate_input_stats)");
      if (padded > n)
        check_cuda(cudaMemsetAsync(static_cast<char*>(workspace_) + size_t(n) * row_bytes, 0,
                                   size_t(padded - n) * row_bytes, stream_),
                   "cudaMemsetAsync (accumulate_input_stats)");
      gram_kernel<<<unsigned(nb * (nb + 1) / 2), 128, 0, stream_>>>(static_cast<const bf16*>(workspace_), K, int(padded),
                                                                   int(K), gram.ptr<float>());
      check_launch("gram_kernel");
    }
  } else {
    const unsigned blocks = unsigned((K * K + 255) / 256);
    if (x.dtype == DType::BF16)
      gram_simple_kernel<bf16><<<blocks, 256, 0, stream_>>>(x.ptr<const bf16>(), x.row_stride, int(T), int(K),
                                                           gram.ptr<float>());
    else
      gram_simple_kernel<float><<<blocks, 256, 0, stream_>>>(x.ptr<const float>(), x.row_stride, int(T), int(K),
                                                            gram.ptr<float>());
    check_launch("gram_simple_kernel");
  }
}

}  // namespace ocria_rt
