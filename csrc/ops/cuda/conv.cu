// gdn_conv: causal depthwise conv (width K, no bias) + SiLU over the channels of x [T, C]:
//   out[t, c] = silu(sum_j w[c, j] * in[t + j, c]),  in = [conv_state (K-1 previous inputs) ; x],
// so w[c, K-1] multiplies the current input; conv_state [C, K-1] (F32) becomes the last K-1 inputs.
// One thread per (channel, chunk of kTokens tokens): coalesced over channels, the window slides in
// registers (ConvWindow, conv.cuh). With more than one chunk the state update runs as a second
// kernel (the first chunk still reads the old state).
#include "ops/cuda/conv.cuh"

namespace ocria_rt {
namespace cuda {
namespace {

constexpr int kTokens = 64;

template <class T>
__global__ void conv_kernel(const T* __restrict__ x, int64_t ldx, ParamView w, float* __restrict__ state,
                            T* __restrict__ out, int64_t ldo, int T_, int C, int K, bool update_state) {
  pdl_launch_dependents();
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  ConvWindow<> cw;
  cw.load_weights(w, c, K, c < C);
  pdl_wait();  // the weights are read-only; x and the state come from earlier kernels
  if (c >= C) return;
  const int t0 = blockIdx.y * kTokens, t1 = min(T_, t0 + kTokens);
  // in[p] = state[p] (p < K-1) or x[p - (K-1)]
  cw.start(K, [&](int j) {
    const int p = t0 + j;
    return p < K - 1 ? state[int64_t(c) * (K - 1) + p] : to_float(x[int64_t(p - (K - 1)) * ldx + c]);
  });
  for (int t = t0; t < t1; ++t) out[int64_t(t) * ldo + c] = from_float<T>(cw.step(to_float(x[int64_t(t) * ldx + c])));
  // Single chunk: this thread read the old state above; the window now ends in in[T .. T+K-2].
  if (update_state) cw.finish(K, [&](int j, float v) { state[int64_t(c) * (K - 1) + j] = v; });
}

// state[c, j] = in[T + j] = x[T - (K-1) + j] (T >= K-1 here, else the single-chunk path ran).
template <class T>
__global__ void conv_state_kernel(const T* __restrict__ x, int64_t ldx, float* __restrict__ state, int T_, int C,
                                  int K) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int j = 0; j < K - 1; ++j) state[int64_t(c) * (K - 1) + j] = to_float(x[int64_t(T_ - (K - 1) + j) * ldx + c]);
}

template <class T>
void launch(const Tensor& x, ParamView w, const Tensor& state, const Tensor& out, int T_, int C, int K,
            const LaunchCtx& ctx) {
  const int chunks = (T_ + kTokens - 1) / kTokens;
  dim3 grid(unsigned((C + 127) / 128), unsigned(chunks));
  launch_pdl(ctx, "conv_kernel", conv_kernel<T>, grid, 128, 0, x.ptr<const T>(), x.row_stride, w, state.ptr<float>(),
             out.ptr<T>(), out.row_stride, T_, C, K, chunks == 1);
  if (chunks > 1) {  // prefill only: an ordinary launch, after conv_kernel has completed
    conv_state_kernel<T><<<unsigned((C + 127) / 128), 128, 0, ctx.stream>>>(x.ptr<const T>(), x.row_stride,
                                                                            state.ptr<float>(), T_, C, K);
    check_launch("conv_state_kernel");
  }
}

}  // namespace
}  // namespace cuda

void CudaBackend::gdn_conv(const Tensor& x, const Tensor& conv_weight, const Tensor& conv_state, const Tensor& out) {
  using namespace cuda;
  const char* op = "gdn_conv";
  require_float(x, op, "x");
  require_tensor(out, x.dtype, op, "out");
  require_tensor(conv_state, DType::F32, op, "conv_state");
  ParamView w = param_view(conv_weight, op, "conv_weight");
  OCRIA_RT_REQUIRE(x.ndim == 2 && out.ndim == 2 && x.dim(0) == out.dim(0) && x.dim(1) == out.dim(1), op,
          "x " + x.shape_str() + " vs out " + out.shape_str());
  const int64_t T = x.dim(0), C = x.dim(1), K = conv_weight.dim(-1);
  OCRIA_RT_REQUIRE(conv_weight.numel() == C * K, op, "conv_weight " + conv_weight.shape_str() + " for " + std::to_string(C) +
                                                " channels");
  OCRIA_RT_REQUIRE(K >= 2 && K <= kConvMaxWidth, op, "conv width " + std::to_string(K) + " unsupported (2..8)");
  OCRIA_RT_REQUIRE(conv_state.numel() == C * (K - 1) && conv_state.contiguous(), op,
          "conv_state " + conv_state.shape_str() + ", expected [C, K-1] contiguous");
  OCRIA_RT_REQUIRE(T <= (int64_t(65535) * kTokens), op, "too many tokens");
  if (T == 0 || C == 0) return;
  activate();
  if (x.dtype == DType::BF16)
    launch<bf16>(x, w, conv_state, out, int(T), int(C), int(K), launch_ctx());
  else
    launch<float>(x, w, conv_state, out, int(T), int(C), int(K), launch_ctx());
}

}  // namespace ocria_rt
