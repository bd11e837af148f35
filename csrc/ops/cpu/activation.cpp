#include "ops/cpu/backend.h"

namespace ocria_rt {

void CpuBackend::add(const Tensor& residual, const Tensor& delta) {
  const int64_t T = residual.dim(0), H = residual.row_size();
  for (int64_t t = 0; t < T; ++t) {
    float* r = row_f32(residual, t);
    const float* d = row_f32(delta, t);
    for (int64_t i = 0; i < H; ++i) r[i] += d[i];
  }
}

void CpuBackend::gelu(const Tensor& x, const Tensor& out, bool tanh_approximation) {
  const int64_t T = x.dim(0), D = x.row_size();
#pragma omp parallel for num_threads(threads_) if (T > 4)
  for (int64_t t = 0; t < T; ++t) {
    const float* a = row_f32(x, t);
    float* o = row_f32(out, t);
    for (int64_t i = 0; i < D; ++i) {
      const float v = a[i];
      // tanh form: 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))); exact: 0.5 v (1 + erf(v / sqrt 2))
      o[i] = tanh_approximation ? 0.5f * v * (1.0f + std::tanh(0.7978845608f * (v + 0.044715f * v * v * v)))
                                : 0.5f * v * (1.0f + std::erf(v * 0.70710678118f));
    }
  }
}

void CpuBackend::silu_mul(const Tensor& gate_up, const Tensor& out) {
  const int64_t T = out.dim(0), I = out.dim(1);
  if (gate_up.dim(1) != 2 * I || I % kGluGroup != 0)
    throw Error(ErrorCode::kInternal, "silu_mul: gate_up " + gate_up.shape_str() + " vs out " + out.shape_str() +
                                          " (gate_up [T, 2I], out [T, I], I a multiple of 8)");
#pragma omp parallel for num_threads(threads_) if (T > 4)
  for (int64_t t = 0; t < T; ++t) {
    const float* gu = row_f32(gate_up, t);
    float* o = row_f32(out, t);
    for (int64_t i = 0; i < I; ++i) {
      const int64_t g = i / kGluGroup * 2 * kGluGroup + i % kGluGroup;  // the GLU layout (ops.h)
      o[i] = silu(gu[g]) * gu[g + kGluGroup];
    }
  }
}

}  // namespace ocria_rt
