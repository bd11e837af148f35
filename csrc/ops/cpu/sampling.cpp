#include <algorithm>
#include <numeric>
#include <vector>

#include "ops/cpu/backend.h"
#include "ops/sampling_rng.h"

namespace ocria_rt {

int32_t argmax_row(const float* logits, int64_t V) {
  return int32_t(std::max_element(logits, logits + V) - logits);  // first max
}

SamplerDistribution sampler_distribution(const float* logits, int64_t V, const SamplerConfig& cfg) {
  SamplerDistribution d;
  // p = softmax(logits / temperature)
  const float mx = *std::max_element(logits, logits + V);
  d.prob.resize(V);
  double total = 0;
  for (int64_t i = 0; i < V; ++i) total += d.prob[i] = std::exp((logits[i] - mx) / cfg.temperature);
  for (int64_t i = 0; i < V; ++i) d.prob[i] = float(d.prob[i] / total);
  // candidates by probability, descending; ties by lower index
  d.order.resize(V);
  std::iota(d.order.begin(), d.order.end(), 0);
  const int64_t k = cfg.top_k > 0 ? std::min<int64_t>(cfg.top_k, V) : V;
  const std::vector<float>& prob = d.prob;
  auto by_prob = [&](int32_t a, int32_t b) { return prob[a] > prob[b] || (prob[a] == prob[b] && a < b); };
  std::partial_sort(d.order.begin(), d.order.begin() + k, d.order.end(), by_prob);
  d.kept = k;
  if (cfg.top_p < 1.0f) {  // smallest prefix whose mass reaches top_p
    double cum = 0;
    for (d.kept = 0; d.kept < k;) {
      cum += prob[d.order[d.kept++]];
      if (cum >= cfg.top_p) break;
    }
  }
  for (int64_t i = 0; i < d.kept; ++i) d.mass += prob[d.order[i]];
  d.p.assign(size_t(V), 0.0);
  for (int64_t i = 0; i < d.kept; ++i) d.p[d.order[i]] = prob[d.order[i]] / d.mass;
  return d;
}

int32_t SamplerDistribution::draw(float u) const {
  const double target = double(u) * mass;
  double cum = 0;
  for (int64_t i = 0; i < kept; ++i) {
    cum += prob[order[i]];
    if (cum > target) return order[i];
  }
  return order[kept - 1];
}

void CpuBackend::sample(const Tensor& logits, const SamplerConfig& config, const Tensor& step, const Tensor& tokens) {
  expect_cpu_f32(logits, "sample logits");
  const int64_t R = logits.ndim == 1 ? 1 : logits.dim(0), V = logits.dim(-1);
  int32_t* counter = step.ptr<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    const float* row = row_f32(logits, r);
    tokens.ptr<int32_t>()[r] =
        config.temperature <= 0
            ? argmax_row(row, V)
            : sampler_distribution(row, V, config).draw(uniform_hash(config.seed, uint64_t(uint32_t(counter[0] + r))));
  }
  counter[0] += int32_t(R);
}

void CpuBackend::speculative_accept(const Tensor& logits, const Tensor& draft, const Tensor& cand, const Tensor& cand_prob,
                                    const SamplerConfig& config, const Tensor& step, const Tensor& out,
                                    const Tensor& count) {
  expect_cpu_f32(logits, "speculative_accept logits");
  const int64_t B = logits.dim(0), V = logits.dim(1), Kq = cand.dim(1);
  const int32_t* d = ids_i32(draft);
  int32_t* emitted = out.ptr<int32_t>();
  int64_t a = 0;
  if (config.temperature <= 0) {
    for (; a < B - 1 && d[a] == argmax_row(row_f32(logits, a), V); ++a) emitted[a] = d[a];
    emitted[a] = argmax_row(row_f32(logits, a), V);
  } else {
    const uint64_t c0 = uint32_t(ids_i32(step)[0]);
    const float last_u = uniform_hash(config.seed, c0 + uint64_t(B - 1));
    int32_t correction = -1;
    for (; a < B - 1; ++a) {
      const SamplerDistribution p = sampler_distribution(row_f32(logits, a), V, config);
      const int32_t* c = ids_i32(cand) + a * cand.row_stride;
      const float* qa = row_f32(cand_prob, a);
      double q = 0;
      for (int64_t k = 0; k < Kq; ++k) q += c[k] == d[a] ? qa[k] : 0.0f;
      if (double(uniform_hash(config.seed, c0 + uint64_t(a))) * q < p.p[d[a]]) {
        emitted[a] = d[a];
        continue;
      }
      // Rejected: a draw from max(0, p - q), renormalised; q is zero off its candidates. Only the
      // tokens p keeps can carry residual mass, so the draw walks p's order.
      std::vector<double> residual(size_t(p.kept));
      double total = 0;
      for (int64_t i = 0; i < p.kept; ++i) {
        const int32_t tok = p.order[i];
        double qt = 0;
        for (int64_t k = 0; k < Kq; ++k) qt += c[k] == tok ? qa[k] : 0.0f;
        total += residual[i] = std::max(0.0, p.p[tok] - qt);
      }
      if (total > 0) {
        const double target = double(last_u) * total;
        double cum = 0;
        for (int64_t i = 0; i < p.kept; ++i) {
          if (residual[i] <= 0) continue;
          correction = p.order[i];  // the last token with residual mass, should rounding leave cum <= target
          if ((cum += residual[i]) > target) break;
        }
      } else {
        correction = p.draw(last_u);
      }
      break;
    }
    emitted[a] = a < B - 1 ? correction : sampler_distribution(row_f32(logits, B - 1), V, config).draw(last_u);
  }
  count.ptr<int32_t>()[0] = int32_t(a + 1);
  step.ptr<int32_t>()[0] += int32_t(B);
}

}  // namespace ocria_rt
