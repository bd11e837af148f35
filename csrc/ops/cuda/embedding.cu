// embedding: out[t, :] = table[ids[t], :] (converted to the output dtype).
// gather_blend_add: x[n, :] += sum_k weights[n, k] * table[rows[n, k], :] (vision position embedding).
#include "ops/cuda/backend.cuh"

namespace ocria_rt {
namespace cuda {
namespace {

template <class TI, class TO, int V>
__global__ void embedding_kernel(const TI* __restrict__ table, int64_t ldt, const int32_t* __restrict__ ids,
                                 TO* __restrict__ out, int64_t ldo, int D) {
  pdl_launch_dependents();
  pdl_wait();  // ids (the last sampled token when decoding) come from an earlier kernel
  const int64_t t = blockIdx.y;
  const TI* src = table + int64_t(ids[t]) * ldt;
  for (int c = (blockIdx.x * blockDim.x + threadIdx.x) * V; c < D; c += gridDim.x * blockDim.x * V) {
    const Pack<TI, V> a = load_pack<TI, V>(src + c);
    Pack<TO, V> o;
#pragma unroll
    for (int e = 0; e < V; ++e) o.v[e] = from_float<TO>(to_float(a.v[e]));
    store_pack(out + t * ldo + c, o);
  }
}

template <class TI, class TO>
void launch(const Tensor& table, const Tensor& ids, const Tensor& out, int64_t T, int64_t D, const LaunchCtx& ctx) {
  constexpr int V = 8;  // 16 bytes of BF16
  const bool vec = vec_ok(table.data, table.row_stride, D, V, sizeof(TI)) &&
                   vec_ok(out.data, out.row_stride, D, V, sizeof(TO));
  const int64_t per = vec ? V : 1;
  unsigned bx = unsigned(std::min<int64_t>(16, std::max<int64_t>(1, (D / per + 255) / 256)));
  dim3 grid(bx, unsigned(T));
  if (vec)
    launch_pdl(ctx, "embedding_kernel", embedding_kernel<TI, TO, V>, grid, 256, 0, table.ptr<const TI>(),
               table.row_stride, ids.ptr<const int32_t>(), out.ptr<TO>(), out.row_stride, int(D));
  else
    launch_pdl(ctx, "embedding_kernel", embedding_kernel<TI, TO, 1>, grid, 256, 0, table.ptr<const TI>(),
               table.row_stride, ids.ptr<const int32_t>(), out.ptr<TO>(), out.row_stride, int(D));
}

}  // namespace
}  // namespace cuda

void CudaBackend::embedding(const Tensor& table, const Tensor& ids, const Tensor& out) {
  using namespace cuda;
  const char* op = "embedding";
  require_float(table, op, "table");
  require_tensor(ids, DType::I32, op, "ids");
  require_float(out, op, "out");
  OCRIA_RT_REQUIRE(table.ndim == 2 && out.ndim == 2 && out.dim(1) == table.dim(1) && ids.numel() == out.dim(0), op,
          "table " + table.shape_str() + ", ids " + ids.shape_str() + ", out " + out.shape_str());
  const int64_t T = out.dim(0), D = out.dim(1);
  OCRIA_RT_REQUIRE(T <= 65535, op, "too many tokens");
  if (T == 0 || D == 0) return;
  activate();
  const bool tb = table.dtype == DType::BF16, ob = out.dtype == DType::BF16;
  if (tb && ob) launch<bf16, bf16>(table, ids, out, T, D, launch_ctx());
  else if (tb) launch<bf16, float>(table, ids, out, T, D, launch_ctx());
  else if (ob) launch<float, bf16>(table, ids, out, T, D, launch_ctx());
  else launch<float, float>(table, ids, out, T, D, launch_ctx());
}

namespace cuda {
namespace {

// One block per row n; each thread blends V consecutive columns: the taps' table rows are read
// as V-element vectors (16 bytes of x's dtype per vector of x), summed in fp32 from 0 in tap
// order, and added to x with one rounding.
template <class TT, class TX, int V>
__global__ void gather_blend_add_kernel(const TT* __restrict__ table, int64_t ldt, const int32_t* __restrict__ rows,
                                        const float* __restrict__ weights, int K, TX* __restrict__ x, int64_t ldx,
                                        int D) {
  const int64_t n = blockIdx.x;
  const int32_t* r = rows + n * K;
  const float* w = weights + n * K;
  TX* xr = x + n * ldx;
  for (int c = threadIdx.x * V; c < D; c += blockDim.x * V) {
    float acc[V];
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = 0.0f;
    for (int k = 0; k < K; ++k) {
      const float wk = w[k];
      const Pack<TT, V> t = load_pack<TT, V>(table + int64_t(r[k]) * ldt + c);
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] = fmaf(wk, to_float(t.v[e]), acc[e]);
    }
    Pack<TX, V> a = load_pack<TX, V>(xr + c);
#pragma unroll
    for (int e = 0; e < V; ++e) a.v[e] = from_float<TX>(to_float(a.v[e]) + acc[e]);
    store_pack(xr + c, a);
  }
}

template <class TT, class TX>
void launch_gather_blend_add(const Tensor& table, const Tensor& rows, const Tensor& weights, const Tensor& x,
                             int64_t N, int64_t D, int64_t K, cudaStream_t stream) {
  constexpr int V = vec16<TX>();
  const bool vec = vec_ok(table.data, table.row_stride, D, V, sizeof(TT)) && vec_ok(x.data, x.row_stride, D, V, sizeof(TX));
  const int per = vec ? V : 1;
  const int threads = int(std::min<int64_t>(256, std::max<int64_t>(32, (D / per + 31) / 32 * 32)));
  auto kernel = vec ? gather_blend_add_kernel<TT, TX, V> : gather_blend_add_kernel<TT, TX, 1>;
  kernel<<<unsigned(N), threads, 0, stream>>>(table.ptr<const TT>(), table.row_stride, rows.ptr<const int32_t>(),
                                              weights.ptr<const float>(), int(K), x.ptr<TX>(), x.row_stride, int(D));
  check_launch("gather_blend_add_kernel");
}

}  // namespace
}  // namespace cuda

void CudaBackend::gather_blend_add(const Tensor& table, const Tensor& rows, const Tensor& weights, const Tensor& x) {
  using namespace cuda;
  const char* op = "gather_blend_add";
  require_float(table, op, "table");
  require_tensor(rows, DType::I32, op, "rows");
  require_tensor(weights, DType::F32, op, "weights");
  require_float(x, op, "x");
  OCRIA_RT_REQUIRE(table.ndim == 2 && x.ndim == 2 && rows.ndim == 2 && weights.ndim == 2 && table.dim(1) == x.dim(1) &&
                       rows.dim(0) == x.dim(0) && weights.dim(0) == x.dim(0) && weights.dim(1) == rows.dim(1) &&
                       rows.contiguous() && weights.contiguous(),
                   op, "table " + table.shape_str() + ", rows " + rows.shape_str() + ", weights " + weights.shape_str() +
                           ", x " + x.shape_str() + " (rows and weights contiguous [N, K], x [N, D])");
  const int64_t N = x.dim(0), D = x.dim(1), K = rows.dim(1);
  OCRIA_RT_REQUIRE(N <= 0x7fffffff && D <= 0x7fffffff && K <= 0x7fffffff, op, "too large");
  if (N == 0 || D == 0) return;
  activate();
  const bool tb = table.dtype == DType::BF16, xb = x.dtype == DType::BF16;
  if (tb && xb) launch_gather_blend_add<bf16, bf16>(table, rows, weights, x, N, D, K, stream_);
  else if (tb) launch_gather_blend_add<bf16, float>(table, rows, weights, x, N, D, K, stream_);
  else if (xb) launch_gather_blend_add<float, bf16>(table, rows, weights, x, N, D, K, stream_);
  else launch_gather_blend_add<float, float>(table, rows, weights, x, N, D, K, stream_);
}

}  // namespace ocria_rt
