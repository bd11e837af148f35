#include <cstring>

#include "ops/cpu/backend.h"

namespace ocria_rt {

void CpuBackend::embedding(const Tensor& table, const Tensor& ids, const Tensor& out) {
  expect_cpu_f32(table, "embedding table");
  expect_cpu_f32(out, "embedding output");
  const int64_t T = ids.dim(0), H = table.dim(1);
  for (int64_t t = 0; t < T; ++t) std::memcpy(row_f32(out, t), row_f32(table, ids_i32(ids)[t]), H * 4);
}

}  // namespace ocria_rt
