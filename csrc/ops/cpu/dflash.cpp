// The DFlash drafter's ops on the CPU: its attention over the context cache and the block, DFlash2's
// grouped dynamic convolution, the logit transform and the candidate walk.
#include <algorithm>
#include <numeric>
#include <vector>

#include "ops/cpu/backend.h"
#include "ops/sampling_rng.h"

namespace ocria_rt {

namespace {

void check_rows(const Tensor& cache, int32_t pos, const char* op) {
  if (pos < 0 || pos >= cache.dim(0))
    throw Error(ErrorCode::kInternal, std::string(op) + ": position " + std::to_string(pos) + " outside the cache's " +
                                          std::to_string(cache.dim(0)) + " rows");
}

}  // namespace

void CpuBackend::draft_store_kv(const Tensor& kv, const Tensor& k_norm, const Tensor& positions, const AttentionParams& p,
                                const Tensor& k_cache, const Tensor& v_cache) {
  const int64_t T = kv.dim(0), Hkv = p.num_kv_heads, hd = p.head_dim;
  const int32_t* pos = ids_i32(positions);
  for (int64_t t = 0; t < T; ++t) {
    check_rows(k_cache, pos[t], "draft_store_kv");
    const int32_t pos3[3] = {pos[t], pos[t], pos[t]};
    const float* src = row_f32(kv, t);
    for (int64_t h = 0; h < Hkv; ++h) {
      float* k = row_f32(k_cache, pos[t]) + h * hd;
      std::copy(src + h * hd, src + (h + 1) * hd, k);
      head_norm(k, k_norm.ptr<const float>(), hd, p.norm_eps);
      apply_rope(k, p, pos3);
      std::copy(src + (Hkv + h) * hd, src + (Hkv + h + 1) * hd, row_f32(v_cache, pos[t]) + h * hd);
    }
  }
}

void CpuBackend::draft_attention(const Tensor& q, const Tensor& q_norm, const Tensor& positions, const Tensor& k_cache,
                                 const Tensor& v_cache, const AttentionParams& p, const DraftMask& mask,
                                 const Tensor& out) {
  const int64_t T = q.dim(0), Hq = p.num_q_heads, hd = p.head_dim, group = Hq / p.num_kv_heads;
  const int32_t* pos = ids_i32(positions);
  const int64_t last = pos[T - 1];
  check_rows(k_cache, int32_t(last), "draft_attention");
  auto visible = [&](int64_t query, int64_t key) {
    if (mask.causal && key > query) return false;
    if (mask.window > 0 && query - key >= mask.window) return false;
    if (mask.window > 0 && !mask.causal && key - query >= mask.window) return false;
    return true;
  };
#pragma omp parallel for num_threads(threads_) schedule(dynamic)
  for (int64_t th = 0; th < T * Hq; ++th) {
    const int64_t t = th / Hq, h = th % Hq, g = h / group;
    std::vector<float> qh(row_f32(q, t) + h * hd, row_f32(q, t) + (h + 1) * hd);
    head_norm(qh.data(), q_norm.ptr<const float>(), hd, p.norm_eps);
    const int32_t pos3[3] = {pos[t], pos[t], pos[t]};
    apply_rope(qh.data(), p, pos3);
    std::vector<float> scores(size_t(last + 1), -INFINITY);
    float mx = -INFINITY;
    for (int64_t j = 0; j <= last; ++j) {
      if (!visible(pos[t], j)) continue;
      const float* kh = row_f32(k_cache, j) + g * hd;
      float s = 0;
      for (int64_t d = 0; d < hd; ++d) s += qh[d] * kh[d];
      scores[j] = s * p.scale;
      mx = std::max(mx, scores[j]);
    }
    double denom = 0;
    std::vector<double> acc(hd, 0.0);
    for (int64_t j = 0; j <= last; ++j) {
      if (scores[j] == -INFINITY) continue;
      const float e = std::exp(scores[j] - mx);
      denom += e;
      const float* vh = row_f32(v_cache, j) + g * hd;
      for (int64_t d = 0; d < hd; ++d) acc[d] += double(e) * vh[d];
    }
    float* o = row_f32(out, t) + h * hd;
    for (int64_t d = 0; d < hd; ++d) o[d] = float(acc[d] / denom);
  }
}

void CpuBackend::dynamic_conv(const Tensor& x, const Tensor& dyn, const Tensor& base, int64_t group, const Tensor& out) {
  const int64_t T = x.dim(0), C = x.dim(1), K = base.dim(0), G = C / group;
  if (base.dim(1) != C || dyn.dim(1) != K * G || C % group != 0)
    throw Error(ErrorCode::kInternal, "dynamic_conv: x " + x.shape_str() + ", dyn " + dyn.shape_str() + ", base " +
                                          base.shape_str() + ", group " + std::to_string(group));
  const float* b = base.ptr<const float>();
#pragma omp parallel for num_threads(threads_) if (T * C > 4096)
  for (int64_t t = 0; t < T; ++t) {
    const float* dt = row_f32(dyn, t);
    float* o = row_f32(out, t);
    for (int64_t c = 0; c < C; ++c) {
      float acc = 0;
      for (int64_t off = 0; off < K && off <= t; ++off) {
        const float xv = row_f32(x, t - off)[c];
        acc += b[off * C + c] * xv;
        acc += dt[off * G + c / group] * xv;
      }
      o[c] = acc;
    }
  }
}

void CpuBackend::scale_softcap(const Tensor& x, float multiplier, float softcap) {
  expect_cpu_f32(x, "scale_softcap input");
  const int64_t R = x.dim(0), V = x.row_size();
  for (int64_t r = 0; r < R; ++r) {
    float* row = row_f32(x, r);
    for (int64_t i = 0; i < V; ++i) {
      const float v = row[i] * multiplier;
      row[i] = softcap > 0 ? std::tanh(v / softcap) * softcap : v;
    }
  }
}

void CpuBackend::selector_walk(const Tensor& logits, const Tensor& h, const Tensor& pred, const Tensor& succ,
                               const Tensor& anchor, float temperature, uint64_t seed, const Tensor& step,
                               const Tensor& tokens, const Tensor& cand, const Tensor& cand_prob) {
  const int64_t R = logits.dim(0), V = logits.dim(1), rank = h.dim(1), K = cand.dim(1);
  if (K > V || pred.dim(1) != rank || succ.dim(1) != rank)
    throw Error(ErrorCode::kInternal, "selector_walk: logits " + logits.shape_str() + ", h " + h.shape_str() + ", codebooks " +
                                          pred.shape_str() + " / " + succ.shape_str() + ", candidates " + cand.shape_str());
  const uint64_t c0 = uint32_t(ids_i32(step)[0]);
  int32_t prev = ids_i32(anchor)[0];
  std::vector<int32_t> order(V);
  std::vector<float> w(rank), score(K);
  for (int64_t t = 0; t < R; ++t) {
    const float* row = row_f32(logits, t);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
    const float* ht = row_f32(h, t);
    const float* a = row_f32(pred, prev);
    for (int64_t j = 0; j < rank; ++j) w[j] = a[j] * ht[j];
    int64_t best = 0;
    for (int64_t k = 0; k < K; ++k) {
      const float* b = row_f32(succ, order[k]);
      float s = 0;
      for (int64_t j = 0; j < rank; ++j) s += w[j] * b[j];
      score[k] = row[order[k]] + s;
      if (score[k] > score[best]) best = k;
    }
    int32_t* c = cand.ptr<int32_t>() + t * cand.row_stride;
    float* q = row_f32(cand_prob, t);
    std::copy(order.begin(), order.begin() + K, c);
    if (temperature <= 0) {
      for (int64_t k = 0; k < K; ++k) q[k] = k == best ? 1.0f : 0.0f;
    } else {  // q = softmax(score / temperature), a draw by its cumulative sum in candidate order
      double total = 0;
      for (int64_t k = 0; k < K; ++k) total += q[k] = std::exp((score[k] - score[best]) / temperature);
      for (int64_t k = 0; k < K; ++k) q[k] = float(q[k] / total);
      const double target = uniform_hash(seed, c0 + uint64_t(t));
      double cum = 0;
      for (best = 0; best < K - 1; ++best)
        if ((cum += q[best]) > target && q[best] > 0) break;
    }
    tokens.ptr<int32_t>()[t] = prev = order[best];
  }
}

}  // namespace ocria_rt
