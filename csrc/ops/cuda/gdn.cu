// Gated DeltaNet: the recurrence (gdn_recurrent, gdn_chunked) and the gated output norm.
//
// Per value head h (key head h / (HV / HK)) and token t, with S [dk, dv] fp32:
//   q, k L2-normalised, q *= dk^-0.5, beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
//   S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q
// Since S_new = S_dec + k u^T, o = S_dec^T q + u (k . q): both reductions over dk (S_dec^T k and
// S_dec^T q) happen in the same pass, so each token needs one block-wide exchange.
//
// Kernel layout: one block per (value head, 32 columns of dv), 4 warps. Lane = column j; warp w holds
// rows i in [w dk/4, (w+1) dk/4) of S in registers for the whole call, so the state is read and
// written once. Tokens are processed in chunks of 16: the warps first normalise q, k and compute
// beta, exp(g), k.q of the chunk's tokens into shared memory, then step through the tokens.
//
// gdn_chunked runs the same kernel: it is exact, and costs ~0.1-0.2 us per token per layer, fine for
// the prompt lengths of page parsing. A chunked (WY / UT-transform) tensor-core kernel for long
// prefills is future work.
#include "ops/cuda/backend.cuh"

namespace ocria_rt {
namespace cuda {
namespace {

constexpr int kTokChunk = 16;
constexpr int kWarps = 4;

__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(__expf(x)); }  // torch threshold

template <int DK, class T>
__global__ void __launch_bounds__(kWarps * 32)
    gdn_recurrent_kernel(const T* __restrict__ qkv, int64_t ldq, const T* __restrict__ ba, int64_t ldb, ParamView A_log,
                         ParamView dt_bias, float* __restrict__ state, T* __restrict__ out, int64_t ldo, int n_tokens,
                         int HK, int HV, int dv) {
  constexpr int R = DK / kWarps;         // rows of S per thread
  constexpr int E = (DK + 31) / 32;     // q / k elements per lane in the prologue
  __shared__ __align__(16) float qs[kTokChunk][DK];
  __shared__ __align__(16) float ks[kTokChunk][DK];
  __shared__ float vs[kTokChunk][32];
  __shared__ float beta_s[kTokChunk], decay_s[kTokChunk], kq_s[kTokChunk];
  __shared__ float red[2][kWarps][32][2];  // [token parity][warp][column] (S^T k, S^T q) partial sums

  pdl_launch_dependents();
  const int h = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int col = blockIdx.y * 32 + lane;
  const bool col_ok = col < dv;  // dv need not be a multiple of 32: surplus lanes carry zeros
  const int hk = h / (HV / HK);
  const int64_t q_off = int64_t(hk) * DK, k_off = int64_t(HK + hk) * DK, v_off = int64_t(2 * HK) * DK + int64_t(h) * dv;
  const float q_scale = rsqrtf(float(DK));
  const float neg_A = -__expf(A_log[h]), dtb = dt_bias[h];
  pdl_wait();  // A_log and dt_bias are read-only; the state and the inputs come from earlier kernels

  float* Sp = state + int64_t(h) * DK * dv + int64_t(warp * R) * dv + col;
  float S[R];
#pragma unroll
  for (int r = 0; r < R; ++r) S[r] = col_ok ? Sp[int64_t(r) * dv] : 0.0f;

  int parity = 0;
  for (int tc = 0; tc < n_tokens; tc += kTokChunk) {
    const int nt = min(kTokChunk, n_tokens - tc);
    __syncthreads();  // the previous chunk's shared inputs are no longer read
    for (int tt = warp; tt < nt; tt += kWarps) {
      const T* row = qkv + int64_t(tc + tt) * ldq;
      float qv[E], kv[E], ssq = 0.0f, ssk = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const bool in = lane + 32 * e < DK;
        qv[e] = in ? to_float(row[q_off + lane + 32 * e]) : 0.0f;
        kv[e] = in ? to_float(row[k_off + lane + 32 * e]) : 0.0f;
        ssq = fmaf(qv[e], qv[e], ssq);
        ssk = fmaf(kv[e], kv[e], ssk);
      }
      // x * rsqrt(sum x^2 + 1e-6), as transformers / fla l2norm; q additionally * dk^-0.5.
      const float qi = rsqrtf(warp_sum(ssq) + 1e-6f) * q_scale, ki = rsqrtf(warp_sum(ssk) + 1e-6f);
      float kq = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float qn = qv[e] * qi, kn = kv[e] * ki;
        if (lane + 32 * e < DK) {
          qs[tt][lane + 32 * e] = qn;
          ks[tt][lane + 32 * e] = kn;
        }
        kq = fmaf(qn, kn, kq);
      }
      kq = warp_sum(kq);
      vs[tt][lane] = col_ok ? to_float(row[v_off + col]) : 0.0f;
      if (lane == 0) {
        const T* bar = ba + int64_t(tc + tt) * ldb;
        beta_s[tt] = sigmoid(to_float(bar[h]));
        decay_s[tt] = __expf(neg_A * softplus(to_float(bar[HV + h]) + dtb));
        kq_s[tt] = kq;
      }
    }
    __syncthreads();
    for (int tt = 0; tt < nt; ++tt) {
      const float d = decay_s[tt];
      const float* kt = &ks[tt][warp * R];
      const float* qt = &qs[tt][warp * R];
      float pk = 0.0f, pq = 0.0f;
#pragma unroll
      for (int r = 0; r < R; r += 4) {
        const float4 k4 = *reinterpret_cast<const float4*>(kt + r);
        const float4 q4 = *reinterpret_cast<const float4*>(qt + r);
        S[r] *= d, S[r + 1] *= d, S[r + 2] *= d, S[r + 3] *= d;
        pk = fmaf(S[r], k4.x, fmaf(S[r + 1], k4.y, fmaf(S[r + 2], k4.z, fmaf(S[r + 3], k4.w, pk))));
        pq = fmaf(S[r], q4.x, fmaf(S[r + 1], q4.y, fmaf(S[r + 2], q4.z, fmaf(S[r + 3], q4.w, pq))));
      }
      red[parity][warp][lane][0] = pk;
      red[parity][warp][lane][1] = pq;
      // One barrier per token: red is double-buffered by token parity, and a warp can only write
      // this buffer again after everyone passed the next token's barrier, i.e. finished reading it.
      __syncthreads();
      float sk = 0.0f, sq = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        sk += red[parity][w][lane][0];
        sq += red[parity][w][lane][1];
      }
      const float u = beta_s[tt] * (vs[tt][lane] - sk);
#pragma unroll
      for (int r = 0; r < R; r += 4) {
        const float4 k4 = *reinterpret_cast<const float4*>(kt + r);
        S[r] = fmaf(k4.x, u, S[r]);
        S[r + 1] = fmaf(k4.y, u, S[r + 1]);
        S[r + 2] = fmaf(k4.z, u, S[r + 2]);
        S[r + 3] = fmaf(k4.w, u, S[r + 3]);
      }
      if (warp == 0 && col_ok) out[int64_t(tc + tt) * ldo + int64_t(h) * dv + col] = from_float<T>(sq + u * kq_s[tt]);
      parity ^= 1;
    }
  }
  if (col_ok)
#pragma unroll
    for (int r = 0; r < R; ++r) Sp[int64_t(r) * dv] = S[r];
}

// out = weight * rmsnorm(o) * silu(z) per (token, value head); one warp per row of dv.
template <class T>
__global__ void gated_norm_kernel(const T* __restrict__ o, int64_t ldo_in, const T* __restrict__ z, int64_t ldz,
                                  ParamView w, T* __restrict__ out, int64_t ldo, int64_t rows, int HV, int dv,
                                  float eps) {
  pdl_launch_dependents();
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  pdl_wait();  // o and z come from earlier kernels
  if (r >= rows) return;
  const int64_t t = r / HV, h = r % HV;
  const T* orow = o + t * ldo_in + h * dv;
  const T* zrow = z + t * ldz + h * dv;
  T* dst = out + t * ldo + h * dv;
  float ss = 0.0f;
  for (int i = lane; i < dv; i += 32) {
    const float v = to_float(orow[i]);
    ss = fmaf(v, v, ss);
  }
  const float inv = rsqrtf(warp_sum(ss) / float(dv) + eps);
  for (int i = lane; i < dv; i += 32)
    dst[i] = from_float<T>(to_float(orow[i]) * inv * (w[i] * silu(to_float(zrow[i]))));
}

template <class T>
void launch_recurrent(int dk, dim3 grid, const Tensor& qkv, const Tensor& ba, ParamView A_log, ParamView dt_bias,
                      const Tensor& state, const Tensor& out, int n, int HK, int HV, int dv, const LaunchCtx& ctx) {
  const T* q = qkv.ptr<const T>();
  const T* b = ba.ptr<const T>();
  auto launch = [&](auto kernel) {
    launch_pdl(ctx, "gdn_recurrent_kernel", kernel, grid, kWarps * 32, 0, q, qkv.row_stride, b, ba.row_stride, A_log,
               dt_bias, state.ptr<float>(), out.ptr<T>(), out.row_stride, n, HK, HV, dv);
  };
  switch (dk) {
    case 16: launch(gdn_recurrent_kernel<16, T>); break;
    case 32: launch(gdn_recurrent_kernel<32, T>); break;
    case 64: launch(gdn_recurrent_kernel<64, T>); break;
    case 128: launch(gdn_recurrent_kernel<128, T>); break;
    case 256: launch(gdn_recurrent_kernel<256, T>); break;
  }
}

}  // namespace
}  // namespace cuda

void CudaBackend::gdn_run(const char* op, const Tensor& qkv, const Tensor& ba, const Tensor& A_log,
                          const Tensor& dt_bias, const Tensor& state, const GdnParams& p, const Tensor& out) {
  using namespace cuda;
  require_float(qkv, op, "qkv");
  require_tensor(ba, qkv.dtype, op, "ba");
  require_tensor(out, qkv.dtype, op, "out");
  require_tensor(state, DType::F32, op, "state");
  ParamView a_log = param_view(A_log, op, "A_log"), dtb = param_view(dt_bias, op, "dt_bias");
  const int64_t HK = p.num_k_heads, HV = p.num_v_heads, dk = p.k_head_dim, dv = p.v_head_dim;
  OCRIA_RT_REQUIRE(HK > 0 && HV > 0 && HV % HK == 0, op, "HV must be a positive multiple of HK");
  OCRIA_RT_REQUIRE(dk == 16 || dk == 32 || dk == 64 || dk == 128 || dk == 256, op,
          "k_head_dim " + std::to_string(dk) + " unsupported (16/32/64/128/256)");
  OCRIA_RT_REQUIRE(dv > 0, op, "v_head_dim must be positive");
  OCRIA_RT_REQUIRE(qkv.ndim == 2 && qkv.dim(1) == p.conv_dim(), op, "qkv " + qkv.shape_str() + " vs conv_dim " +
                                                               std::to_string(p.conv_dim()));
  const int64_t T = qkv.dim(0);
  OCRIA_RT_REQUIRE(ba.ndim == 2 && ba.dim(0) == T && ba.dim(1) == 2 * HV, op, "ba " + ba.shape_str());
  OCRIA_RT_REQUIRE(out.ndim == 2 && out.dim(0) == T && out.dim(1) == HV * dv, op, "out " + out.shape_str());
  OCRIA_RT_REQUIRE(state.numel() == HV * dk * dv && state.contiguous(), op, "state " + state.shape_str());
  OCRIA_RT_REQUIRE(A_log.numel() == HV && dt_bias.numel() == HV, op, "A_log / dt_bias must have HV elements");
  if (T == 0) return;
  OCRIA_RT_REQUIRE(T < (int64_t(1) << 31), op, "too many tokens");
  activate();
  dim3 grid{unsigned(HV), unsigned((dv + 31) / 32)};
  if (qkv.dtype == DType::BF16)
    launch_recurrent<bf16>(int(dk), grid, qkv, ba, a_log, dtb, state, out, int(T), int(HK), int(HV), int(dv),
                           launch_ctx());
  else
    launch_recurrent<float>(int(dk), grid, qkv, ba, a_log, dtb, state, out, int(T), int(HK), int(HV), int(dv),
                            launch_ctx());
}

void CudaBackend::gdn_recurrent(const Tensor& qkv, const Tensor& ba, const Tensor& A_log, const Tensor& dt_bias,
                                const Tensor& state, const GdnParams& p, const Tensor& out) {
  gdn_run("gdn_recurrent", qkv, ba, A_log, dt_bias, state, p, out);
}

void CudaBackend::gdn_chunked(const Tensor& qkv, const Tensor& ba, const Tensor& A_log, const Tensor& dt_bias,
                              const Tensor& state, const GdnParams& p, const Tensor& out) {
  gdn_run("gdn_chunked", qkv, ba, A_log, dt_bias, state, p, out);
}

void CudaBackend::gdn_gated_norm(const Tensor& o, const Tensor& z, const Tensor& weight, const GdnParams& p,
                                 const Tensor& out) {
  using namespace cuda;
  const char* op = "gdn_gated_norm";
  require_float(o, op, "o");
  require_tensor(z, o.dtype, op, "z");
  require_tensor(out, o.dtype, op, "out");
  ParamView w = param_view(weight, op, "weight");
  const int64_t HV = p.num_v_heads, dv = p.v_head_dim;
  OCRIA_RT_REQUIRE(weight.numel() == dv, op, "weight must have v_head_dim elements");
  OCRIA_RT_REQUIRE(o.ndim == 2 && z.ndim == 2 && out.ndim == 2 && o.dim(1) == HV * dv && z.dim(1) == HV * dv &&
              out.dim(1) == HV * dv && z.dim(0) == o.dim(0) && out.dim(0) == o.dim(0),
          op, "o " + o.shape_str() + ", z " + z.shape_str() + ", out " + out.shape_str());
  const int64_t rows = o.dim(0) * HV;
  if (rows == 0) return;
  activate();
  constexpr int kRowsPerBlock = 4;
  const unsigned blocks = unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  if (o.dtype == DType::BF16)
    launch_pdl(launch_ctx(), "gated_norm_kernel", gated_norm_kernel<bf16>, blocks, kRowsPerBlock * 32, 0,
               o.ptr<const bf16>(), o.row_stride, z.ptr<const bf16>(), z.row_stride, w, out.ptr<bf16>(), out.row_stride,
               rows, int(HV), int(dv), p.norm_eps);
  else
    launch_pdl(launch_ctx(), "gated_norm_kernel", gated_norm_kernel<float>, blocks, kRowsPerBlock * 32, 0,
               o.ptr<const float>(), o.row_stride, z.ptr<const float>(), z.row_stride, w, out.ptr<float>(),
               out.row_stride, rows, int(HV), int(dv), p.norm_eps);
}

}  // namespace ocria_rt
