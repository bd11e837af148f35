// The CPU's kl_divergence (the calibration ops of ops.h; the statistics of the projections' inputs are
// taken on the host by engine/linear_observer.cpp).
#include <algorithm>
#include <cmath>

#include "ops/cpu/backend.h"

namespace ocria_rt {

void CpuBackend::kl_divergence(const Tensor& reference, const Tensor& logits, const Tensor& out) {
  expect_cpu_f32(reference, "kl_divergence reference");
  expect_cpu_f32(logits, "kl_divergence logits");
  expect_cpu_f32(out, "kl_divergence out");
  const int64_t R = reference.dim(0), V = reference.dim(1);
  if (logits.dim(0) != R || logits.dim(1) != V || out.numel() != R)
    throw Error(ErrorCode::kInternal, "kl_divergence: reference " + reference.shape_str() + ", logits " +
                                          logits.shape_str() + " and out " + out.shape_str() + " do not match");
  // log-sum-exp of a row, in double
  auto lse = [V](const float* z) {
    const double m = *std::max_element(z, z + V);
    double s = 0.0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(double(z[v]) - m);
    return m + std::log(s);
  };
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    const float *p = row_f32(reference, r), *q = row_f32(logits, r);
    const double lp = lse(p), lq = lse(q);
    double kl = 0.0;  // sum_v p_v (log p_v - log q_v)
    for (int64_t v = 0; v < V; ++v) kl += std::exp(double(p[v]) - lp) * ((double(p[v]) - double(q[v])) - (lp - lq));
    out.ptr<float>()[r] = float(kl);
  }
}

}  // namespace ocria_rt
