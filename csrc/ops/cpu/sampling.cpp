#include <algorithm>
#include <numeric>
#include <vector>

#include "ops/cpu/backend.h"
#include "ops/sampling_rng.h"

namespace ocria_rt {

namespace {

int32_t sample_row(const float* logits, int64_t V, const SamplerConfig& cfg, uint64_t counter) {
  if (cfg.temperature <= 0) return int32_t(std::max_element(logits, logits + V) - logits);  // first max
  // p = softmax(logits / temperature)
  const float mx = *std::max_element(logits, logits + V);
  std::vector<float> prob(V);
  double total = 0;
  for (int64_t i = 0; i < V; ++i) total += prob[i] = std::exp((logits[i] - mx) / cfg.temperature);
  for (int64_t i = 0; i < V; ++i) prob[i] = float(prob[i] / total);
  // candidates by probability, descending; ties by lower index
  std::vector<int32_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  const int64_t k = cfg.top_k > 0 ? std::min<int64_t>(cfg.top_k, V) : V;
  auto by_prob = [&](int32_t a, int32_t b) { return prob[a] > prob[b] || (prob[a] == prob[b] && a < b); };
  std::partial_sort(order.begin(), order.begin() + k, order.end(), by_prob);
  int64_t kept = k;
  if (cfg.top_p < 1.0f) {  // smallest prefix whose mass reaches top_p
    double cum = 0;
    for (kept = 0; kept < k;) {
      cum += prob[order[kept++]];
      if (cum >= cfg.top_p) break;
    }
  }
  double mass = 0;
  for (int64_t i = 0; i < kept; ++i) mass += prob[order[i]];
  const double target = double(uniform_hash(cfg.seed, counter)) * mass;
  double cum = 0;
  for (int64_t i = 0; i < kept; ++i) {
    cum += prob[order[i]];
    if (cum > target) return order[i];
  }
  return order[kept - 1];
}

}  // namespace

void CpuBackend::sample(const Tensor& logits, const SamplerConfig& config, const Tensor& step, const Tensor& tokens) {
  expect_cpu_f32(logits, "sample logits");
  const int64_t R = logits.ndim == 1 ? 1 : logits.dim(0), V = logits.dim(-1);
  int32_t* counter = step.ptr<int32_t>();
  for (int64_t r = 0; r < R; ++r)
    tokens.ptr<int32_t>()[r] = sample_row(row_f32(logits, r), V, config, uint64_t(uint32_t(counter[0] + r)));
  counter[0] += int32_t(R);
}

}  // namespace ocria_rt
