#include <vector>

#include "ops/cpu/backend.h"

namespace ocria_rt {

namespace {

// Which of the (t, h, w) positions frequency j follows under interleaved M-RoPE (see ops.h).
int mrope_axis(int64_t j, const int32_t* section) {
  if (j % 3 == 1 && j < 3 * section[1]) return 1;
  if (j % 3 == 2 && j < 3 * section[2]) return 2;
  return 0;
}

}  // namespace

// Zero-centred RMSNorm of one head, in place: x * rsqrt(mean(x^2) + eps) * (1 + w).
void head_norm(float* x, const float* w, int64_t n, float eps) {
  rms_normalise(x, x, n, eps, [&](int64_t i) { return 1.0f + w[i]; });
}

// Rotate-half RoPE on the first `rot` dims: pairs (i, i + rot/2) turn by angle pos * theta^(-2i/rot).
// The angle is formed in fp32 as transformers does, then cos/sin are evaluated accurately.
void apply_rope(float* x, const AttentionParams& p, const int32_t* pos3) {
  const int64_t rot = p.rotary_dim, half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float inv_freq = 1.0f / std::pow(p.rope_theta, float(2 * i) / float(rot));
    const float angle = float(pos3[mrope_axis(i, p.mrope_section)]) * inv_freq;
    const float c = float(std::cos(double(angle))), s = float(std::sin(double(angle)));
    const float a = x[i], b = x[i + half];
    x[i] = a * c - b * s;
    x[i + half] = b * c + a * s;
  }
}

void CpuBackend::attention_prepare(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm,
                                   const Tensor& positions, const Tensor& rope_positions, const AttentionParams& p,
                                   const Tensor& q_out, const Tensor& k_cache, const Tensor& v_cache) {
  const int64_t T = qkv.dim(0), Hq = p.num_q_heads, Hkv = p.num_kv_heads, hd = p.head_dim;
  const int64_t k_off = Hq * 2 * hd, v_off = k_off + Hkv * hd;
  const int32_t* pos = ids_i32(positions);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* rpos = ids_i32(rope_positions) + 3 * t;
    const float* src = row_f32(qkv, t);
    for (int64_t h = 0; h < Hq; ++h) {
      float* q = row_f32(q_out, t) + h * hd;
      std::copy(src + h * 2 * hd, src + h * 2 * hd + hd, q);
      head_norm(q, q_norm.ptr<const float>(), hd, p.norm_eps);
      apply_rope(q, p, rpos);
    }
    for (int64_t h = 0; h < Hkv; ++h) {
      float* k = row_f32(k_cache, pos[t]) + h * hd;
      std::copy(src + k_off + h * hd, src + k_off + (h + 1) * hd, k);
      head_norm(k, k_norm.ptr<const float>(), hd, p.norm_eps);
      apply_rope(k, p, rpos);
      std::copy(src + v_off + h * hd, src + v_off + (h + 1) * hd, row_f32(v_cache, pos[t]) + h * hd);
    }
  }
}

// out[t, h] = softmax(scale * q[t,h] . K[0..pos[t]]^T) V[0..pos[t]] * sigmoid(gate[t, h]).
void CpuBackend::attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& qkv,
                           const Tensor& positions, const AttentionParams& p, const Tensor& out) {
  const int64_t T = q.dim(0), Hq = p.num_q_heads, hd = p.head_dim, group = Hq / p.num_kv_heads;
  const int32_t* pos = ids_i32(positions);
#pragma omp parallel for num_threads(threads_) schedule(dynamic)
  for (int64_t th = 0; th < T * Hq; ++th) {
    const int64_t t = th / Hq, h = th % Hq, g = h / group, n = int64_t(pos[t]) + 1;
    const float* qh = row_f32(q, t) + h * hd;
    std::vector<float> scores(n);
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      const float* kh = row_f32(k_cache, j) + g * hd;
      float s = 0;
      for (int64_t d = 0; d < hd; ++d) s += qh[d] * kh[d];
      scores[j] = s * p.scale;
      mx = std::max(mx, scores[j]);
    }
    double denom = 0;
    for (int64_t j = 0; j < n; ++j) denom += scores[j] = std::exp(scores[j] - mx);
    std::vector<double> acc(hd, 0.0);
    for (int64_t j = 0; j < n; ++j) {
      const float* vh = row_f32(v_cache, j) + g * hd;
      for (int64_t d = 0; d < hd; ++d) acc[d] += double(scores[j]) * vh[d];
    }
    const float* gate = row_f32(qkv, t) + h * 2 * hd + hd;
    float* o = row_f32(out, t) + h * hd;
    for (int64_t d = 0; d < hd; ++d) o[d] = float(acc[d] / denom) * sigmoid(gate[d]);
  }
}

void CpuBackend::vision_attention(const Tensor& qkv, const Tensor& patch_pos, const Tensor& cu_seqlens,
                                  int64_t num_heads, float rope_theta, const Tensor& out) {
  const int64_t N = qkv.dim(0), H = num_heads, hd = qkv.dim(1) / (3 * H), quarter = hd / 4;
  const int32_t* pos = ids_i32(patch_pos);
  const int32_t* cu = ids_i32(cu_seqlens);
  const int64_t images = cu_seqlens.dim(0) - 1;
  // q, k of every patch and head with their 2-D rotation applied.
  std::vector<float> q(N * H * hd), k(N * H * hd);
#pragma omp parallel for num_threads(threads_) if (N > 16)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = row_f32(qkv, n);
    for (int64_t h = 0; h < H; ++h)
      for (int part = 0; part < 2; ++part) {
        float* dst = (part == 0 ? q.data() : k.data()) + (n * H + h) * hd;
        std::copy(row + part * H * hd + h * hd, row + part * H * hd + (h + 1) * hd, dst);
        for (int64_t i = 0; i < hd / 2; ++i) {
          const int64_t j = i < quarter ? i : i - quarter;
          const float inv_freq = 1.0f / std::pow(rope_theta, float(4 * j) / float(hd));
          const float angle = float(pos[2 * n + (i < quarter ? 0 : 1)]) * inv_freq;
          const float c = float(std::cos(double(angle))), s = float(std::sin(double(angle)));
          const float a = dst[i], b = dst[i + hd / 2];
          dst[i] = a * c - b * s;
          dst[i + hd / 2] = b * c + a * s;
        }
      }
  }
  const float scale = 1.0f / std::sqrt(float(hd));
  for (int64_t img = 0; img < images; ++img) {
    const int64_t b0 = cu[img], b1 = cu[img + 1];
#pragma omp parallel for num_threads(threads_) schedule(dynamic)
    for (int64_t nh = b0 * H; nh < b1 * H; ++nh) {
      const int64_t n = nh / H, h = nh % H;
      const float* qh = &q[(n * H + h) * hd];
      std::vector<float> p(b1 - b0);
      float mx = -INFINITY;
      for (int64_t m = b0; m < b1; ++m) {
        const float* kh = &k[(m * H + h) * hd];
        float s = 0;
        for (int64_t d = 0; d < hd; ++d) s += qh[d] * kh[d];
        p[m - b0] = s * scale;
        mx = std::max(mx, p[m - b0]);
      }
      double denom = 0;
      for (float& v : p) denom += v = std::exp(v - mx);
      std::vector<double> acc(hd, 0.0);
      for (int64_t m = b0; m < b1; ++m) {
        const float* vh = row_f32(qkv, m) + 2 * H * hd + h * hd;
        for (int64_t d = 0; d < hd; ++d) acc[d] += double(p[m - b0]) * vh[d];
      }
      float* o = row_f32(out, n) + h * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] = float(acc[d] / denom);
    }
  }
}

}  // namespace ocria_rt
