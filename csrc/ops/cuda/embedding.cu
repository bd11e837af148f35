// embedding: out[t, :] = table[ids[t], :] (converted to the output dtype).
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

}  // namespace ocria_rt
