#include <vector>

#include "ops/cpu/backend.h"

namespace ocria_rt {

// Causal depthwise conv + SiLU: out[t, c] = silu(sum_j w[c, j] * in[t + j, c]) with
// in = [conv_state (K-1 previous inputs) ; x], so w[c, K-1] multiplies the current input.
void CpuBackend::gdn_conv(const Tensor& x, const Tensor& conv_weight, const Tensor& conv_state, const Tensor& out) {
  const int64_t T = x.dim(0), C = out.dim(1), K = conv_weight.dim(1);
  const float* w = conv_weight.ptr<const float>();
  float* state = conv_state.ptr<float>();
#pragma omp parallel for num_threads(threads_) if (C * T > 4096)
  for (int64_t c = 0; c < C; ++c) {
    std::vector<float> in(K - 1 + T);
    for (int64_t j = 0; j < K - 1; ++j) in[j] = state[c * (K - 1) + j];
    for (int64_t t = 0; t < T; ++t) in[K - 1 + t] = row_f32(x, t)[c];
    for (int64_t t = 0; t < T; ++t) {
      float s = 0;
      for (int64_t j = 0; j < K; ++j) s += w[c * K + j] * in[t + j];
      row_f32(out, t)[c] = silu(s);
    }
    for (int64_t j = 0; j < K - 1; ++j) state[c * (K - 1) + j] = in[T + j];
  }
}

}  // namespace ocria_rt
