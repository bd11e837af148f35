#include <algorithm>
#include <cstring>
#include <vector>

#include "ops/cpu/backend.h"

namespace ocria_rt {

void CpuBackend::embedding(const Tensor& table, const Tensor& ids, const Tensor& out) {
  expect_cpu_f32(table, "embedding table");
  expect_cpu_f32(out, "embedding output");
  const int64_t T = ids.dim(0), H = table.dim(1);
  for (int64_t t = 0; t < T; ++t) std::memcpy(row_f32(out, t), row_f32(table, ids_i32(ids)[t]), H * 4);
}

void CpuBackend::gather_blend_add(const Tensor& table, const Tensor& rows, const Tensor& weights, const Tensor& x) {
  expect_cpu_f32(table, "gather_blend_add table");
  expect_cpu_f32(weights, "gather_blend_add weights");
  expect_cpu_f32(x, "gather_blend_add x");
  const int64_t N = x.ndim == 2 ? x.dim(0) : -1, D = x.ndim == 2 ? x.dim(1) : -1;
  const int64_t K = rows.ndim == 2 ? rows.dim(1) : -1;
  if (x.ndim != 2 || table.ndim != 2 || table.dim(1) != D || rows.dtype != DType::I32 || rows.ndim != 2 ||
      rows.dim(0) != N || !rows.contiguous() || weights.ndim != 2 || weights.dim(0) != N || weights.dim(1) != K ||
      !weights.contiguous())
    throw Error(ErrorCode::kInternal, "gather_blend_add: table " + table.shape_str() + ", rows " + rows.shape_str() +
                                          ", weights " + weights.shape_str() + ", x " + x.shape_str());
  // The blend of one row is summed into `acc` tap by tap (vectorisable over d), then added to x.
#pragma omp parallel num_threads(threads_) if (N * D > (1 << 16))
  {
    std::vector<float> acc(size_t(std::max<int64_t>(D, 0)));
#pragma omp for
    for (int64_t n = 0; n < N; ++n) {
      const int32_t* r = ids_i32(rows) + n * K;
      const float* w = weights.ptr<const float>() + n * K;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const float wk = w[k];
        const float* t = row_f32(table, r[k]);
        for (int64_t d = 0; d < D; ++d) acc[d] += wk * t[d];
      }
      float* xr = row_f32(x, n);
      for (int64_t d = 0; d < D; ++d) xr[d] += acc[d];
    }
  }
}

}  // namespace ocria_rt
