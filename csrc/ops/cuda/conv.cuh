// The causal depthwise conv + SiLU of one channel, shared by gdn_conv (conv.cu) and the fused decode
// kernel (gdn.cu), so that both form the same sums in the same order:
//   out[t] = silu(sum_j w[j] * in[t + j]),  in = [conv_state (K-1 previous inputs) ; x].
// The window is kept right-aligned in fixed-size register arrays (static indices only): after the
// input of token t is shifted in, win[kConvMaxWidth - K + j] = in[t + j] for j < K, and w[] holds the
// weights at the same positions (zeros in front), so out = silu(sum_i w[i] * win[i]).
#pragma once
#include "ops/cuda/backend.cuh"

namespace ocria_rt {
namespace cuda {

constexpr int kConvMaxWidth = 8;

struct ConvWindow {
  float w[kConvMaxWidth], win[kConvMaxWidth];

  // The weights of channel c of conv_weight [C, K]; zeros if !valid.
  __device__ __forceinline__ void load_weights(ParamView cw, int64_t c, int K, bool valid) {
    const int lead = kConvMaxWidth - K;  // unused front slots
#pragma unroll
    for (int i = 0; i < kConvMaxWidth; ++i) w[i] = i >= lead && valid ? cw[c * K + (i - lead)] : 0.0f;
  }
  // The window before token t0: in_at(j) = in[t0 + j] for j < K-1.
  template <class In>
  __device__ __forceinline__ void start(int K, In in_at) {
    const int lead = kConvMaxWidth - K;
#pragma unroll
    for (int i = 0; i < kConvMaxWidth; ++i) {
      const int j = i - lead - 1;  // win[lead + 1 + j] = in[t0 + j]
      win[i] = j >= 0 ? in_at(j) : 0.0f;
    }
  }
  // Shifts in x (the input of the next token) and returns its output.
  __device__ __forceinline__ float step(float x) {
#pragma unroll
    for (int i = 0; i < kConvMaxWidth - 1; ++i) win[i] = win[i + 1];
    win[kConvMaxWidth - 1] = x;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < kConvMaxWidth; ++i) s = fmaf(w[i], win[i], s);
    return silu(s);
  }
  // The new conv state, the last K-1 inputs: put(j, in[T + j]) for j < K-1 (after the last step).
  template <class Put>
  __device__ __forceinline__ void finish(int K, Put put) const {
    const int lead = kConvMaxWidth - K;
#pragma unroll
    for (int i = 0; i < kConvMaxWidth; ++i) {
      const int j = i - lead - 1;
      if (j >= 0) put(j, win[i]);
    }
  }
};

}  // namespace cuda
}  // namespace ocria_rt
