// sample: one token per row of logits [R, V], the same rule as the CPU backend (cpu/sampling.cpp):
//  - temperature <= 0: argmax, lowest index on ties;
//  - else p = softmax((logits - max) / temperature); candidates ordered by p descending, ties by
//    lower index; keep the first top_k (if > 0), then the smallest prefix whose cumulative p reaches
//    top_p (if < 1); u = uniform_hash(seed, uint32(step[0] + r)); pick the first kept candidate whose
//    running sum exceeds u * (kept mass), else the last kept. step[0] += R.
//
// Exactness. p is computed as the CPU does (float(exp((x - max) / T) / double total)), with a
// correctly rounded division and exp (--use_fast_math would otherwise make both approximate). Cumulative sums are exact integers: every p is taken in 2^-52 fixed point
// (exact for p >= 2^-29, and the CPU's double running sum is exact there too), so sums do not depend
// on the order of additions and the result is deterministic.
//
// Order keys. key = ((0x3FFFFFFF - bits(p)) << IB) | index (IB = bits of V - 1): ascending keys are
// exactly the candidate order. Keys are radix-selected 12 bits at a time.
//
// Kernels (grid NB blocks x R rows for the passes over V, one block per row to decide):
//  1 max_kernel      block max / first argmax of the raw logits; zeroes the histograms.
//    greedy: greedy_kernel reduces the block results to the token.
//  2 exp_kernel      q = exp((x - max) / T) into the workspace, block sums (double); u of the row.
//  3 hist_kernel     p = q / total; histogram of the top 12 key bits (counts, fixed-point sums).
//  4 compact_kernel  finds the bins the fast path sorts (gather_range): with a top_k / top_p cut, all
//                    bins through the one where the cut falls, or that bin alone where they hold more
//                    than kCap candidates; without a cut, the bin the draw lands in. If they hold at
//                    most kCap candidates, appends them (unordered) to a list.
//  5 select_kernel   fast path: sorts the list and resolves cut and draw exactly (a draw that lands
//                    before a lone cut bin: one level of the descent below). Otherwise (flat
//                    distributions, whose bins hold more than kCap candidates) a radix descent over
//                    the workspace in one block, 12 bits per level.
#include <algorithm>
#include <climits>
#include <cmath>

#include "ops/cuda/backend.cuh"
#include "ops/sampling_rng.h"

namespace ocria_rt {
namespace cuda {
namespace {

using u64 = unsigned long long;

constexpr int kDigitBits = 12;
constexpr int kBins = 1 << kDigitBits;
constexpr int kCap = 8192;          // candidates one block sorts
constexpr int kPassThreads = 512;   // kernels 1-4
constexpr int kSelectThreads = 1024;
constexpr double kFix = 4503599627370496.0;  // 2^52

struct KeyFormat {
  int ib;      // index bits
  int pad;     // left shift that makes the key a whole number of digits
  int levels;  // digits per key
  int kbp;     // padded key bits = levels * 12
};

KeyFormat key_format(int64_t V) {
  int ib = 1;
  while ((int64_t(1) << ib) < V) ++ib;
  const int kb = 30 + ib;
  KeyFormat f;
  f.ib = ib;
  f.levels = (kb + kDigitBits - 1) / kDigitBits;
  f.kbp = f.levels * kDigitBits;
  f.pad = f.kbp - kb;
  return f;
}

__device__ __forceinline__ u64 make_key(float p, int idx, int ib) {
  return (u64(0x3FFFFFFFu - __float_as_uint(p)) << ib) | u64(idx);
}
__device__ __forceinline__ float key_prob(u64 key, int ib) { return __uint_as_float(0x3FFFFFFFu - uint32_t(key >> ib)); }
__device__ __forceinline__ u64 fixed(float p) { return __double2ull_rn(double(p) * kFix); }
// Digit `level` (0 = most significant) of the padded key.
__device__ __forceinline__ int key_digit(u64 key, const KeyFormat& f, int level) {
  return int(((key << f.pad) >> (f.kbp - kDigitBits * (level + 1))) & (kBins - 1));
}

// exp(x) correctly rounded to float (up to double-rounding cases of probability ~1e-9): through
// the double-precision exp, which --use_fast_math leaves alone (a polynomial in float was 1 ulp off
// for ~6% of inputs, enough to reorder near-equal candidates against the CPU's expf).
__device__ __forceinline__ float exp_accurate(float x) { return __double2float_rn(exp(double(x))); }

// The workspace of one group of rows.
struct SampleWs {
  float* pmax;     // [R][NB]
  int* parg;       // [R][NB]
  double* psum;    // [R][NB]
  float* prob;     // [R][V]: q, then p
  uint32_t* hcnt;  // [R][kBins]
  u64* hsum;       // [R][kBins]
  uint32_t* ncand; // [R]
  u64* cand;       // [R][kCap]
  float* u;        // [R]
  char* end;       // the first byte past the carved workspace
};

size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

size_t ws_bytes_per_row(int64_t V, int NB) {
  return align256(NB * 4) + align256(NB * 4) + align256(NB * 8) + align256(V * 4) + align256(kBins * 4) +
         align256(kBins * 8) + align256(4) + align256(kCap * 8) + align256(4);
}

SampleWs carve(void* base, int64_t R, int64_t V, int NB) {
  char* p = static_cast<char*>(base);
  auto take = [&](size_t bytes) {
    char* q = p;
    p += align256(bytes);
    return q;
  };
  SampleWs w;
  w.pmax = reinterpret_cast<float*>(take(R * NB * 4));
  w.parg = reinterpret_cast<int*>(take(R * NB * 4));
  w.psum = reinterpret_cast<double*>(take(R * NB * 8));
  w.prob = reinterpret_cast<float*>(take(R * V * 4));
  w.hcnt = reinterpret_cast<uint32_t*>(take(R * kBins * 4));
  w.hsum = reinterpret_cast<u64*>(take(R * kBins * 8));
  w.ncand = reinterpret_cast<uint32_t*>(take(R * 4));
  w.cand = reinterpret_cast<u64*>(take(R * kCap * 8));
  w.u = reinterpret_cast<float*>(take(R * 4));
  w.end = p;
  return w;
}

// ---- block-wide helpers ----

// (value, index) max with the lowest index on ties; NaN never wins.
__device__ __forceinline__ void argmax_merge(float& v, int& i, float v2, int i2) {
  if (v2 > v || (v2 == v && i2 < i)) {
    v = v2;
    i = i2;
  }
}

__device__ void block_argmax(float& v, int& i) {
  __shared__ float sv[32];
  __shared__ int si[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) argmax_merge(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
  __syncthreads();
  if (lane == 0) {
    sv[warp] = v;
    si[warp] = i;
  }
  __syncthreads();
  v = lane < nw ? sv[lane] : -INFINITY;
  i = lane < nw ? si[lane] : INT_MAX;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) argmax_merge(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
}

__device__ double block_sum_double(double v) {
  __shared__ double s[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) s[warp] = v;
  __syncthreads();
  v = 0.0;
  if (warp == 0) {  // fixed order: deterministic
    v = lane < nw ? s[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;  // valid in thread 0
}

// Exclusive prefix sums over the block of one (count, sum) pair per thread; also the totals.
__device__ void block_scan2(uint32_t c, u64 s, uint32_t& c_excl, u64& s_excl, uint32_t& c_tot, u64& s_tot) {
  __shared__ uint32_t wc[32];
  __shared__ u64 wsum[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  uint32_t ci = c;
  u64 si = s;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t c2 = __shfl_up_sync(0xffffffffu, ci, o);
    const u64 s2 = __shfl_up_sync(0xffffffffu, si, o);
    if (lane >= o) {
      ci += c2;
      si += s2;
    }
  }
  __syncthreads();
  if (lane == 31) {
    wc[warp] = ci;
    wsum[warp] = si;
  }
  __syncthreads();
  uint32_t cb = 0, ct = 0;
  u64 sb = 0, st = 0;
  for (int w = 0; w < nw; ++w) {
    if (w < warp) {
      cb += wc[w];
      sb += wsum[w];
    }
    ct += wc[w];
    st += wsum[w];
  }
  c_excl = cb + ci - c;
  s_excl = sb + si - s;
  c_tot = ct;
  s_tot = st;
}

// Predicates of a running (count, sum) at a position of the order.
enum : int { kCountGE = 0, kSumGE = 1, kSumGT = 2 };
__device__ __forceinline__ bool pred_holds(int mode, u64 thr, u64 cnt, u64 sum) {
  return mode == kCountGE ? cnt >= thr : mode == kSumGE ? sum >= thr : sum > thr;
}

// First bin (ascending) of a kBins histogram in shared memory where pred(base + inclusive prefix)
// holds; -1 if none. Also returns the exclusive prefix of that bin. blockDim.x divides kBins.
__device__ int first_bin(const uint32_t* cnt, const u64* sum, int mode, u64 thr, u64 base_cnt, u64 base_sum,
                         u64& excl_cnt, u64& excl_sum) {
  __shared__ int found;
  __shared__ u64 f_cnt, f_sum;
  const int per = kBins / blockDim.x, b0 = threadIdx.x * per;
  uint32_t c = 0;
  u64 s = 0;
  for (int b = b0; b < b0 + per; ++b) {
    c += cnt[b];
    s += sum[b];
  }
  uint32_t ce, ct;
  u64 se, st;
  block_scan2(c, s, ce, se, ct, st);
  if (threadIdx.x == 0) found = INT_MAX;
  __syncthreads();
  u64 rc = base_cnt + ce, rs = base_sum + se;
  for (int b = b0; b < b0 + per; ++b) {
    if (pred_holds(mode, thr, rc + cnt[b], rs + sum[b])) {
      atomicMin(&found, b);
      break;
    }
    rc += cnt[b];
    rs += sum[b];
  }
  __syncthreads();
  const int fb = found;
  if (fb != INT_MAX && fb >= b0 && fb < b0 + per) {  // the owner of the bin reports its prefix
    u64 pc = base_cnt + ce, ps = base_sum + se;
    for (int b = b0; b < fb; ++b) {
      pc += cnt[b];
      ps += sum[b];
    }
    f_cnt = pc;
    f_sum = ps;
  }
  __syncthreads();
  excl_cnt = f_cnt;
  excl_sum = f_sum;
  __syncthreads();
  return fb == INT_MAX ? -1 : fb;
}

// Ascending bitonic sort of keys[0, n) in shared memory (n <= kCap), padding with ~0.
__device__ void bitonic_sort(u64* keys, int n) {
  int N = 2;
  while (N < n) N <<= 1;
  for (int i = n + threadIdx.x; i < N; i += blockDim.x) keys[i] = ~0ull;
  __syncthreads();
  for (int k = 2; k <= N; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < N; i += blockDim.x) {
        const int ixj = i ^ j;
        if (ixj > i) {
          const u64 a = keys[i], b = keys[ixj];
          if ((a > b) == ((i & k) == 0)) {
            keys[i] = b;
            keys[ixj] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

// Inclusive fixed-point prefix sums of the sorted keys[0, n) into cum[0, n), starting at base.
__device__ void prefix_sums(const u64* keys, u64* cum, int n, u64 base, int ib) {
  const int per = (n + blockDim.x - 1) / blockDim.x, i0 = threadIdx.x * per, i1 = min(n, i0 + per);
  u64 s = 0;
  for (int i = i0; i < i1; ++i) s += fixed(key_prob(keys[i], ib));
  uint32_t ce, ct;
  u64 se, st;
  block_scan2(0, s, ce, se, ct, st);
  u64 run = base + se;
  for (int i = i0; i < i1; ++i) {
    run += fixed(key_prob(keys[i], ib));
    cum[i] = run;
  }
  __syncthreads();
}

// First position i < n of sorted candidates (global rank base_cnt + i + 1, running sum cum[i]) where
// pred holds; n if none.
__device__ int first_position(const u64* cum, int n, int mode, u64 thr, u64 base_cnt) {
  __shared__ int found;
  if (threadIdx.x == 0) found = n;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    if (pred_holds(mode, thr, base_cnt + i + 1, cum[i])) atomicMin(&found, i);
  __syncthreads();
  const int f = found;
  __syncthreads();
  return f;
}

// ---- kernels ----

template <class T>
__global__ void __launch_bounds__(kPassThreads)
    max_kernel(const T* __restrict__ logits, int64_t ldl, int V, int chunk, SampleWs ws, int NB, bool zero_hist) {
  pdl_launch_dependents();
  pdl_wait();  // the logits come from the LM head; the workspace was last used by earlier kernels
  const int r = blockIdx.y, b = blockIdx.x;
  const T* x = logits + int64_t(r) * ldl;
  const int lo = b * chunk, hi = min(V, lo + chunk);
  float v = -INFINITY;
  int idx = INT_MAX;
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) argmax_merge(v, idx, to_float(x[i]), i);
  block_argmax(v, idx);
  if (threadIdx.x == 0) {
    ws.pmax[r * NB + b] = v;
    ws.parg[r * NB + b] = idx;
    if (b == 0 && zero_hist) ws.ncand[r] = 0;
  }
  if (zero_hist) {
    const int per = (kBins + NB - 1) / NB;
    for (int i = b * per + threadIdx.x; i < min(kBins, (b + 1) * per); i += blockDim.x) {
      ws.hcnt[int64_t(r) * kBins + i] = 0;
      ws.hsum[int64_t(r) * kBins + i] = 0;
    }
  }
}

__global__ void greedy_kernel(SampleWs ws, int NB, int32_t* __restrict__ tokens, int32_t* __restrict__ step, int R) {
  pdl_launch_dependents();
  pdl_wait();
  const int r = blockIdx.x;
  float v = -INFINITY;
  int idx = INT_MAX;
  for (int b = threadIdx.x; b < NB; b += 32) argmax_merge(v, idx, ws.pmax[r * NB + b], ws.parg[r * NB + b]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) argmax_merge(v, idx, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, idx, o));
  if (threadIdx.x == 0) {
    tokens[r] = idx == INT_MAX ? 0 : idx;  // all-NaN row: 0
    if (r == 0) step[0] += R;               // nothing else reads step in greedy mode
  }
}

__device__ __forceinline__ float row_max(const SampleWs& ws, int r, int NB) {
  float m = -INFINITY;
  for (int b = 0; b < NB; ++b) m = fmaxf(m, ws.pmax[r * NB + b]);
  return m;
}

template <class T>
__global__ void __launch_bounds__(kPassThreads)
    exp_kernel(const T* __restrict__ logits, int64_t ldl, int V, int chunk, SampleWs ws, int NB, float temperature,
               uint64_t seed, const int32_t* __restrict__ step, int u_row) {
  pdl_launch_dependents();
  pdl_wait();
  __shared__ float s_max;
  const int r = blockIdx.y, b = blockIdx.x;
  if (threadIdx.x == 0) s_max = row_max(ws, r, NB);
  __syncthreads();
  const float mx = s_max;
  const T* x = logits + int64_t(r) * ldl;
  float* q = ws.prob + int64_t(r) * V;
  const int lo = b * chunk, hi = min(V, lo + chunk);
  double s = 0.0;
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const float e = exp_accurate(__fdiv_rn(to_float(x[i]) - mx, temperature));
    q[i] = e;
    s += double(e);
  }
  s = block_sum_double(s);
  if (threadIdx.x == 0) {
    ws.psum[r * NB + b] = s;
    if (b == 0) ws.u[r] = uniform_hash(seed, uint64_t(uint32_t(step[0] + (u_row >= 0 ? u_row : r))));
  }
}

__global__ void __launch_bounds__(kPassThreads)
    hist_kernel(int V, int chunk, SampleWs ws, int NB, KeyFormat f) {
  pdl_launch_dependents();
  pdl_wait();
  extern __shared__ __align__(16) unsigned char smem[];
  u64* hs = reinterpret_cast<u64*>(smem);
  uint32_t* hc = reinterpret_cast<uint32_t*>(hs + kBins);
  __shared__ double s_total;
  const int r = blockIdx.y, b = blockIdx.x;
  for (int i = threadIdx.x; i < kBins; i += blockDim.x) {
    hs[i] = 0;
    hc[i] = 0;
  }
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (int i = 0; i < NB; ++i) t += ws.psum[r * NB + i];  // same order in every block
    s_total = t;
  }
  __syncthreads();
  const double total = s_total;
  float* p = ws.prob + int64_t(r) * V;
  const int lo = b * chunk, hi = min(V, lo + chunk);
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const float pi = __double2float_rn(__ddiv_rn(double(p[i]), total));
    p[i] = pi;
    const int d = key_digit(make_key(pi, i, f.ib), f, 0);
    atomicAdd(&hc[d], 1u);
    atomicAdd(&hs[d], fixed(pi));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBins; i += blockDim.x) {
    if (hc[i]) {
      atomicAdd(&ws.hcnt[int64_t(r) * kBins + i], hc[i]);
      atomicAdd(&ws.hsum[int64_t(r) * kBins + i], hs[i]);
    }
  }
}

// target = floor(mass * u24 / 2^24), exactly (mass < 2^54).
__device__ __forceinline__ u64 draw_target(u64 mass, float u) {
  const u64 m = u64(u * 16777216.0f);
  const u64 lo = mass * m, hi = __umul64hi(mass, m);
  return (hi << 40) | (lo >> 24);
}

// Count and fixed-point sum of the bins [lo, hi], in every thread.
__device__ void bin_totals(const uint32_t* hc, const u64* hs, int lo, int hi, u64& cnt, u64& sum) {
  uint32_t c = 0;
  u64 s = 0;
  for (int i = lo + int(threadIdx.x); i <= hi; i += blockDim.x) {
    c += hc[i];
    s += hs[i];
  }
  uint32_t ce, ct;
  u64 se, st;
  block_scan2(c, s, ce, se, ct, st);
  cnt = ct;
  sum = st;
}

// The bins [lo, hi] of the first-level histogram whose candidates the fast path sorts, computed alike
// by compact_kernel (which gathers them when they are at most kCap) and select_kernel. With a top_k /
// top_p cut, hi is the bin where the cut falls and lo is 0 (every kept candidate, where they are few)
// or hi (the cut bin alone: the cut and the mass are resolved there, and a draw that lands in an
// earlier bin is found by one pass of the descent). Without a cut the mass is every candidate's, so
// the draw's target is known from the histogram and lo = hi is the bin it lands in.
struct GatherRange {
  int lo = 0, hi = 0;
  bool cut = false;
  u64 n = 0;         // candidates in bins [lo, hi]; above kCap: the radix descent decides
  u64 base_cnt = 0;  // candidates before bin lo
  u64 base_sum = 0;  // their fixed-point sum
  u64 mass = 0;      // without a cut: the total mass
};

__device__ GatherRange gather_range(const uint32_t* hc, const u64* hs, int V, int top_k, u64 thr_p, bool use_p,
                                    float u) {
  GatherRange g;
  u64 kc = 0, ks = 0, pc = 0, ps = 0, sum;
  int bk = INT_MAX, bp = INT_MAX;
  if (top_k > 0 && top_k < V) {
    const int fb = first_bin(hc, hs, kCountGE, u64(top_k), 0, 0, kc, ks);
    if (fb >= 0) bk = fb;
  }
  if (use_p) {
    const int fb = first_bin(hc, hs, kSumGE, thr_p, 0, 0, pc, ps);
    if (fb >= 0) bp = fb;
  }
  g.cut = min(bk, bp) != INT_MAX;
  if (g.cut) {
    g.hi = min(bk, bp);
    bin_totals(hc, hs, 0, g.hi, g.n, sum);
    if (g.n <= u64(kCap)) return g;
    g.lo = g.hi;
    g.base_cnt = bk <= bp ? kc : pc;
    g.base_sum = bk <= bp ? ks : ps;
  } else {
    u64 all;
    bin_totals(hc, hs, 0, kBins - 1, all, g.mass);
    g.lo = g.hi = first_bin(hc, hs, kSumGT, draw_target(g.mass, u), 0, 0, g.base_cnt, g.base_sum);
    if (g.lo < 0) {  // cannot happen (the target lies below the mass): leave it to the descent
      g.n = ~0ull;
      return g;
    }
  }
  g.n = hc[g.lo];
  return g;
}

__global__ void __launch_bounds__(kPassThreads)
    compact_kernel(int V, int chunk, SampleWs ws, KeyFormat f, int top_k, u64 thr_p, bool use_p) {
  pdl_launch_dependents();
  pdl_wait();
  extern __shared__ __align__(16) unsigned char smem[];
  u64* hs = reinterpret_cast<u64*>(smem);
  uint32_t* hc = reinterpret_cast<uint32_t*>(hs + kBins);
  const int r = blockIdx.y, b = blockIdx.x;
  for (int i = threadIdx.x; i < kBins; i += blockDim.x) {
    hc[i] = ws.hcnt[int64_t(r) * kBins + i];
    hs[i] = ws.hsum[int64_t(r) * kBins + i];
  }
  __syncthreads();
  const GatherRange g = gather_range(hc, hs, V, top_k, thr_p, use_p, ws.u[r]);
  if (g.n > u64(kCap)) return;  // select_kernel takes the slow path
  // Appends the members of bins [lo, hi], one atomicAdd per warp and iteration.
  const float* p = ws.prob + int64_t(r) * V;
  const int lo = b * chunk, hi = min(V, lo + chunk), lane = threadIdx.x & 31;
  for (int i0 = lo; i0 < hi; i0 += blockDim.x) {
    const int i = i0 + threadIdx.x;
    u64 key = 0;
    bool take = false;
    if (i < hi) {
      key = make_key(p[i], i, f.ib);
      const int d = key_digit(key, f, 0);
      take = d >= g.lo && d <= g.hi;
    }
    const unsigned mask = __ballot_sync(0xffffffffu, take);
    if (mask == 0) continue;
    const int leader = __ffs(mask) - 1;
    uint32_t slot = 0;
    if (lane == leader) slot = atomicAdd(&ws.ncand[r], uint32_t(__popc(mask)));
    slot = __shfl_sync(0xffffffffu, slot, leader) + __popc(mask & ((1u << lane) - 1));
    if (take) ws.cand[int64_t(r) * kCap + slot] = key;
  }
}

struct Found {
  u64 key;
  u64 cnt;  // rank of key (1-based)
  u64 sum;  // running sum through key
  bool ok;
};

// Radix descent in one block over the p of row r: the first key (ascending) whose running
// (rank, sum) satisfies pred. hc / hs hold the first-level histogram on entry and are clobbered.
__device__ Found find_first(const float* __restrict__ p, int V, const KeyFormat& f, uint32_t* hc, u64* hs,
                            u64* keys, u64* cum, const uint32_t* h0c, const u64* h0s, int mode, u64 thr) {
  __shared__ uint32_t n_members;
  u64 prefix = 0, base_cnt = 0, base_sum = 0;
  for (int level = 0; level < f.levels; ++level) {
    if (level == 0) {
      for (int i = threadIdx.x; i < kBins; i += blockDim.x) {
        hc[i] = h0c[i];
        hs[i] = h0s[i];
      }
    } else {
      for (int i = threadIdx.x; i < kBins; i += blockDim.x) {
        hc[i] = 0;
        hs[i] = 0;
      }
      __syncthreads();
      const int shift = f.kbp - kDigitBits * level;
      for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const u64 key = make_key(p[i], i, f.ib);
        if (((key << f.pad) >> shift) == prefix) {
          const int d = key_digit(key, f, level);
          atomicAdd(&hc[d], 1u);
          atomicAdd(&hs[d], fixed(p[i]));
        }
      }
    }
    __syncthreads();
    u64 ec, es;
    const int bin = first_bin(hc, hs, mode, thr, base_cnt, base_sum, ec, es);
    if (bin < 0) return Found{0, 0, 0, false};
    const uint32_t members = hc[bin];
    prefix = (prefix << kDigitBits) | u64(bin);
    base_cnt = ec;
    base_sum = es;
    __syncthreads();
    if (members <= uint32_t(kCap) || level == f.levels - 1) {
      // Gather the bin's members, order them, and finish exactly.
      if (threadIdx.x == 0) n_members = 0;
      __syncthreads();
      const int shift = f.kbp - kDigitBits * (level + 1);
      for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const u64 key = make_key(p[i], i, f.ib);
        if (((key << f.pad) >> shift) == prefix) keys[atomicAdd(&n_members, 1u)] = key;
      }
      __syncthreads();
      const int n = int(n_members);
      bitonic_sort(keys, n);
      prefix_sums(keys, cum, n, base_sum, f.ib);
      const int pos = first_position(cum, n, mode, thr, base_cnt);
      if (pos >= n) return Found{0, 0, 0, false};  // cannot happen: the bin satisfied pred
      return Found{keys[pos], base_cnt + pos + 1, cum[pos], true};
    }
  }
  return Found{0, 0, 0, false};
}

// What the sampler keeps of a row and draws from it: the token drawn with the row's u; with a
// top-k / top-p cut, the key of the last kept candidate (keys ascend in candidate order, so the kept
// ones are those up to it); the kept mass (fixed point). The same in every thread.
struct RowSelection {
  int token;
  bool cut;
  u64 last_key;
  u64 mass;
};

constexpr int kSelectSmem = 2 * kCap * 8 + kBins * (8 + 4);  // keys, cum, the histogram

// Kernel 5's work for row r, by one block of kSelectThreads (smem: kSelectSmem bytes of scratch).
__device__ RowSelection select_row(int V, const SampleWs& ws, const KeyFormat& f, int top_k, u64 thr_p, bool use_p,
                                   int r, unsigned char* smem) {
  u64* keys = reinterpret_cast<u64*>(smem);  // [kCap]
  u64* cum = keys + kCap;                     // [kCap]
  u64* hs = cum + kCap;                       // [kBins]
  uint32_t* hc = reinterpret_cast<uint32_t*>(hs + kBins);
  RowSelection sel{0, false, ~0ull, 0};
  const uint32_t* h0c = ws.hcnt + int64_t(r) * kBins;
  const u64* h0s = ws.hsum + int64_t(r) * kBins;
  const float u = ws.u[r];
  const u64 k_eff = top_k > 0 ? u64(min(top_k, V)) : u64(V);
  for (int i = threadIdx.x; i < kBins; i += blockDim.x) {
    hc[i] = h0c[i];
    hs[i] = h0s[i];
  }
  __syncthreads();
  const GatherRange g = gather_range(hc, hs, V, top_k, thr_p, use_p, u);
  int token;
  if (g.n <= u64(kCap)) {
    // Fast path: compact_kernel gathered the candidates of bins [lo, hi], ranks base_cnt + 1 .. of
    // the order once sorted. With a cut, the first L of them are the last kept ones, and their sums
    // give the mass.
    const int n = int(ws.ncand[r]);
    for (int i = threadIdx.x; i < n; i += blockDim.x) keys[i] = ws.cand[int64_t(r) * kCap + i];
    __syncthreads();
    bitonic_sort(keys, n);
    prefix_sums(keys, cum, n, g.base_sum, f.ib);
    int L = n;
    u64 mass = g.mass;
    if (g.cut) {
      L = int(min(k_eff - g.base_cnt, u64(n)));
      if (use_p) L = min(L, first_position(cum, n, kSumGE, thr_p, 0) + 1);
      mass = cum[L - 1];
      sel.cut = true;
      sel.last_key = keys[L - 1];
    }
    sel.mass = mass;
    const u64 target = draw_target(mass, u);
    if (target >= g.base_sum) {  // the draw lands in the list
      const int pick = min(first_position(cum, L, kSumGT, target, 0), L - 1);
      token = int(keys[pick] & ((u64(1) << f.ib) - 1));
    } else {  // in a bin before the cut bin: kept, and found as the descent finds it
      const float* p = ws.prob + int64_t(r) * V;
      const u64 last = keys[L - 1];
      __syncthreads();  // keys is the descent's scratch
      const Found pk = find_first(p, V, f, hc, hs, keys, cum, h0c, h0s, kSumGT, target);
      token = int((pk.ok ? pk.key : last) & ((u64(1) << f.ib) - 1));
    }
  } else {
    // Slow path: radix descents over the whole row.
    const float* p = ws.prob + int64_t(r) * V;
    Found cut{0, u64(V), 0, false};
    if (top_k > 0 && k_eff < u64(V)) cut = find_first(p, V, f, hc, hs, keys, cum, h0c, h0s, kCountGE, k_eff);
    if (use_p) {
      const Found fp = find_first(p, V, f, hc, hs, keys, cum, h0c, h0s, kSumGE, thr_p);
      if (fp.ok && (!cut.ok || fp.key < cut.key)) cut = fp;
    }
    u64 mass = cut.sum;
    if (!cut.ok) {  // no cut: everything is kept
      __shared__ u64 s_mass;
      if (threadIdx.x == 0) s_mass = 0;
      __syncthreads();
      u64 s = 0;
      for (int i = threadIdx.x; i < kBins; i += blockDim.x) s += h0s[i];
      atomicAdd(&s_mass, s);
      __syncthreads();
      mass = s_mass;
      cut.cnt = u64(V);
    }
    sel.cut = cut.ok;
    sel.last_key = cut.ok ? cut.key : ~0ull;
    sel.mass = mass;
    const Found pk = find_first(p, V, f, hc, hs, keys, cum, h0c, h0s, kSumGT, draw_target(mass, u));
    u64 key;
    if (pk.ok && pk.cnt <= cut.cnt) {
      key = pk.key;
    } else {  // the last kept candidate
      key = find_first(p, V, f, hc, hs, keys, cum, h0c, h0s, kCountGE, cut.cnt).key;
    }
    token = int(key & ((u64(1) << f.ib) - 1));
  }
  sel.token = token;
  return sel;
}

__global__ void __launch_bounds__(kSelectThreads)
    select_kernel(int V, SampleWs ws, KeyFormat f, int top_k, u64 thr_p, bool use_p, int32_t* __restrict__ tokens,
                  int32_t* __restrict__ step, int R) {
  pdl_launch_dependents();
  pdl_wait();
  extern __shared__ __align__(16) unsigned char smem[];
  const int r = blockIdx.x;
  const RowSelection sel = select_row(V, ws, f, top_k, thr_p, use_p, r, smem);
  if (threadIdx.x == 0) {
    tokens[r] = sel.token;
    if (r == 0) step[0] += R;  // every row read step in exp_kernel, which has finished
  }
}

template <class T>
void launch_sample(const T* logits, int64_t ldl, int R, int V, const SamplerConfig& cfg, int32_t* step,
                   int32_t* tokens, void* workspace, int NB, const LaunchCtx& ctx) {
  const int chunk = (V + NB - 1) / NB;
  SampleWs ws = carve(workspace, R, V, NB);
  const bool greedy = !(cfg.temperature > 0.0f);
  launch_pdl(ctx, "sample max_kernel", max_kernel<T>, dim3(NB, R), kPassThreads, 0, logits, ldl, V, chunk, ws, NB,
             !greedy);
  if (greedy) {
    launch_pdl(ctx, "sample greedy_kernel", greedy_kernel, R, 32, 0, ws, NB, tokens, step, R);
    return;
  }
  const KeyFormat f = key_format(V);
  const bool use_p = cfg.top_p < 1.0f;
  const u64 thr_p = use_p ? u64(std::ceil(double(cfg.top_p) * kFix)) : 0;
  launch_pdl(ctx, "sample exp_kernel", exp_kernel<T>, dim3(NB, R), kPassThreads, 0, logits, ldl, V, chunk, ws, NB,
             cfg.temperature, cfg.seed, step, -1);

  constexpr int hist_smem = kBins * (8 + 4);
  static const cudaError_t a1 = cudaFuncSetAttribute(hist_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, hist_smem);
  static const cudaError_t a2 =
      cudaFuncSetAttribute(compact_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, hist_smem);
  constexpr int select_smem = kSelectSmem;
  static const cudaError_t a3 =
      cudaFuncSetAttribute(select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, select_smem);
  check_cuda(a1, "cudaFuncSetAttribute (sample hist_kernel)");
  check_cuda(a2, "cudaFuncSetAttribute (sample compact_kernel)");
  check_cuda(a3, "cudaFuncSetAttribute (sample select_kernel)");

  launch_pdl(ctx, "sample hist_kernel", hist_kernel, dim3(NB, R), kPassThreads, hist_smem, V, chunk, ws, NB, f);
  launch_pdl(ctx, "sample compact_kernel", compact_kernel, dim3(NB, R), kPassThreads, hist_smem, V, chunk, ws, f,
             cfg.top_k, thr_p, use_p);
  launch_pdl(ctx, "sample select_kernel", select_kernel, R, kSelectThreads, select_smem, V, ws, f, cfg.top_k, thr_p,
             use_p, tokens, step, R);
}


// ---------------------------------------------------------------------------------------------
// speculative_accept: the rule of cpu/sampling.cpp on the sampler's own distributions.
//
// Greedy: max_kernel over the B rows, then one block compares the argmaxes with the drafts.
// Sampling: kernels 1-4 over the B rows with every row's u the bonus / correction draw's,
// uniform_hash(seed, step[0] + B - 1); then accept_select_kernel, one block per row, resolves the
// row's cut, mass and draw from p with that u (select_row), and for a row r < B - 1
//  - tests the draft: accepted iff u_r q_r(d) < p_r(d), p_r(d) = prob(d) / mass on the kept tokens,
//    in double as the CPU forms it (the mass is the exact fixed-point sum, which is the CPU's double
//    sum wherever every kept p is at least 2^-29);
//  - if rejected, draws the correction from max(0, p - q): in fixed point (units of 2^-52 of the
//    unnormalised p), the residual of a kept token x is P(x) - m(x), m(x) = min(P(x), q(x) M), and
//    m is non-zero only on the at most Kq draft candidates c_1 < ... < c_n (key order). The first x
//    whose residual prefix F(x) = Pprefix(x) - sum_{c_j <= x} m(c_j) exceeds the target lies either at
//    a candidate or strictly between two, where F = Pprefix - (the m of the candidates before): one
//    pass over the row gives Pprefix at every candidate (per-warp buckets in shared memory), which
//    tells the segment, and one radix descent (find_first) finds x inside it. A zero residual falls
//    back to the draw from p, as the CPU does.
// accept_finish_kernel then takes the first rejection (or the bonus draw of row B - 1), writes the
// emitted tokens and their count, and advances step by B.
// ---------------------------------------------------------------------------------------------
constexpr int kMaxAcceptRows = 64;   // B
constexpr int kMaxDraftCands = 64;   // Kq

struct AcceptWs {
  int32_t* accepted;    // [B]: row r's draft passed the test
  int32_t* correction;  // [B]: row r's correction, should it be the first rejection
  int32_t* draw;        // [B]: row B - 1's draw (the bonus)
};

__global__ void accept_greedy_kernel(SampleWs ws, int NB, int B, const int32_t* __restrict__ draft,
                                     int32_t* __restrict__ out, int32_t* __restrict__ count, int32_t* __restrict__ step) {
  __shared__ int arg_s[kMaxAcceptRows];
  pdl_launch_dependents();
  pdl_wait();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int r = warp; r < B; r += nw) {  // greedy_kernel's reduction: lowest index on ties
    float v = -INFINITY;
    int idx = INT_MAX;
    for (int b = lane; b < NB; b += 32) argmax_merge(v, idx, ws.pmax[r * NB + b], ws.parg[r * NB + b]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      argmax_merge(v, idx, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, idx, o));
    if (lane == 0) arg_s[r] = idx == INT_MAX ? 0 : idx;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int a = 0;
    for (; a < B - 1 && draft[a] == arg_s[a]; ++a) out[a] = draft[a];
    out[a] = arg_s[a];
    count[0] = a + 1;
    step[0] += B;
  }
}

__global__ void __launch_bounds__(kSelectThreads)
    accept_select_kernel(int V, SampleWs ws, KeyFormat f, int top_k, u64 thr_p, bool use_p, int B,
                         const int32_t* __restrict__ draft, const int32_t* __restrict__ cand, int64_t ldc,
                         const float* __restrict__ cand_prob, int64_t ldq, int Kq, uint64_t seed,
                         const int32_t* __restrict__ step, AcceptWs aw) {
  extern __shared__ __align__(16) unsigned char smem[];
  // The kept draft candidates in key order: key, P (fixed-point p), m = min(P, q M), then the
  // prefix of P through each; and what the residual draw needs.
  __shared__ u64 c_key[kMaxDraftCands], c_P[kMaxDraftCands], c_m[kMaxDraftCands], c_pre[kMaxDraftCands];
  __shared__ int c_id[kMaxDraftCands];
  __shared__ int n_c, rejected, answer;
  __shared__ bool need_descent;
  __shared__ u64 descent_thr;
  pdl_launch_dependents();
  pdl_wait();
  const int r = blockIdx.x;
  const RowSelection sel = select_row(V, ws, f, top_k, thr_p, use_p, r, smem);
  if (r == B - 1) {
    if (threadIdx.x == 0) aw.draw[r] = sel.token;
    return;
  }
  const float* p = ws.prob + int64_t(r) * V;
  const u64 M = sel.mass;
  auto kept = [&](u64 key) { return !sel.cut || key <= sel.last_key; };
  if (threadIdx.x == 0) {
    const int32_t* c = cand + int64_t(r) * ldc;
    const float* qa = cand_prob + int64_t(r) * ldq;
    const int d = draft[r];
    double qd = 0.0;  // q_r(d), summed over the candidate slots in order as the CPU sums it
    for (int k = 0; k < Kq; ++k)
      if (c[k] == d) qd = __dadd_rn(qd, double(qa[k]));
    double pd = 0.0;
    if (d >= 0 && d < V && kept(make_key(p[d], d, f.ib))) pd = __ddiv_rn(double(p[d]), double(M) * (1.0 / kFix));
    const float u = uniform_hash(seed, uint64_t(uint32_t(step[0])) + uint64_t(r));
    const bool accepted = __dmul_rn(double(u), qd) < pd;
    aw.accepted[r] = accepted;
    aw.correction[r] = sel.token;  // the draw from p: the residual's fallback
    rejected = !accepted;
    int n = 0;
    for (int k = 0; k < Kq && !accepted; ++k) {
      const int id = c[k];
      bool seen = id < 0 || id >= V;
      for (int k2 = 0; k2 < k && !seen; ++k2) seen = c[k2] == id;
      if (seen) continue;
      const u64 key = make_key(p[id], id, f.ib);
      if (!kept(key)) continue;
      double q = 0.0;
      for (int k2 = k; k2 < Kq; ++k2)
        if (c[k2] == id) q = __dadd_rn(q, double(qa[k2]));
      const u64 P = fixed(p[id]);
      const u64 Qm = __double2ull_rn(fmin(fmax(q, 0.0), 1.0) * double(M));
      int j = n++;  // insertion by key
      for (; j > 0 && c_key[j - 1] > key; --j) {
        c_key[j] = c_key[j - 1];
        c_P[j] = c_P[j - 1];
        c_m[j] = c_m[j - 1];
        c_id[j] = c_id[j - 1];
      }
      c_key[j] = key;
      c_P[j] = P;
      c_m[j] = min(P, Qm);
      c_id[j] = id;
    }
    n_c = n;
  }
  __syncthreads();  // also: every thread is done with select_row's scratch
  if (!rejected) return;
  const int nc = n_c;
  if (nc > 0) {
    // Pprefix at each candidate: per-warp sums of P over the keys in (c_{j-1}, c_j], then a prefix.
    const int nw = blockDim.x >> 5, warp = threadIdx.x >> 5;
    u64* bucket = reinterpret_cast<u64*>(smem);  // [nw][nc]
    for (int i = threadIdx.x; i < nw * nc; i += blockDim.x) bucket[i] = 0;
    __syncthreads();
    const u64 last_c = c_key[nc - 1];
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
      const float pi = p[i];
      const u64 key = make_key(pi, i, f.ib);
      if (key > last_c) continue;
      int lo = 0, hi = nc - 1;  // the first candidate at or after key
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (key <= c_key[mid]) hi = mid;
        else lo = mid + 1;
      }
      atomicAdd(&bucket[warp * nc + lo], fixed(pi));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      u64 pre = 0;
      for (int j = 0; j < nc; ++j) {
        for (int w = 0; w < nw; ++w) pre += bucket[w * nc + j];
        c_pre[j] = pre;
      }
      u64 D = 0;
      for (int j = 0; j < nc; ++j) D += c_m[j];
      const u64 total = M - D;  // the residual's mass
      answer = sel.token;
      need_descent = false;
      if (total > 0) {
        const u64 target = draw_target(total, ws.u[r]);
        D = 0;
        for (int j = 0;; ++j) {
          // segment j: the keys strictly between c_{j-1} and c_j, where F = Pprefix - D
          if (j == nc || c_pre[j] - c_P[j] > target + D) {
            need_descent = true;
            descent_thr = target + D;
            break;
          }
          if (c_pre[j] - D - c_m[j] > target) {  // F at c_j itself
            answer = c_id[j];
            break;
          }
          D += c_m[j];
        }
      }
    }
    __syncthreads();
    if (need_descent) {
      u64* keys = reinterpret_cast<u64*>(smem);
      u64* cum = keys + kCap;
      u64* hs = cum + kCap;
      uint32_t* hc = reinterpret_cast<uint32_t*>(hs + kBins);
      const Found x = find_first(p, V, f, hc, hs, keys, cum, ws.hcnt + int64_t(r) * kBins, ws.hsum + int64_t(r) * kBins,
                                 kSumGT, descent_thr);
      if (threadIdx.x == 0 && x.ok) answer = int(x.key & ((u64(1) << f.ib) - 1));
    }
    if (threadIdx.x == 0) aw.correction[r] = answer;
  }
}

__global__ void accept_finish_kernel(AcceptWs aw, const int32_t* __restrict__ draft, int B, int32_t* __restrict__ out,
                                     int32_t* __restrict__ count, int32_t* __restrict__ step) {
  pdl_launch_dependents();
  pdl_wait();
  if (threadIdx.x != 0) return;
  int a = 0;
  for (; a < B - 1 && aw.accepted[a]; ++a) out[a] = draft[a];
  out[a] = a < B - 1 ? aw.correction[a] : aw.draw[B - 1];
  count[0] = a + 1;
  step[0] += B;  // every kernel that read step has finished
}

template <class T>
void launch_accept(const T* logits, int64_t ldl, int B, int V, const SamplerConfig& cfg, const int32_t* draft,
                   const int32_t* cand, int64_t ldc, const float* cand_prob, int64_t ldq, int Kq, int32_t* step,
                   int32_t* out, int32_t* count, void* workspace, int NB, const LaunchCtx& ctx) {
  const int chunk = (V + NB - 1) / NB;
  const SampleWs ws = carve(workspace, B, V, NB);
  const bool greedy = !(cfg.temperature > 0.0f);
  launch_pdl(ctx, "speculative_accept max_kernel", max_kernel<T>, dim3(NB, B), kPassThreads, 0, logits, ldl, V, chunk,
             ws, NB, !greedy);
  if (greedy) {
    launch_pdl(ctx, "accept_greedy_kernel", accept_greedy_kernel, 1, 32 * std::min(B, 32), 0, ws, NB, B, draft, out,
               count, step);
    return;
  }
  AcceptWs aw;
  aw.accepted = reinterpret_cast<int32_t*>(ws.end);
  aw.correction = aw.accepted + B;
  aw.draw = aw.correction + B;
  const KeyFormat f = key_format(V);
  const bool use_p = cfg.top_p < 1.0f;
  const u64 thr_p = use_p ? u64(std::ceil(double(cfg.top_p) * kFix)) : 0;
  launch_pdl(ctx, "speculative_accept exp_kernel", exp_kernel<T>, dim3(NB, B), kPassThreads, 0, logits, ldl, V, chunk,
             ws, NB, cfg.temperature, cfg.seed, step, B - 1);
  constexpr int hist_smem = kBins * (8 + 4);
  static const cudaError_t a1 = cudaFuncSetAttribute(hist_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, hist_smem);
  static const cudaError_t a2 =
      cudaFuncSetAttribute(compact_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, hist_smem);
  static const cudaError_t a3 =
      cudaFuncSetAttribute(accept_select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSelectSmem);
  check_cuda(a1, "cudaFuncSetAttribute (sample hist_kernel)");
  check_cuda(a2, "cudaFuncSetAttribute (sample compact_kernel)");
  check_cuda(a3, "cudaFuncSetAttribute (accept_select_kernel)");
  launch_pdl(ctx, "speculative_accept hist_kernel", hist_kernel, dim3(NB, B), kPassThreads, hist_smem, V, chunk, ws, NB,
             f);
  launch_pdl(ctx, "speculative_accept compact_kernel", compact_kernel, dim3(NB, B), kPassThreads, hist_smem, V, chunk,
             ws, f, cfg.top_k, thr_p, use_p);
  launch_pdl(ctx, "accept_select_kernel", accept_select_kernel, B, kSelectThreads, kSelectSmem, V, ws, f, cfg.top_k,
             thr_p, use_p, B, draft, cand, ldc, cand_prob, ldq, Kq, cfg.seed, step, aw);
  launch_pdl(ctx, "accept_finish_kernel", accept_finish_kernel, 1, 32, 0, aw, draft, B, out, count, step);
}

}  // namespace
}  // namespace cuda

void CudaBackend::sample(const Tensor& logits, const SamplerConfig& config, const Tensor& step, const Tensor& tokens) {
  using namespace cuda;
  const char* op = "sample";
  require_float(logits, op, "logits");
  require_tensor(step, DType::I32, op, "step");
  require_tensor(tokens, DType::I32, op, "tokens");
  const int64_t R = logits.ndim == 1 ? 1 : logits.dim(0), V = logits.dim(-1);
  const int64_t ldl = logits.ndim == 1 ? V : logits.row_stride;
  OCRIA_RT_REQUIRE(logits.ndim == 1 || logits.ndim == 2, op, "logits must be [R, V] or [V]");
  OCRIA_RT_REQUIRE(tokens.numel() == R, op, "tokens must have R elements");
  OCRIA_RT_REQUIRE(V > 0 && V <= (int64_t(1) << 30), op, "vocabulary size " + std::to_string(V) + " out of range");
  OCRIA_RT_REQUIRE(!(config.temperature > 0.0f) || (config.top_p > 0.0f), op, "top_p must be > 0");
  if (R == 0) return;
  activate();
  const int NB = int(std::clamp<int64_t>((V + 4095) / 4096, 1, 128));
  const size_t per_row = ws_bytes_per_row(V, NB);
  const int64_t rows_per_group = int64_t(workspace_bytes_ / per_row);
  OCRIA_RT_REQUIRE(rows_per_group >= 1, op, "workspace too small for one row of " + std::to_string(V) +
                                       " logits: call reserve_workspace()");
  for (int64_t r0 = 0; r0 < R; r0 += rows_per_group) {
    // Each group advances step by its row count, so the next group's draws continue the sequence.
    const int rg = int(std::min<int64_t>(rows_per_group, R - r0));
    OCRIA_RT_REQUIRE(rg <= 65535, op, "too many rows");
    if (logits.dtype == DType::BF16)
      launch_sample<bf16>(logits.ptr<const bf16>() + r0 * ldl, ldl, rg, int(V), config, step.ptr<int32_t>(),
                          tokens.ptr<int32_t>() + r0, workspace_, NB, launch_ctx());
    else
      launch_sample<float>(logits.ptr<const float>() + r0 * ldl, ldl, rg, int(V), config, step.ptr<int32_t>(),
                           tokens.ptr<int32_t>() + r0, workspace_, NB, launch_ctx());
  }
}

void CudaBackend::speculative_accept(const Tensor& logits, const Tensor& draft, const Tensor& cand,
                                     const Tensor& cand_prob, const SamplerConfig& config, const Tensor& step,
                                     const Tensor& out, const Tensor& count) {
  using namespace cuda;
  const char* op = "speculative_accept";
  require_float(logits, op, "logits");
  require_tensor(draft, DType::I32, op, "draft");
  require_tensor(cand, DType::I32, op, "cand");
  require_tensor(cand_prob, DType::F32, op, "cand_prob");
  require_tensor(step, DType::I32, op, "step");
  require_tensor(out, DType::I32, op, "out");
  require_tensor(count, DType::I32, op, "count");
  OCRIA_RT_REQUIRE(logits.ndim == 2 && cand.ndim == 2 && cand_prob.ndim == 2, op, "logits, cand, cand_prob must be 2-D");
  const int64_t B = logits.dim(0), V = logits.dim(1), Kq = cand.dim(1);
  OCRIA_RT_REQUIRE(B >= 1 && B <= kMaxAcceptRows, op, std::to_string(B) + " rows unsupported (1.." +
                                                           std::to_string(kMaxAcceptRows) + ")");
  OCRIA_RT_REQUIRE(Kq >= 1 && Kq <= kMaxDraftCands, op, "draft candidates " + std::to_string(Kq) + " unsupported (1.." +
                                                            std::to_string(kMaxDraftCands) + ")");
  OCRIA_RT_REQUIRE(draft.numel() == B - 1 && cand.dim(0) == B - 1 && cand_prob.dim(0) == B - 1 &&
                       cand_prob.dim(1) == Kq && out.numel() == B && out.contiguous() && count.numel() == 1 &&
                       step.numel() == 1,
                   op, "logits " + logits.shape_str() + ", draft " + draft.shape_str() + ", cand " + cand.shape_str() +
                           ", cand_prob " + cand_prob.shape_str() + ", out " + out.shape_str());
  OCRIA_RT_REQUIRE(V > 0 && V <= (int64_t(1) << 30), op, "vocabulary size " + std::to_string(V) + " out of range");
  OCRIA_RT_REQUIRE(!(config.temperature > 0.0f) || (config.top_p > 0.0f), op, "top_p must be > 0");
  const int NB = int(std::clamp<int64_t>((V + 4095) / 4096, 1, 128));
  // All B rows at once (the first rejection decides which row's draw is emitted), then B * 3 results.
  OCRIA_RT_REQUIRE(size_t(B) * ws_bytes_per_row(V, NB) + 256 + size_t(3 * B) * sizeof(int32_t) <= workspace_bytes_, op,
                   "workspace too small for " + std::to_string(B) + " rows of " + std::to_string(V) +
                       " logits: call reserve_workspace()");
  activate();
  const int32_t* d = draft.ptr<const int32_t>();
  const int32_t* c = cand.ptr<const int32_t>();
  if (logits.dtype == DType::BF16)
    launch_accept<bf16>(logits.ptr<const bf16>(), logits.row_stride, int(B), int(V), config, d, c, cand.row_stride,
                        cand_prob.ptr<const float>(), cand_prob.row_stride, int(Kq), step.ptr<int32_t>(),
                        out.ptr<int32_t>(), count.ptr<int32_t>(), workspace_, NB, launch_ctx());
  else
    launch_accept<float>(logits.ptr<const float>(), logits.row_stride, int(B), int(V), config, d, c, cand.row_stride,
                         cand_prob.ptr<const float>(), cand_prob.row_stride, int(Kq), step.ptr<int32_t>(),
                         out.ptr<int32_t>(), count.ptr<int32_t>(), workspace_, NB, launch_ctx());
}

}  // namespace ocria_rt
