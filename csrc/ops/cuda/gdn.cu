// Gated DeltaNet: the recurrence (gdn_recurrent, gdn_chunked), the gated output norm, and the fused
// decode kernel (gdn_decode: conv + recurrence + gated norm).
//
// Per value head h (key head h / (HV / HK)) and token t, with S [dk, dv] fp32:
//   q, k L2-normalised, q *= dk^-0.5, beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
//   S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q
//
// Token-serial kernel (gdn_recurrent; gdn_chunked below 64 tokens or for shapes the chunked
// kernels do not take). Since S_new = S_dec + k u^T, o = S_dec^T q + u (k . q): both reductions over
// dk (S_dec^T k and S_dec^T q) happen in the same pass, so each token needs one block-wide exchange.
// One block per (value head, 32 columns of dv), 4 warps. Lane = column j; warp w holds rows i in
// [w dk/4, (w+1) dk/4) of S in registers for the whole call, so the state is read and written once.
// Tokens are processed in chunks of 16: the warps first normalise q, k and compute beta, exp(g), k.q
// of the chunk's tokens into shared memory, then step through the tokens.
//
// Fused decode kernel (gdn_decode, up to 16 tokens): see the comment before it.
//
// Speculative verification (gdn_verify, gdn_commit: ReplaySSM): see the comment before their kernels.
//
// Chunked form (gdn_chunked from 64 tokens, BF16, dk 64 / 128): see the comment before its kernels.
#include "ops/cuda/backend.cuh"
#include "ops/cuda/conv.cuh"
#include "ops/cuda/mma.cuh"

#include <algorithm>

namespace ocria_rt {
namespace cuda {
namespace {

constexpr int kTokChunk = 16;
constexpr int kWarps = 4;

// ---- the per-token arithmetic, shared by the recurrent and the fused decode kernels (so that both
// give the same bits) ----

__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(__expf(x)); }  // torch threshold

// g = neg_A * softplus(a + dt_bias), neg_A = -exp(A_log): the log decay; gdn_decay = exp(g), formed
// from the same float g that gdn_verify records, so that gdn_commit's __expf(g) gives the same bits.
__device__ __forceinline__ float gdn_log_decay(float a, float neg_A, float dt_bias) {
  return neg_A * softplus(a + dt_bias);
}
__device__ __forceinline__ float gdn_decay(float a, float neg_A, float dt_bias) {
  return __expf(gdn_log_decay(a, neg_A, dt_bias));
}

// One warp L2-normalises q and k of one token, x * rsqrt(sum x^2 + 1e-6) as transformers / fla
// l2norm, q additionally * dk^-0.5. Lane l handles elements l + 32 e; q_at(i), k_at(i) read raw
// element i, and the results go to qs[i], ks[i] (which may be the elements read: each lane reads
// all of its elements before it writes any). Returns k . q (in every lane).
template <int DK, class QAt, class KAt>
__device__ __forceinline__ float l2norm_qk(QAt q_at, KAt k_at, float* qs, float* ks, int lane) {
  constexpr int E = (DK + 31) / 32;
  const float q_scale = rsqrtf(float(DK));
  float qv[E], kv[E], ssq = 0.0f, ssk = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const bool in = lane + 32 * e < DK;
    qv[e] = in ? q_at(lane + 32 * e) : 0.0f;
    kv[e] = in ? k_at(lane + 32 * e) : 0.0f;
    ssq = fmaf(qv[e], qv[e], ssq);
    ssk = fmaf(kv[e], kv[e], ssk);
  }
  const float qi = rsqrtf(warp_sum(ssq) + 1e-6f) * q_scale, ki = rsqrtf(warp_sum(ssk) + 1e-6f);
  float kq = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const float qn = qv[e] * qi, kn = kv[e] * ki;
    if (lane + 32 * e < DK) {
      qs[lane + 32 * e] = qn;
      ks[lane + 32 * e] = kn;
    }
    kq = fmaf(qn, kn, kq);
  }
  return warp_sum(kq);
}

// One token of the recurrence for this thread's R rows of one column of S (row group `rw` of the
// kWarps warps that share the column). kt, qt: the normalised k, q at the thread's first row
// (16-byte aligned); v: the column's value. red [kWarps][32] (the current token parity's buffer)
// carries the partial sums of S_dec^T k and S_dec^T q over the row groups: one barrier per token, and
// a warp writes the same buffer again only after the next token's barrier, when every warp has read
// it. Contains __syncthreads(). Returns o = S_dec^T q + u (k . q) for the column, and u = beta (v - S_dec^T k)
// in `u_out`.
template <int R>
__device__ __forceinline__ float gdn_token(float (&S)[R], const float* kt, const float* qt, float decay, float beta,
                                           float v, float kq, float2 (*red)[32], int rw, int lane, float& u_out) {
  float pk = 0.0f, pq = 0.0f;
#pragma unroll
  for (int r = 0; r < R; r += 4) {
    const float4 k4 = *reinterpret_cast<const float4*>(kt + r);
    const float4 q4 = *reinterpret_cast<const float4*>(qt + r);
    S[r] *= decay, S[r + 1] *= decay, S[r + 2] *= decay, S[r + 3] *= decay;
    pk = fmaf(S[r], k4.x, fmaf(S[r + 1], k4.y, fmaf(S[r + 2], k4.z, fmaf(S[r + 3], k4.w, pk))));
    pq = fmaf(S[r], q4.x, fmaf(S[r + 1], q4.y, fmaf(S[r + 2], q4.z, fmaf(S[r + 3], q4.w, pq))));
  }
  red[rw][lane] = make_float2(pk, pq);
  __syncthreads();
  float sk = 0.0f, sq = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const float2 p = red[w][lane];
    sk += p.x;
    sq += p.y;
  }
  const float u = beta * (v - sk);
#pragma unroll
  for (int r = 0; r < R; r += 4) {
    const float4 k4 = *reinterpret_cast<const float4*>(kt + r);
    S[r] = fmaf(k4.x, u, S[r]);
    S[r + 1] = fmaf(k4.y, u, S[r + 1]);
    S[r + 2] = fmaf(k4.z, u, S[r + 2]);
    S[r + 3] = fmaf(k4.w, u, S[r + 3]);
  }
  u_out = u;
  return fmaf(u, kq, sq);
}

// The gated norm of one row of dv outputs, one warp: inv = 1 / rms(o) from the lanes' sums of
// squares (fmaf over the lane's elements lane, lane + 32, ... in order), then each output
// weight * o * inv * silu(z).
__device__ __forceinline__ float gated_norm_inv(float ss, int dv, float eps) {
  return rsqrtf(warp_sum(ss) / float(dv) + eps);
}
__device__ __forceinline__ float gated_norm_out(float o, float inv, float w, float z) { return o * inv * (w * silu(z)); }

// ---- gdn_recurrent ----

// L2 prefetch, before pdl_wait(), of the R rows of S a warp holds (its 32 columns from `first`, rows
// dv apart; none where they start past dv), one line per lane: S was last written by the same layer
// in the previous step, so its DRAM reads may start while the kernels before this one run.
template <int R>
__device__ __forceinline__ void prefetch_state_rows(const float* first, int dv, bool cols_ok, int lane) {
  if (cols_ok)
    for (int r = lane; r < R; r += 32) prefetch_l2_line(first + int64_t(r) * dv);
}

template <int DK, class T>
__global__ void __launch_bounds__(kWarps * 32)
    gdn_recurrent_kernel(const T* __restrict__ qkv, int64_t ldq, const T* __restrict__ ba, int64_t ldb, ParamView A_log,
                         ParamView dt_bias, float* __restrict__ state, T* __restrict__ out, int64_t ldo, int n_tokens,
                         int HK, int HV, int dv) {
  constexpr int R = DK / kWarps;  // rows of S per thread
  __shared__ __align__(16) float qs[kTokChunk][DK];
  __shared__ __align__(16) float ks[kTokChunk][DK];
  __shared__ float vs[kTokChunk][32];
  __shared__ float beta_s[kTokChunk], decay_s[kTokChunk], kq_s[kTokChunk];
  __shared__ float2 red[2][kWarps][32];  // [token parity][warp][column] (S^T k, S^T q) partial sums

  pdl_launch_dependents();
  const int h = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int col = blockIdx.y * 32 + lane;
  const bool col_ok = col < dv;  // dv need not be a multiple of 32: surplus lanes carry zeros
  const int hk = h / (HV / HK);
  const int64_t q_off = int64_t(hk) * DK, k_off = int64_t(HK + hk) * DK, v_off = int64_t(2 * HK) * DK + int64_t(h) * dv;
  const float neg_A = -__expf(A_log[h]), dtb = dt_bias[h];
  float* Sp = state + int64_t(h) * DK * dv + int64_t(warp * R) * dv + col;
  prefetch_state_rows<R>(Sp - lane, dv, col - lane < dv, lane);
  pdl_wait();  // A_log and dt_bias are read-only; the state and the inputs come from earlier kernels

  float S[R];
#pragma unroll
  for (int r = 0; r < R; ++r) S[r] = col_ok ? Sp[r * dv] : 0.0f;

  int parity = 0;
  for (int tc = 0; tc < n_tokens; tc += kTokChunk) {
    const int nt = min(kTokChunk, n_tokens - tc);
    __syncthreads();  // the previous chunk's shared inputs are no longer read
    for (int tt = warp; tt < nt; tt += kWarps) {
      const T* row = qkv + int64_t(tc + tt) * ldq;
      const float kq = l2norm_qk<DK>([&](int i) { return to_float(row[q_off + i]); },
                                     [&](int i) { return to_float(row[k_off + i]); }, qs[tt], ks[tt], lane);
      vs[tt][lane] = col_ok ? to_float(row[v_off + col]) : 0.0f;
      if (lane == 0) {
        const T* bar = ba + int64_t(tc + tt) * ldb;
        beta_s[tt] = sigmoid(to_float(bar[h]));
        decay_s[tt] = gdn_decay(to_float(bar[HV + h]), neg_A, dtb);
        kq_s[tt] = kq;
      }
    }
    __syncthreads();
    for (int tt = 0; tt < nt; ++tt) {
      float u;
      const float o = gdn_token<R>(S, &ks[tt][warp * R], &qs[tt][warp * R], decay_s[tt], beta_s[tt], vs[tt][lane],
                                   kq_s[tt], red[parity], warp, lane, u);
      if (warp == 0 && col_ok) out[int64_t(tc + tt) * ldo + int64_t(h) * dv + col] = from_float<T>(o);
      parity ^= 1;
    }
  }
  if (col_ok)
#pragma unroll
    for (int r = 0; r < R; ++r) Sp[r * dv] = S[r];
}

// ---- gdn_gated_norm: out = weight * rmsnorm(o) * silu(z) per (token, value head); one warp per row ----

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
  const float inv = gated_norm_inv(ss, dv, eps);
  for (int i = lane; i < dv; i += 32) dst[i] = from_float<T>(gated_norm_out(to_float(orow[i]), inv, w[i], to_float(zrow[i])));
}

// ---- gdn_decode: the fused decode kernel ----
//
// gdn_conv, gdn_recurrent and gdn_gated_norm for up to kTokChunk tokens (BF16), one block per value
// head h, with the same arithmetic (ConvWindow, l2norm_qk, gdn_token, the gated-norm helpers) and the
// same BF16 roundings (conv output, recurrence output) as the three kernels, hence the same bits.
// 16 warps: row group rw = warp % 4 and column group cg = warp / 4 hold S rows [rw dk/4, (rw+1) dk/4)
// of column 32 cg + lane, as the recurrent kernel's 4 warps do for one 32-column slice (dv <= 128).
// DV = kDecMaxDv and KW = the conv width (Qwen3.5's 128 and 4) at compile time: the dk/4 state
// loads and stores of a thread take immediate offsets and no column test (with dv at run time, their
// 64-bit address arithmetic is half the kernel's instructions, ncu on the H200: 571k against 305k
// warp instructions, 5.3 against 4.25 us a layer), and the conv window keeps KW registers; DV = KW =
// 0: both at run time.
//  1. Thread i < 2 dk + dv convolves channel i of the head (q and k of key head h / (HV/HK), then
//     the dv v channels of h) over the tokens into xs.
//  2. Warp t normalises q, k of token t in place and forms its gates.
//  3. The tokens step through the recurrence; row group 0 keeps o (as BF16 values) in os.
//  4. Warp t forms the gated norm of token t.
// The conv state of a key head's q, k channels is read by the blocks of all its HV/HK value heads
// and written by the first of them only. Those blocks form one thread block cluster: every thread
// arrives at a cluster barrier once it has read the old state, and the writer waits on it before
// storing the new one (arrive has release, wait acquire semantics). The v channels' conv state and
// S belong to one block.
constexpr int kDecThreads = 512;
constexpr int kDecMaxDv = 128;  // 4 column groups of 32
static_assert(kDecThreads / 32 / kWarps * 32 == kDecMaxDv, "every column of dv <= kDecMaxDv has its warps");
constexpr int kDecMaxCluster = 8;  // HV / HK: the portable cluster size
constexpr int kDecFixedWidth = 4;  // the conv width of the compile-time instantiations
static_assert(kDecThreads / 32 >= kTokChunk, "a warp per token");
static_assert(2 * 128 + kDecMaxDv <= kDecThreads, "a conv channel per thread up to dk = 128");

// At most 80 registers a thread (no spills; 124 unbounded): 512 x 80 of an SM's 64K leave room for a
// decode-GEMM block beside it, so that out_proj's blocks start streaming their weights on the SMs
// that hold these blocks too while the recurrence runs (H200, 4B step: out_proj 61 -> 69% of copy
// bandwidth, the DeltaNet kernel 147 -> 129 us a step, against no register cap).
constexpr int kDecMaxRegs = 80;

// proj (the in_proj GEMM's output) is not __restrict__: as const __restrict__ the compiler loaded
// its z and gate values as invariant memory (LDG.CONSTANT) above pdl_wait(), before that GEMM had
// written them (tests/test_pdl_sass.py).
template <int DK, int DV, int KW>
__global__ void __maxnreg__(kDecMaxRegs)
    gdn_decode_kernel(const bf16* proj, int64_t ldp, ParamView conv_w, float* __restrict__ conv_state,
                      ParamView A_log, ParamView dt_bias, ParamView norm_w, float* __restrict__ state,
                      bf16* __restrict__ out, int64_t ldo, int n_tokens, int HK, int HV, int dv_arg, int K_arg, float eps) {
  constexpr int R = DK / kWarps;        // rows of S per thread
  const int dv = DV > 0 ? DV : dv_arg, K = KW > 0 ? KW : K_arg;
  constexpr int kCh = 2 * DK + kDecMaxDv;
  constexpr int kPer = kDecMaxDv / 32;  // gated-norm elements per lane
  __shared__ __align__(16) float xs[kTokChunk][kCh];  // conv outputs q | k | v (BF16 values); q, k then normalised
  __shared__ float os[kTokChunk][kDecMaxDv];          // recurrence outputs (BF16 values)
  __shared__ float2 red[2][kDecMaxDv / 32][kWarps][32];  // [token parity][column group][row group][lane]
  __shared__ float beta_s[kTokChunk], decay_s[kTokChunk], kq_s[kTokChunk];

  pdl_launch_dependents();
  const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rw = warp % kWarps, cg = warp / kWarps, col = 32 * cg + lane;
  const bool col_ok = DV == kDecMaxDv || col < dv;  // (col < kDecMaxDv always)
  const int group = HV / HK, hk = h / group;
  const int64_t C = 2 * int64_t(HK) * DK + int64_t(HV) * dv, vdim = int64_t(HV) * dv;
  const bool has_ch = tid < 2 * DK + dv;  // this thread's conv channel: q | k of key head hk, v of h
  const int64_t ch = tid < DK       ? int64_t(hk) * DK + tid
                     : tid < 2 * DK ? int64_t(HK + hk) * DK + (tid - DK)
                                    : 2 * int64_t(HK) * DK + int64_t(h) * dv + (tid - 2 * DK);
  const bool has_tok = warp < n_tokens;  // warp t forms the gates and the gated norm of token t
  ConvWindow<(KW > 0 ? KW : kConvMaxWidth)> cw;
  cw.load_weights(conv_w, ch, K, has_ch);
  const float neg_A = -__expf(A_log[h]), dtb = dt_bias[h];
  float nw[kPer];
#pragma unroll
  for (int m = 0; m < kPer; ++m) nw[m] = lane + 32 * m < dv ? norm_w[lane + 32 * m] : 0.0f;
  float* Sp = state + int64_t(h) * DK * dv + rw * R * dv + col;  // row r of the thread's: Sp[r * dv]
  prefetch_state_rows<R>(Sp - lane, dv, col - lane < dv, lane);
  if (has_ch) prefetch_l2_line(conv_state + ch * (K - 1));
  pdl_wait();  // the weights, A_log, dt_bias are read-only; the rest comes from earlier kernels

  float S[R];
#pragma unroll
  for (int r = 0; r < R; ++r) S[r] = col_ok ? Sp[r * dv] : 0.0f;
  // Token `warp`'s z (gated norm) and b, a (gates), fetched now to overlap the state loads.
  float zr[kPer], b_raw = 0.0f, a_raw = 0.0f;
#pragma unroll
  for (int m = 0; m < kPer; ++m)
    zr[m] = has_tok && lane + 32 * m < dv ? to_float(proj[int64_t(warp) * ldp + C + int64_t(h) * dv + lane + 32 * m])
                                          : 0.0f;
  if (has_tok && lane == 0) {
    b_raw = to_float(proj[int64_t(warp) * ldp + C + vdim + h]);
    a_raw = to_float(proj[int64_t(warp) * ldp + C + vdim + HV + h]);
  }

  // 1. conv + SiLU, rounded to BF16 as gdn_conv stores it.
  if (has_ch) cw.start(K, [&](int j) { return conv_state[ch * (K - 1) + j]; });
  if (has_ch)
    for (int t = 0; t < n_tokens; ++t)
      xs[t][tid] = to_float(from_float<bf16>(cw.step(to_float(proj[int64_t(t) * ldp + ch]))));
  __syncthreads();

  // 2. norms and gates.
  if (has_tok) {
    float* x = xs[warp];
    const float kq = l2norm_qk<DK>([&](int i) { return x[i]; }, [&](int i) { return x[DK + i]; }, x, x + DK, lane);
    if (lane == 0) {
      beta_s[warp] = sigmoid(b_raw);
      decay_s[warp] = gdn_decay(a_raw, neg_A, dtb);
      kq_s[warp] = kq;
    }
  }
  // This thread has read the old conv state. The release makes the thread wait for all its loads,
  // so it comes where step 3 would wait for them anyway (the S loads).
  cluster_arrive();
  __syncthreads();

  // 3. the recurrence; o rounded to BF16 as gdn_recurrent stores it.
  int parity = 0;
  for (int t = 0; t < n_tokens; ++t) {
    const float v = col_ok ? xs[t][2 * DK + col] : 0.0f;
    float u;
    const float o = gdn_token<R>(S, &xs[t][DK + rw * R], &xs[t][rw * R], decay_s[t], beta_s[t], v, kq_s[t],
                                 red[parity][cg], rw, lane, u);
    if (rw == 0 && col_ok) os[t][col] = to_float(from_float<bf16>(o));
    parity ^= 1;
  }
  __syncthreads();

  // 4. the gated norm.
  if (has_tok) {
    float ss = 0.0f;
#pragma unroll
    for (int m = 0; m < kPer; ++m)
      if (lane + 32 * m < dv) ss = fmaf(os[warp][lane + 32 * m], os[warp][lane + 32 * m], ss);
    const float inv = gated_norm_inv(ss, dv, eps);
    bf16* dst = out + int64_t(warp) * ldo + int64_t(h) * dv;
#pragma unroll
    for (int m = 0; m < kPer; ++m)
      if (lane + 32 * m < dv)
        dst[lane + 32 * m] = from_float<bf16>(gated_norm_out(os[warp][lane + 32 * m], inv, nw[m], zr[m]));
  }

  if (col_ok)
#pragma unroll
    for (int r = 0; r < R; ++r) Sp[r * dv] = S[r];
  cluster_wait();  // every block of the cluster has read the old conv state
  if (has_ch && (tid >= 2 * DK || h % group == 0))
    cw.finish(K, [&](int j, float x) { conv_state[ch * (K - 1) + j] = x; });
}

// ---- gdn_verify / gdn_commit: the ReplaySSM form of a verified block ----
//
// gdn_verify_kernel: gdn_decode's arithmetic for a block of tokens without writing either state, so
// its outputs are gdn_decode's bits. At T = 16 the recurrence is compute-bound per head (about 4 flops
// per state element and token), so each value head is spread over ceil(dv / 32) blocks of 4 warps
// (a thread block cluster), one per 32 columns of dv, in the layout of gdn_recurrent_kernel (row group
// = warp, column = lane): the 4B's 32 heads fill 128 SMs instead of 32. Each block
//  1. convolves the q, k channels of key head h / (HV / HK) and its 32 v channels over the tokens
//     (ConvWindow, BF16-rounded as gdn_conv stores them), recording the raw inputs (conv_in);
//  2. normalises q, k per token (l2norm_qk) and forms the gates, recording k and the log decay g;
//  3. steps the tokens through gdn_token with S in registers (read once, never written), recording
//     u, and sends each o (BF16-rounded) to the block of the cluster that normalises that token
//     (token t to block t % blocks, distributed shared memory);
//  4. after a cluster barrier, forms the gated norm of its tokens over all dv columns, in
//     gdn_decode's order.
// The q, k records of a key head are written by block 0 of its first value head only. Tokens past
// kTokChunk run in further chunks (the conv window restarts from the raw inputs, as gdn_conv's chunks
// do), the state staying in registers.
//
// gdn_commit_kernel: per state element S = exp(g) S + k u (exactly gdn_token's two roundings) for the
// first keep[0] tokens, keep read on the device; and the conv state shifted by keep[0] inputs. Each
// thread holds a 4 x 4 tile of one head's state; further blocks take the conv channels.
constexpr int kVerifyMaxGroups = 8;  // column groups of 32 per head (the cluster size): dv <= 256
// o of the tokens a block normalises: token t of the chunk at slot t / groups, row length 32 * groups.
constexpr int kVerifyOutSlots = kTokChunk * 32 + 32 * kVerifyMaxGroups;

// Where gdn_verify writes its records (row strides in elements).
struct ReplayView {
  bf16* conv_in;
  int64_t ld_conv_in;
  float* k;
  int64_t ld_k;
  float* g;
  int64_t ld_g;
  float* u;
  int64_t ld_u;
};

__device__ __forceinline__ void cluster_sync_all() {
  cluster_arrive();
  cluster_wait();
}

template <int DK, int KW>
__global__ void __launch_bounds__(kWarps * 32)
    gdn_verify_kernel(const bf16* __restrict__ proj, int64_t ldp, ParamView conv_w, const float* __restrict__ conv_state,
                      ParamView A_log, ParamView dt_bias, ParamView norm_w, const float* __restrict__ state,
                      bf16* __restrict__ out, int64_t ldo, ReplayView rec, int n_tokens, int HK, int HV, int dv,
                      int K_arg, float eps) {
  constexpr int R = DK / kWarps;    // rows of S per thread
  constexpr int kCh = 2 * DK + 32;  // conv channels of a block: q | k of the key head, 32 v columns
  const int K = KW > 0 ? KW : K_arg;
  __shared__ __align__(16) float xs[kTokChunk][2 * DK];  // conv outputs q | k (BF16 values), then normalised
  __shared__ float vs[kTokChunk][32];                    // conv outputs of the block's v columns
  __shared__ float on[kVerifyOutSlots];                  // o (BF16 values) of the tokens this block normalises
  __shared__ float2 red[2][kWarps][32];
  __shared__ float beta_s[kTokChunk], decay_s[kTokChunk], kq_s[kTokChunk];

  pdl_launch_dependents();
  const int cg = blockIdx.x, groups = gridDim.x, h = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int col = 32 * cg + lane;
  const bool col_ok = col < dv;
  const int group = HV / HK, hk = h / group;
  const int64_t C = 2 * int64_t(HK) * DK + int64_t(HV) * dv, vdim = int64_t(HV) * dv;
  const bool qk_writer = cg == 0 && h % group == 0;  // records conv_in and k of the key head's q, k channels
  const float neg_A = -__expf(A_log[h]), dtb = dt_bias[h];
  const float* Sp = state + int64_t(h) * DK * dv + int64_t(warp * R) * dv + col;  // row r: Sp[r * dv]
  prefetch_state_rows<R>(Sp - lane, dv, col - lane < dv, lane);
  cluster_arrive_relaxed();  // this block has started: the others may store into its shared memory
  pdl_wait();  // the weights, A_log, dt_bias are read-only; the rest comes from earlier kernels

  float S[R];
#pragma unroll
  for (int r = 0; r < R; ++r) S[r] = col_ok ? Sp[r * dv] : 0.0f;
  cluster_wait();

  int parity = 0;
  for (int t0 = 0; t0 < n_tokens; t0 += kTokChunk) {
    const int nt = min(kTokChunk, n_tokens - t0);
    // Every block of the cluster is done with the previous chunk's `on`, and this block with xs, vs.
    if (t0 > 0) cluster_sync_all();

    // 1. conv + SiLU of the block's channels, rounded to BF16 as gdn_conv stores them.
    for (int i = tid; i < kCh; i += kWarps * 32) {
      const bool is_v = i >= 2 * DK;
      const int vcol = 32 * cg + (i - 2 * DK);
      if (is_v && vcol >= dv) continue;
      const int64_t ch = i < DK       ? int64_t(hk) * DK + i
                         : i < 2 * DK ? int64_t(HK + hk) * DK + (i - DK)
                                      : 2 * int64_t(HK) * DK + int64_t(h) * dv + vcol;
      const bool record = is_v || qk_writer;
      ConvWindow<(KW > 0 ? KW : kConvMaxWidth)> cw;
      cw.load_weights(conv_w, ch, K, true);
      // in[p] = conv_state[p] (p < K-1) or the raw input of token p - (K-1)
      cw.start(K, [&](int j) {
        const int p = t0 + j;
        return p < K - 1 ? conv_state[ch * (K - 1) + p] : to_float(proj[int64_t(p - (K - 1)) * ldp + ch]);
      });
      bf16 x[kTokChunk];
#pragma unroll
      for (int t = 0; t < kTokChunk; ++t)
        if (t < nt) x[t] = proj[int64_t(t0 + t) * ldp + ch];
#pragma unroll
      for (int t = 0; t < kTokChunk; ++t) {
        if (t >= nt) break;
        if (record) rec.conv_in[int64_t(t0 + t) * rec.ld_conv_in + ch] = x[t];
        const float y = to_float(from_float<bf16>(cw.step(to_float(x[t]))));
        if (is_v) vs[t][i - 2 * DK] = y;
        else xs[t][i] = y;
      }
    }
    __syncthreads();

    // 2. norms and gates; warp w takes tokens w, w + 4, ...
    for (int t = warp; t < nt; t += kWarps) {
      float* x = xs[t];
      const float kq = l2norm_qk<DK>([&](int i) { return x[i]; }, [&](int i) { return x[DK + i]; }, x, x + DK, lane);
      __syncwarp();
      if (qk_writer)
        for (int i = lane; i < DK; i += 32) rec.k[int64_t(t0 + t) * rec.ld_k + int64_t(hk) * DK + i] = x[DK + i];
      if (lane == 0) {
        const bf16* gates = proj + int64_t(t0 + t) * ldp + C + vdim;  // b (HV) | a (HV)
        const float g = gdn_log_decay(to_float(gates[HV + h]), neg_A, dtb);
        beta_s[t] = sigmoid(to_float(gates[h]));
        decay_s[t] = __expf(g);
        kq_s[t] = kq;
        if (cg == 0) rec.g[int64_t(t0 + t) * rec.ld_g + h] = g;
      }
    }
    __syncthreads();

    // 3. the recurrence; o rounded to BF16 as gdn_recurrent stores it, sent to its normalising block.
    for (int t = 0; t < nt; ++t) {
      const float v = col_ok ? vs[t][lane] : 0.0f;
      float u;
      const float o = gdn_token<R>(S, &xs[t][DK + warp * R], &xs[t][warp * R], decay_s[t], beta_s[t], v, kq_s[t],
                                   red[parity], warp, lane, u);
      if (warp == 0 && col_ok) {
        rec.u[int64_t(t0 + t) * rec.ld_u + int64_t(h) * dv + col] = u;
        store_cluster_shared(&on[(t / groups) * 32 * groups + col], unsigned(t % groups), to_float(from_float<bf16>(o)));
      }
      parity ^= 1;
    }
    cluster_sync_all();  // every o of this chunk is in the shared memory of its normalising block

    // 4. the gated norm of tokens cg, cg + groups, ... of the chunk over the dv columns (elements
    //    lane + 32 m in order, as gdn_decode and gdn_gated_norm sum them).
    for (int slot = warp;; slot += kWarps) {
      const int t = cg + groups * slot;
      if (t >= nt) break;
      const float* ot = on + slot * 32 * groups;
      float ss = 0.0f;
      for (int m = 0; m < groups; ++m)
        if (lane + 32 * m < dv) ss = fmaf(ot[lane + 32 * m], ot[lane + 32 * m], ss);
      const float inv = gated_norm_inv(ss, dv, eps);
      const bf16* z = proj + int64_t(t0 + t) * ldp + C + int64_t(h) * dv;
      bf16* dst = out + int64_t(t0 + t) * ldo + int64_t(h) * dv;
      for (int m = 0; m < groups; ++m) {
        const int c = lane + 32 * m;
        if (c < dv) dst[c] = from_float<bf16>(gated_norm_out(ot[c], inv, norm_w[c], to_float(z[c])));
      }
    }
  }
}

constexpr int kCommitThreads = 256;

// Blocks [0, state_blocks): the state, thread = (head, 4 rows, 4 columns); the rest: conv channels.
template <bool VEC>
__global__ void __launch_bounds__(kCommitThreads)
    gdn_commit_kernel(ReplayView rec, const int32_t* __restrict__ keep, int max_keep, float* __restrict__ conv_state,
                      float* __restrict__ state, int C, int K1, int HK, int HV, int dk, int dv, int state_blocks) {
  pdl_launch_dependents();
  if (int(blockIdx.x) >= state_blocks) {
    const int c = (int(blockIdx.x) - state_blocks) * kCommitThreads + int(threadIdx.x);
    pdl_wait();
    if (c >= C) return;
    const int n = min(max(keep[0], 0), max_keep);
    // conv_state <- the last K-1 of [conv_state ; conv_in[0 : n]]
    float old[kConvMaxWidth - 1];
#pragma unroll
    for (int j = 0; j < kConvMaxWidth - 1; ++j) old[j] = j < K1 ? conv_state[int64_t(c) * K1 + j] : 0.0f;
#pragma unroll
    for (int j = 0; j < kConvMaxWidth - 1; ++j) {
      if (j >= K1) break;
      const int p = n + j;  // index into [old ; conv_in]
      float v;
      if (p < K1) {
        v = 0.0f;
#pragma unroll
        for (int i = 0; i < kConvMaxWidth - 1; ++i)
          if (i == p) v = old[i];  // static indices: old stays in registers
      } else {
        v = to_float(rec.conv_in[int64_t(p - K1) * rec.ld_conv_in + c]);
      }
      conv_state[int64_t(c) * K1 + j] = v;
    }
    return;
  }
  const int nq = (dv + 3) / 4, rq = dk / 4;
  const int64_t item = int64_t(blockIdx.x) * kCommitThreads + threadIdx.x;
  const int jq = int(item % nq);
  const int64_t rest = item / nq;
  const int iq = int(rest % rq), h = int(rest / rq);
  const bool ok = h < HV;
  const int hk = ok ? h / (HV / HK) : 0, j0 = 4 * jq, i0 = 4 * iq;
  float* Sp = state + (int64_t(h) * dk + i0) * dv + j0;
  if (ok && jq % 8 == 0)  // one prefetch per 128-byte line; the state was last written by this op
#pragma unroll
    for (int a = 0; a < 4; ++a) prefetch_l2_line(Sp + int64_t(a) * dv);
  pdl_wait();
  if (!ok) return;
  const int n = min(max(keep[0], 0), max_keep);
  float S[4][4];
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    if (VEC) {
      const float4 v = *reinterpret_cast<const float4*>(Sp + int64_t(a) * dv);
      S[a][0] = v.x, S[a][1] = v.y, S[a][2] = v.z, S[a][3] = v.w;
    } else {
#pragma unroll
      for (int b = 0; b < 4; ++b) S[a][b] = j0 + b < dv ? Sp[int64_t(a) * dv + b] : 0.0f;
    }
  }
#pragma unroll 4  // the loads of several tokens in flight together
  for (int t = 0; t < n; ++t) {
    const float decay = __expf(rec.g[int64_t(t) * rec.ld_g + h]);
    const float* kt = rec.k + int64_t(t) * rec.ld_k + int64_t(hk) * dk + i0;
    const float* ut = rec.u + int64_t(t) * rec.ld_u + int64_t(h) * dv + j0;
    float k[4], u[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) k[a] = kt[a];
#pragma unroll
    for (int b = 0; b < 4; ++b) u[b] = VEC || j0 + b < dv ? ut[b] : 0.0f;
    // gdn_token's order: the decayed state rounded, then the rank-1 update fused
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) S[a][b] = fmaf(k[a], u[b], __fmul_rn(S[a][b], decay));
  }
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    if (VEC) {
      *reinterpret_cast<float4*>(Sp + int64_t(a) * dv) = make_float4(S[a][0], S[a][1], S[a][2], S[a][3]);
    } else {
#pragma unroll
      for (int b = 0; b < 4; ++b)
        if (j0 + b < dv) Sp[int64_t(a) * dv + b] = S[a][b];
    }
  }
}

// ---- launches ----

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

// ---------------------------------------------------------------------------------------------
// Chunked (WY / UT-transform) form, the algebra of cpu/gdn.cpp's gdn_chunked. Tokens are cut into
// chunks of kC = 64; inside a chunk, with G_i = sum_{s <= i} g_s and S the state entering it:
//   A  = tril_strict(beta_i e^(G_i - G_j) k_i.k_j),  Ti = (I + A)^-1
//   W  = Ti diag(beta e^G) K,  U = Ti diag(beta) V        (the state-independent part)
//   V' = U - W S                                          (the values the tokens actually write)
//   O  = diag(e^G) Q S + tril(e^(G_i - G_j) q_i.k_j) V'
//   S' = e^(G_last) S + K^T diag(e^(G_last - G)) V'
// G is non-increasing, so every exponential formed, e^(G_i - G_j) for i >= j, e^G and
// e^(G_last - G), is of a non-positive number.
//
// Two kernels per pass over up to kPassChunks chunks (the scratch lives in the op workspace):
//  - gdn_chunk_prep_kernel, one block per (chunk, value head), all chunks in parallel: gates, norms,
//    A and P = tril(e^(G_i - G_j) q_i.k_j) on tensor cores, Ti by forward substitution in fp32,
//    then W, U on tensor cores; writes W (BF16), P (BF16), U (fp32) and per-token scales.
//  - gdn_chunk_state_kernel, one block per (value head, 32 columns of dv): column c of S only
//    depends on column c of U, so each block walks the chunks in order with its [dk, 32] slice of S
//    in registers (fp32 mma accumulators), forming V', O and S' with mma.sync.
//
// q, k, v enter every product as the raw BF16 inputs (exact); their L2 norms and the decays are
// fp32 row / column scales applied around the mma. Precision (measured with a NumPy model of the
// kernels on the test inputs, against an fp64 recurrence): rounding Ti, U or the state update's V'
// to BF16 each cost ~1.6e-3 relative error on the state, so U = Ti diag(beta) V uses Ti split into
// hi + lo BF16 parts, U stays fp32, and K^T V' uses V' split into hi + lo; the state then agrees with
// the fp32 reference to ~5e-5. W, P, the state as the B operand of W S and Q S, and V' in P V' are
// single BF16 (as in flash-linear-attention); the output's error (~3e-3) is mostly its own BF16
// rounding.
// ---------------------------------------------------------------------------------------------

constexpr int kC = 64;                  // chunk length
constexpr int kScal = 2 * kC + 4;       // per (chunk, head): e^G q-norm [kC], e^(G_last - G) k-norm [kC], e^G_last, pad
constexpr int kPrepThreads = 2 * kC;    // 4 warps: warp w owns rows 16w .. 16w+15 of the chunk's matrices
constexpr int kStateThreads = 256;      // 8 warps
constexpr int kSlice = 32;              // state columns per gdn_chunk_state_kernel block
constexpr int kMaxChunkedDv = 256;
// Chunks per pass at most: 1024 tokens, so that a pass's scratch (~29 MB for the 4B's 32 value
// heads) can stay in L2 (50 MB) between the two kernels. The workspace may allow fewer.
constexpr int kPassChunks = 16;

// mma.sync with the A fragment as one array (fragment layouts: mma.cuh).
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  mma_16816(c, a[0], a[1], a[2], a[3], b0, b1);
}

// Operand fragments from BF16 tiles in shared memory (row stride ld elements, rows 16-byte aligned)
// with ldmatrix.x4 (see mma.cuh); l & 8 and (l >> 4) * 8 pick the 8x8 quadrant each lane addresses.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* p) {
  ldmatrix_x4(r, static_cast<uint32_t>(__cvta_generic_to_shared(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const bf16* p) {
  ldmatrix_x4_trans(r, static_cast<uint32_t>(__cvta_generic_to_shared(p)));
}
// A at (rows m0, cols k0) of a row-major [m][k] tile: quadrants (m0, k0), (m0+8, k0), (m0, k0+8), (m0+8, k0+8).
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* x, int ld, int m0, int k0) {
  const int l = threadIdx.x & 31;
  ldsm_x4(a, x + (m0 + (l & 7) + (l & 8)) * ld + k0 + (l >> 4) * 8);
}
// A at (rows m0, cols k0) of A = X^T, X a row-major [k][m] tile.
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const bf16* x, int ld, int m0, int k0) {
  const int l = threadIdx.x & 31;
  ldsm_x4_trans(a, x + (k0 + (l & 7) + (l >> 4) * 8) * ld + m0 + (l & 8));
}
// B for k rows k0 .. k0+15 and two 8-column tiles n0 .., n0+8 .. of B = X^T, X a row-major [n][k]
// tile: b[0], b[1] are the first tile's b0, b1, and b[2], b[3] the second's.
__device__ __forceinline__ void load_b(uint32_t (&b)[4], const bf16* x, int ld, int k0, int n0) {
  const int l = threadIdx.x & 31;
  ldsm_x4(b, x + (n0 + (l & 7) + (l >> 4) * 8) * ld + k0 + (l & 8));
}
// Same, B a row-major [k][n] tile.
__device__ __forceinline__ void load_b_trans(uint32_t (&b)[4], const bf16* x, int ld, int k0, int n0) {
  const int l = threadIdx.x & 31;
  ldsm_x4_trans(b, x + (k0 + (l & 7) + (l & 8)) * ld + n0 + (l >> 4) * 8);
}

__device__ __forceinline__ void store_bf16x2(bf16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

// Scratch of one pass, per (chunk, value head) ch = chunk * HV + h: W [kC, dk] BF16, P [kC, kC]
// BF16 (zero above the diagonal), U [kC, dv] fp32, scal [kScal] fp32.
struct ChunkScratch {
  bf16* W;
  bf16* P;
  float* U;
  float* scal;
};

size_t chunk_scratch_bytes(int64_t dk, int64_t dv) {  // per (chunk, value head)
  return size_t(kC) * size_t(2 * dk + 2 * kC + 4 * dv) + 4 * kScal;
}

ChunkScratch carve_scratch(void* ws, int64_t units, int64_t dk, int64_t dv) {  // units = chunks * HV
  ChunkScratch s;
  char* p = static_cast<char*>(ws);
  s.W = reinterpret_cast<bf16*>(p);
  p += units * kC * dk * 2;
  s.P = reinterpret_cast<bf16*>(p);
  p += units * kC * kC * 2;
  s.U = reinterpret_cast<float*>(p);
  p += units * kC * dv * 4;
  s.scal = reinterpret_cast<float*>(p);
  return s;
}

// Shared-memory row strides. BF16 tiles (dk + 8, dv + 8, kC + 8, kSlice + 8 elements) are odd
// multiples of 16 bytes, so the 8 rows of an ldmatrix hit distinct banks.
constexpr int kLdT = kC + 8;  // P, Ti (BF16)
constexpr int kLdA = kC + 4;  // A (fp32)

size_t prep_smem_bytes(int dk, int dv) {
  return size_t(2 * kC * (dk + 8) + kC * (dv + 8) + 3 * kC * kLdT) * 2 + size_t(kC * kLdA + 5 * kC) * 4;
}

// One block per (chunk c of the pass, value head h); blockIdx = (c, h).
template <int DK>
__global__ void __launch_bounds__(kPrepThreads)
    gdn_chunk_prep_kernel(const bf16* __restrict__ qkv, int64_t ldq, const bf16* __restrict__ ba, int64_t ldb,
                          ParamView A_log, ParamView dt_bias, int tok_begin, int n_tokens, int HK, int HV, int dv,
                          ChunkScratch scr) {
  constexpr int LDK = DK + 8;
  const int LDV = dv + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Ks = reinterpret_cast<bf16*>(smem);  // raw k, q, v of the chunk; rows past the end are zero
  bf16* Qs = Ks + kC * LDK;
  bf16* Vs = Qs + kC * LDK;
  float* As = reinterpret_cast<float*>(Vs + kC * LDV);
  bf16* TiW = reinterpret_cast<bf16*>(As + kC * kLdA);  // Ti diag(beta e^G knorm), BF16
  bf16* TiH = TiW + kC * kLdT;                          // Ti diag(beta) = TiH + TiL
  bf16* TiL = TiH + kC * kLdT;
  float* g_s = reinterpret_cast<float*>(TiL + kC * kLdT);
  float* G_s = g_s + kC;
  float* beta_s = G_s + kC;
  float* kn_s = beta_s + kC;  // 1 / |k|
  float* qn_s = kn_s + kC;    // dk^-0.5 / |q|

  const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int tok0 = tok_begin + c * kC, L = min(kC, n_tokens - tok0);
  const int hk = h / (HV / HK);
  const int64_t ch = int64_t(c) * HV + h;
  const bf16* q_src = qkv + int64_t(tok0) * ldq + hk * DK;
  const bf16* k_src = q_src + HK * DK;
  const bf16* v_src = qkv + int64_t(tok0) * ldq + 2 * HK * DK + h * dv;

  for (int i = tid; i < kC * (DK / 8); i += kPrepThreads) {
    const int r = i / (DK / 8), e = (i % (DK / 8)) * 8;
    const int64_t off = int64_t(r < L ? r : 0) * ldq + e;
    cp_async16(Ks + r * LDK + e, k_src + off, r < L ? 16 : 0);
    cp_async16(Qs + r * LDK + e, q_src + off, r < L ? 16 : 0);
  }
  for (int i = tid; i < kC * (dv / 8); i += kPrepThreads) {
    const int r = i / (dv / 8), e = (i % (dv / 8)) * 8;
    cp_async16(Vs + r * LDV + e, v_src + int64_t(r < L ? r : 0) * ldq + e, r < L ? 16 : 0);
  }
  cp_async_commit();
  if (tid < kC) {  // tokens past the end get beta = 0, g = 0: they change nothing
    float beta = 0.0f, lg = 0.0f;
    if (tid < L) {
      const bf16* bar = ba + int64_t(tok0 + tid) * ldb;
      beta = sigmoid(to_float(bar[h]));
      lg = -__expf(A_log[h]) * softplus(to_float(bar[HV + h]) + dt_bias[h]);
    }
    beta_s[tid] = beta;
    g_s[tid] = lg;
  }
  cp_async_wait<0>();
  __syncthreads();

  {  // threads 0..63: 1/|k| of token tid; threads 64..127: dk^-0.5/|q| of token tid - 64
    const int r = tid & (kC - 1);
    const bf16* row = (tid < kC ? Ks : Qs) + r * LDK;
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < DK; e += 8) {
      const Pack<bf16, 8> p = load_pack<bf16, 8>(row + e);
#pragma unroll
      for (int j = 0; j < 8; ++j) ss = fmaf(to_float(p.v[j]), to_float(p.v[j]), ss);
    }
    const float inv = r < L ? rsqrtf(ss + 1e-6f) : 0.0f;
    if (tid < kC) kn_s[r] = inv;
    else qn_s[r] = inv * rsqrtf(float(DK));
  }
  if (tid == 0) {  // in token order, as the CPU reference
    float acc = 0.0f;
    for (int i = 0; i < kC; ++i) G_s[i] = acc += g_s[i];
  }
  __syncthreads();

  if (tid < kC) {  // the row scales gdn_chunk_state_kernel applies
    float* sc = scr.scal + ch * kScal;
    const float Gi = G_s[tid], Gl = G_s[kC - 1];
    sc[tid] = __expf(Gi) * qn_s[tid];
    sc[kC + tid] = __expf(Gl - Gi) * kn_s[tid];
    if (tid < 4) sc[2 * kC + tid] = tid == 0 ? __expf(Gl) : 0.0f;
  }

  {  // A (strictly lower, fp32, to shared) and P (lower, BF16, to scratch) from raw k.k and q.k.
    // Warp w computes rows 16w .. 16w+15, columns 0 .. 16w+15 (the 16-column blocks np <= w).
    float kk[8][4] = {}, qk[8][4] = {};
#pragma unroll
    for (int ks = 0; ks < DK / 16; ++ks) {
      uint32_t ka[4], qa[4];
      load_a(ka, Ks, LDK, 16 * warp, 16 * ks);
      load_a(qa, Qs, LDK, 16 * warp, 16 * ks);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        if (np > warp) continue;
        uint32_t b[4];
        load_b(b, Ks, LDK, 16 * ks, 16 * np);
        mma(kk[2 * np], ka, b[0], b[1]);
        mma(kk[2 * np + 1], ka, b[2], b[3]);
        mma(qk[2 * np], qa, b[0], b[1]);
        mma(qk[2 * np + 1], qa, b[2], b[3]);
      }
    }
    bf16* P = scr.P + ch * kC * kC;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = 16 * warp + g + 8 * hr, j = 8 * nt + 2 * t;
        float p0 = 0.0f, p1 = 0.0f;
        if (nt / 2 <= warp) {
          const float Gi = G_s[i], bk = beta_s[i] * kn_s[i], qn = qn_s[i];
          const float e0 = __expf(fminf(Gi - G_s[j], 0.0f)) * kn_s[j];
          const float e1 = __expf(fminf(Gi - G_s[j + 1], 0.0f)) * kn_s[j + 1];
          // Entries on and above the diagonal are written as 0: the solve reads them (times 0).
          *reinterpret_cast<float2*>(As + i * kLdA + j) =
              make_float2(i > j ? bk * e0 * kk[nt][2 * hr] : 0.0f, i > j + 1 ? bk * e1 * kk[nt][2 * hr + 1] : 0.0f);
          p0 = i >= j ? qn * e0 * qk[nt][2 * hr] : 0.0f;
          p1 = i >= j + 1 ? qn * e1 * qk[nt][2 * hr + 1] : 0.0f;
        }
        store_bf16x2(P + i * kC + j, p0, p1);
      }
    }
  }
  __syncthreads();

  if (tid < kC) {
    // Column `col` of Ti = (I + A)^-1 by forward substitution: x_i = [i == col] - sum_{j<i} A_ij x_j.
    // x_j = 0 for j < col, and every x_j not yet computed is 0, so whole float4 groups of A can be
    // read (A's entries at j >= i are 0).
    const int col = tid;
    float x[kC];
#pragma unroll
    for (int i = 0; i < kC; ++i) x[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < kC; ++i) {
      float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma unroll
      for (int j = 0; j < i; j += 4) {
        const float4 a = *reinterpret_cast<const float4*>(As + i * kLdA + j);
        s0 = fmaf(a.x, x[j], s0);
        s1 = fmaf(a.y, x[j + 1], s1);
        s2 = fmaf(a.z, x[j + 2], s2);
        s3 = fmaf(a.w, x[j + 3], s3);
      }
      x[i] = i == col ? 1.0f : i < col ? 0.0f : -((s0 + s1) + (s2 + s3));
    }
    const float dw = beta_s[col] * __expf(G_s[col]) * kn_s[col], du = beta_s[col];
#pragma unroll
    for (int i = 0; i < kC; ++i) {
      TiW[i * kLdT + col] = __float2bfloat16_rn(x[i] * dw);
      const float u = x[i] * du;
      const bf16 hi = __float2bfloat16_rn(u);
      TiH[i * kLdT + col] = hi;
      TiL[i * kLdT + col] = __float2bfloat16_rn(u - __bfloat162float(hi));
    }
  }
  __syncthreads();

  // W = TiW K, U = (TiH + TiL) V for rows 16w .. 16w+15; Ti is lower triangular, so k-steps ks <= w.
  {
    float acc[DK / 8][4] = {};
    for (int ks = 0; ks <= warp; ++ks) {
      uint32_t a[4];
      load_a(a, TiW, kLdT, 16 * warp, 16 * ks);
#pragma unroll
      for (int np = 0; np < DK / 16; ++np) {
        uint32_t b[4];
        load_b_trans(b, Ks, LDK, 16 * ks, 16 * np);
        mma(acc[2 * np], a, b[0], b[1]);
        mma(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
    bf16* W = scr.W + ch * kC * DK;
#pragma unroll
    for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        store_bf16x2(W + (16 * warp + g + 8 * hr) * DK + 8 * nt + 2 * t, acc[nt][2 * hr], acc[nt][2 * hr + 1]);
  }
  float* U = scr.U + ch * kC * dv;
  for (int c0 = 0; c0 < dv; c0 += 64) {  // 64 columns at a time; dv is a multiple of 16
    float acc[8][4] = {};
    for (int ks = 0; ks <= warp; ++ks) {
      uint32_t ah[4], al[4];
      load_a(ah, TiH, kLdT, 16 * warp, 16 * ks);
      load_a(al, TiL, kLdT, 16 * warp, 16 * ks);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        if (c0 + 16 * np >= dv) continue;
        uint32_t b[4];
        load_b_trans(b, Vs, LDV, 16 * ks, c0 + 16 * np);
        mma(acc[2 * np], ah, b[0], b[1]);
        mma(acc[2 * np], al, b[0], b[1]);
        mma(acc[2 * np + 1], ah, b[2], b[3]);
        mma(acc[2 * np + 1], al, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (c0 + 8 * nt >= dv) continue;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        *reinterpret_cast<float2*>(U + (16 * warp + g + 8 * hr) * dv + c0 + 8 * nt + 2 * t) =
            make_float2(acc[nt][2 * hr], acc[nt][2 * hr + 1]);
    }
  }
}

// Shared memory of gdn_chunk_state_kernel: two chunk buffers (cp.async double buffering), then the
// state as a BF16 B operand and the chunk's V' (for P V') and V'' = diag(e^(G_last - G) knorm) V'
// as hi + lo (for K^T V'').
template <int DK> struct StateSmem {
  static constexpr int kLdK = DK + 8;       // W, q, k rows (BF16)
  static constexpr int kLdU = kSlice + 8;   // U slice rows (fp32)
  static constexpr int kLdS = kSlice + 8;   // state slice, V', V'' rows (BF16)
  static constexpr int kW = 0, kQ = kW + kC * kLdK * 2, kK = kQ + kC * kLdK * 2, kP = kK + kC * kLdK * 2,
                       kU = kP + kC * kLdT * 2, kSc = kU + kC * kLdU * 4, kBuf = kSc + kScal * 4;
  static constexpr int kSb = 2 * kBuf, kVp = kSb + DK * kLdS * 2, kVh = kVp + kC * kLdS * 2,
                       kVl = kVh + kC * kLdS * 2, kBytes = kVl + kC * kLdS * 2;
};

// One block per (value head h, columns col0 .. col0+31 of dv); blockIdx = (h, col0 / 32). Walks the
// pass's n_chunks chunks in order. Warp w computes, per chunk:
//  - tokens 16 (w/2) .. +15 x columns 16 (w%2) .. +15 of V' = U - W S, Q S and O;
//  - state rows 16 ms .. +15 x its PP = DK/32 8-column tiles from ns0 of S' (the tiles it holds).
template <int DK>
__global__ void __launch_bounds__(kStateThreads, 1)
    gdn_chunk_state_kernel(const bf16* __restrict__ qkv, int64_t ldq, int tok_begin, int n_tokens, int n_chunks,
                           int HK, int HV, int dv, ChunkScratch scr, float* __restrict__ state,
                           bf16* __restrict__ out, int64_t ldo) {
  using Sm = StateSmem<DK>;
  constexpr int LDK = Sm::kLdK, LDU = Sm::kLdU, LDS = Sm::kLdS;
  constexpr int PP = DK / 32;
  static_assert(PP == 2 || PP == 4, "state tiles per warp");
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Sb = reinterpret_cast<bf16*>(smem + Sm::kSb);
  bf16* Vp = reinterpret_cast<bf16*>(smem + Sm::kVp);
  bf16* Vh = reinterpret_cast<bf16*>(smem + Sm::kVh);
  bf16* Vl = reinterpret_cast<bf16*>(smem + Sm::kVl);

  const int h = blockIdx.x, col0 = blockIdx.y * kSlice, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int hk = h / (HV / HK);
  const int mt = warp >> 1, np1 = warp & 1;                 // V' / O tile
  const int ms = (warp * PP) >> 2, ns0 = (warp * PP) & 3;  // state tiles

  auto load_chunk = [&](int c) {
    unsigned char* buf = smem + (c & 1) * Sm::kBuf;
    bf16* Ws = reinterpret_cast<bf16*>(buf + Sm::kW);
    bf16* Qs = reinterpret_cast<bf16*>(buf + Sm::kQ);
    bf16* Ks = reinterpret_cast<bf16*>(buf + Sm::kK);
    bf16* Ps = reinterpret_cast<bf16*>(buf + Sm::kP);
    float* Us = reinterpret_cast<float*>(buf + Sm::kU);
    float* Sc = reinterpret_cast<float*>(buf + Sm::kSc);
    const int tok0 = tok_begin + c * kC, L = min(kC, n_tokens - tok0);
    const int64_t ch = int64_t(c) * HV + h;
    const bf16* Wg = scr.W + ch * kC * DK;
    const bf16* Pg = scr.P + ch * kC * kC;
    const float* Ug = scr.U + ch * kC * dv + col0;
    const float* Cg = scr.scal + ch * kScal;
    const bf16* qg = qkv + int64_t(tok0) * ldq + hk * DK;
    const bf16* kg = qg + HK * DK;
    for (int i = tid; i < kC * (DK / 8); i += kStateThreads) {
      const int r = i / (DK / 8), e = (i % (DK / 8)) * 8;
      const int64_t off = int64_t(r < L ? r : 0) * ldq + e;
      cp_async16(Ws + r * LDK + e, Wg + r * DK + e, 16);
      cp_async16(Qs + r * LDK + e, qg + off, r < L ? 16 : 0);
      cp_async16(Ks + r * LDK + e, kg + off, r < L ? 16 : 0);
    }
    for (int i = tid; i < kC * (kC / 8); i += kStateThreads) {
      const int r = i / (kC / 8), e = (i % (kC / 8)) * 8;
      cp_async16(Ps + r * kLdT + e, Pg + r * kC + e, 16);
    }
    for (int i = tid; i < kC * (kSlice / 4); i += kStateThreads) {
      const int r = i / (kSlice / 4), e = (i % (kSlice / 4)) * 4;
      const bool in = col0 + e < dv;  // columns past dv read as 0
      cp_async16(Us + r * LDU + e, Ug + (in ? int64_t(r) * dv + e : 0), in ? 16 : 0);
    }
    for (int i = tid; i < kScal / 4; i += kStateThreads) cp_async16(Sc + 4 * i, Cg + 4 * i, 16);
  };

  float* Sp = state + int64_t(h) * DK * dv + col0;
  float S[PP][4];
#pragma unroll
  for (int p = 0; p < PP; ++p) {
    const int col = (ns0 + p) * 8 + 2 * t;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float2 v = col0 + col < dv ? *reinterpret_cast<const float2*>(Sp + int64_t(16 * ms + g + 8 * hr) * dv + col)
                                       : make_float2(0.0f, 0.0f);
      S[p][2 * hr] = v.x;
      S[p][2 * hr + 1] = v.y;
    }
  }

  load_chunk(0);
  cp_async_commit();
  for (int c = 0; c < n_chunks; ++c) {
    const unsigned char* buf = smem + (c & 1) * Sm::kBuf;
    const bf16* Ws = reinterpret_cast<const bf16*>(buf + Sm::kW);
    const bf16* Qs = reinterpret_cast<const bf16*>(buf + Sm::kQ);
    const bf16* Ks = reinterpret_cast<const bf16*>(buf + Sm::kK);
    const bf16* Ps = reinterpret_cast<const bf16*>(buf + Sm::kP);
    const float* Us = reinterpret_cast<const float*>(buf + Sm::kU);
    const float* Sc = reinterpret_cast<const float*>(buf + Sm::kSc);

    cp_async_wait<0>();  // this chunk's copies (the only group in flight)
#pragma unroll
    for (int p = 0; p < PP; ++p)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        store_bf16x2(Sb + (16 * ms + g + 8 * hr) * LDS + (ns0 + p) * 8 + 2 * t, S[p][2 * hr], S[p][2 * hr + 1]);
    // After this barrier every warp is past the previous chunk, whose buffer the next copies reuse.
    __syncthreads();
    if (c + 1 < n_chunks) load_chunk(c + 1);
    cp_async_commit();

    // X = W S and Y = Q S (raw q) for tokens 16 mt .., columns 16 np1 ..
    float X[2][4] = {}, Y[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < DK / 16; ++ks) {
      uint32_t aw[4], aq[4], b[4];
      load_a(aw, Ws, LDK, 16 * mt, 16 * ks);
      load_a(aq, Qs, LDK, 16 * mt, 16 * ks);
      load_b_trans(b, Sb, LDS, 16 * ks, 16 * np1);
      mma(X[0], aw, b[0], b[1]);
      mma(X[1], aw, b[2], b[3]);
      mma(Y[0], aq, b[0], b[1]);
      mma(Y[1], aq, b[2], b[3]);
    }
    // V' = U - X; V'' = e^(G_last - G_i) knorm_i V'_i (hi + lo); Y_i *= e^(G_i) qnorm_i.
#pragma unroll
    for (int nh = 0; nh < 2; ++nh)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = 16 * mt + g + 8 * hr, j = 16 * np1 + 8 * nh + 2 * t;
        const float2 u = *reinterpret_cast<const float2*>(Us + i * LDU + j);
        const float v0 = u.x - X[nh][2 * hr], v1 = u.y - X[nh][2 * hr + 1];
        store_bf16x2(Vp + i * LDS + j, v0, v1);
        const float kd = Sc[kC + i], w0 = kd * v0, w1 = kd * v1;
        const __nv_bfloat162 hi = __floats2bfloat162_rn(w0, w1);
        *reinterpret_cast<__nv_bfloat162*>(Vh + i * LDS + j) = hi;
        store_bf16x2(Vl + i * LDS + j, w0 - __low2float(hi), w1 - __high2float(hi));
        const float qs = Sc[i];
        Y[nh][2 * hr] *= qs;
        Y[nh][2 * hr + 1] *= qs;
      }
    __syncthreads();

    // O = Y + P V' (P is zero above the diagonal: k-steps ks <= mt).
    for (int ks = 0; ks <= mt; ++ks) {
      uint32_t a[4], b[4];
      load_a(a, Ps, kLdT, 16 * mt, 16 * ks);
      load_b_trans(b, Vp, LDS, 16 * ks, 16 * np1);
      mma(Y[0], a, b[0], b[1]);
      mma(Y[1], a, b[2], b[3]);
    }
    const int tok0 = tok_begin + c * kC, L = min(kC, n_tokens - tok0);
#pragma unroll
    for (int nh = 0; nh < 2; ++nh)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = 16 * mt + g + 8 * hr, col = col0 + 16 * np1 + 8 * nh + 2 * t;
        if (i < L && col < dv)
          store_bf16x2(out + int64_t(tok0 + i) * ldo + int64_t(h) * dv + col, Y[nh][2 * hr], Y[nh][2 * hr + 1]);
      }

    // S' = e^(G_last) S + K^T V'' (raw k; V'' as hi + lo).
    const float decay = Sc[2 * kC];
#pragma unroll
    for (int p = 0; p < PP; ++p)
#pragma unroll
      for (int e = 0; e < 4; ++e) S[p][e] *= decay;
#pragma unroll
    for (int ks = 0; ks < kC / 16; ++ks) {
      uint32_t a[4];
      load_a_trans(a, Ks, LDK, 16 * ms, 16 * ks);
#pragma unroll
      for (int pp = 0; pp < PP / 2; ++pp) {
        uint32_t bh[4], bl[4];
        load_b_trans(bh, Vh, LDS, 16 * ks, 8 * ns0 + 16 * pp);
        load_b_trans(bl, Vl, LDS, 16 * ks, 8 * ns0 + 16 * pp);
        mma(S[2 * pp], a, bh[0], bh[1]);
        mma(S[2 * pp], a, bl[0], bl[1]);
        mma(S[2 * pp + 1], a, bh[2], bh[3]);
        mma(S[2 * pp + 1], a, bl[2], bl[3]);
      }
    }
  }

#pragma unroll
  for (int p = 0; p < PP; ++p) {
    const int col = (ns0 + p) * 8 + 2 * t;
    if (col0 + col >= dv) continue;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
      *reinterpret_cast<float2*>(Sp + int64_t(16 * ms + g + 8 * hr) * dv + col) =
          make_float2(S[p][2 * hr], S[p][2 * hr + 1]);
  }
}

// Whether the chunked kernels take this call (else gdn_chunked runs the recurrence).
bool chunked_fits(const Tensor& qkv, const Tensor& out, int64_t T, int64_t dk, int64_t dv, int64_t HV,
                  size_t workspace_bytes) {
  return qkv.dtype == DType::BF16 && T >= kC && (dk == 64 || dk == 128) && dv % 16 == 0 && dv <= kMaxChunkedDv &&
         aligned16(qkv.data) && qkv.row_stride % 8 == 0 && reinterpret_cast<uintptr_t>(out.data) % 4 == 0 &&
         out.row_stride % 2 == 0 && workspace_bytes >= size_t(HV) * chunk_scratch_bytes(dk, dv);
}

// The prompt in passes of up to kPassChunks chunks (fewer if the workspace holds fewer); each pass
// runs the prep kernel over its chunks, then the state kernel from the state the previous pass left.
template <int DK>
void launch_chunked(const Tensor& qkv, const Tensor& ba, ParamView A_log, ParamView dt_bias, const Tensor& state,
                    const Tensor& out, int T, int HK, int HV, int dv, void* workspace, size_t workspace_bytes,
                    cudaStream_t s) {
  const int n_chunks = (T + kC - 1) / kC;
  const int per_pass = int(std::min<size_t>(std::min(n_chunks, kPassChunks),
                                            workspace_bytes / (size_t(HV) * chunk_scratch_bytes(DK, dv))));
  // Once per instantiation (thread-safe static initialisation); allowed during graph capture.
  constexpr auto kMaxSmem = cudaFuncAttributeMaxDynamicSharedMemorySize;
  static const cudaError_t a1 =
      cudaFuncSetAttribute(gdn_chunk_prep_kernel<DK>, kMaxSmem, int(prep_smem_bytes(DK, kMaxChunkedDv)));
  static const cudaError_t a2 = cudaFuncSetAttribute(gdn_chunk_state_kernel<DK>, kMaxSmem, StateSmem<DK>::kBytes);
  check_cuda(a1, "cudaFuncSetAttribute (gdn_chunk_prep_kernel)");
  check_cuda(a2, "cudaFuncSetAttribute (gdn_chunk_state_kernel)");
  const bf16* q = qkv.ptr<const bf16>();
  for (int c0 = 0; c0 < n_chunks; c0 += per_pass) {
    const int nc = std::min(per_pass, n_chunks - c0);
    const ChunkScratch scr = carve_scratch(workspace, int64_t(nc) * HV, DK, dv);
    gdn_chunk_prep_kernel<DK><<<dim3(unsigned(nc), unsigned(HV)), kPrepThreads, prep_smem_bytes(DK, dv), s>>>(
        q, qkv.row_stride, ba.ptr<const bf16>(), ba.row_stride, A_log, dt_bias, c0 * kC, T, HK, HV, dv, scr);
    check_launch("gdn_chunk_prep_kernel");
    gdn_chunk_state_kernel<DK><<<dim3(unsigned(HV), unsigned((dv + kSlice - 1) / kSlice)), kStateThreads,
                                 StateSmem<DK>::kBytes, s>>>(q, qkv.row_stride, c0 * kC, T, nc, HK, HV, dv, scr,
                                                             state.ptr<float>(), out.ptr<bf16>(), out.row_stride);
    check_launch("gdn_chunk_state_kernel");
  }
}

}  // namespace
}  // namespace cuda

void CudaBackend::gdn_run(const char* op, const Tensor& qkv, const Tensor& ba, const Tensor& A_log,
                          const Tensor& dt_bias, const Tensor& state, const GdnParams& p, const Tensor& out,
                          bool chunked) {
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
  if (chunked && chunked_fits(qkv, out, T, dk, dv, HV, workspace_bytes_)) {
    auto launch = dk == 64 ? launch_chunked<64> : launch_chunked<128>;
    launch(qkv, ba, a_log, dtb, state, out, int(T), int(HK), int(HV), int(dv), workspace_, workspace_bytes_, stream_);
    return;
  }
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
  gdn_run("gdn_recurrent", qkv, ba, A_log, dt_bias, state, p, out, false);
}

void CudaBackend::gdn_chunked(const Tensor& qkv, const Tensor& ba, const Tensor& A_log, const Tensor& dt_bias,
                              const Tensor& state, const GdnParams& p, const Tensor& out) {
  gdn_run("gdn_chunked", qkv, ba, A_log, dt_bias, state, p, out, true);
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

void CudaBackend::gdn_decode(const Tensor& proj, const Tensor& conv_weight, const Tensor& conv_state,
                             const Tensor& A_log, const Tensor& dt_bias, const Tensor& norm_weight, const Tensor& state,
                             const GdnParams& p, const Tensor& conv_out, const Tensor& o, const Tensor& out) {
  using namespace cuda;
  const int64_t T = proj.dim(0), HK = p.num_k_heads, HV = p.num_v_heads, dk = p.k_head_dim, dv = p.v_head_dim;
  const int64_t K = conv_weight.dim(-1);
  const bool fused = gdn_fused_ && proj.dtype == DType::BF16 && T >= 1 && T <= kTokChunk &&
                     (dk == 16 || dk == 32 || dk == 64 || dk == 128) && dv >= 1 && dv <= kDecMaxDv && K >= 2 &&
                     K <= kConvMaxWidth && HK > 0 && HV % HK == 0 && HV / HK <= kDecMaxCluster;
  if (!fused) {
    Backend::gdn_decode(proj, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, p, conv_out, o, out);
    return;
  }
  const char* op = "gdn_decode";
  require_tensor(proj, DType::BF16, op, "proj");
  require_tensor(out, DType::BF16, op, "out");
  require_tensor(conv_state, DType::F32, op, "conv_state");
  require_tensor(state, DType::F32, op, "state");
  ParamView cw = param_view(conv_weight, op, "conv_weight"), a_log = param_view(A_log, op, "A_log"),
            dtb = param_view(dt_bias, op, "dt_bias"), nw = param_view(norm_weight, op, "norm_weight");
  const int64_t C = p.conv_dim(), vdim = HV * dv;
  OCRIA_RT_REQUIRE(proj.ndim == 2 && proj.dim(1) == C + vdim + 2 * HV, op,
                   "proj " + proj.shape_str() + ", expected [T, " + std::to_string(C + vdim + 2 * HV) + "]");
  OCRIA_RT_REQUIRE(out.ndim == 2 && out.dim(0) == T && out.dim(1) == vdim, op, "out " + out.shape_str());
  OCRIA_RT_REQUIRE(conv_weight.numel() == C * K, op, "conv_weight " + conv_weight.shape_str());
  OCRIA_RT_REQUIRE(conv_state.numel() == C * (K - 1) && conv_state.contiguous(), op,
                   "conv_state " + conv_state.shape_str() + ", expected [C, K-1] contiguous");
  OCRIA_RT_REQUIRE(state.numel() == HV * dk * dv && state.contiguous(), op, "state " + state.shape_str());
  OCRIA_RT_REQUIRE(A_log.numel() == HV && dt_bias.numel() == HV, op, "A_log / dt_bias must have HV elements");
  OCRIA_RT_REQUIRE(norm_weight.numel() == dv, op, "norm_weight must have v_head_dim elements");
  activate();
  // One cluster per key head: its HV / HK value heads' blocks (consecutive, as h / (HV / HK) groups them).
  auto launch = [&](auto kernel) {
    launch_pdl_cluster(launch_ctx(), "gdn_decode_kernel", unsigned(HV / HK), kernel, dim3(unsigned(HV)),
                       dim3(kDecThreads), 0, proj.ptr<const bf16>(), proj.row_stride, cw, conv_state.ptr<float>(),
                       a_log, dtb, nw, state.ptr<float>(), out.ptr<bf16>(), out.row_stride, int(T), int(HK), int(HV),
                       int(dv), int(K), p.norm_eps);
  };
  // dv = 128 and a conv width of 4 (every Qwen3.5 size) as compile-time constants; others at run time.
  const bool fixed = dv == kDecMaxDv && K == kDecFixedWidth;
  switch (dk) {
    case 16: fixed ? launch(gdn_decode_kernel<16, kDecMaxDv, kDecFixedWidth>) : launch(gdn_decode_kernel<16, 0, 0>); break;
    case 32: fixed ? launch(gdn_decode_kernel<32, kDecMaxDv, kDecFixedWidth>) : launch(gdn_decode_kernel<32, 0, 0>); break;
    case 64: fixed ? launch(gdn_decode_kernel<64, kDecMaxDv, kDecFixedWidth>) : launch(gdn_decode_kernel<64, 0, 0>); break;
    case 128: fixed ? launch(gdn_decode_kernel<128, kDecMaxDv, kDecFixedWidth>) : launch(gdn_decode_kernel<128, 0, 0>); break;
  }
}

namespace {

// The records of a replay for T tokens, checked against the shapes of p (and K - 1 conv inputs).
cuda::ReplayView replay_view(const GdnReplay& r, int64_t T, const GdnParams& p, const char* op) {
  using namespace cuda;
  require_tensor(r.conv_in, DType::BF16, op, "replay.conv_in");
  require_tensor(r.k, DType::F32, op, "replay.k");
  require_tensor(r.g, DType::F32, op, "replay.g");
  require_tensor(r.u, DType::F32, op, "replay.u");
  const int64_t rows = r.u.dim(0);
  OCRIA_RT_REQUIRE(r.conv_in.ndim == 2 && r.conv_in.dim(0) == rows && r.conv_in.dim(1) == p.conv_dim(), op,
                   "replay.conv_in " + r.conv_in.shape_str());
  OCRIA_RT_REQUIRE(r.k.ndim == 2 && r.k.dim(0) == rows && r.k.dim(1) == p.num_k_heads * p.k_head_dim, op,
                   "replay.k " + r.k.shape_str());
  OCRIA_RT_REQUIRE(r.g.ndim == 2 && r.g.dim(0) == rows && r.g.dim(1) == p.num_v_heads, op, "replay.g " + r.g.shape_str());
  OCRIA_RT_REQUIRE(r.u.ndim == 2 && r.u.dim(1) == p.num_v_heads * p.v_head_dim, op, "replay.u " + r.u.shape_str());
  OCRIA_RT_REQUIRE(T <= rows, op, std::to_string(T) + " tokens, replay rows for " + std::to_string(rows));
  return {r.conv_in.ptr<bf16>(), r.conv_in.row_stride, r.k.ptr<float>(), r.k.row_stride,
          r.g.ptr<float>(),       r.g.row_stride,       r.u.ptr<float>(), r.u.row_stride};
}

}  // namespace

void CudaBackend::gdn_verify(const Tensor& proj, const Tensor& conv_weight, const Tensor& conv_state,
                             const Tensor& A_log, const Tensor& dt_bias, const Tensor& norm_weight, const Tensor& state,
                             const GdnParams& p, const Tensor& conv_out, const Tensor& o, const Tensor& out,
                             const GdnReplay& replay) {
  using namespace cuda;
  const char* op = "gdn_verify";
  require_tensor(proj, DType::BF16, op, "proj");
  require_tensor(out, DType::BF16, op, "out");
  require_tensor(conv_state, DType::F32, op, "conv_state");
  require_tensor(state, DType::F32, op, "state");
  ParamView cw = param_view(conv_weight, op, "conv_weight"), a_log = param_view(A_log, op, "A_log"),
            dtb = param_view(dt_bias, op, "dt_bias"), nw = param_view(norm_weight, op, "norm_weight");
  const int64_t T = proj.dim(0), HK = p.num_k_heads, HV = p.num_v_heads, dk = p.k_head_dim, dv = p.v_head_dim;
  const int64_t C = p.conv_dim(), vdim = HV * dv, K = conv_weight.dim(-1);
  OCRIA_RT_REQUIRE(HK > 0 && HV > 0 && HV % HK == 0, op, "HV must be a positive multiple of HK");
  OCRIA_RT_REQUIRE(dk == 16 || dk == 32 || dk == 64 || dk == 128 || dk == 256, op,
                   "k_head_dim " + std::to_string(dk) + " unsupported (16/32/64/128/256)");
  OCRIA_RT_REQUIRE(dv >= 1 && dv <= 32 * kVerifyMaxGroups, op,
                   "v_head_dim " + std::to_string(dv) + " unsupported (1.." + std::to_string(32 * kVerifyMaxGroups) + ")");
  OCRIA_RT_REQUIRE(K >= 2 && K <= kConvMaxWidth, op, "conv width " + std::to_string(K) + " unsupported (2..8)");
  OCRIA_RT_REQUIRE(proj.ndim == 2 && proj.dim(1) == C + vdim + 2 * HV, op,
                   "proj " + proj.shape_str() + ", expected [T, " + std::to_string(C + vdim + 2 * HV) + "]");
  OCRIA_RT_REQUIRE(out.ndim == 2 && out.dim(0) == T && out.dim(1) == vdim, op, "out " + out.shape_str());
  OCRIA_RT_REQUIRE(conv_weight.numel() == C * K, op, "conv_weight " + conv_weight.shape_str());
  OCRIA_RT_REQUIRE(conv_state.numel() == C * (K - 1) && conv_state.contiguous(), op,
                   "conv_state " + conv_state.shape_str() + ", expected [C, K-1] contiguous");
  OCRIA_RT_REQUIRE(state.numel() == HV * dk * dv && state.contiguous(), op, "state " + state.shape_str());
  OCRIA_RT_REQUIRE(A_log.numel() == HV && dt_bias.numel() == HV, op, "A_log / dt_bias must have HV elements");
  OCRIA_RT_REQUIRE(norm_weight.numel() == dv, op, "norm_weight must have v_head_dim elements");
  OCRIA_RT_REQUIRE(T < (int64_t(1) << 31), op, "too many tokens");
  const ReplayView rec = replay_view(replay, T, p, op);
  if (T == 0) return;
  activate();
  const unsigned groups = unsigned((dv + 31) / 32);
  auto launch = [&](auto kernel) {
    launch_pdl_cluster(launch_ctx(), "gdn_verify_kernel", groups, kernel, dim3(groups, unsigned(HV)), dim3(kWarps * 32),
                       0, proj.ptr<const bf16>(), proj.row_stride, cw, conv_state.ptr<const float>(), a_log, dtb, nw,
                       state.ptr<const float>(), out.ptr<bf16>(), out.row_stride, rec, int(T), int(HK), int(HV),
                       int(dv), int(K), p.norm_eps);
  };
  // The conv width of every Qwen3.5 size (4) at compile time; others at run time.
  const bool fixed = K == kDecFixedWidth;
  switch (dk) {
    case 16: fixed ? launch(gdn_verify_kernel<16, kDecFixedWidth>) : launch(gdn_verify_kernel<16, 0>); break;
    case 32: fixed ? launch(gdn_verify_kernel<32, kDecFixedWidth>) : launch(gdn_verify_kernel<32, 0>); break;
    case 64: fixed ? launch(gdn_verify_kernel<64, kDecFixedWidth>) : launch(gdn_verify_kernel<64, 0>); break;
    case 128: fixed ? launch(gdn_verify_kernel<128, kDecFixedWidth>) : launch(gdn_verify_kernel<128, 0>); break;
    case 256: fixed ? launch(gdn_verify_kernel<256, kDecFixedWidth>) : launch(gdn_verify_kernel<256, 0>); break;
  }
}

void CudaBackend::gdn_commit(const GdnReplay& replay, const Tensor& keep, const GdnParams& p, const Tensor& conv_state,
                             const Tensor& state) {
  using namespace cuda;
  const char* op = "gdn_commit";
  require_tensor(keep, DType::I32, op, "keep");
  require_tensor(conv_state, DType::F32, op, "conv_state");
  require_tensor(state, DType::F32, op, "state");
  const int64_t HK = p.num_k_heads, HV = p.num_v_heads, dk = p.k_head_dim, dv = p.v_head_dim, C = p.conv_dim();
  OCRIA_RT_REQUIRE(keep.numel() == 1, op, "keep must be one I32 element, got " + keep.shape_str());
  OCRIA_RT_REQUIRE(HK > 0 && HV > 0 && HV % HK == 0 && dk % 4 == 0 && dv >= 1, op, "bad GdnParams");
  OCRIA_RT_REQUIRE(C < (int64_t(1) << 31), op, "too many channels");
  OCRIA_RT_REQUIRE(state.numel() == HV * dk * dv && state.contiguous(), op, "state " + state.shape_str());
  const int64_t K1 = p.conv_kernel - 1;
  OCRIA_RT_REQUIRE(K1 >= 1 && K1 < kConvMaxWidth, op, "conv width " + std::to_string(p.conv_kernel) + " unsupported (2..8)");
  OCRIA_RT_REQUIRE(conv_state.contiguous() && conv_state.numel() == C * K1, op,
                   "conv_state " + conv_state.shape_str() + ", expected [C, K-1] contiguous");
  const ReplayView rec = replay_view(replay, 0, p, op);
  activate();
  const int64_t items = HV * (dk / 4) * ((dv + 3) / 4);
  const int64_t state_blocks = (items + kCommitThreads - 1) / kCommitThreads;
  const int64_t conv_blocks = (C + kCommitThreads - 1) / kCommitThreads;
  OCRIA_RT_REQUIRE(state_blocks + conv_blocks < (int64_t(1) << 31), op, "state too large");
  const bool vec = dv % 4 == 0 && aligned16(state.data);
  auto launch = [&](auto kernel) {
    launch_pdl(launch_ctx(), "gdn_commit_kernel", kernel, unsigned(state_blocks + conv_blocks), kCommitThreads, 0, rec,
               keep.ptr<const int32_t>(), int(replay.u.dim(0)), conv_state.ptr<float>(), state.ptr<float>(), int(C),
               int(K1), int(HK), int(HV), int(dk), int(dv), int(state_blocks));
  };
  vec ? launch(gdn_commit_kernel<true>) : launch(gdn_commit_kernel<false>);
}

}  // namespace ocria_rt
