#include "ops/cpu/backend.h"

namespace ocria_rt {

void CpuBackend::rms_norm(const Tensor& x, const Tensor& weight, const Tensor& out, float eps) {
  expect_cpu_f32(x, "rms_norm input");
  const int64_t D = weight.defined() ? weight.dim(0) : x.dim(-1), R = x.numel() / D;
  const float* w = weight.defined() ? weight.ptr<const float>() : nullptr;
  if (x.dim(-1) != D) throw Error(ErrorCode::kInternal, "rms_norm: input " + x.shape_str() + " vs weight " + weight.shape_str());
  const int64_t per_row = x.row_size() / D;  // norm groups in one index of dimension 0
#pragma omp parallel for num_threads(threads_) if (R > 64)
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = row_f32(x, r / per_row) + (r % per_row) * D;
    float* yr = row_f32(out, r / per_row) + (r % per_row) * D;
    rms_normalise(xr, yr, D, eps, [&](int64_t i) { return w ? 1.0f + w[i] : 1.0f; });
  }
}

void CpuBackend::fold_norm_weight(const Tensor& w, const Tensor& norm_weight) {
  expect_cpu_f32(w, "fold_norm_weight weight");
  if (w.ndim != 2 || norm_weight.numel() != w.dim(1))
    throw Error(ErrorCode::kInternal, "fold_norm_weight: weight " + w.shape_str() + " vs norm weight " + norm_weight.shape_str());
  const int64_t N = w.dim(0), K = w.dim(1);
  const float* nw = norm_weight.ptr<const float>();
#pragma omp parallel for num_threads(threads_) if (N > 64)
  for (int64_t n = 0; n < N; ++n) {
    float* row = row_f32(w, n);
    for (int64_t k = 0; k < K; ++k) row[k] *= 1.0f + nw[k];
  }
}

void CpuBackend::layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out, float eps) {
  const int64_t D = weight.dim(0), R = x.numel() / D, per_row = x.row_size() / D;
  const float* w = weight.ptr<const float>();
  const float* b = bias.ptr<const float>();
#pragma omp parallel for num_threads(threads_) if (R > 64)
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = row_f32(x, r / per_row) + (r % per_row) * D;
    float* yr = row_f32(out, r / per_row) + (r % per_row) * D;
    double mean = 0, var = 0;
    for (int64_t i = 0; i < D; ++i) mean += xr[i];
    mean /= double(D);
    for (int64_t i = 0; i < D; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    const float inv = 1.0f / std::sqrt(float(var / double(D)) + eps);
    for (int64_t i = 0; i < D; ++i) yr[i] = float(xr[i] - mean) * inv * w[i] + b[i];
  }
}

void CpuBackend::gdn_gated_norm(const Tensor& o, const Tensor& z, const Tensor& weight, const GdnParams& p,
                                const Tensor& out) {
  const int64_t T = o.dim(0), HV = p.num_v_heads, dv = p.v_head_dim;
  const float* w = weight.ptr<const float>();
#pragma omp parallel for num_threads(threads_) if (T * HV > 64)
  for (int64_t r = 0; r < T * HV; ++r) {
    const int64_t t = r / HV, h = r % HV;
    const float* zr = row_f32(z, t) + h * dv;
    rms_normalise(row_f32(o, t) + h * dv, row_f32(out, t) + h * dv, dv, p.norm_eps,
                  [&](int64_t i) { return w[i] * silu(zr[i]); });
  }
}

}  // namespace ocria_rt
