// The causal depthwise conv + SiLU of one channel, shared by gdn_conv (conv.cu) and the fused decode
// kernel (gdn.cu), so that both form the same sums in the same order:
//   out[t] = silu(sum_j w[j] * in[t + j]),  in = [conv_state (K-1 previous inputs) ; x].
// The window is kept right-aligned in register arrays of W >= K slots (static indices only): after
// the input of token t is shifted in, win[W - K + j] = in[t + j] for j < K, and w[] holds the weights
// at the same positions (zeros in front), so out = silu(sum_i w[i] * win[i]). The zero slots add
// exact zeros first, so every W >= K gives the same bits; W = K (known at compile time) keeps fewer
// registers.
#pragma once
#include "ops/cuda/backend.cuh"

namespace ocria_rt {
namespace cuda {

constexpr int kConvMaxWidth = 8;

template <int W = kConvMaxWidth> struct ConvWindow {
  float w[W], win[W];

  // The weights of channel c of conv_weight [C, K]; zeros if !valid.
  __device__ __forceinline__ void load_weights(ParamView cw, int64_t c, int K, bool valid) {
    const int lead = W - K;  // unused front slots
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = i >= lead && valid ? cw[c * K + (i - lead)] : 0.0f;
  }
  // The window before token t0: in_at(j) = in[t0 + j] for j < K-1.
  template <class In>
  __device__ __forceinline__ void start(int K, In in_at) {
    const int lead = W - K;
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const int j = i - lead - 1;  // win[lead + 1 + j] = in[t0 + j]
      win[i] = j >= 0 ? in_at(j) : 0.0f;
    }
  }
  // Shifts in x (the input of the next token) and returns its output.
  __device__ __forceinline__ float step(float x) {
#pragma unroll
    for (int i = 0; i < W - 1; ++i) win[i] = win[i + 1];
    win[W - 1] = x;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < W; ++i) s = fmaf(w[i], win[i], s);
    return silu(s);
  }
  // The new conv state, the last K-1 inputs: put(j, in[T + j]) for j < K-1 (after the last step).
  template <class Put>
  __device__ __forceinline__ void finish(int K, Put put) const {
    const int lead = W - K;
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const int j = i - lead - 1;
      if (j >= 0) put(j, win[i]);
    }
  }
};

}  // namespace cuda
}  // namespace ocria_rt
