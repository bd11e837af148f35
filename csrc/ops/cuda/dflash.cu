// The DFlash drafter's ops on CUDA (the reference: cpu/dflash.cpp; the semantics: ops.h).
//
// draft_store_kv, and the q side of draft_attention: one warp per (token, head) applies the
// zero-centred RMSNorm and RoPE over the whole head at the token's sequence position (the angle in
// fp32, cos / sin in double, as the CPU forms them).
//
// draft_attention: split-K flash decoding with tensor cores. Query t sees the cache rows [lo_t, hi_t]
// (its mask, ops.h); the union of those ranges is cut into `nsplit` splits (a launch constant chosen
// from the cache capacity, so a captured graph stays valid as the context grows: the split length
// comes from the positions on the device, and splits past the end exit at once). Block (split, kv
// head, query-row group) takes up to 64 query rows of its kv head, (token, q head of the GQA group)
// pairs, so each K / V row is read once for every query of a block: the 16 queries of a block and
// the group's heads share the tile loads. Per tile of K / V rows (double-buffered cp.async), each warp
// forms S = Q K^T for its 16 query rows (mma m16n8k16, fp32), masks the keys outside each row's
// range, runs the online softmax in base 2 and accumulates O += P V with P rounded to BF16 (the
// flash-attention recipe of attention.cu). With one non-empty split the block writes the output;
// otherwise a combine kernel merges the splits' (max, sum, O).
//
// dynamic_conv and scale_softcap: elementwise.
//
// selector_walk: the top-K candidates of each row (K <= kMaxCandidates) in two passes (the top K of
// each 8192 logits by K rounds of warp maxima over keys (value, -id), then the top K of those per
// row); then every pairwise score s_t(c | p) for p among the K candidates of row t - 1 (the anchor at
// t = 0), each dot product summed in the CPU's order (the products of BF16 values are exact in fp32, so
// the sums are the CPU's bits); then one warp walks the rows, drawing as the CPU does at temperature > 0.
#include <algorithm>
#include <climits>
#include <cmath>
#include <type_traits>

#include "ops/cuda/backend.cuh"
#include "ops/cuda/mma.cuh"
#include "ops/sampling_rng.h"

namespace ocria_rt {
namespace cuda {
namespace {

using u64 = unsigned long long;

// ---------------------------------------------------------------------------------------------
// norm + RoPE of one head per warp
// ---------------------------------------------------------------------------------------------
constexpr int kRopeWarps = 8;
constexpr int kRopeMaxPer = 256 / 32;  // head_dim <= 256: elements per lane

// theta^(-2f/hd) in fp32 (pow in double, correctly rounded to float).
__device__ __forceinline__ float draft_inv_freq(int f, int hd, float theta) {
  return __fdiv_rn(1.0f, float(pow(double(theta), double(__fdiv_rn(float(2 * f), float(hd))))));
}

// The head src[0, hd) normed (x * rsqrt(mean x^2 + eps) * (1 + w)) and rotated at position pos into
// dst[0, hd) (rotate-half pairs (i, i + hd/2)). x: hd floats of shared memory for this warp.
template <class T>
__device__ __forceinline__ void norm_rope_head(const T* src, ParamView w, int hd, float eps, float theta, int pos,
                                               float* x, bf16* dst, int lane) {
  float xv[kRopeMaxPer];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kRopeMaxPer; ++j) {
    const int i = lane + 32 * j;
    xv[j] = i < hd ? to_float(src[i]) : 0.0f;
    ss = fmaf(xv[j], xv[j], ss);
  }
  const float inv = rsqrtf(__fdiv_rn(warp_sum(ss), float(hd)) + eps);
#pragma unroll
  for (int j = 0; j < kRopeMaxPer; ++j) {
    const int i = lane + 32 * j;
    if (i < hd) x[i] = xv[j] * inv * (1.0f + w[i]);
  }
  __syncwarp();
  const int half = hd / 2;
#pragma unroll
  for (int j = 0; j < kRopeMaxPer; ++j) {
    const int i = lane + 32 * j;
    if (i >= hd) break;
    const int f = i < half ? i : i - half;
    const float angle = __fmul_rn(float(pos), draft_inv_freq(f, hd, theta));
    double s, c;
    sincos(double(angle), &s, &c);
    const float cs = float(c), sn = float(s);
    const float y = i < half ? x[i] * cs - x[i + half] * sn : x[i] * cs + x[i - half] * sn;
    dst[i] = __float2bfloat16_rn(y);
  }
  __syncwarp();  // x is reused by the warp's next head
}

// Warp (t, head): src row t at src + t * ld_src + head * hd. to_cache: k of kv head `head` normed and
// rotated into k_cache row positions[t], and v (at v_off columns after k) copied to v_cache; positions
// outside [0, rows) are skipped. Else q head `head` normed and rotated into dst + (t * heads + head) * hd.
template <class T>
__global__ void __launch_bounds__(kRopeWarps * 32)
    draft_rope_kernel(const T* __restrict__ src, int64_t ld_src, ParamView norm_w, const int32_t* __restrict__ positions,
                      int n_tokens, int heads, int hd, float theta, float eps, bool to_cache, int64_t v_off,
                      bf16* __restrict__ dst, bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, int64_t ldc,
                      int rows) {
  __shared__ float buf[kRopeWarps][256];
  pdl_launch_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t item = int64_t(blockIdx.x) * kRopeWarps + warp;
  pdl_wait();  // the inputs, positions and caches come from earlier kernels
  if (item >= int64_t(n_tokens) * heads) return;
  const int t = int(item / heads), head = int(item % heads);
  const int pos = positions[t];
  const T* s = src + int64_t(t) * ld_src + int64_t(head) * hd;
  if (!to_cache) {
    norm_rope_head(s, norm_w, hd, eps, theta, pos, buf[warp], dst + (int64_t(t) * heads + head) * hd, lane);
    return;
  }
  if (pos < 0 || pos >= rows) return;
  norm_rope_head(s, norm_w, hd, eps, theta, pos, buf[warp], k_cache + int64_t(pos) * ldc + int64_t(head) * hd, lane);
  const T* v = s + v_off;
  bf16* vd = v_cache + int64_t(pos) * ldc + int64_t(head) * hd;
  for (int i = lane; i < hd; i += 32) vd[i] = from_float<bf16>(to_float(v[i]));
}

// ---------------------------------------------------------------------------------------------
// draft_attention
// ---------------------------------------------------------------------------------------------
constexpr int kDraftRows = 64;      // query rows per block: 4 warps x one m16 tile
constexpr int kDraftThreads = 128;
constexpr int kDraftMinChunk = 64;  // the shortest split (rows)
constexpr int kDraftMaxSplits = 1024;

template <int HD> struct DraftAttnConfig {
  static constexpr int KEYS = HD <= 128 ? 64 : 32;  // keys per K / V tile
  static constexpr int LD = HD + 8;  // shared row stride (elements): the 8 rows of an ldmatrix hit distinct banks
  static constexpr int SMEM = (kDraftRows + 4 * KEYS) * LD * int(sizeof(bf16));  // Q, 2 K, 2 V tiles
};

struct DraftAttnArgs {
  const bf16* q = nullptr;  // normed, rotated queries [T][Hq][HD]
  const bf16* k = nullptr;  // cache row r, kv head g: k + r * ldc + g * HD (v alike)
  const bf16* v = nullptr;
  int64_t ldc = 0;
  int rows = 0;  // cache rows
  const int32_t* positions = nullptr;
  int T = 0, Hq = 0, G = 1;
  bool causal = false;
  int window = 0;
  float scale_log2 = 0;
  int nsplit = 1;
  float* part_o = nullptr;   // [nsplit][T * Hq][HD]: unnormalised O of a split
  float2* part_ml = nullptr; // [nsplit][T * Hq]: (max of the base-2 scores, sum)
  bf16* out = nullptr;       // out + t * ldo + h * HD
  int64_t ldo = 0;
};

// The cache rows query t sees (empty: lo > hi).
__device__ __forceinline__ int2 draft_key_range(const DraftAttnArgs& a, int t, int last) {
  const int pos = a.positions[t];
  int lo = 0, hi = a.causal ? min(pos, last) : last;
  if (a.window > 0) {
    lo = int(max(int64_t(0), int64_t(pos) - a.window + 1));
    if (!a.causal) hi = int(min(int64_t(hi), int64_t(pos) + a.window - 1));
  }
  return make_int2(lo, min(hi, a.rows - 1));
}

// How the union [lo, hi] of the queries' ranges is split: every split but the last has `chunk`
// rows; `active` splits hold rows (at least one, which then has none when the union is empty).
struct DraftSplits {
  int lo, hi, chunk, active;
};
__device__ __forceinline__ DraftSplits draft_splits(const DraftAttnArgs& a) {
  const int last = a.positions[a.T - 1];
  int lo = INT_MAX, hi = -1;
  for (int t = 0; t < a.T; ++t) {
    const int2 r = draft_key_range(a, t, last);
    if (r.x <= r.y) {
      lo = min(lo, r.x);
      hi = max(hi, r.y);
    }
  }
  DraftSplits s{lo, hi, kDraftMinChunk, 1};
  if (hi < lo) return s;
  const int len = hi - lo + 1;
  s.chunk = max((len + a.nsplit - 1) / a.nsplit, kDraftMinChunk);
  s.active = (len + s.chunk - 1) / s.chunk;
  return s;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ROWS rows of HD BF16 from src + r * ld into a [ROWS][LD] shared tile by cp.async, rows r >= valid
// zero-filled.
template <int HD, int ROWS, class RowPtr>
__device__ __forceinline__ void draft_load_tile(bf16* dst, RowPtr row_ptr, int valid, const bf16* any) {
  constexpr int C = HD / 8, LD = DraftAttnConfig<HD>::LD;
  for (int i = threadIdx.x; i < ROWS * C; i += kDraftThreads) {
    const int r = i / C, c = i % C;
    const bool ok = r < valid;
    cp_async16(dst + r * LD + c * 8, ok ? row_ptr(r) + c * 8 : any, ok ? 16 : 0);
  }
}

template <int HD>
__global__ void __launch_bounds__(kDraftThreads)
    draft_attention_kernel(const DraftAttnArgs a) {
  using Cfg = DraftAttnConfig<HD>;
  constexpr int KEYS = Cfg::KEYS, LD = Cfg::LD;
  constexpr int NT = HD / 8;     // 8-column tiles of an output row
  constexpr int KT = KEYS / 16;  // k16 steps of P V
  extern __shared__ __align__(128) unsigned char draft_smem[];
  __shared__ int2 range_s[kDraftRows];
  __shared__ DraftSplits split_s;
  bf16* q_s = reinterpret_cast<bf16*>(draft_smem);  // [kDraftRows][LD]
  bf16* k_s = q_s + kDraftRows * LD;                // [2][KEYS][LD]
  bf16* v_s = k_s + 2 * KEYS * LD;                  // [2][KEYS][LD]
  pdl_launch_dependents();
  const int split = blockIdx.x, kvh = blockIdx.y, row0 = blockIdx.z * kDraftRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int NQ = a.T * a.G;  // query rows of the kv head: row i = token i / G, q head kvh * G + i % G
  pdl_wait();  // q, the caches and the positions come from earlier kernels
  if (threadIdx.x == 0) split_s = draft_splits(a);
  __syncthreads();
  const DraftSplits sp = split_s;
  if (split >= sp.active) return;  // no rows: the combine kernel does not read this split
  const int start = sp.lo + split * sp.chunk;
  const int end = sp.hi < sp.lo ? start - 1 : min(sp.hi, start + sp.chunk - 1);
  const int last = a.positions[a.T - 1];
  for (int r = threadIdx.x; r < kDraftRows; r += kDraftThreads) {
    const int i = row0 + r;
    int2 range = make_int2(INT_MAX, -1);
    if (i < NQ) {
      range = draft_key_range(a, i / a.G, last);
      range.x = max(range.x, start);
      range.y = min(range.y, end);
    }
    range_s[r] = range;
  }
  draft_load_tile<HD, kDraftRows>(
      q_s, [&](int r) { return a.q + (int64_t((row0 + r) / a.G) * a.Hq + kvh * a.G + (row0 + r) % a.G) * HD; },
      NQ - row0, a.q);
  const bf16* k_g = a.k + int64_t(kvh) * HD;
  const bf16* v_g = a.v + int64_t(kvh) * HD;
  const int tiles = end >= start ? (end - start) / KEYS + 1 : 0;
  auto load_kv = [&](int j) {  // tile j into buffer j % 2
    const int kv0 = start + j * KEYS, valid = min(KEYS, end - kv0 + 1);
    draft_load_tile<HD, KEYS>(k_s + (j & 1) * KEYS * LD, [&](int r) { return k_g + int64_t(kv0 + r) * a.ldc; }, valid,
                              a.k);
    draft_load_tile<HD, KEYS>(v_s + (j & 1) * KEYS * LD, [&](int r) { return v_g + int64_t(kv0 + r) * a.ldc; }, valid,
                              a.v);
  };
  if (tiles > 0) load_kv(0);
  cp_async_commit();  // Q and tile 0
  __syncthreads();    // range_s

  // The warp's 16 rows see keys within [lo_min, hi_max] (nothing where all are padding).
  const int2 own = range_s[16 * warp + (lane & 15)];
  const int lo_min = __reduce_min_sync(~0u, own.x), hi_max = __reduce_max_sync(~0u, own.y);

  // ldmatrix addresses (fragment layouts in mma.cuh): Q, A operand at k-step kk: row lane % 16 of
  // the warp's, column 16 kk + 8 (lane / 16); K, B operands of keys 16 np ..: key lane % 8 + 8 (lane / 16),
  // column 16 kk + 8 ((lane / 8) % 2); V (.trans), B operands of head dims 16 dp .. at k-step kt: key
  // 16 kt + lane % 8 + 8 ((lane / 8) % 2), column 16 dp + 8 (lane / 16).
  const uint32_t q_addr = uint32_t(__cvta_generic_to_shared(q_s + (16 * warp + (lane & 15)) * LD + 8 * (lane >> 4)));
  const uint32_t k_addr =
      uint32_t(__cvta_generic_to_shared(k_s + ((lane & 7) + 8 * (lane >> 4)) * LD + 8 * ((lane >> 3) & 1)));
  const uint32_t v_addr =
      uint32_t(__cvta_generic_to_shared(v_s + ((lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 8 * (lane >> 4)));

  float o[NT][4];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // per row g, g + 8: running max (base 2), partial sum
#pragma unroll
  for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

  for (int j = 0; j < tiles; ++j) {
    cp_async_wait<0>();
    __syncthreads();  // tile j (and Q) visible to every warp; all are done with tile j - 1's buffers
    if (j + 1 < tiles) load_kv(j + 1);
    cp_async_commit();
    const int kv0 = start + j * KEYS;
    if (kv0 > hi_max || kv0 + KEYS - 1 < lo_min) continue;  // no key of this tile for the warp's rows
    const uint32_t buf = uint32_t((j & 1) * KEYS * LD * sizeof(bf16));

    float s[2 * KT][4];
#pragma unroll
    for (int n = 0; n < 2 * KT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t qf[4];
      ldmatrix_x4(qf, q_addr + 32 * kk);
#pragma unroll
      for (int np = 0; np < KT; ++np) {
        uint32_t kf[4];
        ldmatrix_x4(kf, k_addr + buf + 2 * (16 * np * LD + 16 * kk));
        mma_16816(s[2 * np], qf[0], qf[1], qf[2], qf[3], kf[0], kf[1]);
        mma_16816(s[2 * np + 1], qf[0], qf[1], qf[2], qf[3], kf[2], kf[3]);
      }
    }
    // Keys outside a row's range (its mask, the split, padding rows) weigh nothing.
#pragma unroll
    for (int n = 0; n < 2 * KT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = kv0 + 8 * n + 2 * (lane & 3) + (e & 1);
        const int2 r = range_s[16 * warp + 8 * (e >> 1) + (lane >> 2)];
        if (key < r.x || key > r.y) s[n][e] = -INFINITY;
      }

    // Online softmax; the 4 lanes of a quad share a row. P becomes the A fragments of P V.
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
      pf[n / 2][2 * (n % 2)] = pack_bf16(p[0], p[1]);
      pf[n / 2][2 * (n % 2) + 1] = pack_bf16(p[2], p[3]);
    }
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        uint32_t vf[4];
        ldmatrix_x4_trans(vf, v_addr + buf + 2 * (16 * kt * LD + 16 * dp));
        mma_16816(o[2 * dp], pf[kt][0], pf[kt][1], pf[kt][2], pf[kt][3], vf[0], vf[1]);
        mma_16816(o[2 * dp + 1], pf[kt][0], pf[kt][1], pf[kt][2], pf[kt][3], vf[2], vf[3]);
      }
  }
  cp_async_wait<0>();  // nothing may be in flight into shared memory when the block exits

  // This thread holds head dims 8n + 2 (lane % 4), +1 of rows g and g + 8 of the warp's tile.
  const int d0 = 2 * (lane & 3);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float sum = l[i];
    sum += __shfl_xor_sync(~0u, sum, 1);
    sum += __shfl_xor_sync(~0u, sum, 2);
    const int row = row0 + 16 * warp + 8 * i + (lane >> 2);
    if (row >= NQ) continue;
    const int t = row / a.G, h = kvh * a.G + row % a.G;
    if (sp.active == 1) {
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // no visible key: 0
      bf16* dst = a.out + int64_t(t) * a.ldo + int64_t(h) * HD + d0;
#pragma unroll
      for (int n = 0; n < NT; ++n)
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * n) = __floats2bfloat162_rn(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
    } else {
      const int64_t slot = int64_t(split) * a.T * a.Hq + int64_t(t) * a.Hq + h;
      float* dst = a.part_o + slot * HD + d0;
#pragma unroll
      for (int n = 0; n < NT; ++n) *reinterpret_cast<float2*>(dst + 8 * n) = make_float2(o[n][2 * i], o[n][2 * i + 1]);
      if ((lane & 3) == 0) a.part_ml[slot] = make_float2(m[i], sum);
    }
  }
}

// Merges the non-empty splits of one (token, q head): out = sum_s O_s w_s / sum_s L_s w_s,
// w_s = 2^(m_s - M), M = max_s m_s (splits without a visible key have m = -inf and weigh 0).
// One thread per head dim.
__global__ void draft_combine_kernel(const DraftAttnArgs a, int hd) {
  __shared__ DraftSplits split_s;
  __shared__ float w_s[kDraftMaxSplits];
  __shared__ float L_s;
  pdl_launch_dependents();
  const int t = blockIdx.x / a.Hq, h = blockIdx.x % a.Hq;
  pdl_wait();  // the partial results come from draft_attention_kernel
  if (threadIdx.x == 0) split_s = draft_splits(a);
  __syncthreads();
  const int active = split_s.active;
  if (active <= 1) return;  // the split kernel wrote the output
  const int64_t slot0 = int64_t(t) * a.Hq + h, stride = int64_t(a.T) * a.Hq;
  if (threadIdx.x == 0) {
    float M = -INFINITY;
    for (int s = 0; s < active; ++s) M = fmaxf(M, a.part_ml[s * stride + slot0].x);
    float L = 0.0f;
    for (int s = 0; s < active; ++s) {
      const float2 ml = a.part_ml[s * stride + slot0];
      const float w = M == -INFINITY ? 0.0f : exp2f(ml.x - M);
      w_s[s] = w;
      L = fmaf(ml.y, w, L);
    }
    L_s = L;
  }
  __syncthreads();
  const int d = threadIdx.x;
  if (d >= hd) return;
  float A = 0.0f;
  for (int s = 0; s < active; ++s) A = fmaf(a.part_o[(s * stride + slot0) * hd + d], w_s[s], A);
  const float L = L_s;
  a.out[int64_t(t) * a.ldo + int64_t(h) * hd + d] = __float2bfloat16_rn(L > 0.0f ? A / L : 0.0f);
}

template <int HD> void launch_draft_attention(const DraftAttnArgs& a, int Hkv, int zgroups, const LaunchCtx& ctx) {
  using Cfg = DraftAttnConfig<HD>;
  // Once per instantiation (thread-safe static initialisation); allowed during graph capture.
  static const cudaError_t attr =
      cudaFuncSetAttribute(draft_attention_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SMEM);
  check_cuda(attr, "cudaFuncSetAttribute (draft_attention_kernel)");
  launch_pdl(ctx, "draft_attention_kernel", draft_attention_kernel<HD>,
             dim3(unsigned(a.nsplit), unsigned(Hkv), unsigned(zgroups)), kDraftThreads, Cfg::SMEM, a);
  if (a.nsplit > 1)
    launch_pdl(ctx, "draft_combine_kernel", draft_combine_kernel, unsigned(a.T * a.Hq), unsigned(std::max(HD, 32)), 0,
               a, HD);
}

// ---------------------------------------------------------------------------------------------
// dynamic_conv, scale_softcap
// ---------------------------------------------------------------------------------------------

template <class T>
__global__ void dynamic_conv_kernel(const T* __restrict__ x, int64_t ldx, const T* __restrict__ dyn, int64_t ldd,
                                    const float* __restrict__ base, int64_t ldb, T* __restrict__ out, int64_t ldo,
                                    int n_tokens, int C, int K, int group) {
  pdl_launch_dependents();
  const int c = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
  pdl_wait();
  if (c >= C) return;
  const int G = C / group;
  float acc = 0.0f;
  for (int off = 0; off < K && off <= t; ++off) {
    const float xv = to_float(x[int64_t(t - off) * ldx + c]);
    acc = fmaf(base[int64_t(off) * ldb + c], xv, acc);
    acc = fmaf(to_float(dyn[int64_t(t) * ldd + int64_t(off) * G + c / group]), xv, acc);
  }
  out[int64_t(t) * ldo + c] = from_float<T>(acc);
}

template <class T>
__global__ void scale_softcap_kernel(T* __restrict__ x, int64_t ldx, int64_t rows, int64_t cols, float multiplier,
                                     float softcap) {
  pdl_launch_dependents();
  pdl_wait();
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    T* p = x + (i / cols) * ldx + i % cols;
    const float v = to_float(*p) * multiplier;
    *p = from_float<T>(softcap > 0.0f ? tanhf(__fdiv_rn(v, softcap)) * softcap : v);
  }
}

// ---------------------------------------------------------------------------------------------
// selector_walk
// ---------------------------------------------------------------------------------------------
constexpr int kTopkThreads = 256;
constexpr int kTopkPerThread = 32;
constexpr int kTopkChunk = kTopkThreads * kTopkPerThread;  // logits per block of the first pass
constexpr int kMaxCandidates = 64;
constexpr int kPairThreads = 256;
constexpr int kSelectorMaxSmem = 200 * 1024;  // dynamic shared memory of the merge and pair kernels, at most

// Candidate order as one integer: larger keys are larger logits, then lower ids (0: no element).
// -0 counts as +0, as the CPU's comparisons take them equal.
__device__ __forceinline__ u64 logit_key(float v, int id) {
  uint32_t b = __float_as_uint(v);
  if ((b & 0x7FFFFFFFu) == 0) b = 0;
  const uint32_t ord = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (u64(ord) << 32) | u64(~uint32_t(id));
}
__device__ __forceinline__ int key_id(u64 key) { return int(~uint32_t(key)); }
__device__ __forceinline__ float key_value(u64 key) {
  const uint32_t ord = uint32_t(key >> 32);
  return __uint_as_float((ord & 0x80000000u) ? (ord & 0x7FFFFFFFu) : ~ord);
}

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The K largest keys of n keys (`at(i)`, i < n, lane-strided), by one warp: K rounds, each the
// largest key below the previous round's. Lane 0 gets them in `out` (0 where fewer than K exist).
template <class At>
__device__ __forceinline__ void warp_top_keys(At at, int n, int K, u64* out, int lane) {
  u64 thr = ~0ull;
  for (int k = 0; k < K; ++k) {
    u64 best = 0;
    for (int i = lane; i < n; i += 32) {
      const u64 c = at(i);
      if (c < thr && c > best) best = c;
    }
    best = warp_max_u64(best);
    if (lane == 0) out[k] = best;
    thr = best;
  }
}

// Block (chunk b, row r): the K largest keys of logits [b * kTopkChunk, +kTopkChunk) of row r, into
// part[(r * NB + b) * K ..]. Each warp selects from its 1024 keys in registers, warp 0 from the 8 lists.
template <class T>
__global__ void __launch_bounds__(kTopkThreads)
    topk_partial_kernel(const T* __restrict__ logits, int64_t ldl, int V, int K, u64* __restrict__ part, int NB) {
  constexpr int kWarpsPerBlock = kTopkThreads / 32;
  __shared__ u64 warp_best[kWarpsPerBlock][kMaxCandidates];
  pdl_launch_dependents();
  const int b = blockIdx.x, r = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  pdl_wait();  // the logits come from the LM head
  const T* x = logits + int64_t(r) * ldl;
  const int first = b * kTopkChunk + warp * 32 * kTopkPerThread;
  u64 key[kTopkPerThread];
#pragma unroll
  for (int e = 0; e < kTopkPerThread; ++e) {
    const int i = first + 32 * e + lane;
    key[e] = i < V ? logit_key(to_float(x[i]), i) : 0ull;
  }
  u64 thr = ~0ull;
  for (int k = 0; k < K; ++k) {
    u64 best = 0;
#pragma unroll
    for (int e = 0; e < kTopkPerThread; ++e)
      if (key[e] < thr && key[e] > best) best = key[e];
    best = warp_max_u64(best);
    if (lane == 0) warp_best[warp][k] = best;
    thr = best;
  }
  __syncthreads();
  if (warp == 0)
    warp_top_keys([&](int i) { return warp_best[i / K][i % K]; }, kWarpsPerBlock * K, K,
                  part + (int64_t(r) * NB + b) * K, lane);
}

// Block r: the K largest of row r's NB * K partial keys, in order: the candidate ids into cand and
// their logits into cand_val [R][K].
__global__ void __launch_bounds__(kTopkThreads)
    topk_merge_kernel(const u64* __restrict__ part, int NB, int K, int32_t* __restrict__ cand, int64_t ldc,
                      float* __restrict__ cand_val) {
  extern __shared__ __align__(16) unsigned char merge_smem[];
  u64* keys = reinterpret_cast<u64*>(merge_smem);  // [NB * K]
  __shared__ u64 warp_best[kTopkThreads / 32];
  pdl_launch_dependents();
  const int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n = NB * K;
  pdl_wait();
  for (int i = threadIdx.x; i < n; i += kTopkThreads) keys[i] = part[int64_t(r) * n + i];
  __syncthreads();
  u64 thr = ~0ull;
  for (int k = 0; k < K; ++k) {
    u64 best = 0;
    for (int i = threadIdx.x; i < n; i += kTopkThreads)
      if (keys[i] < thr && keys[i] > best) best = keys[i];
    best = warp_max_u64(best);
    if (lane == 0) warp_best[warp] = best;
    __syncthreads();
    best = 0;
    for (int w = 0; w < kTopkThreads / 32; ++w) best = max(best, warp_best[w]);
    __syncthreads();  // warp_best is rewritten by the next round
    if (threadIdx.x == 0) {
      cand[int64_t(r) * ldc + k] = key_id(best);
      cand_val[r * K + k] = key_value(best);
    }
    thr = best;
  }
}

// Block t: score[t][p][c] = logit(c) + sum_j pred[p, j] h[t, j] succ[c, j] for the candidates c of
// row t and the predecessors p (the anchor at t = 0, else the candidates of row t - 1), the sum in
// j order as the CPU forms it: w_j = pred[p, j] h[t, j], then s += w_j succ[c, j], each step rounded.
template <class T>
__global__ void __launch_bounds__(kPairThreads)
    selector_pair_kernel(const T* __restrict__ h, int64_t ldh, const bf16* __restrict__ pred, int64_t ldp,
                         const bf16* __restrict__ succ, int64_t lds, const int32_t* __restrict__ anchor,
                         const int32_t* __restrict__ cand, int64_t ldc, const float* __restrict__ cand_val, int K,
                         int rank, int V, float* __restrict__ score) {
  extern __shared__ __align__(16) unsigned char pair_smem[];
  const int t = blockIdx.x, P = t == 0 ? 1 : K, ld = rank + 1;  // rows padded: conflict-free column reads
  float* w_s = reinterpret_cast<float*>(pair_smem);  // [P][ld]
  float* b_s = w_s + P * ld;                         // [K][ld]
  pdl_launch_dependents();
  pdl_wait();
  for (int i = threadIdx.x; i < P * rank; i += kPairThreads) {
    const int p = i / rank, j = i % rank;
    const int prev = min(max(t == 0 ? anchor[0] : cand[int64_t(t - 1) * ldc + p], 0), V - 1);
    w_s[p * ld + j] = __fmul_rn(__bfloat162float(pred[int64_t(prev) * ldp + j]), to_float(h[int64_t(t) * ldh + j]));
  }
  for (int i = threadIdx.x; i < K * rank; i += kPairThreads) {
    const int c = i / rank, j = i % rank;
    const int id = min(max(cand[int64_t(t) * ldc + c], 0), V - 1);
    b_s[c * ld + j] = __bfloat162float(succ[int64_t(id) * lds + j]);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < P * K; i += kPairThreads) {
    const int p = i / K, c = i % K;
    const float* w = w_s + p * ld;
    const float* b = b_s + c * ld;
    float s = 0.0f;
    for (int j = 0; j < rank; ++j) s = __fadd_rn(s, __fmul_rn(w[j], b[j]));
    score[(int64_t(t) * K + p) * K + c] = __fadd_rn(cand_val[t * K + c], s);
  }
}

// exp(x) correctly rounded to float (as sampling.cu's sampler forms it, to match the CPU's expf).
__device__ __forceinline__ float exp_correct(float x) { return __double2float_rn(exp(double(x))); }

// One warp walks the rows: at row t the scores given the previous choice, the highest (first on
// ties) at temperature 0, else a draw from softmax(score / temperature) with uniform_hash(seed,
// step[0] + t), as cpu/dflash.cpp forms them.
__global__ void selector_walk_kernel(const float* __restrict__ score, const int32_t* __restrict__ cand, int64_t ldc,
                                     int R, int K, float temperature, uint64_t seed, const int32_t* __restrict__ step,
                                     int32_t* __restrict__ tokens, float* __restrict__ cand_prob, int64_t ldq) {
  __shared__ float q_s[kMaxCandidates];
  __shared__ int best_s;
  pdl_launch_dependents();
  const int lane = threadIdx.x;
  pdl_wait();
  const uint64_t c0 = uint32_t(step[0]);
  int prev = 0;  // index of the previous choice among row t - 1's candidates (row 0: the anchor's scores)
  for (int t = 0; t < R; ++t) {
    const float* sc = score + (int64_t(t) * K + prev) * K;
    float v = -INFINITY;
    int best = INT_MAX;
    for (int k = lane; k < K; k += 32)
      if (sc[k] > v || (sc[k] == v && k < best) || best == INT_MAX) v = sc[k], best = k;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
      const int b2 = __shfl_xor_sync(0xffffffffu, best, o);
      if (v2 > v || (v2 == v && b2 < best)) v = v2, best = b2;
    }
    float* q = cand_prob + int64_t(t) * ldq;
    if (!(temperature > 0.0f)) {
      for (int k = lane; k < K; k += 32) q[k] = k == best ? 1.0f : 0.0f;
    } else {
      if (lane == 0) {  // q = softmax(score / temperature), a draw by its cumulative sum in candidate order
        double total = 0.0;
        for (int k = 0; k < K; ++k) {
          q_s[k] = exp_correct(__fdiv_rn(__fsub_rn(sc[k], sc[best]), temperature));
          total = __dadd_rn(total, double(q_s[k]));
        }
        for (int k = 0; k < K; ++k) q_s[k] = __double2float_rn(__ddiv_rn(double(q_s[k]), total));
        const double target = uniform_hash(seed, c0 + uint64_t(t));
        double cum = 0.0;
        int pick = 0;
        for (; pick < K - 1; ++pick) {
          cum = __dadd_rn(cum, double(q_s[pick]));
          if (cum > target && q_s[pick] > 0.0f) break;
        }
        best_s = pick;
      }
      __syncwarp();
      best = best_s;
      for (int k = lane; k < K; k += 32) q[k] = q_s[k];
      __syncwarp();  // q_s and best_s are rewritten at the next row
    }
    if (lane == 0) tokens[t] = cand[int64_t(t) * ldc + best];
    prev = best;
  }
}

template <class T>
void launch_selector_walk(const Tensor& logits, const Tensor& h, const Tensor& pred, const Tensor& succ,
                          const Tensor& anchor, float temperature, uint64_t seed, const Tensor& step,
                          const Tensor& tokens, const Tensor& cand, const Tensor& cand_prob, void* workspace,
                          const LaunchCtx& ctx) {
  const int R = int(logits.dim(0)), V = int(logits.dim(1)), K = int(cand.dim(1)), rank = int(h.dim(1));
  const int NB = (V + kTopkChunk - 1) / kTopkChunk;
  char* ws = static_cast<char*>(workspace);
  u64* part = reinterpret_cast<u64*>(ws);
  float* cand_val = reinterpret_cast<float*>(ws + size_t(R) * NB * K * sizeof(u64));
  float* score = cand_val + size_t(R) * K;
  launch_pdl(ctx, "topk_partial_kernel", topk_partial_kernel<T>, dim3(unsigned(NB), unsigned(R)), kTopkThreads, 0,
             logits.ptr<const T>(), logits.row_stride, V, K, part, NB);
  // Once per instantiation (thread-safe static initialisation; allowed during graph capture): the
  // largest dynamic shared memory the op admits (selector_walk checks the sizes against it).
  static const cudaError_t a1 =
      cudaFuncSetAttribute(topk_merge_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSelectorMaxSmem);
  static const cudaError_t a2 =
      cudaFuncSetAttribute(selector_pair_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSelectorMaxSmem);
  check_cuda(a1, "cudaFuncSetAttribute (topk_merge_kernel)");
  check_cuda(a2, "cudaFuncSetAttribute (selector_pair_kernel)");
  const size_t merge_smem = size_t(NB) * K * sizeof(u64);
  launch_pdl(ctx, "topk_merge_kernel", topk_merge_kernel, unsigned(R), kTopkThreads, merge_smem, part, NB, K,
             cand.ptr<int32_t>(), cand.row_stride, cand_val);
  const size_t pair_smem = size_t(2 * K) * (rank + 1) * sizeof(float);
  launch_pdl(ctx, "selector_pair_kernel", selector_pair_kernel<T>, unsigned(R), kPairThreads, pair_smem,
             h.ptr<const T>(), h.row_stride, pred.ptr<const bf16>(), pred.row_stride, succ.ptr<const bf16>(),
             succ.row_stride, anchor.ptr<const int32_t>(), cand.ptr<const int32_t>(), cand.row_stride, cand_val, K,
             rank, V, score);
  launch_pdl(ctx, "selector_walk_kernel", selector_walk_kernel, 1, 32, 0, score, cand.ptr<const int32_t>(),
             cand.row_stride, R, K, temperature, seed, step.ptr<const int32_t>(), tokens.ptr<int32_t>(),
             cand_prob.ptr<float>(), cand_prob.row_stride);
}

size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

}  // namespace
}  // namespace cuda

void CudaBackend::draft_store_kv(const Tensor& kv, const Tensor& k_norm, const Tensor& positions,
                                 const AttentionParams& p, const Tensor& k_cache, const Tensor& v_cache) {
  using namespace cuda;
  const char* op = "draft_store_kv";
  require_float(kv, op, "kv");
  require_tensor(positions, DType::I32, op, "positions");
  require_tensor(k_cache, DType::BF16, op, "k_cache");
  require_tensor(v_cache, DType::BF16, op, "v_cache");
  const ParamView kn = param_view(k_norm, op, "k_norm");
  const int64_t T = kv.dim(0), Hkv = p.num_kv_heads, hd = p.head_dim;
  OCRIA_RT_REQUIRE(hd >= 2 && hd <= 256 && hd % 2 == 0, op, "head_dim " + std::to_string(hd) + " unsupported (even, <= 256)");
  OCRIA_RT_REQUIRE(kv.ndim == 2 && kv.dim(1) == 2 * Hkv * hd, op, "kv " + kv.shape_str());
  OCRIA_RT_REQUIRE(k_norm.numel() == hd, op, "k_norm must have head_dim elements");
  OCRIA_RT_REQUIRE(positions.numel() == T, op, "positions must have T elements");
  OCRIA_RT_REQUIRE(k_cache.ndim >= 2 && k_cache.row_size() == Hkv * hd && v_cache.row_size() == Hkv * hd &&
                       k_cache.row_stride == v_cache.row_stride && k_cache.dim(0) == v_cache.dim(0),
                   op, "k_cache " + k_cache.shape_str() + " / v_cache " + v_cache.shape_str() + " vs Hkv * head_dim");
  OCRIA_RT_REQUIRE(k_cache.dim(0) < (int64_t(1) << 31), op, "too many cache rows");
  if (T == 0) return;
  activate();
  const unsigned blocks = unsigned((T * Hkv + kRopeWarps - 1) / kRopeWarps);
  auto launch = [&](auto* src) {
    launch_pdl(launch_ctx(), "draft_rope_kernel", draft_rope_kernel<std::remove_const_t<std::remove_pointer_t<decltype(src)>>>,
               blocks, kRopeWarps * 32, 0, src, kv.row_stride, kn, positions.ptr<const int32_t>(), int(T), int(Hkv),
               int(hd), p.rope_theta, p.norm_eps, true, Hkv * hd, static_cast<bf16*>(nullptr), k_cache.ptr<bf16>(),
               v_cache.ptr<bf16>(), k_cache.row_stride, int(k_cache.dim(0)));
  };
  if (kv.dtype == DType::BF16) launch(kv.ptr<const bf16>());
  else launch(kv.ptr<const float>());
}

void CudaBackend::draft_attention(const Tensor& q, const Tensor& q_norm, const Tensor& positions, const Tensor& k_cache,
                                  const Tensor& v_cache, const AttentionParams& p, const DraftMask& mask,
                                  const Tensor& out) {
  using namespace cuda;
  const char* op = "draft_attention";
  require_float(q, op, "q");
  require_tensor(positions, DType::I32, op, "positions");
  require_tensor(k_cache, DType::BF16, op, "k_cache");
  require_tensor(v_cache, DType::BF16, op, "v_cache");
  require_tensor(out, DType::BF16, op, "out");
  const ParamView qn = param_view(q_norm, op, "q_norm");
  const int64_t T = q.dim(0), Hq = p.num_q_heads, Hkv = p.num_kv_heads, hd = p.head_dim;
  OCRIA_RT_REQUIRE(hd == 16 || hd == 32 || hd == 64 || hd == 128 || hd == 256, op,
                   "head_dim " + std::to_string(hd) + " unsupported (16/32/64/128/256)");
  OCRIA_RT_REQUIRE(Hkv > 0 && Hq % Hkv == 0, op, "num_q_heads must be a multiple of num_kv_heads");
  OCRIA_RT_REQUIRE(q.ndim == 2 && q.dim(1) == Hq * hd, op, "q " + q.shape_str());
  OCRIA_RT_REQUIRE(out.ndim == 2 && out.dim(0) == T && out.dim(1) == Hq * hd, op, "out " + out.shape_str());
  OCRIA_RT_REQUIRE(q_norm.numel() == hd, op, "q_norm must have head_dim elements");
  OCRIA_RT_REQUIRE(positions.numel() == T, op, "positions must have T elements");
  OCRIA_RT_REQUIRE(k_cache.ndim >= 2 && k_cache.row_size() == Hkv * hd && v_cache.row_size() == Hkv * hd &&
                       k_cache.row_stride == v_cache.row_stride && k_cache.dim(0) == v_cache.dim(0),
                   op, "k_cache " + k_cache.shape_str() + " / v_cache " + v_cache.shape_str() + " vs Hkv * head_dim");
  OCRIA_RT_REQUIRE(aligned16(k_cache.data) && aligned16(v_cache.data) && k_cache.row_stride % 8 == 0, op,
                   "the caches' rows must be 16-byte aligned");
  OCRIA_RT_REQUIRE(reinterpret_cast<uintptr_t>(out.data) % 4 == 0 && out.row_stride % 2 == 0, op,
                   "out must be 4-byte aligned with an even row stride");
  OCRIA_RT_REQUIRE(k_cache.dim(0) < (int64_t(1) << 31) && T * Hq < (int64_t(1) << 31), op, "too many rows");
  OCRIA_RT_REQUIRE(mask.window >= 0, op, "negative window");
  if (T == 0) return;
  activate();
  const int64_t G = Hq / Hkv, zgroups = (T * G + kDraftRows - 1) / kDraftRows;
  OCRIA_RT_REQUIRE(zgroups <= 65535, op, "too many query rows");
  // Splits: about two blocks per SM over the (kv head, query-row group) pairs, at most one per
  // kDraftMinChunk cache rows, as the workspace allows.
  const size_t q_bytes = align256(size_t(T * Hq * hd) * sizeof(bf16));
  auto bytes = [&](int64_t ns) {
    return q_bytes + align256(size_t(ns * T * Hq * hd) * sizeof(float)) + align256(size_t(ns * T * Hq) * sizeof(float2));
  };
  int64_t nsplit = std::min<int64_t>({(k_cache.dim(0) + kDraftMinChunk - 1) / kDraftMinChunk,
                                      std::max<int64_t>(1, 2 * sm_count_ / (Hkv * zgroups)), kDraftMaxSplits});
  nsplit = std::max<int64_t>(nsplit, 1);
  while (nsplit > 1 && bytes(nsplit) > workspace_bytes_) nsplit = (nsplit + 1) / 2;
  OCRIA_RT_REQUIRE(bytes(nsplit) <= workspace_bytes_, op, "workspace too small: call reserve_workspace()");

  // q normed and rotated into the workspace, then the split kernel (and the combine).
  char* ws = static_cast<char*>(workspace_);
  bf16* q_rot = reinterpret_cast<bf16*>(ws);
  const unsigned rope_blocks = unsigned((T * Hq + kRopeWarps - 1) / kRopeWarps);
  auto rope = [&](auto* src) {
    launch_pdl(launch_ctx(), "draft_rope_kernel", draft_rope_kernel<std::remove_const_t<std::remove_pointer_t<decltype(src)>>>,
               rope_blocks, kRopeWarps * 32, 0, src, q.row_stride, qn, positions.ptr<const int32_t>(), int(T), int(Hq),
               int(hd), p.rope_theta, p.norm_eps, false, int64_t(0), q_rot, static_cast<bf16*>(nullptr),
               static_cast<bf16*>(nullptr), int64_t(0), 0);
  };
  if (q.dtype == DType::BF16) rope(q.ptr<const bf16>());
  else rope(q.ptr<const float>());

  DraftAttnArgs a;
  a.q = q_rot;
  a.k = k_cache.ptr<const bf16>();
  a.v = v_cache.ptr<const bf16>();
  a.ldc = k_cache.row_stride;
  a.rows = int(k_cache.dim(0));
  a.positions = positions.ptr<const int32_t>();
  a.T = int(T);
  a.Hq = int(Hq);
  a.G = int(G);
  a.causal = mask.causal;
  a.window = int(std::min<int64_t>(mask.window, int64_t(1) << 30));
  a.scale_log2 = p.scale * 1.4426950408889634f;
  a.nsplit = int(nsplit);
  a.part_o = reinterpret_cast<float*>(ws + q_bytes);
  a.part_ml = reinterpret_cast<float2*>(ws + q_bytes + align256(size_t(nsplit * T * Hq * hd) * sizeof(float)));
  a.out = out.ptr<bf16>();
  a.ldo = out.row_stride;
  const LaunchCtx ctx = launch_ctx();
  switch (hd) {
    case 16: launch_draft_attention<16>(a, int(Hkv), int(zgroups), ctx); break;
    case 32: launch_draft_attention<32>(a, int(Hkv), int(zgroups), ctx); break;
    case 64: launch_draft_attention<64>(a, int(Hkv), int(zgroups), ctx); break;
    case 128: launch_draft_attention<128>(a, int(Hkv), int(zgroups), ctx); break;
    case 256: launch_draft_attention<256>(a, int(Hkv), int(zgroups), ctx); break;
  }
}

void CudaBackend::dynamic_conv(const Tensor& x, const Tensor& dyn, const Tensor& base, int64_t group, const Tensor& out) {
  using namespace cuda;
  const char* op = "dynamic_conv";
  require_float(x, op, "x");
  require_tensor(dyn, x.dtype, op, "dyn");
  require_tensor(out, x.dtype, op, "out");
  require_tensor(base, DType::F32, op, "base");
  const int64_t T = x.dim(0), C = x.dim(1), K = base.dim(0);
  OCRIA_RT_REQUIRE(x.ndim == 2 && out.ndim == 2 && dyn.ndim == 2 && base.ndim == 2 && group > 0 && C % group == 0 &&
                       base.dim(1) == C && dyn.dim(0) == T && dyn.dim(1) == K * (C / group) && out.dim(0) == T &&
                       out.dim(1) == C,
                   op, "x " + x.shape_str() + ", dyn " + dyn.shape_str() + ", base " + base.shape_str() + ", out " +
                           out.shape_str() + ", group " + std::to_string(group));
  OCRIA_RT_REQUIRE(T <= 65535 && C < (int64_t(1) << 31), op, "x " + x.shape_str() + " too large");
  if (T == 0 || C == 0) return;
  activate();
  const dim3 grid(unsigned((C + 255) / 256), unsigned(T));
  if (x.dtype == DType::BF16)
    launch_pdl(launch_ctx(), "dynamic_conv_kernel", dynamic_conv_kernel<bf16>, grid, 256, 0, x.ptr<const bf16>(),
               x.row_stride, dyn.ptr<const bf16>(), dyn.row_stride, base.ptr<const float>(), base.row_stride,
               out.ptr<bf16>(), out.row_stride, int(T), int(C), int(K), int(group));
  else
    launch_pdl(launch_ctx(), "dynamic_conv_kernel", dynamic_conv_kernel<float>, grid, 256, 0, x.ptr<const float>(),
               x.row_stride, dyn.ptr<const float>(), dyn.row_stride, base.ptr<const float>(), base.row_stride,
               out.ptr<float>(), out.row_stride, int(T), int(C), int(K), int(group));
}

void CudaBackend::scale_softcap(const Tensor& x, float multiplier, float softcap) {
  using namespace cuda;
  const char* op = "scale_softcap";
  require_float(x, op, "x");
  OCRIA_RT_REQUIRE(x.ndim == 1 || x.ndim == 2, op, "x " + x.shape_str() + " must be [R, V] or [V]");
  const int64_t rows = x.ndim == 1 ? 1 : x.dim(0), cols = x.dim(-1), ld = x.ndim == 1 ? cols : x.row_stride;
  if (rows * cols == 0) return;
  activate();
  const unsigned blocks = unsigned(std::min<int64_t>((rows * cols + 255) / 256, int64_t(sm_count_) * 8));
  if (x.dtype == DType::BF16)
    launch_pdl(launch_ctx(), "scale_softcap_kernel", scale_softcap_kernel<bf16>, blocks, 256, 0, x.ptr<bf16>(), ld, rows,
               cols, multiplier, softcap);
  else
    launch_pdl(launch_ctx(), "scale_softcap_kernel", scale_softcap_kernel<float>, blocks, 256, 0, x.ptr<float>(), ld,
               rows, cols, multiplier, softcap);
}

void CudaBackend::selector_walk(const Tensor& logits, const Tensor& h, const Tensor& pred, const Tensor& succ,
                                const Tensor& anchor, float temperature, uint64_t seed, const Tensor& step,
                                const Tensor& tokens, const Tensor& cand, const Tensor& cand_prob) {
  using namespace cuda;
  const char* op = "selector_walk";
  require_float(logits, op, "logits");
  require_tensor(h, logits.dtype, op, "h");
  require_tensor(pred, DType::BF16, op, "predecessor_codebook");
  require_tensor(succ, DType::BF16, op, "successor_codebook");
  require_tensor(anchor, DType::I32, op, "anchor");
  require_tensor(step, DType::I32, op, "step");
  require_tensor(tokens, DType::I32, op, "tokens");
  require_tensor(cand, DType::I32, op, "cand");
  require_tensor(cand_prob, DType::F32, op, "cand_prob");
  OCRIA_RT_REQUIRE(logits.ndim == 2 && h.ndim == 2 && pred.ndim == 2 && succ.ndim == 2 && cand.ndim == 2 &&
                       cand_prob.ndim == 2,
                   op, "logits, h, codebooks, cand, cand_prob must be 2-D");
  const int64_t R = logits.dim(0), V = logits.dim(1), rank = h.dim(1), K = cand.dim(1);
  OCRIA_RT_REQUIRE(K >= 1 && K <= kMaxCandidates && K <= V, op,
                   "candidates " + std::to_string(K) + " unsupported (1.." + std::to_string(kMaxCandidates) + ", <= V)");
  OCRIA_RT_REQUIRE(h.dim(0) == R && pred.dim(0) == V && succ.dim(0) == V && pred.dim(1) == rank && succ.dim(1) == rank &&
                       cand.dim(0) == R && cand_prob.dim(0) == R && cand_prob.dim(1) == K && tokens.numel() == R &&
                       anchor.numel() == 1 && step.numel() == 1,
                   op, "logits " + logits.shape_str() + ", h " + h.shape_str() + ", codebooks " + pred.shape_str() +
                           " / " + succ.shape_str() + ", candidates " + cand.shape_str() + " / " + cand_prob.shape_str());
  OCRIA_RT_REQUIRE(V < (int64_t(1) << 31) && R <= 65535 && rank >= 1, op, "logits " + logits.shape_str() + " unsupported");
  const int64_t NB = (V + kTopkChunk - 1) / kTopkChunk;
  const size_t merge_smem = size_t(NB * K) * sizeof(u64), pair_smem = size_t(2 * K) * size_t(rank + 1) * sizeof(float);
  OCRIA_RT_REQUIRE(merge_smem <= size_t(kSelectorMaxSmem) && pair_smem <= size_t(kSelectorMaxSmem), op,
                   "vocabulary, candidates or selector rank too large for shared memory");
  const size_t ws_bytes = size_t(R * NB * K) * sizeof(u64) + size_t(R * K) * sizeof(float) * (1 + size_t(K));
  OCRIA_RT_REQUIRE(ws_bytes <= workspace_bytes_, op, "workspace too small: call reserve_workspace()");
  if (R == 0) return;
  activate();
  if (logits.dtype == DType::BF16)
    launch_selector_walk<bf16>(logits, h, pred, succ, anchor, temperature, seed, step, tokens, cand, cand_prob,
                               workspace_, launch_ctx());
  else
    launch_selector_walk<float>(logits, h, pred, succ, anchor, temperature, seed, step, tokens, cand, cand_prob,
                                workspace_, launch_ctx());
}

}  // namespace ocria_rt
