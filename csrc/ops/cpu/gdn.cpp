// Gated DeltaNet on the CPU: the token-by-token recurrence and the chunked (WY / UT-transform)
// form, which must agree. Notation per value head: S [dk, dv], g = log decay, beta = write strength.
#include <vector>

#include "ops/cpu/backend.h"

namespace ocria_rt {

namespace {

float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold 20

// x * rsqrt(sum(x^2) + 1e-6) * scale, the l2norm transformers and fla apply to q and k.
void l2_normalise(const float* x, float* y, int64_t n, float scale) {
  float ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss + 1e-6f) * scale;
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv;
}

// The per-token inputs of one value head, in fp32.
struct HeadInputs {
  int64_t T, dk, dv;
  std::vector<float> q, k, v;   // [T, dk], [T, dk], [T, dv]; q, k normalised, q scaled by dk^-0.5
  std::vector<float> g, beta;   // [T]

  HeadInputs(const Tensor& qkv, const Tensor& ba, const float* A_log, const float* dt_bias, const GdnParams& p,
             int64_t h)
      : T(qkv.dim(0)), dk(p.k_head_dim), dv(p.v_head_dim), q(T * dk), k(T * dk), v(T * dv), g(T), beta(T) {
    const int64_t HK = p.num_k_heads, HV = p.num_v_heads, hk = h / (HV / HK);
    const float q_scale = 1.0f / std::sqrt(float(dk));
    for (int64_t t = 0; t < T; ++t) {
      const float* row = row_f32(qkv, t);
      l2_normalise(row + hk * dk, &q[t * dk], dk, q_scale);
      l2_normalise(row + HK * dk + hk * dk, &k[t * dk], dk, 1.0f);
      std::copy(row + 2 * HK * dk + h * dv, row + 2 * HK * dk + (h + 1) * dv, &v[t * dv]);
      const float* bar = row_f32(ba, t);
      beta[t] = sigmoid(bar[h]);
      g[t] = -std::exp(A_log[h]) * softplus(bar[HV + h] + dt_bias[h]);
    }
  }
};

// The recurrence of value head h over in.T tokens from the state S [dk, dv] (updated in place), its
// outputs into out. With `replay`, each token's normalised key (written by the first value head of
// its key head), log decay and corrected update are recorded, as gdn_commit replays them.
void recurrent_head(const HeadInputs& in, float* S, int64_t h, const GdnParams& p, const Tensor& out,
                    const GdnReplay* replay) {
  const int64_t dk = in.dk, dv = in.dv, group = p.num_v_heads / p.num_k_heads;
  std::vector<float> u(dv);
  for (int64_t t = 0; t < in.T; ++t) {
    const float* k = &in.k[t * dk];
    const float* q = &in.q[t * dk];
    const float decay = std::exp(in.g[t]);
    for (int64_t i = 0; i < dk * dv; ++i) S[i] *= decay;
    // u = beta * (v - S^T k)
    for (int64_t j = 0; j < dv; ++j) {
      float s = 0;
      for (int64_t i = 0; i < dk; ++i) s += S[i * dv + j] * k[i];
      u[j] = in.beta[t] * (in.v[t * dv + j] - s);
    }
    // S += k u^T ; o = S^T q
    float* o = row_f32(out, t) + h * dv;
    for (int64_t j = 0; j < dv; ++j) o[j] = 0;
    for (int64_t i = 0; i < dk; ++i) {
      for (int64_t j = 0; j < dv; ++j) {
        S[i * dv + j] += k[i] * u[j];
        o[j] += S[i * dv + j] * q[i];
      }
    }
    if (replay) {
      if (h % group == 0) std::copy(k, k + dk, row_f32(replay->k, t) + (h / group) * dk);
      row_f32(replay->g, t)[h] = in.g[t];
      std::copy(u.begin(), u.end(), row_f32(replay->u, t) + h * dv);
    }
  }
}

}  // namespace

void CpuBackend::gdn_recurrent(const Tensor& qkv, const Tensor& ba, const Tensor& A_log, const Tensor& dt_bias,
                               const Tensor& state, const GdnParams& p, const Tensor& out) {
  const int64_t HV = p.num_v_heads, dk = p.k_head_dim, dv = p.v_head_dim;
#pragma omp parallel for num_threads(threads_)
  for (int64_t h = 0; h < HV; ++h) {
    HeadInputs in(qkv, ba, A_log.ptr<const float>(), dt_bias.ptr<const float>(), p, h);
    recurrent_head(in, state.ptr<float>() + h * dk * dv, h, p, out, nullptr);
  }
}

// gdn_decode's three ops on copies of the states, the recurrence recording its replay; the same
// arithmetic as gdn_decode, so gdn_commit leaves the states gdn_decode would have left, bit for bit.
void CpuBackend::gdn_verify(const Tensor& proj, const Tensor& conv_weight, const Tensor& conv_state, const Tensor& A_log,
                            const Tensor& dt_bias, const Tensor& norm_weight, const Tensor& state, const GdnParams& p,
                            const Tensor& conv_out, const Tensor& o, const Tensor& out, const GdnReplay& replay) {
  const int64_t T = proj.dim(0), C = p.conv_dim(), vdim = p.num_v_heads * p.v_head_dim, HV = p.num_v_heads;
  const int64_t dk = p.k_head_dim, dv = p.v_head_dim;
  if (T > replay.u.dim(0))
    throw Error(ErrorCode::kInternal, "gdn_verify: " + std::to_string(T) + " tokens, replay rows for " +
                                          std::to_string(replay.u.dim(0)));
  copy(replay.conv_in.rows(0, T), proj.cols(0, C));
  std::vector<float> conv_copy(size_t(conv_state.numel()));
  std::copy(conv_state.ptr<const float>(), conv_state.ptr<const float>() + conv_state.numel(), conv_copy.data());
  gdn_conv(proj.cols(0, C), conv_weight, Tensor(conv_copy.data(), DType::F32, DeviceKind::CPU, {C, p.conv_kernel - 1}),
           conv_out);
  const Tensor ba = proj.cols(C + vdim, 2 * HV);
#pragma omp parallel for num_threads(threads_)
  for (int64_t h = 0; h < HV; ++h) {
    HeadInputs in(conv_out, ba, A_log.ptr<const float>(), dt_bias.ptr<const float>(), p, h);
    std::vector<float> S(state.ptr<const float>() + h * dk * dv, state.ptr<const float>() + (h + 1) * dk * dv);
    recurrent_head(in, S.data(), h, p, o, &replay);
  }
  gdn_gated_norm(o, proj.cols(C, vdim), norm_weight, p, out);
}

void CpuBackend::gdn_commit(const GdnReplay& replay, const Tensor& keep, const GdnParams& p, const Tensor& conv_state,
                            const Tensor& state) {
  const int64_t n = ids_i32(keep)[0], C = p.conv_dim(), K1 = p.conv_kernel - 1;
  const int64_t HK = p.num_k_heads, HV = p.num_v_heads, dk = p.k_head_dim, dv = p.v_head_dim, group = HV / HK;
  if (n < 1 || n > replay.u.dim(0))
    throw Error(ErrorCode::kInternal, "gdn_commit: keep " + std::to_string(n) + " outside 1.." + std::to_string(replay.u.dim(0)));
  // conv_state <- the last K-1 rows of [conv_state ; conv_in[0 : n]], per channel
  float* cs = conv_state.ptr<float>();
  for (int64_t c = 0; c < C; ++c) {
    std::vector<float> in(K1 + n);
    for (int64_t j = 0; j < K1; ++j) in[j] = cs[c * K1 + j];
    for (int64_t t = 0; t < n; ++t) in[K1 + t] = row_f32(replay.conv_in, t)[c];
    for (int64_t j = 0; j < K1; ++j) cs[c * K1 + j] = in[n + j];
  }
#pragma omp parallel for num_threads(threads_)
  for (int64_t h = 0; h < HV; ++h) {
    float* S = state.ptr<float>() + h * dk * dv;
    for (int64_t t = 0; t < n; ++t) {
      const float* k = row_f32(replay.k, t) + (h / group) * dk;
      const float* u = row_f32(replay.u, t) + h * dv;
      const float decay = std::exp(row_f32(replay.g, t)[h]);
      for (int64_t i = 0; i < dk * dv; ++i) S[i] *= decay;
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dv; ++j) S[i * dv + j] += k[i] * u[j];
    }
  }
}

// Chunked form (chunk C = 64). Within a chunk, with G_t = sum_{s<=t} g_s (log decay from the chunk
// start) and the state S0 entering the chunk, the recurrence unrolls to
//   U = T^-1 (beta V),  W = T^-1 (beta e^G K)   with T = I + tril_strict(beta_i e^(G_i - G_j) k_i.k_j)
//   V' = U - W S0                                (the values each token actually writes)
//   O  = e^G (Q S0) + (tril(e^(G_i - G_j) q_i.k_j)) V'
//   S1 = e^(G_last) S0 + sum_t e^(G_last - G_t) k_t V'_t^T
void CpuBackend::gdn_chunked(const Tensor& qkv, const Tensor& ba, const Tensor& A_log, const Tensor& dt_bias,
                             const Tensor& state, const GdnParams& p, const Tensor& out) {
  constexpr int64_t kChunk = 64;
  const int64_t HV = p.num_v_heads, dk = p.k_head_dim, dv = p.v_head_dim;
#pragma omp parallel for num_threads(threads_)
  for (int64_t h = 0; h < HV; ++h) {
    HeadInputs in(qkv, ba, A_log.ptr<const float>(), dt_bias.ptr<const float>(), p, h);
    float* S = state.ptr<float>() + h * dk * dv;
    std::vector<float> G(kChunk), Tm(kChunk * kChunk), U(kChunk * dv), W(kChunk * dk), Vn(kChunk * dv);
    for (int64_t c0 = 0; c0 < in.T; c0 += kChunk) {
      const int64_t L = std::min(kChunk, in.T - c0);
      const float* q = &in.q[c0 * dk];
      const float* k = &in.k[c0 * dk];
      float acc = 0;
      for (int64_t i = 0; i < L; ++i) G[i] = acc += in.g[c0 + i];
      auto dot = [](const float* a, const float* b, int64_t n) {
        float s = 0;
        for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
        return s;
      };
      // Forward substitution with the unit lower-triangular T: row i = rhs_i - sum_{j<i} T_ij row_j.
      for (int64_t i = 0; i < L; ++i) {
        const float b = in.beta[c0 + i];
        for (int64_t j = 0; j < i; ++j) Tm[i * kChunk + j] = b * std::exp(G[i] - G[j]) * dot(&k[i * dk], &k[j * dk], dk);
        for (int64_t e = 0; e < dv; ++e) U[i * dv + e] = b * in.v[(c0 + i) * dv + e];
        for (int64_t e = 0; e < dk; ++e) W[i * dk + e] = b * std::exp(G[i]) * k[i * dk + e];
        for (int64_t j = 0; j < i; ++j) {
          const float t = Tm[i * kChunk + j];
          for (int64_t e = 0; e < dv; ++e) U[i * dv + e] -= t * U[j * dv + e];
          for (int64_t e = 0; e < dk; ++e) W[i * dk + e] -= t * W[j * dk + e];
        }
      }
      // V' = U - W S0
      for (int64_t i = 0; i < L; ++i)
        for (int64_t e = 0; e < dv; ++e) {
          float s = 0;
          for (int64_t a = 0; a < dk; ++a) s += W[i * dk + a] * S[a * dv + e];
          Vn[i * dv + e] = U[i * dv + e] - s;
        }
      // O = e^G (Q S0) + tril(e^(G_i - G_j) q_i.k_j) V'
      for (int64_t i = 0; i < L; ++i) {
        float* o = row_f32(out, c0 + i) + h * dv;
        const float eg = std::exp(G[i]);
        for (int64_t e = 0; e < dv; ++e) {
          float s = 0;
          for (int64_t a = 0; a < dk; ++a) s += q[i * dk + a] * S[a * dv + e];
          o[e] = eg * s;
        }
        for (int64_t j = 0; j <= i; ++j) {
          const float a = std::exp(G[i] - G[j]) * dot(&q[i * dk], &k[j * dk], dk);
          for (int64_t e = 0; e < dv; ++e) o[e] += a * Vn[j * dv + e];
        }
      }
      // S1 = e^(G_last) S0 + sum_t e^(G_last - G_t) k_t V'_t^T
      const float last = G[L - 1];
      for (int64_t i = 0; i < dk * dv; ++i) S[i] *= std::exp(last);
      for (int64_t t = 0; t < L; ++t) {
        const float d = std::exp(last - G[t]);
        for (int64_t a = 0; a < dk; ++a) {
          const float ka = d * k[t * dk + a];
          for (int64_t e = 0; e < dv; ++e) S[a * dv + e] += ka * Vn[t * dv + e];
        }
      }
    }
  }
}

}  // namespace ocria_rt
