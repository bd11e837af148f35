// Gated attention: attention_prepare (q/k RMSNorm + partial RoPE, KV-cache write), attention
// (causal softmax attention over the cache, GQA, times sigmoid(gate)) and attention_decode (the two,
// for one token as one kernel: attention_decode_kernel, see its section); vision_attention.
//
// attention, prefill (T > 16 tokens, head_dim 64 / 128 / 256, 16-byte aligned rows): flash_attention,
// a tensor-core kernel (see its section below), also used by vision_attention.
//
// attention, speculative verify (2 <= T <= 16 tokens, the same head dims and alignment): verify_attention,
// flash-decoding on tensor cores that reads each K / V row once for all T tokens of a kv head (see its
// section; OCRIA_RT_ATTN_VERIFY=0 sends these to the kernels below instead).
//
// attention, decode (T = 1) and the shapes neither tensor-core kernel takes: flash-decoding. Block
// (split, kv head, token) covers cache rows [split * chunk, (split + 1) * chunk) of 0..positions[t],
// chunk = max(ceil(len / splits), 32), for all q heads of its kv head (GQA group) at once, so K / V
// rows are read once per group. Each of the 4 warps runs an online softmax over its own groups of
// 4 (or 2) rows (lane = 1/32 of head_dim, 16-byte loads of K and V rows, the next group's loads
// issued before the current group is used, the group's (row, head) scores summed with one transposed
// butterfly); the warps merge in shared memory. With one split the block writes the output;
// otherwise it writes (max, sum) and the unnormalised acc to the workspace and a combine kernel
// merges the non-empty splits. The number of splits is a launch constant: one wave of blocks (the
// kernel's occupancy) over the (token, kv head) pairs, bounded by the cache capacity; both kernels
// read the actual lengths on the device, so a captured graph stays valid as the context grows
// (splits past the end exit at once and are not read).
// Above 16 tokens (head_dim 32, misaligned views) every token gets its own blocks without splits.
#include <algorithm>
#include <climits>
#include <cmath>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "ops/cuda/backend.cuh"
#include "ops/cuda/mma.cuh"

namespace ocria_rt {
namespace cuda {
namespace {

constexpr int kAttnWarps = 4;
constexpr int kMinChunk = 32;       // the shortest split (rows)
constexpr int kMaxSplitTokens = 16;  // larger T: one split per (token, kv head)

// ---------------------------------------------------------------------------------------------
// attention_prepare: one warp per (token, q head or kv head).
// ---------------------------------------------------------------------------------------------
constexpr int kPrepWarps = 8;

struct MropeSection {
  int s[3];
};

// Which of the (t, h, w) rope positions frequency j follows under interleaved M-RoPE (ops.h):
// h if j % 3 == 1 and j < 3 * s[1], w if j % 3 == 2 and j < 3 * s[2], else t.
__device__ __forceinline__ int mrope_axis(int j, const MropeSection& m) {
  if (j % 3 == 1 && j < 3 * m.s[1]) return 1;
  if (j % 3 == 2 && j < 3 * m.s[2]) return 2;
  return 0;
}

constexpr int kPrepMaxPer = 256 / 32;  // head_dim <= 256: elements per lane

// Pieces of the q_norm / k_norm and RoPE that attention_prepare_kernel and attention_decode_kernel
// share (the same arithmetic, so the same bits).

// theta^(-2f/rot), the frequency of rotation pair f, formed in fp32 as transformers does (correctly
// rounded, whatever --use_fast_math does to powf / division).
__device__ __forceinline__ float rope_inv_freq(int f, int rot, float theta) {
  return __fdiv_rn(1.0f, float(pow(double(theta), double(__fdiv_rn(float(2 * f), float(rot))))));
}

// (cos, sin) of the angle p * inv_freq, formed in fp32 as transformers does, cos / sin evaluated in
// double.
__device__ __forceinline__ float2 rope_cos_sin(int p, float inv_freq) {
  const float angle = __fmul_rn(float(p), inv_freq);
  double s, c;
  sincos(double(angle), &s, &c);
  return make_float2(float(c), float(s));
}

// Zero-centred RMSNorm of the head src[0, hd) by one warp into x (shared memory): x[i] = src[i] *
// rsqrt(mean(src^2) + eps) * scale(j) for the lane's elements i = lane + 32 j < hd, j < PER (scale(j):
// 1 + the norm weight of element i).
template <int PER, class T, class Scale>
__device__ __forceinline__ void rms_norm_head(const T* src, int hd, float eps, int lane, Scale scale, float* x) {
  float xv[PER];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int i = lane + 32 * j;
    xv[j] = i < hd ? to_float(src[i]) : 0.0f;
    ss = fmaf(xv[j], xv[j], ss);
  }
  const float inv = rsqrtf(warp_sum(ss) / float(hd) + eps);
#pragma unroll
  for (int j = 0; j < PER; ++j)
    if (lane + 32 * j < hd) x[lane + 32 * j] = xv[j] * inv * scale(j);
  __syncwarp();
}

// Rotate-half RoPE of element i < rot of the normed head x: pair (f, f + rot/2) turns by the angle
// whose (cos, sin) is cs.
__device__ __forceinline__ float rope_rotate(const float* x, int i, int half, float2 cs) {
  return i < half ? x[i] * cs.x - x[i + half] * cs.y : x[i] * cs.x + x[i - half] * cs.y;
}

// What does not depend on earlier kernels (the norm weights, the RoPE frequencies and their M-RoPE
// axes) is formed before pdl_wait(): in decode the weights have long left L2, and pow() in double
// is slow, so both would otherwise sit on the critical path.
template <class T>
__global__ void __launch_bounds__(kPrepWarps * 32)
    attention_prepare_kernel(const T* __restrict__ qkv, int64_t ldqkv, ParamView q_norm, ParamView k_norm,
                             const int32_t* __restrict__ positions, const int32_t* __restrict__ rope_positions,
                             int64_t ldrp, MropeSection mrope, T* __restrict__ q_out, int64_t ldqo,
                             T* __restrict__ k_cache, T* __restrict__ v_cache, int64_t ldc, int n_tokens, int Hq,
                             int Hkv, int hd, int rot, float theta, float eps) {
  __shared__ float buf[kPrepWarps][256];
  pdl_launch_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t item = int64_t(blockIdx.x) * kPrepWarps + warp;
  const int heads = Hq + Hkv;
  const int t = int(item / heads), slot = int(item % heads);
  const bool is_q = slot < Hq;
  const int head = is_q ? slot : slot - Hq;
  const ParamView& w = is_q ? q_norm : k_norm;
  const int half = rot / 2;
  // Element i = lane + 32 j: 1 + its norm weight; for i < rot, the frequency of its rotation pair
  // f = i mod rot/2, and which rope position it follows.
  float w1[kPrepMaxPer], inv_freq[kPrepMaxPer];
  int axis[kPrepMaxPer];
#pragma unroll
  for (int j = 0; j < kPrepMaxPer; ++j) {
    const int i = lane + 32 * j, f = i < half ? i : i - half;
    w1[j] = i < hd ? 1.0f + w[i] : 0.0f;
    inv_freq[j] = i < rot ? rope_inv_freq(f, rot, theta) : 0.0f;
    axis[j] = mrope_axis(f, mrope);
  }
  pdl_wait();  // qkv and the positions come from earlier kernels
  if (item >= int64_t(n_tokens) * heads) return;
  const T* src = qkv + int64_t(t) * ldqkv + (is_q ? int64_t(head) * 2 * hd : int64_t(Hq) * 2 * hd + int64_t(head) * hd);
  const int pos = positions[t];                               // cache row
  const int32_t* rpos = rope_positions + int64_t(t) * ldrp;  // (t, h, w) rope positions
  float* x = buf[warp];
  rms_norm_head<kPrepMaxPer>(src, hd, eps, lane, [&](int j) { return w1[j]; }, x);

  // RoPE on the first `rot` dims, p the t, h or w rope position of frequency f (interleaved M-RoPE;
  // all equal for text tokens).
  T* dst = is_q ? q_out + int64_t(t) * ldqo + int64_t(head) * hd : k_cache + int64_t(pos) * ldc + int64_t(head) * hd;
#pragma unroll
  for (int j = 0; j < kPrepMaxPer; ++j) {
    const int i = lane + 32 * j;
    if (i >= hd) break;
    float y = x[i];
    if (i < rot) y = rope_rotate(x, i, half, rope_cos_sin(rpos[axis[j]], inv_freq[j]));
    dst[i] = from_float<T>(y);
  }
  if (!is_q) {  // v is stored as is
    const T* vsrc = qkv + int64_t(t) * ldqkv + int64_t(Hq) * 2 * hd + int64_t(Hkv + head) * hd;
    T* vdst = v_cache + int64_t(pos) * ldc + int64_t(head) * hd;
    for (int i = lane; i < hd; i += 32) vdst[i] = vsrc[i];
  }
}

// ---------------------------------------------------------------------------------------------
// attention (decode / verify / simple prefill)
// ---------------------------------------------------------------------------------------------

// Rows of a split: chunk = max(ceil(len / nsplit), kMinChunk); splits at or past ceil(len / chunk)
// are empty. The kernels derive this from the device-side length.
__device__ __forceinline__ int split_chunk(int len, int nsplit) { return max((len + nsplit - 1) / nsplit, kMinChunk); }
// The non-empty splits: those that hold rows.
__device__ __forceinline__ int split_count(int len, int chunk) { return (len + chunk - 1) / chunk; }
// The splits of verify_attention_kernel: one chunk for all tokens of the launch, ceil(len / nsplit)
// rounded up to a multiple of `tile` rows, len = max_t positions[t] + 1 (verify_length).
__device__ __forceinline__ int verify_chunk(int len, int nsplit, int tile) {
  return ((len + nsplit - 1) / nsplit + tile - 1) / tile * tile;
}
__device__ __forceinline__ int verify_length(const int32_t* positions, int T) {
  int len = 1;
  for (int t = 0; t < T; ++t) len = max(len, positions[t] + 1);
  return len;
}

// K/V rows each warp has in one group: 4, or 2 where q and the accumulators already take 128
// registers per lane (head_dim 256, groups of 5..8), so that two groups fit without spilling.
template <int E, int GM> constexpr int attn_rows_per_group() { return E * GM >= 64 ? 2 : 4; }

// Loads K and V rows r0 .. r0 + R - 1 (this lane's E elements); rows past `last` repeat row `last`
// (valid memory; their scores are masked by the caller).
template <int E, int R>
__device__ __forceinline__ void load_kv_rows(const bf16* kbase, const bf16* vbase, int64_t ldc, int r0, int last,
                                             Pack<bf16, E> (&kr)[R], Pack<bf16, E> (&vr)[R]) {
#pragma unroll
  for (int u = 0; u < R; ++u) {
    const int64_t row = min(r0 + u, last);
    kr[u] = load_pack<bf16, E>(kbase + row * ldc);
    vr[u] = load_pack<bf16, E>(vbase + row * ldc);
  }
}

// Sums each of N values (N a power of two <= 32) over the warp with N - 1 + log2(32 / N) shuffles
// instead of 5 N: each butterfly step halves the values a lane carries (it keeps the half selected by
// its lane bit and adds the partner's copy of that half). Lane i ends with the total of value
// i / (32 / N); v is clobbered. (Recursion over the steps keeps every index of v a constant.)
template <int N, int Half> __device__ __forceinline__ void transposed_sum_steps(float (&v)[N], int lane) {
  if constexpr (Half >= 1) {
    constexpr int offset = 32 * Half / N;
    const bool upper = lane & offset;
#pragma unroll
    for (int j = 0; j < Half; ++j) {
      const float send = upper ? v[j] : v[j + Half], keep = upper ? v[j + Half] : v[j];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
    }
    transposed_sum_steps<N, Half / 2>(v, lane);
  }
}
template <int N> __device__ __forceinline__ float warp_sum_transposed(float (&v)[N], int lane) {
  transposed_sum_steps<N, N / 2>(v, lane);
  float total = v[0];
#pragma unroll
  for (int offset = 16 / N; offset > 0; offset >>= 1) total += __shfl_xor_sync(0xffffffffu, total, offset);
  return total;
}

constexpr int kAttnPrefetchRows = 64;  // splits of at most this many rows are prefetched into L2 before pdl_wait()

// A value an earlier kernel may still be writing, read before pdl_wait(): only ever a hint.
__device__ __forceinline__ int load_hint(const int32_t* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// L2 prefetch of kv head kvh's K and V in cache rows start .. start + rows - 1 (none for rows <= 0), by
// the threads of the block.
template <int HD>
__device__ __forceinline__ void prefetch_kv_rows(const bf16* k_cache, const bf16* v_cache, int64_t ldc, int kvh,
                                                 int start, int rows) {
  constexpr int kLineElems = 64, kLines = HD > kLineElems ? HD / kLineElems : 1;  // 128-byte lines per row
  for (int i = threadIdx.x; i < rows * 2 * kLines; i += blockDim.x) {
    const int row = start + i / (2 * kLines), line = i % (2 * kLines);
    const bf16* base = line < kLines ? k_cache : v_cache;
    prefetch_l2_line(base + int64_t(row) * ldc + int64_t(kvh) * HD + (line % kLines) * kLineElems);
  }
}

// L2 prefetch of this block's split of the K and V caches, before pdl_wait(), where the split is short
// (short contexts, whose attention is latency-bound: 1k context 9.6 -> 7.9 us per layer on the H200;
// prefetching the first 64 rows of the long splits of a 32k context gained nothing). In decode the
// cache has long left L2 (each step streams the weights through it), and the split's rows are known
// but for the length, which an earlier kernel of the step writes. A length read too early prefetches
// other rows of the cache (clamped to its capacity), which costs bandwidth, not correctness.
template <int HD>
__device__ __forceinline__ void prefetch_split_rows(const bf16* k_cache, const bf16* v_cache, int64_t ldc,
                                                    const int32_t* position, int capacity, int nsplit, int split,
                                                    int kvh) {
  const int len = min(max(load_hint(position) + 1, 1), capacity);
  const int chunk = split_chunk(len, nsplit), start = split * chunk;
  const int rows = chunk <= kAttnPrefetchRows ? min(len - start, chunk) : 0;
  prefetch_kv_rows<HD>(k_cache, v_cache, ldc, kvh, start, rows);
}

// The pieces attention_kernel and attention_decode_kernel share. E: head_dim / 32 elements per lane
// (elements lane * E .. lane * E + E - 1 of a head); GM: the largest GQA group the instantiation handles.

// q of the group's G heads (head g at q_heads + g * 32 E), pre-scaled so that p = exp2(s - m); 0 for
// g >= G.
template <int E, int GM>
__device__ __forceinline__ void load_scaled_q(const bf16* q_heads, int G, int lane, float scale_log2,
                                              float (&qf)[GM][E]) {
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    if (g < G) {
      const Pack<bf16, E> qp = load_pack<bf16, E>(q_heads + int64_t(g) * 32 * E + lane * E);
#pragma unroll
      for (int e = 0; e < E; ++e) qf[g][e] = __bfloat162float(qp.v[e]) * scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) qf[g][e] = 0.0f;
    }
  }
}

// The online softmax of warp `warp` over its groups of cache rows in [start, end): m, l, acc end as
// its running max (of the scaled scores, base 2), sum and unnormalised output per head. kbase / vbase:
// this lane's elements of the kv head in row 0.
template <int E, int GM>
__device__ __forceinline__ void attend_rows(const float (&qf)[GM][E], const bf16* kbase, const bf16* vbase,
                                            int64_t ldc, int start, int end, int warp, int lane,
                                            float (&m)[GM], float (&l)[GM], float (&acc)[GM][E]) {
  constexpr int R = attn_rows_per_group<E, GM>();
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.0f;
  }

  // Warp w takes the groups of R rows starting at start + R (w + kAttnWarps i). Software pipeline:
  // the loads of a warp's next group are issued before it computes on the current one.
  constexpr int kStride = kAttnWarps * R;
  int r0 = start + warp * R;
  Pack<bf16, E> kr[R], vr[R];
  if (r0 < end) load_kv_rows<E, R>(kbase, vbase, ldc, r0, end - 1, kr, vr);
  for (; r0 < end; r0 += kStride) {
    Pack<bf16, E> kn[R], vn[R];
    // past the end: row end - 1, unused
    load_kv_rows<E, R>(kbase, vbase, ldc, r0 + kStride, end - 1, kn, vn);
    // Scores: lane partial dot products of the R x GM (row, head) pairs, summed over the warp and
    // broadcast back (every lane then holds the same scores, so branches on them are uniform).
    float dots[R * GM];
#pragma unroll
    for (int u = 0; u < R; ++u) {
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) d = fmaf(qf[g][e], __bfloat162float(kr[u].v[e]), d);
        dots[u * GM + g] = d;
      }
    }
    const float total = warp_sum_transposed<R * GM>(dots, lane);
    float s[R][GM];
#pragma unroll
    for (int u = 0; u < R; ++u) {
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        const float sc = __shfl_sync(0xffffffffu, total, (u * GM + g) * (32 / (R * GM)));
        s[u][g] = r0 + u < end ? sc : -INFINITY;
      }
    }
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < R; ++u) mx = fmaxf(mx, s[u][g]);  // finite: row r0 is valid
      if (mx > m[g]) {  // rescale only when the running max grows
        const float corr = exp2f(m[g] - mx);  // 0 on the first rows (m = -inf)
        m[g] = mx;
        l[g] *= corr;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] *= corr;
      }
#pragma unroll
      for (int u = 0; u < R; ++u) {
        const float p = exp2f(s[u][g] - m[g]);
        l[g] += p;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = fmaf(p, __bfloat162float(vr[u].v[e]), acc[g][e]);
      }
    }
#pragma unroll
    for (int u = 0; u < R; ++u) {
      kr[u] = kn[u];
      vr[u] = vn[u];
    }
  }
}

// One more row (this lane's elements k, v of it) through a warp's online softmax, as attend_rows
// takes a group of rows: the row's scores for the GM heads, a rescale where the running max grows
// (m = -inf: the first row), then l += p, acc += p v.
template <int E, int GM>
__device__ __forceinline__ void attend_one_row(const float (&qf)[GM][E], const bf16* k, const bf16* v, int lane,
                                               float (&m)[GM], float (&l)[GM], float (&acc)[GM][E]) {
  const Pack<bf16, E> kr = load_pack<bf16, E>(k), vr = load_pack<bf16, E>(v);
  float dots[GM];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    float d = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) d = fmaf(qf[g][e], __bfloat162float(kr.v[e]), d);
    dots[g] = d;
  }
  const float total = warp_sum_transposed<GM>(dots, lane);
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    const float s = __shfl_sync(0xffffffffu, total, g * (32 / GM));
    if (s > m[g]) {
      const float corr = exp2f(m[g] - s);
      m[g] = s;
      l[g] *= corr;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] *= corr;
    }
    const float p = exp2f(s - m[g]);
    l[g] += p;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = fmaf(p, __bfloat162float(vr.v[e]), acc[g][e]);
  }
}

// The warps' (m, l, acc), in shared memory for their merge.
template <int GM, int HD> struct WarpStates {
  float m[kAttnWarps][GM], l[kAttnWarps][GM];
  float acc[kAttnWarps][GM][HD];
};

template <int E, int GM>
__device__ __forceinline__ void store_warp_state(WarpStates<GM, 32 * E>& ws, const float (&m)[GM], const float (&l)[GM],
                                                 const float (&acc)[GM][E], int warp, int lane) {
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    if (lane == 0) {
      ws.m[warp][g] = m[g];
      ws.l[warp][g] = l[g];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) ws.acc[warp][g][lane * E + e] = acc[g][e];
  }
}

// The warps' states merged for head g: M = max_w m_w, L = sum_w l_w f_w and, for element d,
// A = sum_w acc_w f_w, with f_w = 2^(m_w - M). A warp without rows has m = -inf and weight 0; warp 0
// always has row `start`, so M is finite. weigh(g) forms M, L and the f_w once per head; the threads
// then take the head's elements.
template <int GM, int HD> struct WarpMerge {
  const WarpStates<GM, HD>& ws;
  int g = -1;
  float M, L, f[kAttnWarps];

  __device__ __forceinline__ void weigh(int head) {
    g = head;
    M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, ws.m[w][g]);
    L = 0.0f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) {
      f[w] = exp2f(ws.m[w][g] - M);
      L = fmaf(ws.l[w][g], f[w], L);
    }
  }
  __device__ __forceinline__ float acc(int d) const {
    float A = 0.0f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) A = fmaf(ws.acc[w][g][d], f[w], A);
    return A;
  }
};

template <int E, int GM>
__global__ void __launch_bounds__(kAttnWarps * 32)
    attention_kernel(const bf16* __restrict__ q, int64_t ldq, const bf16* __restrict__ k_cache,
                     const bf16* __restrict__ v_cache, int64_t ldc, const bf16* __restrict__ qkv, int64_t ldqkv,
                     const int32_t* __restrict__ positions, float* __restrict__ part_acc,
                     float2* __restrict__ part_ml, bf16* __restrict__ out, int64_t ldo, int Hq, int G, int nsplit,
                     int capacity, float scale_log2) {
  constexpr int HD = 32 * E;
  __shared__ WarpStates<GM, HD> ws;
  pdl_launch_dependents();
  const int split = blockIdx.x, kvh = blockIdx.y, t = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  prefetch_split_rows<HD>(k_cache, v_cache, ldc, positions + t, capacity, nsplit, split, kvh);
  pdl_wait();  // q, the caches and the positions come from earlier kernels
  const int len = positions[t] + 1;
  const int chunk = split_chunk(len, nsplit);
  const int start = split * chunk;
  if (start >= len) return;  // empty split: the combine kernel does not read it
  const int end = min(len, start + chunk);

  float qf[GM][E];
  load_scaled_q<E, GM>(q + int64_t(t) * ldq + int64_t(kvh) * G * HD, G, lane, scale_log2, qf);
  float m[GM], l[GM], acc[GM][E];
  attend_rows<E, GM>(qf, k_cache + int64_t(kvh) * HD + lane * E, v_cache + int64_t(kvh) * HD + lane * E, ldc,
                     start, end, warp, lane, m, l, acc);
  store_warp_state<E, GM>(ws, m, l, acc, warp, lane);
  __syncthreads();
  WarpMerge<GM, HD> merge{ws};
  for (int idx = threadIdx.x; idx < G * HD; idx += blockDim.x) {
    const int g = idx / HD, d = idx % HD, h = kvh * G + g;
    if (g != merge.g) merge.weigh(g);  // warp-uniform (HD is a multiple of 32)
    const float M = merge.M, L = merge.L, A = merge.acc(d);
    if (nsplit == 1) {
      const float gate = __bfloat162float(qkv[int64_t(t) * ldqkv + int64_t(h) * 2 * HD + HD + d]);
      out[int64_t(t) * ldo + int64_t(h) * HD + d] = __float2bfloat16_rn(A / L * sigmoid(gate));
    } else {
      const int64_t slot = (int64_t(t) * Hq + h) * nsplit + split;
      part_acc[slot * HD + d] = A;
      if (d == 0) part_ml[slot] = make_float2(M, L);
    }
  }
}

// Merges the non-empty splits of one (token, q head), kCombineCols columns of it per block:
// out = (sum_s A_s w_s) / (sum_s L_s w_s) * sigmoid(gate), w_s = 2^(m_s - M), M = max_s m_s.
// The block first forms the weights (threads over splits), then sums A_s w_s with threads over
// (group of splits, 4 columns) and 16-byte loads, and finally adds up the groups in shared memory.
// The splits are attention_kernel's (each token's own chunk) or, kVerify, verify_attention_kernel's
// (verify_chunk of the launch's longest length, in multiples of verify_tile rows; gridDim.y = T).
constexpr int kCombineThreads = 256;
constexpr int kCombineCols = 128;
constexpr int kMaxSplits = 1024;

template <bool kVerify>
__global__ void __launch_bounds__(kCombineThreads)
    attention_combine_kernel(const float* __restrict__ part_acc, const float2* __restrict__ part_ml,
                             const int32_t* __restrict__ positions, const bf16* __restrict__ qkv, int64_t ldqkv,
                             bf16* __restrict__ out, int64_t ldo, int Hq, int hd, int nsplit, int verify_tile) {
  __shared__ float w_s[kMaxSplits];
  __shared__ float red[32];
  __shared__ float4 sum_s[kCombineThreads];
  pdl_launch_dependents();
  const int cols = min(hd, kCombineCols), slices = hd / cols;
  const int h = blockIdx.x / slices, col0 = (blockIdx.x % slices) * cols, t = blockIdx.y;
  pdl_wait();  // the partial results come from attention_kernel / verify_attention_kernel
  const int len = positions[t] + 1;
  const int chunk = kVerify ? verify_chunk(verify_length(positions, int(gridDim.y)), nsplit, verify_tile)
                            : split_chunk(len, nsplit);
  const int active = split_count(len, chunk);
  const int d = col0 + threadIdx.x;  // the output column of threads < cols
  const bf16* gate_row = qkv + int64_t(t) * ldqkv + int64_t(h) * 2 * hd + hd;
  const float gate = threadIdx.x < cols ? __bfloat162float(gate_row[d]) : 0.0f;
  const int64_t slot0 = (int64_t(t) * Hq + h) * nsplit;

  float mx = -INFINITY;
  for (int s = threadIdx.x; s < active; s += blockDim.x) mx = fmaxf(mx, part_ml[slot0 + s].x);
  mx = warp_max(mx);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
  __syncthreads();
  float M = -INFINITY;
  for (int w = 0; w < kCombineThreads / 32; ++w) M = fmaxf(M, red[w]);  // finite: split 0 has row 0
  float l = 0.0f;
  for (int s = threadIdx.x; s < active; s += blockDim.x) {
    const float2 ml = part_ml[slot0 + s];
    const float w = exp2f(ml.x - M);
    w_s[s] = w;
    l = fmaf(ml.y, w, l);
  }
  const float L = block_sum(l, red);  // its __syncthreads also publishes w_s

  const int quads = cols / 4, groups = kCombineThreads / quads;
  const int quad = threadIdx.x % quads, group = threadIdx.x / quads;
  const float* src = part_acc + slot0 * hd + col0 + 4 * quad;
  float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
  for (int s = group; s < active; s += groups) {
    const float4 v = *reinterpret_cast<const float4*>(src + int64_t(s) * hd);
    const float w = w_s[s];
    a.x = fmaf(v.x, w, a.x);
    a.y = fmaf(v.y, w, a.y);
    a.z = fmaf(v.z, w, a.z);
    a.w = fmaf(v.w, w, a.w);
  }
  sum_s[threadIdx.x] = a;  // column col0 + c of group g sits at float g * cols + c
  __syncthreads();
  if (threadIdx.x < cols) {
    const float* sums = reinterpret_cast<const float*>(sum_s);
    float A = 0.0f;
    for (int g = 0; g < groups; ++g) A += sums[g * cols + threadIdx.x];
    out[int64_t(t) * ldo + int64_t(h) * hd + d] = __float2bfloat16_rn(A / L * sigmoid(gate));
  }
}

// ---------------------------------------------------------------------------------------------
// attention_decode for one token: attention_prepare, attention_kernel and the combine in one kernel.
//
// Block (split, kv head) as attention_kernel's. Before pdl_wait() it forms the q / k norm scales and
// the RoPE frequencies (as attention_prepare_kernel does) and prefetches its split's rows into L2.
// After it, the block of every non-empty split normalises and rotates the q heads of its group from
// the qkv row itself (the bits attention_prepare stores, BF16), so q never goes through memory. The
// block of the last non-empty split, the one holding the new row pos = positions[0], also forms k and
// v of its kv head, stores them into cache row pos (the row's only writer) and adds that row from
// shared memory after the split's cache rows (no other block reads it: the splits are disjoint).
// The splits are merged inside the kernel. With one non-empty split its block writes out. Otherwise
// each block writes its partial state to the workspace and counts itself in on a counter of
// CudaBackend's attention counters (__threadfence, atomicAdd; the block that completes a count resets
// the counter for the next launch). Up to CudaBackend::attn_merge_group non-empty splits, the last
// block merges them all and writes out. Beyond, the last block of each group of about sqrt(splits)
// consecutive splits merges the group's partials into the group's first slot, and the last of those
// merges the groups and writes out: the block that finishes last then reads about 2 sqrt(splits)
// partials instead of all of them, for one more fence and count. Every merge runs in split order, so
// the result does not depend on which block finishes last.
// ---------------------------------------------------------------------------------------------

// Splits per first-level group of `active` non-empty splits: min_group (CudaBackend::attn_merge_group:
// up to that many, one level) or, for more than its square, the smallest size whose square covers them.
__device__ __forceinline__ int merge_group_size(int active, int min_group) {
  int size = min_group;
  while (size * size < active) ++size;
  return size;
}

// Who merges what: thread i takes q head i / TPH of the group and its Q quads of columns
// 4 (i % TPH + TPH k), k < Q (consecutive quads in consecutive threads). Q is a power of two, so a
// thread's columns lie in one head.
template <int GM, int HD> struct MergeLayout {
  static constexpr int Q = GM * HD > 4 * kAttnWarps * 32 ? GM * HD / (4 * kAttnWarps * 32) : 1;
  static constexpr int TPH = HD / (4 * Q);  // threads per head
};

// Merges the partial states of one q head in slots first + stride s, s < count (head_slots: the
// head's slot 0), in slot order, for the thread's columns: M = max_s m_s, L = sum_s L_s 2^(m_s - M),
// A = sum_s A_s 2^(m_s - M), as one pass that rescales the sums whenever the max grows. The loads of
// kBatch slots go out together (through L2: other blocks of this launch wrote the partials): 256
// bytes of partials per thread, or 4 slots where a thread takes one quad (the small instantiations,
// whose registers the merge would otherwise set).
template <int GM, int HD>
__device__ __forceinline__ void merge_partials(const float* part_acc, const float2* part_ml, int64_t head_slots,
                                               int first, int stride, int count, int quad0, float& M, float& L,
                                               float (&A)[MergeLayout<GM, HD>::Q][4]) {
  using Layout = MergeLayout<GM, HD>;
  constexpr int Q = Layout::Q, kBatch = Q == 1 ? 4 : 16 / Q;
  M = -INFINITY;
  L = 0.0f;
#pragma unroll
  for (int k = 0; k < Q; ++k) A[k][0] = A[k][1] = A[k][2] = A[k][3] = 0.0f;
  for (int s0 = 0; s0 < count; s0 += kBatch) {
    float2 ml[kBatch];
    float4 v[kBatch][Q];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (s0 + b >= count) break;
      const int64_t slot = head_slots + first + int64_t(s0 + b) * stride;
      ml[b] = __ldcg(part_ml + slot);
#pragma unroll
      for (int k = 0; k < Q; ++k)
        v[b][k] = __ldcg(reinterpret_cast<const float4*>(part_acc + slot * HD + 4 * (quad0 + Layout::TPH * k)));
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (s0 + b >= count) break;
      const float m_new = fmaxf(M, ml[b].x);
      const float keep = exp2f(M - m_new), w = exp2f(ml[b].x - m_new);  // keep = 0 for the first slot
      M = m_new;
      L = fmaf(L, keep, ml[b].y * w);
#pragma unroll
      for (int k = 0; k < Q; ++k) {
        A[k][0] = fmaf(A[k][0], keep, v[b][k].x * w);
        A[k][1] = fmaf(A[k][1], keep, v[b][k].y * w);
        A[k][2] = fmaf(A[k][2], keep, v[b][k].z * w);
        A[k][3] = fmaf(A[k][3], keep, v[b][k].w * w);
      }
    }
  }
}

// k_cache / v_cache are read (every row but pos) and k_store / v_store written (row pos only): the
// same caches, disjoint elements. counters: Hkv (nsplit + 1) of them, zero between launches.
template <int E, int GM>
__global__ void __launch_bounds__(kAttnWarps * 32)
    attention_decode_kernel(const bf16* __restrict__ qkv, ParamView q_norm, ParamView k_norm,
                            const int32_t* __restrict__ positions, const int32_t* __restrict__ rope_positions,
                            MropeSection mrope, const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                            bf16* __restrict__ k_store, bf16* __restrict__ v_store, int64_t ldc,
                            float* __restrict__ part_acc, float2* __restrict__ part_ml,
                            uint32_t* __restrict__ counters, bf16* __restrict__ out, int Hq, int Hkv, int G, int rot,
                            float theta, float eps, int nsplit, int min_group, int capacity, float scale_log2) {
  constexpr int HD = 32 * E;
  using Layout = MergeLayout<GM, HD>;
  __shared__ WarpStates<GM, HD> ws;  // before the main loop ws.acc[w][0] is warp w's exchange for the norms
  __shared__ float q_scale[HD], k_scale[HD];  // 1 + the norm weights
  __shared__ float2 rope_cs[HD / 2];          // (cos, sin) of rotation pair f < rot / 2
  __shared__ __align__(16) bf16 q_s[GM][HD];
  __shared__ __align__(16) bf16 k_new[HD];
  __shared__ __align__(16) bf16 v_new[HD];
  pdl_launch_dependents();
  const int split = blockIdx.x, kvh = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = threadIdx.x; i < HD; i += blockDim.x) {
    q_scale[i] = 1.0f + q_norm[i];
    k_scale[i] = 1.0f + k_norm[i];
  }
  const int half = rot / 2, pair = threadIdx.x;  // thread f forms pair f's rotation (rot / 2 <= 128 threads)
  const float inv_freq = pair < half ? rope_inv_freq(pair, rot, theta) : 0.0f;
  const int axis = mrope_axis(pair, mrope);
  prefetch_split_rows<HD>(k_cache, v_cache, ldc, positions, capacity, nsplit, split, kvh);
  pdl_wait();  // qkv, the caches and the positions come from earlier kernels
  const int pos = positions[0], len = pos + 1;
  const int rope_pos = pair < half ? rope_positions[axis] : 0;  // loaded together with pos
  const int chunk = split_chunk(len, nsplit);
  const int start = split * chunk;
  if (start >= len) return;  // empty split: not counted in
  const int end = min(len, start + chunk), active = split_count(len, chunk);
  const bool has_new_row = end == len;
  if (pair < half) rope_cs[pair] = rope_cos_sin(rope_pos, inv_freq);
  __syncthreads();

  // Warp w forms items w, w + kAttnWarps, ...: the group's q heads 0 .. G-1, then (in the split with
  // the new row) k and v of the kv head.
  const bf16* k_src = qkv + int64_t(Hq) * 2 * HD + int64_t(kvh) * HD;
  const bf16* v_src = k_src + int64_t(Hkv) * HD;
  float* x = ws.acc[warp][0];
  for (int item = warp; item < G + int(has_new_row); item += kAttnWarps) {
    const bool is_q = item < G;
    const float* scale = is_q ? q_scale : k_scale;
    rms_norm_head<E>(is_q ? qkv + int64_t(kvh * G + item) * 2 * HD : k_src, HD, eps, lane,
                     [&](int j) { return scale[lane + 32 * j]; }, x);
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const int i = lane + 32 * j;
      const bf16 y = __float2bfloat16_rn(i < rot ? rope_rotate(x, i, half, rope_cs[i < half ? i : i - half]) : x[i]);
      if (is_q) {
        q_s[item][i] = y;
      } else {
        k_new[i] = y;
        v_new[i] = v_src[i];
        k_store[int64_t(pos) * ldc + int64_t(kvh) * HD + i] = y;
        v_store[int64_t(pos) * ldc + int64_t(kvh) * HD + i] = v_src[i];
      }
    }
    __syncwarp();  // x is rewritten for the warp's next item
  }
  __syncthreads();

  float qf[GM][E];
  load_scaled_q<E, GM>(&q_s[0][0], G, lane, scale_log2, qf);
  float m[GM], l[GM], acc[GM][E];
  // The cache rows through the loop attention_kernel runs, then warp 0 adds the new row from shared
  // memory. (Taking that row from shared memory inside the loop puts each row's loads behind a branch:
  // the next group's 8 loads do not go out together, and the step takes 31 instead of 20 us at 8k
  // rows, 95 instead of 47 at 32k on the H200.)
  attend_rows<E, GM>(qf, k_cache + int64_t(kvh) * HD + lane * E, v_cache + int64_t(kvh) * HD + lane * E, ldc, start,
                     has_new_row ? len - 1 : end, warp, lane, m, l, acc);
  if (has_new_row && warp == 0) attend_one_row<E, GM>(qf, k_new + lane * E, v_new + lane * E, lane, m, l, acc);
  store_warp_state<E, GM>(ws, m, l, acc, warp, lane);
  __syncthreads();
  const bf16* gate = qkv + HD;  // q head h's gate: gate + h * 2 HD
  WarpMerge<GM, HD> merge{ws};
  for (int idx = threadIdx.x; idx < G * HD; idx += blockDim.x) {
    const int g = idx / HD, d = idx % HD, h = kvh * G + g;
    if (g != merge.g) merge.weigh(g);  // warp-uniform (HD is a multiple of 32)
    const float M = merge.M, L = merge.L, A = merge.acc(d);
    if (active == 1) {
      out[int64_t(h) * HD + d] = __float2bfloat16_rn(A / L * sigmoid(__bfloat162float(gate[int64_t(h) * 2 * HD + d])));
    } else {
      const int64_t slot = int64_t(h) * nsplit + split;
      __stcg(part_acc + slot * HD + d, A);
      if (d == 0) __stcg(part_ml + slot, make_float2(M, L));
    }
  }
  if (active == 1) return;

  // The merges. This kv head's counters: one per group, then the head's at [nsplit].
  uint32_t* head_counters = counters + int64_t(kvh) * (nsplit + 1);
  const int group_size = merge_group_size(active, min_group), groups = split_count(active, group_size);
  const int first = split / group_size * group_size;
  if (!arrive_last(head_counters + split / group_size, 0, min(group_size, active - first), true)) return;
  const int g = threadIdx.x / Layout::TPH, quad0 = threadIdx.x % Layout::TPH;
  const bool merges = g < G;
  const int h = kvh * G + g;
  const int64_t head_slots = int64_t(h) * nsplit;
  float M = 0.0f, L = 0.0f, A[Layout::Q][4];
  if (groups > 1) {  // this group's partials into its first slot
    if (merges) {
      merge_partials<GM, HD>(part_acc, part_ml, head_slots, first, 1, min(group_size, active - first), quad0, M, L, A);
#pragma unroll
      for (int k = 0; k < Layout::Q; ++k)
        __stcg(reinterpret_cast<float4*>(part_acc + (head_slots + first) * HD + 4 * (quad0 + Layout::TPH * k)),
               make_float4(A[k][0], A[k][1], A[k][2], A[k][3]));
    }
    __syncthreads();  // every merging thread has read the (m, L) of slot `first`
    if (merges && quad0 == 0) __stcg(part_ml + head_slots + first, make_float2(M, L));
    if (!arrive_last(head_counters + nsplit, 0, groups, true)) return;
  }
  if (!merges) return;
  // The groups' first slots (with one group: the splits), then out = A / L * sigmoid(gate).
  merge_partials<GM, HD>(part_acc, part_ml, head_slots, 0, groups > 1 ? group_size : 1, groups > 1 ? groups : active,
                         quad0, M, L, A);
#pragma unroll
  for (int k = 0; k < Layout::Q; ++k) {
    const int d = 4 * (quad0 + Layout::TPH * k);
    const Pack<bf16, 4> gp = load_pack<bf16, 4>(gate + int64_t(h) * 2 * HD + d);
    Pack<bf16, 4> o;
#pragma unroll
    for (int c = 0; c < 4; ++c) o.v[c] = __float2bfloat16_rn(A[k][c] / L * sigmoid(__bfloat162float(gp.v[c])));
    store_pack(out + int64_t(h) * HD + d, o);
  }
}

// Resident blocks per SM of one of the decode kernels (kAttnWarps warps; registers and shared memory
// decide).
template <auto kKernel> int decode_blocks_per_sm() {
  static const int blocks = [] {
    int n = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, kAttnWarps * 32, 0),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor (attention decode kernel)");
    return std::max(n, 1);
  }();
  return blocks;
}

// Splits of a decode launch: one wave of blocks (blocks_per_sm per SM) over the `pairs` (token, kv
// head) pairs, bounded by the cache capacity (kMinChunk-row chunks), the combine kernel's weight
// buffer and the workspace (per_split bytes per split). The lengths are only known on the device: a
// short context leaves the splits past its end empty.
int64_t decode_splits(int64_t pairs, int blocks_per_sm, int sm_count, int64_t capacity, int64_t per_split,
                      size_t workspace_bytes) {
  const int64_t wave = int64_t(blocks_per_sm) * sm_count;
  const int64_t n = std::min({wave / pairs, (capacity + kMinChunk - 1) / kMinChunk, int64_t(kMaxSplits),
                              int64_t(workspace_bytes) / per_split});
  return std::max<int64_t>(n, 1);
}

struct DecodeArgs {
  const bf16 *q, *k_cache, *v_cache, *qkv;
  int64_t ldq, ldc, ldqkv, ldo;
  const int32_t* positions;
  bf16* out;
  int T, Hq, Hkv, hd, G;
  int64_t capacity;  // cache rows
  float scale_log2;
  void* workspace;
  size_t workspace_bytes;
  int sm_count;
};

template <int E, int GM> void launch_attention_decode(const DecodeArgs& a, const LaunchCtx& ctx) {
  int64_t nsplit = 1;  // T > kMaxSplitTokens: one split per (token, kv head)
  if (a.T <= kMaxSplitTokens)
    nsplit = decode_splits(int64_t(a.T) * a.Hkv, decode_blocks_per_sm<attention_kernel<E, GM>>(), a.sm_count,
                           a.capacity, int64_t(a.T) * a.Hq * (a.hd + 2) * int64_t(sizeof(float)), a.workspace_bytes);
  // Workspace: acc [T, Hq, nsplit, hd] floats, then (m, L) [T, Hq, nsplit] float2.
  float* part_acc = static_cast<float*>(a.workspace);
  float2* part_ml = reinterpret_cast<float2*>(part_acc + int64_t(a.T) * a.Hq * nsplit * a.hd);
  const dim3 grid{unsigned(nsplit), unsigned(a.Hkv), unsigned(a.T)};
  launch_pdl(ctx, "attention_kernel", attention_kernel<E, GM>, grid, kAttnWarps * 32, 0, a.q, a.ldq, a.k_cache,
             a.v_cache, a.ldc, a.qkv, a.ldqkv, a.positions, part_acc, part_ml, a.out, a.ldo, a.Hq, a.G, int(nsplit),
             int(std::min<int64_t>(a.capacity, INT_MAX)), a.scale_log2);
  if (nsplit > 1) {
    const int slices = a.hd / std::min(a.hd, kCombineCols);
    launch_pdl(ctx, "attention_combine_kernel", attention_combine_kernel<false>,
               dim3(unsigned(a.Hq * slices), unsigned(a.T)), kCombineThreads, 0, part_acc, part_ml, a.positions, a.qkv,
               a.ldqkv, a.out, a.ldo, a.Hq, a.hd, int(nsplit), 0);
  }
}

struct StepArgs {
  const bf16* qkv;
  ParamView q_norm, k_norm;
  const int32_t *positions, *rope_positions;
  MropeSection mrope;
  bf16 *k_cache, *v_cache;
  int64_t ldc;
  bf16* out;
  int Hq, Hkv, G, rot;
  float theta, eps, scale_log2;
  int64_t capacity;  // cache rows
  void* workspace;
  size_t workspace_bytes;
  uint32_t* counters;  // CudaBackend::kAttnCounters
  int min_group;       // CudaBackend::attn_merge_group
  int sm_count;
};

// attention_decode_kernel: the splits as attention_kernel's for one token (its own occupancy), within
// the counters; the workspace as attention_kernel's for T = 1.
template <int E, int GM> void launch_attention_step(const StepArgs& a, const LaunchCtx& ctx) {
  constexpr int HD = 32 * E;
  int64_t nsplit = decode_splits(a.Hkv, decode_blocks_per_sm<attention_decode_kernel<E, GM>>(), a.sm_count, a.capacity,
                                 int64_t(a.Hq) * (HD + 2) * int64_t(sizeof(float)), a.workspace_bytes);
  nsplit = std::max<int64_t>(std::min<int64_t>(nsplit, CudaBackend::kAttnCounters / a.Hkv - 1), 1);
  float* part_acc = static_cast<float*>(a.workspace);
  float2* part_ml = reinterpret_cast<float2*>(part_acc + int64_t(a.Hq) * nsplit * HD);
  launch_pdl(ctx, "attention_decode_kernel", attention_decode_kernel<E, GM>, dim3(unsigned(nsplit), unsigned(a.Hkv)),
             kAttnWarps * 32, 0, a.qkv, a.q_norm, a.k_norm, a.positions, a.rope_positions, a.mrope,
             static_cast<const bf16*>(a.k_cache), static_cast<const bf16*>(a.v_cache), a.k_cache, a.v_cache, a.ldc,
             part_acc, part_ml, a.counters, a.out, a.Hq, a.Hkv, a.G, a.rot, a.theta, a.eps, int(nsplit), a.min_group,
             int(std::min<int64_t>(a.capacity, INT_MAX)), a.scale_log2);
}

// Calls f(std::integral_constant<int, E>{}, std::integral_constant<int, GM>{}) for the instantiation
// of the decode kernels that takes head_dim hd = 32 E (32, 64, 128; anything else: 256, which the
// callers have checked) and GQA group G: the smallest GM of 1, 2, 4, 8 with G <= GM.
template <class F> void dispatch_decode(int64_t hd, int G, F&& f) {
  auto by_group = [&](auto e) {
    if (G <= 1) f(e, std::integral_constant<int, 1>{});
    else if (G <= 2) f(e, std::integral_constant<int, 2>{});
    else if (G <= 4) f(e, std::integral_constant<int, 4>{});
    else f(e, std::integral_constant<int, 8>{});
  };
  switch (hd) {
    case 32: by_group(std::integral_constant<int, 1>{}); break;
    case 64: by_group(std::integral_constant<int, 2>{}); break;
    case 128: by_group(std::integral_constant<int, 4>{}); break;
    default: by_group(std::integral_constant<int, 8>{}); break;
  }
}

// ---------------------------------------------------------------------------------------------
// flash_attention: tensor-core attention (FlashAttention-2 style) for prefill (causal over the
// cache) and for the vision encoder (bidirectional inside each image).
//
// Every query row t attends to one contiguous key range [lo_t, hi_t]: 0 .. positions[t] (causal), or
// the rows of t's image. Block = kFlashRows (128) query rows of one q head; each warp owns 16 * MT
// consecutive rows (MT = 2 for head_dim <= 128: every K / V fragment read from shared memory feeds two
// m16 tiles; MT = 1 for 256, whose fp32 accumulator is already 128 registers per thread). The block
// walks the union of its rows' key ranges in tiles of kFlashKeys (64) keys; K and V tiles are
// double-buffered in shared memory (cp.async: tile j + 1 loads while tile j is used); Q stays in shared
// memory and its fragments are re-read per tile (for hd 256 they would not fit in registers). Per tile,
// each warp computes
//   S = Q K^T (mma m16n8k16, fp32), masks the keys outside each row's range (only on tiles that cut a
//   range of the warp; tiles outside all of the warp's ranges are skipped),
//   online softmax in base 2: x = scale_log2 * s, m' = max(m, max_j x_j), P = 2^(x - m'),
//   l = l 2^(m - m') + sum_j P_j, O = O 2^(m - m') + P V,
// with P rounded to BF16 in registers and used directly as the A operand of P V: the accumulator
// layout of S over key columns 16k .. 16k+15 is the A-fragment layout of k-step k (mma.cuh).
// Shared-memory rows are hd BF16 = hd / 8 chunks of 16 bytes; chunk c of row r is stored at chunk
// c ^ (r % 8), so the 8 row addresses of every ldmatrix (8 consecutive rows) hit distinct banks.
// Positions are read on the device and may be arbitrary: a block's key range is the union of its rows'
// ranges (consecutive prefill positions give the causal triangle). Keys inside that union but outside
// a row's own range are weighted by exactly 0, so those cache rows must hold finite values: true for a
// sequence, whose rows 0 .. max position have all been written.
// ---------------------------------------------------------------------------------------------
constexpr int kFlashRows = 128;       // query rows per block
constexpr int kFlashKeys = 64;        // keys per K / V tile
constexpr int kFlashMinTokens = 16;   // attention takes the flash kernel above this many tokens

template <int HD> struct FlashConfig {
  static constexpr int MT = HD <= 128 ? 2 : 1;  // m16 tiles per warp
  static constexpr int WARPS = kFlashRows / (16 * MT);
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int MIN_BLOCKS = HD <= 128 ? 2 : 1;  // per SM: 8 or 16 warps (registers)
  static constexpr int SMEM = (kFlashRows + 4 * kFlashKeys) * HD * int(sizeof(bf16));  // Q, 2 K, 2 V tiles
};

struct FlashArgs {
  const bf16* q = nullptr;  // query t, head h: q + t * ldq + h * hd
  int64_t ldq = 0;
  const bf16* k = nullptr;  // key j, kv head g: k + j * ldkv + g * hd (v alike)
  const bf16* v = nullptr;
  int64_t ldkv = 0;
  const bf16* gate = nullptr;  // optional: out *= sigmoid(gate[t * ldg + h * gate_hs + d])
  int64_t ldg = 0;
  int64_t gate_hs = 0;
  bf16* out = nullptr;  // out + t * ldo + h * hd
  int64_t ldo = 0;
  const int32_t* positions = nullptr;  // causal: query t sees keys 0 .. positions[t]
  const int32_t* cu = nullptr;         // without positions: the keys of t's segment, cu[s] <= t < cu[s + 1]
  int segments = 0;
  int T = 0;  // query rows
  int G = 1;  // q head h reads kv head h / G
  float scale_log2 = 0;
};

// Key range [lo, hi] of query row t; empty (lo > hi) past the last row.
__device__ __forceinline__ int2 flash_key_range(const FlashArgs& a, int t) {
  if (t >= a.T) return make_int2(INT_MAX, -1);
  if (a.positions) return make_int2(0, a.positions[t]);
  int lo = 0, hi = a.segments;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    (a.cu[mid] <= t ? lo : hi) = mid;
  }
  return make_int2(a.cu[lo], a.cu[lo + 1] - 1);
}

// Element offset of 16-byte chunk c of row r in a swizzled [rows][HD] BF16 tile.
template <int HD> __device__ __forceinline__ int flash_swz(int r, int c) { return r * HD + ((c ^ (r & 7)) << 3); }

// A [ROWS][HD] tile from the global rows src + r * ld by cp.async; rows r >= valid (>= 1) are
// zero-filled. Thread i copies chunk i % C of rows i / C + STEP * n: STEP is a multiple of 8, so the
// swizzle of its chunks does not depend on n.
template <int HD, int THREADS, int ROWS>
__device__ __forceinline__ void flash_load(bf16* dst, const bf16* src, int64_t ld, int valid) {
  constexpr int C = HD / 8, STEP = THREADS / C;
  static_assert(STEP % 8 == 0 && ROWS % STEP == 0, "flash_load: tile shape");
  const int r = threadIdx.x / C, c = threadIdx.x % C;
  bf16* d = dst + flash_swz<HD>(r, c);
  const bf16* s = src + int64_t(r) * ld + c * 8;
#pragma unroll
  for (int n = 0; n < ROWS / STEP; ++n) {
    const bool ok = r + n * STEP < valid;
    cp_async16(d + n * STEP * HD, ok ? s + n * STEP * ld : src, ok ? 16 : 0);
  }
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <int HD>
__global__ void __launch_bounds__(FlashConfig<HD>::THREADS, FlashConfig<HD>::MIN_BLOCKS)
    flash_attention_kernel(const FlashArgs a) {
  using Cfg = FlashConfig<HD>;
  constexpr int MT = Cfg::MT, THREADS = Cfg::THREADS;
  constexpr int NT = HD / 8;             // 8-column tiles of an output row
  constexpr int KT = kFlashKeys / 16;    // k16 steps of P V
  constexpr int TILE = kFlashKeys * HD;  // elements of one K or V tile
  extern __shared__ __align__(128) unsigned char flash_smem[];
  __shared__ int2 range_s[kFlashRows];              // key range of each query row of the block
  bf16* q_s = reinterpret_cast<bf16*>(flash_smem);  // [kFlashRows][HD]
  bf16* k_s = q_s + kFlashRows * HD;                // [2][kFlashKeys][HD]
  bf16* v_s = k_s + 2 * TILE;                       // [2][kFlashKeys][HD]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int h = blockIdx.x;
  const int q0 = int(gridDim.y - 1 - blockIdx.y) * kFlashRows;  // the latest (longest) query tiles start first

  flash_load<HD, THREADS, kFlashRows>(q_s, a.q + int64_t(q0) * a.ldq + int64_t(h) * HD, a.ldq, a.T - q0);
  for (int r = threadIdx.x; r < kFlashRows; r += THREADS) range_s[r] = flash_key_range(a, q0 + r);
  __syncthreads();
  // The block's keys [kv_begin, kv_end]; the warp's rows (16 MT from wrow0) all see [lo_max, hi_min]
  // and together see [lo_min, hi_max].
  int kv_begin = INT_MAX, kv_end = -1;
#pragma unroll
  for (int r = lane; r < kFlashRows; r += 32) {
    kv_begin = min(kv_begin, range_s[r].x);
    kv_end = max(kv_end, range_s[r].y);
  }
  kv_begin = __reduce_min_sync(~0u, kv_begin);
  kv_end = __reduce_max_sync(~0u, kv_end);
  const int tiles = kv_end >= kv_begin ? (kv_end - kv_begin) / kFlashKeys + 1 : 0;
  const int wrow0 = warp * 16 * MT;
  const int2 own = range_s[wrow0 + lane % (16 * MT)];
  const int lo_min = __reduce_min_sync(~0u, own.x), lo_max = __reduce_max_sync(~0u, own.x);
  const int hi_min = __reduce_min_sync(~0u, own.y), hi_max = __reduce_max_sync(~0u, own.y);

  const bf16* k_g = a.k + int64_t(h / a.G) * HD;  // this q head's kv head
  const bf16* v_g = a.v + int64_t(h / a.G) * HD;
  auto load_kv = [&](int j) {  // tile j into buffer j % 2
    const int kv0 = kv_begin + j * kFlashKeys;
    flash_load<HD, THREADS, kFlashKeys>(k_s + (j & 1) * TILE, k_g + int64_t(kv0) * a.ldkv, a.ldkv, kv_end - kv0 + 1);
    flash_load<HD, THREADS, kFlashKeys>(v_s + (j & 1) * TILE, v_g + int64_t(kv0) * a.ldkv, a.ldkv, kv_end - kv0 + 1);
  };
  if (tiles > 0) load_kv(0);
  cp_async_commit();  // Q and tile 0

  // ldmatrix row addresses of this lane (fragment layouts in mma.cuh):
  // Q, A operand of m-tile mt at k-step kk: row 16 mt + lane % 16 of the warp's, chunk 2 kk + lane / 16;
  // K, B operands of keys 16 np .. 16 np + 15: key lane % 8 + 8 (lane / 16), chunk 2 kk + (lane / 8) % 2;
  // V (.trans), B operands of head dims 16 dp .. at k-step kt: key 16 kt + lane % 8 + 8 ((lane / 8) % 2),
  //   chunk 2 dp + lane / 16.
  const uint32_t q_addr = uint32_t(__cvta_generic_to_shared(q_s));
  const uint32_t k_addr = uint32_t(__cvta_generic_to_shared(k_s));
  const uint32_t v_addr = uint32_t(__cvta_generic_to_shared(v_s));
  const int q_row = wrow0 + (lane & 15), q_chunk = lane >> 4;
  const int k_row = (lane & 7) + ((lane >> 4) << 3), k_chunk = (lane >> 3) & 1;
  const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_chunk = lane >> 4;

  float o[MT][NT][4];
  float m[MT][2], l[MT][2];  // running max (of x) and this thread's partial sum, per row
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < NT; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.0f;
  }

  for (int j = 0; j < tiles; ++j) {
    cp_async_wait<0>();
    __syncthreads();  // tile j (and Q) visible to every warp; all are done with tile j - 1's buffers
    if (j + 1 < tiles) load_kv(j + 1);
    cp_async_commit();
    const int kv0 = kv_begin + j * kFlashKeys;
    if (kv0 > hi_max || kv0 + kFlashKeys - 1 < lo_min) continue;  // no key of this tile for the warp's rows
    const uint32_t kb = k_addr + (j & 1) * TILE * 2, vb = v_addr + (j & 1) * TILE * 2;

    // S = Q K^T: s[mt][n] covers keys kv0 + 8n .. 8n + 7.
    float s[MT][2 * KT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < 2 * KT; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t qf[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldmatrix_x4(qf[mt], q_addr + 2 * flash_swz<HD>(q_row + 16 * mt, 2 * kk + q_chunk));
#pragma unroll
      for (int np = 0; np < KT; ++np) {
        uint32_t kf[4];
        ldmatrix_x4(kf, kb + 2 * flash_swz<HD>(16 * np + k_row, 2 * kk + k_chunk));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816(s[mt][2 * np], qf[mt][0], qf[mt][1], qf[mt][2], qf[mt][3], kf[0], kf[1]);
          mma_16816(s[mt][2 * np + 1], qf[mt][0], qf[mt][1], qf[mt][2], qf[mt][3], kf[2], kf[3]);
        }
      }
    }
    if (!(kv0 >= lo_max && kv0 + kFlashKeys - 1 <= hi_min)) {  // the tile cuts some row's range
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < 2 * KT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = kv0 + 8 * n + 2 * (lane & 3) + (e & 1);
            const int2 r = range_s[wrow0 + 16 * mt + 8 * (e >> 1) + (lane >> 2)];
            if (key < r.x || key > r.y) s[mt][n][e] = -INFINITY;
          }
    }

    // Online softmax; the 4 lanes of a quad share a row. P goes to pf as the A fragments of P V.
    uint32_t pf[MT][KT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float base[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < 2 * KT; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * i], s[mt][n][2 * i + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, 2));
        const float m_new = fmaxf(m[mt][i], mx * a.scale_log2);
        base[i] = m_new == -INFINITY ? 0.0f : m_new;  // no key for this row yet: 2^(x - base) = 0, not NaN
        const float corr = exp2f(m[mt][i] - base[i]);
        m[mt][i] = m_new;
        l[mt][i] *= corr;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          o[mt][n][2 * i] *= corr;
          o[mt][n][2 * i + 1] *= corr;
        }
      }
#pragma unroll
      for (int n = 0; n < 2 * KT; ++n) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) p[e] = exp2f(fmaf(s[mt][n][e], a.scale_log2, -base[e >> 1]));
        l[mt][0] += p[0] + p[1];
        l[mt][1] += p[2] + p[3];
        pf[mt][n / 2][2 * (n % 2)] = pack_bf16x2(p[0], p[1]);
        pf[mt][n / 2][2 * (n % 2) + 1] = pack_bf16x2(p[2], p[3]);
      }
    }

    // O += P V: o[mt][n] covers head dims 8n .. 8n + 7.
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        uint32_t vf[4];
        ldmatrix_x4_trans(vf, vb + 2 * flash_swz<HD>(16 * kt + v_row, 2 * dp + v_chunk));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816(o[mt][2 * dp], pf[mt][kt][0], pf[mt][kt][1], pf[mt][kt][2], pf[mt][kt][3], vf[0], vf[1]);
          mma_16816(o[mt][2 * dp + 1], pf[mt][kt][0], pf[mt][kt][1], pf[mt][kt][2], pf[mt][kt][3], vf[2], vf[3]);
        }
      }
  }

  // out = O / l (* sigmoid(gate)); this thread holds head dims 8n + 2 (lane % 4), +1 of its rows.
  const int d0 = 2 * (lane & 3);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float sum = l[mt][i];
      sum += __shfl_xor_sync(~0u, sum, 1);
      sum += __shfl_xor_sync(~0u, sum, 2);
      const int t = q0 + wrow0 + 16 * mt + 8 * i + (lane >> 2);
      if (t >= a.T) continue;
      const float inv = 1.0f / sum;
      bf16* dst = a.out + int64_t(t) * a.ldo + int64_t(h) * HD + d0;
      const bf16* gate = a.gate ? a.gate + int64_t(t) * a.ldg + int64_t(h) * a.gate_hs + d0 : nullptr;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        float x0 = o[mt][n][2 * i] * inv, x1 = o[mt][n][2 * i + 1] * inv;
        if (gate) {
          const float2 gv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(gate + 8 * n));
          x0 *= sigmoid(gv.x);
          x1 *= sigmoid(gv.y);
        }
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * n) = __floats2bfloat162_rn(x0, x1);
      }
    }
}

template <int HD> void launch_flash(const FlashArgs& a, int heads, cudaStream_t stream) {
  using Cfg = FlashConfig<HD>;
  // Once per instantiation (thread-safe static initialisation); allowed during graph capture.
  static const cudaError_t attr =
      cudaFuncSetAttribute(flash_attention_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SMEM);
  check_cuda(attr, "cudaFuncSetAttribute (flash_attention_kernel)");
  const dim3 grid(unsigned(heads), unsigned((a.T + kFlashRows - 1) / kFlashRows));
  flash_attention_kernel<HD><<<grid, Cfg::THREADS, Cfg::SMEM, stream>>>(a);
  check_launch("flash_attention_kernel");
}

// hd 64, 128 or 256.
void launch_flash_hd(int hd, const FlashArgs& a, int heads, cudaStream_t stream) {
  switch (hd) {
    case 64: launch_flash<64>(a, heads, stream); break;
    case 128: launch_flash<128>(a, heads, stream); break;
    default: launch_flash<256>(a, heads, stream); break;
  }
}

// Whether views with these base pointers and row strides (elements) keep every row 16-byte aligned,
// as the flash kernel's loads need.
bool flash_aligned(std::initializer_list<std::pair<const void*, int64_t>> views) {
  for (const auto& [p, ld] : views)
    if (!aligned16(p) || ld % 8 != 0) return false;
  return true;
}

// ---------------------------------------------------------------------------------------------
// verify_attention: attention for a speculative verify block (2..16 tokens over a long cache;
// head_dim 64 / 128 / 256, 16-byte aligned rows) on tensor cores.
//
// Flash-decoding with the flash kernel's tile math. Block (split, kv head) covers cache rows
// [split * chunk, min((split + 1) * chunk, len)) for all M = T G query rows of its kv head (query row
// r: token r / G, q head kvh G + r % G), so every K / V row is read from memory once per kv head, not
// once per token. len = max_t positions[t] + 1 and chunk = verify_chunk (a multiple of the K / V tile)
// are formed on the device from the positions, so a captured graph stays valid as the context grows;
// splits at or past len exit at once. The number of splits is a launch constant: one wave of blocks
// (the kernel's occupancy) over the kv heads, bounded by the cache capacity in tiles, the combine
// kernel's weight buffer and the workspace.
//
// The query rows, padded with zero rows to ROWS (64 or 128), sit in shared memory, a warp per 16 of
// them (a warp whose rows are all padding only helps with the copies). K and V tiles of KEYS rows go
// through a ring of STAGES buffers filled by cp.async (tiles j + 1 .. j + STAGES - 1 load while tile j
// is used). Per tile each warp computes S = Q K^T, masks the keys past each row's position (row r sees
// cache rows 0 .. positions[r / G]; only on tiles that cut some row's range of the warp; tiles past all
// of its rows' ranges are skipped), and runs the online softmax and O += P V as flash_attention_kernel
// does (base 2, P rounded to BF16 as the A operand of P V). With one split the block writes
// out = O / l * sigmoid(gate); otherwise the rows of every token that has cache rows in the split write
// (m, l) and the unnormalised O to attention_kernel's workspace layout, and attention_combine_kernel
// <true> merges each token's non-empty splits. Keys of a split past a row's own position are weighted by
// exactly 0, so cache rows below len must hold finite values (true for a sequence: rows 0 .. the
// largest position have all been written). Shared-memory rows are swizzled as flash_swz lays them out.
// ---------------------------------------------------------------------------------------------
constexpr int kVerifyMinTokens = 2;  // one token keeps attention_kernel (and attention_decode's one-kernel step)

template <int HD, int ROWS> struct VerifyConfig {
  static constexpr int WARPS = ROWS / 16;            // a warp per 16 query rows
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int KEYS = HD == 256 ? 32 : 64;  // keys per K / V tile (32 KB of K and V; 16 KB for hd 64)
  static constexpr int STAGES = 4;                   // tiles in the cp.async ring
  static constexpr int TILE = KEYS * HD;             // elements of one K or V tile
  static constexpr int SMEM = (ROWS * HD + 2 * STAGES * TILE) * int(sizeof(bf16));  // Q, the K and V rings
};

struct VerifyArgs {
  const bf16* q;  // token t, q head h: q + t * ldq + h * HD
  int64_t ldq;
  const bf16 *k, *v;  // cache row j, kv head g: k + j * ldc + g * HD (v alike)
  int64_t ldc;
  const bf16* qkv;  // the gate of (t, h): qkv + t * ldqkv + h * 2 HD + HD
  int64_t ldqkv;
  bf16* out;  // out + t * ldo + h * HD
  int64_t ldo;
  const int32_t* positions;
  float* part_acc;  // [T, Hq, nsplit, HD]
  float2* part_ml;  // [T, Hq, nsplit]
  int T, Hq, G, nsplit, capacity;
  float scale_log2;
};

template <int HD, int ROWS>
__global__ void __launch_bounds__(VerifyConfig<HD, ROWS>::THREADS, 1) verify_attention_kernel(const VerifyArgs a) {
  using Cfg = VerifyConfig<HD, ROWS>;
  constexpr int THREADS = Cfg::THREADS, KEYS = Cfg::KEYS, STAGES = Cfg::STAGES, TILE = Cfg::TILE;
  constexpr int C = HD / 8;         // 16-byte chunks of a row
  constexpr int STEP = THREADS / C;  // rows the block copies per pass
  constexpr int NT = HD / 8;        // 8-column tiles of an output row
  constexpr int KT = KEYS / 16;     // k16 steps of P V
  static_assert(THREADS % C == 0 && ROWS % STEP == 0 && KEYS % STEP == 0, "verify_attention: copy shape");
  extern __shared__ __align__(128) unsigned char verify_smem[];
  __shared__ int limit_s[ROWS];                        // the last cache row query row r sees; -1: padding
  bf16* q_s = reinterpret_cast<bf16*>(verify_smem);  // [ROWS][HD]
  bf16* k_s = q_s + ROWS * HD;                        // [STAGES][KEYS][HD]
  bf16* v_s = k_s + STAGES * TILE;                    // [STAGES][KEYS][HD]
  pdl_launch_dependents();
  const int split = blockIdx.x, kvh = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int M = a.T * a.G;
  {  // L2 prefetch of a short split before the positions are final (as prefetch_split_rows)
    int hint = 1;
    for (int t = 0; t < a.T; ++t) hint = max(hint, load_hint(a.positions + t) + 1);
    const int len = min(hint, a.capacity), chunk = verify_chunk(len, a.nsplit, KEYS), start = split * chunk;
    if (chunk <= kAttnPrefetchRows) prefetch_kv_rows<HD>(a.k, a.v, a.ldc, kvh, start, min(len - start, chunk));
  }
  pdl_wait();  // q, the caches and the positions come from earlier kernels
  const int len = verify_length(a.positions, a.T);
  const int chunk = verify_chunk(len, a.nsplit, KEYS), start = split * chunk;
  if (start >= len) return;  // empty split: the combine kernel does not read it
  const int end = min(len, start + chunk), tiles = (end - start + KEYS - 1) / KEYS;

  for (int r = threadIdx.x; r < ROWS; r += THREADS) limit_s[r] = r < M ? a.positions[r / a.G] : -1;
  // Copies: thread i takes chunk i % C of rows i / C + STEP n. Q rows past M are zero-filled.
  const int c = threadIdx.x % C, r0 = threadIdx.x / C;
#pragma unroll
  for (int n = 0; n < ROWS / STEP; ++n) {
    const int r = r0 + n * STEP;
    const bool ok = r < M;
    const int64_t off = ok ? int64_t(r / a.G) * a.ldq + int64_t(kvh * a.G + r % a.G) * HD + c * 8 : 0;
    cp_async16(q_s + flash_swz<HD>(r, c), a.q + off, ok ? 16 : 0);
  }
  const bf16* k_g = a.k + int64_t(kvh) * HD;
  const bf16* v_g = a.v + int64_t(kvh) * HD;
  // Tile j (cache rows start + KEYS j ..) into ring slot j % STAGES; rows past end zero-filled.
  auto load_tile = [&](int j) {
    const int kv0 = start + j * KEYS;
    bf16* kd = k_s + (j % STAGES) * TILE;
    bf16* vd = v_s + (j % STAGES) * TILE;
#pragma unroll
    for (int n = 0; n < KEYS / STEP; ++n) {
      const int r = r0 + n * STEP;
      const bool ok = kv0 + r < end;
      const int64_t off = ok ? int64_t(kv0 + r) * a.ldc + c * 8 : 0;
      cp_async16(kd + flash_swz<HD>(r, c), k_g + off, ok ? 16 : 0);
      cp_async16(vd + flash_swz<HD>(r, c), v_g + off, ok ? 16 : 0);
    }
  };
  load_tile(0);
  cp_async_commit();  // group 0: Q and tile 0; group j: tile j
#pragma unroll
  for (int j = 1; j < STAGES - 1; ++j) {
    if (j < tiles) load_tile(j);
    cp_async_commit();
  }
  __syncthreads();  // limit_s

  // The warp's rows 16 warp .. + 15: the real ones (< M) all see [0, hi_min] and together [0, hi_max]
  // (hi_max = -1: only padding rows, the warp skips every tile).
  const int wrow0 = warp * 16, own = wrow0 + (lane & 15);
  const int hi_min = __reduce_min_sync(~0u, own < M ? limit_s[own] : INT_MAX);
  const int hi_max = __reduce_max_sync(~0u, own < M ? limit_s[own] : -1);

  // ldmatrix row addresses of this lane, as in flash_attention_kernel (fragment layouts in mma.cuh).
  const uint32_t q_addr = uint32_t(__cvta_generic_to_shared(q_s));
  const uint32_t k_addr = uint32_t(__cvta_generic_to_shared(k_s));
  const uint32_t v_addr = uint32_t(__cvta_generic_to_shared(v_s));
  const int q_row = wrow0 + (lane & 15), q_chunk = lane >> 4;
  const int k_row = (lane & 7) + ((lane >> 4) << 3), k_chunk = (lane >> 3) & 1;
  const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_chunk = lane >> 4;

  float o[NT][4];
  // Per row: the running max (of x) and this thread's partial sum.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
  for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

  for (int j = 0; j < tiles; ++j) {
    cp_async_wait<STAGES - 2>();  // this thread's copies of tile j (and Q) have landed
    __syncthreads();  // everyone's have; every warp is done with tile j - 1, whose slot the next copy takes
    if (j + STAGES - 1 < tiles) load_tile(j + STAGES - 1);
    cp_async_commit();
    const int kv0 = start + j * KEYS;
    if (kv0 > hi_max) continue;  // no key of this tile for the warp's rows
    const uint32_t slot_bytes = uint32_t(j % STAGES) * TILE * 2;
    const uint32_t kb = k_addr + slot_bytes, vb = v_addr + slot_bytes;

    // S = Q K^T: s[n] covers keys kv0 + 8n .. 8n + 7.
    float s[2 * KT][4];
#pragma unroll
    for (int n = 0; n < 2 * KT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t qf[4];
      ldmatrix_x4(qf, q_addr + 2 * flash_swz<HD>(q_row, 2 * kk + q_chunk));
#pragma unroll
      for (int np = 0; np < KT; ++np) {
        uint32_t kf[4];
        ldmatrix_x4(kf, kb + 2 * flash_swz<HD>(16 * np + k_row, 2 * kk + k_chunk));
        mma_16816(s[2 * np], qf[0], qf[1], qf[2], qf[3], kf[0], kf[1]);
        mma_16816(s[2 * np + 1], qf[0], qf[1], qf[2], qf[3], kf[2], kf[3]);
      }
    }
    if (kv0 + KEYS - 1 > hi_min) {  // the tile cuts some row's range (or runs past len)
#pragma unroll
      for (int n = 0; n < 2 * KT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = kv0 + 8 * n + 2 * (lane & 3) + (e & 1);
          if (key > limit_s[wrow0 + 8 * (e >> 1) + (lane >> 2)]) s[n][e] = -INFINITY;
        }
    }

    // Online softmax; the 4 lanes of a quad share a row. P goes to pf as the A fragments of P V.
    float base[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 2 * KT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * i], s[n][2 * i + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, 2));
      const float m_new = fmaxf(m[i], mx * a.scale_log2);
      base[i] = m_new == -INFINITY ? 0.0f : m_new;  // no key for this row yet: 2^(x - base) = 0, not NaN
      const float corr = exp2f(m[i] - base[i]);
      m[i] = m_new;
      l[i] *= corr;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        o[n][2 * i] *= corr;
        o[n][2 * i + 1] *= corr;
      }
    }
    uint32_t pf[KT][4];
#pragma unroll
    for (int n = 0; n < 2 * KT; ++n) {
      float p[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) p[e] = exp2f(fmaf(s[n][e], a.scale_log2, -base[e >> 1]));
      l[0] += p[0] + p[1];
      l[1] += p[2] + p[3];
      pf[n / 2][2 * (n % 2)] = pack_bf16x2(p[0], p[1]);
      pf[n / 2][2 * (n % 2) + 1] = pack_bf16x2(p[2], p[3]);
    }

    // O += P V: o[n] covers head dims 8n .. 8n + 7.
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        uint32_t vf[4];
        ldmatrix_x4_trans(vf, vb + 2 * flash_swz<HD>(16 * kt + v_row, 2 * dp + v_chunk));
        mma_16816(o[2 * dp], pf[kt][0], pf[kt][1], pf[kt][2], pf[kt][3], vf[0], vf[1]);
        mma_16816(o[2 * dp + 1], pf[kt][0], pf[kt][1], pf[kt][2], pf[kt][3], vf[2], vf[3]);
      }
  }

  // This thread holds head dims 8n + 2 (lane % 4), +1 of rows wrow0 + lane / 4 (i = 0) and + 8 (i = 1).
  const int d0 = 2 * (lane & 3);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float sum = l[i];
    sum += __shfl_xor_sync(~0u, sum, 1);
    sum += __shfl_xor_sync(~0u, sum, 2);
    const int r = wrow0 + 8 * i + (lane >> 2);
    if (r >= M || limit_s[r] < start) continue;  // padding, or a token without rows in this split
    const int t = r / a.G, h = kvh * a.G + r % a.G;
    if (a.nsplit == 1) {
      const float inv = 1.0f / sum;
      const bf16* gate = a.qkv + int64_t(t) * a.ldqkv + int64_t(h) * 2 * HD + HD + d0;
      bf16* dst = a.out + int64_t(t) * a.ldo + int64_t(h) * HD + d0;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const float2 gv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(gate + 8 * n));
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * n) =
            __floats2bfloat162_rn(o[n][2 * i] * inv * sigmoid(gv.x), o[n][2 * i + 1] * inv * sigmoid(gv.y));
      }
    } else {
      const int64_t slot = (int64_t(t) * a.Hq + h) * a.nsplit + split;
      float* dst = a.part_acc + slot * HD + d0;
#pragma unroll
      for (int n = 0; n < NT; ++n) *reinterpret_cast<float2*>(dst + 8 * n) = make_float2(o[n][2 * i], o[n][2 * i + 1]);
      if ((lane & 3) == 0) a.part_ml[slot] = make_float2(m[i], sum);
    }
  }
}

// Resident blocks per SM of verify_attention_kernel<HD, ROWS> (its shared memory decides); the first
// call also allows the kernel its dynamic shared memory (allowed during graph capture).
template <int HD, int ROWS> int verify_blocks_per_sm() {
  using Cfg = VerifyConfig<HD, ROWS>;
  static const int blocks = [] {
    check_cuda(cudaFuncSetAttribute(verify_attention_kernel<HD, ROWS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    Cfg::SMEM),
               "cudaFuncSetAttribute (verify_attention_kernel)");
    int n = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, verify_attention_kernel<HD, ROWS>, Cfg::THREADS,
                                                             Cfg::SMEM),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor (verify_attention_kernel)");
    return std::max(n, 1);
  }();
  return blocks;
}

// verify_attention_kernel, then (with more than one split) the combine; the workspace as
// launch_attention_decode's.
template <int HD, int ROWS> void launch_verify_attention(const DecodeArgs& d, const LaunchCtx& ctx) {
  using Cfg = VerifyConfig<HD, ROWS>;
  const int64_t wave = int64_t(verify_blocks_per_sm<HD, ROWS>()) * d.sm_count;
  const int64_t per_split = int64_t(d.T) * d.Hq * (HD + 2) * int64_t(sizeof(float));
  const int64_t nsplit = std::max<int64_t>(1, std::min({wave / d.Hkv, (d.capacity + Cfg::KEYS - 1) / Cfg::KEYS,
                                                         int64_t(kMaxSplits), int64_t(d.workspace_bytes) / per_split}));
  VerifyArgs a;
  a.q = d.q;
  a.ldq = d.ldq;
  a.k = d.k_cache;
  a.v = d.v_cache;
  a.ldc = d.ldc;
  a.qkv = d.qkv;
  a.ldqkv = d.ldqkv;
  a.out = d.out;
  a.ldo = d.ldo;
  a.positions = d.positions;
  a.part_acc = static_cast<float*>(d.workspace);
  a.part_ml = reinterpret_cast<float2*>(a.part_acc + int64_t(d.T) * d.Hq * nsplit * HD);
  a.T = d.T;
  a.Hq = d.Hq;
  a.G = d.G;
  a.nsplit = int(nsplit);
  a.capacity = int(std::min<int64_t>(d.capacity, INT_MAX));
  a.scale_log2 = d.scale_log2;
  launch_pdl(ctx, "verify_attention_kernel", verify_attention_kernel<HD, ROWS>, dim3(unsigned(nsplit), unsigned(d.Hkv)),
             Cfg::THREADS, Cfg::SMEM, a);
  if (nsplit > 1) {
    const int slices = HD / std::min(HD, kCombineCols);
    launch_pdl(ctx, "attention_combine_kernel", attention_combine_kernel<true>,
               dim3(unsigned(d.Hq * slices), unsigned(d.T)), kCombineThreads, 0, static_cast<const float*>(a.part_acc),
               static_cast<const float2*>(a.part_ml), d.positions, d.qkv, d.ldqkv, d.out, d.ldo, d.Hq, HD, a.nsplit,
               Cfg::KEYS);
  }
}

// Calls f(std::integral_constant<int, HD>{}, std::integral_constant<int, ROWS>{}) for the instantiation
// of verify_attention_kernel that takes head_dim hd (64, 128; anything else: 256, which the caller
// has checked) and `rows` = T G <= 128 query rows.
template <class F> void dispatch_verify(int64_t hd, int64_t rows, F&& f) {
  auto by_rows = [&](auto h) {
    if (rows <= 64) f(h, std::integral_constant<int, 64>{});
    else f(h, std::integral_constant<int, 128>{});
  };
  switch (hd) {
    case 64: by_rows(std::integral_constant<int, 64>{}); break;
    case 128: by_rows(std::integral_constant<int, 128>{}); break;
    default: by_rows(std::integral_constant<int, 256>{}); break;
  }
}

}  // namespace
}  // namespace cuda

namespace cuda {
namespace {

// The arguments attention_prepare and attention_decode share, checked; returns the norm weights' views.
std::pair<ParamView, ParamView> check_prepare_args(const char* op, const Tensor& qkv, const Tensor& q_norm,
                                                   const Tensor& k_norm, const Tensor& positions,
                                                   const Tensor& rope_positions, const AttentionParams& p,
                                                   const Tensor& k_cache, const Tensor& v_cache) {
  require_tensor(qkv, DType::BF16, op, "qkv");
  require_tensor(k_cache, DType::BF16, op, "k_cache");
  require_tensor(v_cache, DType::BF16, op, "v_cache");
  require_tensor(positions, DType::I32, op, "positions");
  require_tensor(rope_positions, DType::I32, op, "rope_positions");
  const ParamView qn = param_view(q_norm, op, "q_norm"), kn = param_view(k_norm, op, "k_norm");
  const int64_t T = qkv.dim(0), Hq = p.num_q_heads, Hkv = p.num_kv_heads, hd = p.head_dim;
  OCRIA_RT_REQUIRE(hd > 0 && hd <= 256, op, "head_dim " + std::to_string(hd) + " unsupported (at most 256)");
  OCRIA_RT_REQUIRE(p.rotary_dim >= 0 && p.rotary_dim <= hd && p.rotary_dim % 2 == 0, op, "bad rotary_dim");
  OCRIA_RT_REQUIRE(qkv.ndim == 2 && qkv.dim(1) == (2 * Hq + 2 * Hkv) * hd, op, "qkv " + qkv.shape_str());
  OCRIA_RT_REQUIRE(k_cache.ndim >= 2 && k_cache.row_size() == Hkv * hd && v_cache.row_size() == Hkv * hd &&
              k_cache.row_stride == v_cache.row_stride && k_cache.dim(0) == v_cache.dim(0),
          op, "k_cache " + k_cache.shape_str() + " / v_cache " + v_cache.shape_str() + " vs Hkv * head_dim");
  OCRIA_RT_REQUIRE(positions.numel() == T, op, "positions must have T elements");
  OCRIA_RT_REQUIRE(rope_positions.numel() == 3 * T && (rope_positions.ndim == 1 || rope_positions.dim(-1) == 3), op,
          "rope_positions " + rope_positions.shape_str() + ", expected [T, 3]");
  OCRIA_RT_REQUIRE(q_norm.numel() == hd && k_norm.numel() == hd, op, "q_norm / k_norm must have head_dim elements");
  return {qn, kn};
}

}  // namespace
}  // namespace cuda

void CudaBackend::attention_prepare(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm,
                                    const Tensor& positions, const Tensor& rope_positions, const AttentionParams& p,
                                    const Tensor& q_out, const Tensor& k_cache, const Tensor& v_cache) {
  using namespace cuda;
  const char* op = "attention_prepare";
  const auto [qn, kn] = check_prepare_args(op, qkv, q_norm, k_norm, positions, rope_positions, p, k_cache, v_cache);
  require_tensor(q_out, DType::BF16, op, "q_out");
  const int64_t T = qkv.dim(0), Hq = p.num_q_heads, Hkv = p.num_kv_heads, hd = p.head_dim;
  OCRIA_RT_REQUIRE(q_out.numel() == T * Hq * hd && q_out.dim(0) == T, op, "q_out " + q_out.shape_str());
  if (T == 0) return;
  activate();
  const int64_t items = T * (Hq + Hkv);
  const unsigned blocks = unsigned((items + kPrepWarps - 1) / kPrepWarps);
  launch_pdl(launch_ctx(), "attention_prepare_kernel", attention_prepare_kernel<bf16>, blocks, kPrepWarps * 32, 0,
             qkv.ptr<const bf16>(), qkv.row_stride, qn, kn, positions.ptr<const int32_t>(),
             rope_positions.ptr<const int32_t>(), rope_positions.ndim == 2 ? rope_positions.row_stride : 3,
             MropeSection{{p.mrope_section[0], p.mrope_section[1], p.mrope_section[2]}}, q_out.ptr<bf16>(),
             q_out.row_stride, k_cache.ptr<bf16>(), v_cache.ptr<bf16>(), k_cache.row_stride, int(T), int(Hq), int(Hkv),
             int(hd), int(p.rotary_dim), p.rope_theta, p.norm_eps);
}

void CudaBackend::attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& qkv,
                            const Tensor& positions, const AttentionParams& p, const Tensor& out) {
  using namespace cuda;
  const char* op = "attention";
  require_tensor(q, DType::BF16, op, "q");
  require_tensor(k_cache, DType::BF16, op, "k_cache");
  require_tensor(v_cache, DType::BF16, op, "v_cache");
  require_tensor(qkv, DType::BF16, op, "qkv");
  require_tensor(out, DType::BF16, op, "out");
  require_tensor(positions, DType::I32, op, "positions");
  const int64_t T = q.dim(0), Hq = p.num_q_heads, Hkv = p.num_kv_heads, hd = p.head_dim;
  OCRIA_RT_REQUIRE(hd == 32 || hd == 64 || hd == 128 || hd == 256, op, "head_dim " + std::to_string(hd) + " unsupported (32/64/128/256)");
  OCRIA_RT_REQUIRE(Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= 8, op, "GQA group Hq / Hkv must be an integer <= 8");
  OCRIA_RT_REQUIRE(q.numel() == T * Hq * hd && (q.ndim == 2 || q.ndim == 3), op, "q " + q.shape_str());
  OCRIA_RT_REQUIRE(qkv.ndim == 2 && qkv.dim(0) == T && qkv.dim(1) == (2 * Hq + 2 * Hkv) * hd, op, "qkv " + qkv.shape_str());
  OCRIA_RT_REQUIRE(out.ndim == 2 && out.dim(0) == T && out.dim(1) == Hq * hd, op, "out " + out.shape_str());
  OCRIA_RT_REQUIRE(k_cache.row_size() == Hkv * hd && v_cache.row_size() == Hkv * hd && k_cache.row_stride == v_cache.row_stride,
          op, "k_cache / v_cache vs Hkv * head_dim");
  OCRIA_RT_REQUIRE(positions.numel() == T, op, "positions must have T elements");
  OCRIA_RT_REQUIRE(T <= 65535, op, "too many tokens");
  if (T == 0) return;
  activate();
  const int G = int(Hq / Hkv);
  const int64_t ldc = k_cache.row_stride;
  if (T > kFlashMinTokens && (hd == 64 || hd == 128 || hd == 256) &&
      flash_aligned({{q.data, q.row_stride}, {k_cache.data, ldc}, {v_cache.data, ldc}, {qkv.data, qkv.row_stride},
                     {out.data, out.row_stride}})) {
    FlashArgs a;
    a.q = q.ptr<const bf16>();
    a.ldq = q.row_stride;
    a.k = k_cache.ptr<const bf16>();
    a.v = v_cache.ptr<const bf16>();
    a.ldkv = ldc;
    a.gate = qkv.ptr<const bf16>() + hd;  // per q head: [q | gate]
    a.ldg = qkv.row_stride;
    a.gate_hs = 2 * hd;
    a.out = out.ptr<bf16>();
    a.ldo = out.row_stride;
    a.positions = positions.ptr<const int32_t>();
    a.T = int(T);
    a.G = G;
    a.scale_log2 = p.scale * 1.4426950408889634f;
    launch_flash_hd(int(hd), a, int(Hq), stream_);
    return;
  }
  DecodeArgs a;
  a.q = q.ptr<const bf16>();
  a.k_cache = k_cache.ptr<const bf16>();
  a.v_cache = v_cache.ptr<const bf16>();
  a.qkv = qkv.ptr<const bf16>();
  a.ldq = q.row_stride;
  a.ldc = ldc;
  a.ldqkv = qkv.row_stride;
  a.ldo = out.row_stride;
  a.positions = positions.ptr<const int32_t>();
  a.out = out.ptr<bf16>();
  a.T = int(T);
  a.Hq = int(Hq);
  a.Hkv = int(Hkv);
  a.hd = int(hd);
  a.G = G;
  a.capacity = k_cache.dim(0);
  a.scale_log2 = p.scale * 1.4426950408889634f;
  a.workspace = workspace_;
  a.workspace_bytes = workspace_bytes_;
  a.sm_count = sm_count_;
  if (attn_verify_ && T >= kVerifyMinTokens && T <= kMaxSplitTokens && (hd == 64 || hd == 128 || hd == 256) &&
      flash_aligned({{q.data, q.row_stride}, {k_cache.data, ldc}, {v_cache.data, ldc}, {qkv.data, qkv.row_stride},
                     {out.data, out.row_stride}})) {
    dispatch_verify(hd, T * G, [&](auto h, auto rows) { launch_verify_attention<h, rows>(a, launch_ctx()); });
    return;
  }
  dispatch_decode(hd, G, [&](auto e, auto gm) { launch_attention_decode<e, gm>(a, launch_ctx()); });
}

void CudaBackend::attention_decode(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm,
                                   const Tensor& positions, const Tensor& rope_positions, const AttentionParams& p,
                                   const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& out) {
  using namespace cuda;
  const int64_t T = qkv.dim(0), Hq = p.num_q_heads, Hkv = p.num_kv_heads, hd = p.head_dim;
  // One kernel for one token where attention_kernel's head sizes and groups apply, on BF16 views whose
  // rows are 16-byte aligned; anything else runs the two ops.
  const bool fused = attn_fused_ && T == 1 && (hd == 32 || hd == 64 || hd == 128 || hd == 256) && Hkv > 0 &&
                     Hq % Hkv == 0 && Hq / Hkv <= 8 && qkv.dtype == DType::BF16 && out.dtype == DType::BF16 &&
                     k_cache.dtype == DType::BF16 && v_cache.dtype == DType::BF16 && aligned16(qkv.data) &&
                     aligned16(out.data) &&
                     flash_aligned({{k_cache.data, k_cache.row_stride}, {v_cache.data, v_cache.row_stride}});
  if (!fused) {
    Backend::attention_decode(qkv, q_norm, k_norm, positions, rope_positions, p, q, k_cache, v_cache, out);
    return;
  }
  const char* op = "attention_decode";
  const auto [qn, kn] = check_prepare_args(op, qkv, q_norm, k_norm, positions, rope_positions, p, k_cache, v_cache);
  require_tensor(out, DType::BF16, op, "out");
  OCRIA_RT_REQUIRE(out.ndim == 2 && out.dim(0) == T && out.dim(1) == Hq * hd, op, "out " + out.shape_str());
  activate();
  StepArgs a;
  a.qkv = qkv.ptr<const bf16>();
  a.q_norm = qn;
  a.k_norm = kn;
  a.positions = positions.ptr<const int32_t>();
  a.rope_positions = rope_positions.ptr<const int32_t>();
  a.mrope = MropeSection{{p.mrope_section[0], p.mrope_section[1], p.mrope_section[2]}};
  a.k_cache = k_cache.ptr<bf16>();
  a.v_cache = v_cache.ptr<bf16>();
  a.ldc = k_cache.row_stride;
  a.out = out.ptr<bf16>();
  a.Hq = int(Hq);
  a.Hkv = int(Hkv);
  a.G = int(Hq / Hkv);
  a.rot = int(p.rotary_dim);
  a.theta = p.rope_theta;
  a.eps = p.norm_eps;
  a.scale_log2 = p.scale * 1.4426950408889634f;
  a.capacity = k_cache.dim(0);
  a.workspace = workspace_;
  a.workspace_bytes = workspace_bytes_;
  a.counters = attn_counters_;
  a.min_group = std::min(attn_merge_group_, kMaxSplits);
  a.sm_count = sm_count_;
  dispatch_decode(hd, a.G, [&](auto e, auto gm) { launch_attention_step<e, gm>(a, launch_ctx()); });
}

namespace cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// vision_attention: bidirectional attention inside each image for the vision encoder.
// Step 1 rotates q and k in place (2-D RoPE, angles from double-precision powers as on the CPU).
// Step 2, head_dim 64 / 128: flash_attention, each row's keys being its image. Otherwise (16 / 32,
// misaligned views): a block of kVisRows warps takes kVisRows consecutive query rows of one head;
// K / V tiles of 32 keys go through shared memory once per block; lane j scores key j of the tile
// against its warp's query, the warp runs an online softmax, and each lane accumulates its head
// dimensions. Rows of different images in one block each mask the keys outside their own image.
// ---------------------------------------------------------------------------------------------
constexpr int kVisRows = 8;
constexpr int kVisKeys = 32;

__global__ void vision_rope_kernel(bf16* __restrict__ qkv, int64_t ldq, const int32_t* __restrict__ pos, int64_t N,
                                   int H, int hd, float theta) {
  const int half = hd / 2, quarter = hd / 4;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * H * half) return;
  const int i = int(idx % half), h = int((idx / half) % H);
  const int64_t n = idx / (int64_t(half) * H);
  const int j = i < quarter ? i : i - quarter;
  const float inv_freq = float(1.0 / pow(double(theta), 4.0 * j / hd));
  const float angle = float(pos[2 * n + (i < quarter ? 0 : 1)]) * inv_freq;
  const float c = float(cos(double(angle))), sn = float(sin(double(angle)));
  for (int part = 0; part < 2; ++part) {  // q, then k
    bf16* head = qkv + n * ldq + int64_t(part) * H * hd + int64_t(h) * hd;
    const float a = __bfloat162float(head[i]), b = __bfloat162float(head[i + half]);
    head[i] = __float2bfloat16_rn(a * c - b * sn);
    head[i + half] = __float2bfloat16_rn(b * c + a * sn);
  }
}

template <int HD>
__global__ void __launch_bounds__(kVisRows * 32)
    vision_attention_kernel(const bf16* __restrict__ qkv, int64_t ldq, const int32_t* __restrict__ cu, int images,
                            int64_t N, int H, float scale_log2, bf16* __restrict__ out, int64_t ldo) {
  constexpr int E = (HD + 31) / 32;  // head dimensions per lane
  __shared__ float ks[kVisKeys][HD + 1];  // +1: lane j reads row j without bank conflicts
  __shared__ float vs[kVisKeys][HD];
  __shared__ float qs[kVisRows][HD];
  __shared__ int seg[kVisRows][2];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, h = blockIdx.y;
  const int64_t row = int64_t(blockIdx.x) * kVisRows + warp;
  const bool active = row < N;
  if (lane == 0) {
    int lo = 0, hi = images;  // the image holding `row`: cu[s] <= row < cu[s + 1]
    while (active && hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      (cu[mid] <= row ? lo : hi) = mid;
    }
    seg[warp][0] = active ? cu[lo] : 0;
    seg[warp][1] = active ? cu[lo + 1] : 0;
  }
  for (int d = lane; d < HD; d += 32)
    qs[warp][d] = active ? __bfloat162float(qkv[row * ldq + int64_t(h) * HD + d]) * scale_log2 : 0.0f;
  __syncthreads();
  int64_t lo = INT64_MAX, hi = 0;
  for (int w = 0; w < kVisRows; ++w)
    if (seg[w][1] > seg[w][0]) {
      lo = lo < seg[w][0] ? lo : seg[w][0];
      hi = hi > seg[w][1] ? hi : seg[w][1];
    }
  const int b0 = seg[warp][0], b1 = seg[warp][1];
  float m = -INFINITY, l = 0.0f, acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.0f;
  for (int64_t k0 = lo; k0 < hi; k0 += kVisKeys) {
    __syncthreads();  // the previous tile is no longer read
    for (int idx = threadIdx.x; idx < kVisKeys * HD; idx += blockDim.x) {
      const int r = idx / HD, d = idx % HD;
      const int64_t key = k0 + r;
      const bf16* src = qkv + key * ldq + int64_t(h) * HD + d;
      ks[r][d] = key < hi ? __bfloat162float(src[int64_t(H) * HD]) : 0.0f;
      vs[r][d] = key < hi ? __bfloat162float(src[2 * int64_t(H) * HD]) : 0.0f;
    }
    __syncthreads();
    if (!active) continue;
    const int64_t key = k0 + lane;
    float sc = -INFINITY;
    if (key >= b0 && key < b1) {
      sc = 0.0f;
#pragma unroll 8
      for (int d = 0; d < HD; ++d) sc = fmaf(qs[warp][d], ks[lane][d], sc);
    }
    const float m_new = fmaxf(m, warp_max(sc));
    if (m_new == -INFINITY) continue;  // no key of this row's image in the tile yet
    const float p = sc == -INFINITY ? 0.0f : exp2f(sc - m_new);
    const float corr = exp2f(m - m_new);
    l = l * corr + warp_sum(p);
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] *= corr;
    for (int j = 0; j < kVisKeys; ++j) {
      const float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
      for (int e = 0; e < E; ++e)
        if (lane + 32 * e < HD) acc[e] = fmaf(pj, vs[j][lane + 32 * e], acc[e]);
    }
    m = m_new;
  }
  if (!active) return;
#pragma unroll
  for (int e = 0; e < E; ++e)
    if (lane + 32 * e < HD) out[row * ldo + int64_t(h) * HD + lane + 32 * e] = __float2bfloat16_rn(acc[e] / l);
}

}  // namespace
}  // namespace cuda

void CudaBackend::vision_attention(const Tensor& qkv, const Tensor& patch_pos, const Tensor& cu_seqlens,
                                   int64_t num_heads, float rope_theta, const Tensor& out) {
  using namespace cuda;
  const char* op = "vision_attention";
  require_tensor(qkv, DType::BF16, op, "qkv");
  require_tensor(out, DType::BF16, op, "out");
  require_tensor(patch_pos, DType::I32, op, "patch_pos");
  require_tensor(cu_seqlens, DType::I32, op, "cu_seqlens");
  const int64_t N = qkv.dim(0), H = num_heads;
  OCRIA_RT_REQUIRE(H > 0 && qkv.ndim == 2 && qkv.dim(1) % (3 * H) == 0, op, "qkv " + qkv.shape_str());
  const int64_t hd = qkv.dim(1) / (3 * H);
  OCRIA_RT_REQUIRE(hd == 16 || hd == 32 || hd == 64 || hd == 128, op, "head_dim " + std::to_string(hd) + " unsupported (16/32/64/128)");
  OCRIA_RT_REQUIRE(out.ndim == 2 && out.dim(0) == N && out.dim(1) == H * hd, op, "out " + out.shape_str());
  OCRIA_RT_REQUIRE(patch_pos.numel() == 2 * N && patch_pos.contiguous(), op, "patch_pos must be [N, 2]");
  const int64_t images = cu_seqlens.numel() - 1;
  OCRIA_RT_REQUIRE(images >= 1, op, "cu_seqlens needs at least 2 entries");
  if (N == 0) return;
  activate();
  const int64_t pairs = N * H * (hd / 2);
  vision_rope_kernel<<<unsigned((pairs + 255) / 256), 256, 0, stream_>>>(qkv.ptr<bf16>(), qkv.row_stride,
                                                                        patch_pos.ptr<const int32_t>(), N, int(H),
                                                                        int(hd), rope_theta);
  check_launch("vision_rope_kernel");
  const float scale_log2 = float(1.0 / std::sqrt(double(hd))) * 1.4426950408889634f;
  if ((hd == 64 || hd == 128) && flash_aligned({{qkv.data, qkv.row_stride}, {out.data, out.row_stride}})) {
    OCRIA_RT_REQUIRE((N + kFlashRows - 1) / kFlashRows <= 65535, op, "too many patches");
    FlashArgs a;
    a.q = qkv.ptr<const bf16>();  // q | k | v, head-major
    a.ldq = qkv.row_stride;
    a.k = a.q + H * hd;
    a.v = a.q + 2 * H * hd;
    a.ldkv = qkv.row_stride;
    a.out = out.ptr<bf16>();
    a.ldo = out.row_stride;
    a.cu = cu_seqlens.ptr<const int32_t>();
    a.segments = int(images);
    a.T = int(N);
    a.scale_log2 = scale_log2;
    launch_flash_hd(int(hd), a, int(H), stream_);
    return;
  }
  const dim3 grid(unsigned((N + kVisRows - 1) / kVisRows), unsigned(H));
  OCRIA_RT_REQUIRE(grid.y <= 65535, op, "too many heads");
  auto launch = [&](auto kernel) {
    kernel<<<grid, kVisRows * 32, 0, stream_>>>(qkv.ptr<const bf16>(), qkv.row_stride, cu_seqlens.ptr<const int32_t>(),
                                                int(images), N, int(H), scale_log2, out.ptr<bf16>(), out.row_stride);
  };
  switch (hd) {
    case 16: launch(vision_attention_kernel<16>); break;
    case 32: launch(vision_attention_kernel<32>); break;
    case 64: launch(vision_attention_kernel<64>); break;
    default: launch(vision_attention_kernel<128>); break;
  }
  check_launch("vision_attention_kernel");
}

}  // namespace ocria_rt
