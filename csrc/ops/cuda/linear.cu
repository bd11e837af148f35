// linear: out[M, N] = x[M, K] · W[N, K]^T (+ bias), BF16 in, fp32 accumulate.
//
// Dispatch on M (tokens):
//  - M <= 16: skinny GEMM that streams W once (decode / speculative verify are memory bound), with
//    an optional split-K over blocks (off unless OCRIA_RT_SKINNY_KSPLIT asks) or over the blocks of a
//    thread block cluster (above 8 tokens, or as OCRIA_RT_SKINNY_CLUSTER asks), and persistent blocks
//    for many row tiles (OCRIA_RT_SKINNY_PERSISTENT); see skinny_gemm_kernel and launch_skinny below.
//  - M > 16: CUTLASS sm90 TMA/wgmma GEMM (linear_gemm_sm90.cu), bias added by a second kernel.
//  - anything the two cannot take (K or a stride not a multiple of 8, misaligned views, F32 output
//    for M > 16): a simple shared-memory tiled kernel.
// linear_glu: the MLP's act = silu(gate) * up from a weight in the GLU layout (ops.h); for M <= 16
// the skinny GEMM applies it as it stores (one pass, and the down projection then reads a plain
// [M, I] input), above that through memory (GEMM, then silu_mul).
// rms_norm_linear(_glu), linear_add: a residual block's two ends (ops.h). For M <= 16 the skinny GEMM
// reads the un-normed residual row and scales each token's sums by rsqrt(mean(x^2) + eps), its sum
// of squares gathered from the x it loads anyway (NORM), and adds the rounded products to the
// residual as it stores them (ADD): no separate norm or add kernel between the projections of a
// decode step. Above that through memory (rms_norm, GEMM; GEMM, add).
#include <algorithm>
#include <type_traits>

#include "ops/cuda/backend.cuh"
#include "ops/cuda/linear.cuh"
#include "ops/cuda/mma.cuh"

namespace ocria_rt {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// Skinny GEMM on tensor cores (mma.sync m16n8k16, BF16 -> fp32).
//
// The product is computed transposed, out^T[N, M] = W[N, K] · x[M, K]^T, so that W is the 16-row
// A operand and the (at most 16) tokens are the 8-column B operand of one or two mma tiles. A block
// owns 16 rows of W and all tokens; its WARPS warps split K (warp w takes 32-wide K chunks
// w, w + WARPS, ...), and the partial tiles are summed in shared memory at the end.
//
// 16-byte loads: a dot product may sum over K in any order, so inside each 32-wide chunk the K
// positions are permuted such that every thread's mma fragments come from one 16-byte load per row.
// Thread (g = lane / 4, t = lane % 4) loads W rows g and g + 8 and x row g at k = 8t .. 8t + 7 and
// uses the 32-bit words {0, 1} for the first k16 mma step and {2, 3} for the second: in both the A
// and the B fragment, mma column / row pairs (2t, 2t+1) and (2t+8, 2t+9) then hold the same
// physical k, so the permutation is consistent and the result exact.
//
// Loads in flight: W goes through a per-thread ring of S shared-memory stages of U chunks, filled by
// cp.async (16 bytes each, L2 only, zero-filled past the edges), so that (S - 1) * U chunks of every
// thread are in flight while it multiplies the oldest stage. A thread only reads back what it copied
// itself, so the ring needs cp.async.wait_group but no barrier. x (at most 16 rows, read by every
// block) goes to registers ahead of its use (skinny_x_ahead stages): its first reads in a block come
// from L2, which the weight stream keeps busy, and loaded only after the stage's wait they stalled
// every stage once (H200, M = 1: the linears whose blocks re-read x from L1 streamed at 92-105% of
// copy bandwidth, those reading it from L2 at every stage at 63-70%; one stage ahead 74-99%).
//
// Programmatic dependent launch: W is read-only, so a block issues the ring's first S - 1 stages
// (K range [0, kpre) of its own K range, kpre = (S - 1) * U * WARPS * 32) before pdl_wait(); only
// then does it read x. The weight stream thereby starts while the kernels before it still run. An L2
// prefetch of the next pf_bytes of each of its 16 rows can go out there too (OCRIA_RT_L2_PREFETCH_MB):
// off by default, because with the norms inside the linears it only slows the step (H200, 4B decode
// step: 2.68 ms with a budget of 16 MiB per launch, 2.56 with 4 MiB or none): what the blocks of a
// starting linear prefetch competes with the bytes the linear before it still streams.
//
// Split-K (SPLIT, grid.y = ksplit > 1; only when asked for, see skinny_ksplit): meant for few row
// tiles (N = 2560: 160 tiles on 132 SMs leave SMs with one tile next to SMs with two), it measured
// slower there on the H200. Block (tile, s) then takes the s-th of ksplit contiguous, balanced
// ranges of 32-wide K chunks, writes its fp32 partial tile to SplitKScratch::partials after
// pdl_wait(), and counts itself in on the tile's counter; the block that completes the count sums the
// ksplit partials in split order (deterministic whichever block is last), adds the bias, stores, and
// resets the counter to 0 for the next launch (graph replays included). Without SPLIT a block takes
// the whole K range of its tile.
//
// NORM: x is a residual row whose RMSNorm weight is folded into W (fold_norm_weight). Each thread adds
// up the squares of the x pieces it loads for the mma, and block_sum, which meets every warp's
// partial sums anyway, sums them per token into r = rsqrt(sum x^2 / K + eps) and scales the token's
// outputs by it: (x · W^T) * r = (x * r) · W^T. Every block then needs all of K (no split-K).
// ADD: out is the residual, out = round(out + round(sums)) as linear + add would store it; without
// split-K (and outside persistent blocks) the residual element is read right after pdl_wait(), so its
// latency stays out of the block's end.
//
// Cluster split-K (CS > 1; see skinny_cluster below): the same balance
// for few row tiles without the scratch and the counters. The CS consecutive blocks of a cluster
// (grid.x = tiles * CS) take the CS balanced K ranges of one tile; blocks 1 .. CS-1 store their
// partial tile into block 0's shared memory (distributed shared memory), and after a cluster barrier
// block 0 adds them in split order and stores. Every block arrives at a first cluster barrier when it
// starts and waits on it before its remote stores, so block 0 is known to be running by then.
// ---------------------------------------------------------------------------------------------

template <class T> __device__ __forceinline__ void store_out(T* p, float v);
template <> __device__ __forceinline__ void store_out<bf16>(bf16* p, float v) { *p = __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ void store_out<float>(float* p, float v) { *p = v; }
__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
// v as store_out<T> would store it.
template <class T> __device__ __forceinline__ float out_round(float v) {
  return std::is_same_v<T, bf16> ? bf16_round(v) : v;
}

// acc + the squares of the 8 BF16 values of a 16-byte piece (a BF16 is the top half of an fp32).
__device__ __forceinline__ float add_squares(const uint4& v, float acc) {
  for (const uint32_t w : {v.x, v.y, v.z, v.w}) {
    const float lo = __uint_as_float(w << 16), hi = __uint_as_float(w & 0xffff0000u);
    acc = fmaf(hi, hi, fmaf(lo, lo, acc));
  }
  return acc;
}

// Dynamic shared memory: the ring (S stages of U chunks of 2 RT rows per thread), then (cluster
// split-K) the partial tiles of blocks 1 .. CS-1.
template <int WARPS, int U, int S, int RT> constexpr int skinny_ring_bytes() {
  return S * U * 2 * RT * WARPS * 32 * 16;
}
template <int WARPS, int NT, int U, int S, int CS, int RT> constexpr int skinny_smem_bytes() {
  return skinny_ring_bytes<WARPS, U, S, RT>() + (CS - 1) * 16 * 8 * NT * int(sizeof(float));
}
// How many stages ahead of its use a thread loads x (into that many register sets). Its loads queue
// behind the weight bytes the SM has in flight, (S - 1) stages of them, so one stage ahead is not
// enough: ncu put a quarter of in_proj's stall samples at 1 token on the move of the x registers
// (long scoreboard), and a third at 16 tokens on the mma that reads them (H200). The 8-warp blocks of
// one token tile load 3 ahead (a thread stays within the 80 registers of 3 blocks per SM): alone,
// in_proj 16.3 -> 15.8 us and qkv 14.5 -> 14.2 at 1 token against 1 ahead, the LM head 307 -> 291 us
// at 4; the decode step does not move (4B 402.6 against 402.5 / 403.5 tokens/s). The others, whose
// registers are spent, keep 1.
template <int WARPS, int NT> constexpr int skinny_x_ahead() { return WARPS == 8 && NT == 1 ? 3 : 1; }
// The K range [0, kpre) of the stages issued before pdl_wait().
template <int WARPS, int U, int S> constexpr int skinny_prologue_k() { return (S - 1) * U * WARPS * 32; }

// Split-K scratch (CudaBackend::splitk_scratch_): one counter per row tile, zero between launches,
// and one partial tile of 16 rows x 8 NT tokens per (tile, split), [tile][split][token][row].
struct SplitKScratch {
  unsigned* counters = nullptr;
  float* partials = nullptr;
};

// Requirements (checked by the caller): K % 8 == 0, ldx % 8 == 0, ldw % 8 == 0, x and w 16-byte
// aligned, 1 <= M <= 8 * NT; pf_bytes a multiple of 16 with kpre + pf_bytes / 2 no larger than a
// block's K range (or 0). Dynamic shared memory: skinny_smem_bytes<WARPS, NT, U, S, CS, RT>().
// GLU: W is in the GLU layout (ops.h, kGluGroup = 8: rows 0-7 of each 16-row tile are gate rows,
// rows 8-15 the matching up rows) and out [M, N / 2] receives silu(gate) * up, with gate and up
// rounded to BF16 first as the separate silu_mul kernel would read them; N % 16 == 0.
// ADD: out [M, N] += the rounded products (not with GLU). NORM: the products of token m are scaled by
// rsqrt(mean(x[m]^2) + norm_eps) before the bias (not with SPLIT or CS > 1).
// SPLIT: gridDim.y splits of K (at most one per chunk), scratch for gridDim.x tiles x gridDim.y splits.
// CS > 1: launched in clusters of CS blocks along x, gridDim.x = tiles * CS, at most one split per chunk.
// PERSIST: gridDim.x <= tiles blocks, block b taking tiles b, b + gridDim.x, ...; its stages run on
// from one tile into the next (stage g is step g % iters of its (g / iters)-th tile, iters the same
// for every warp), so the ring keeps the next tile's weights in flight while a tile's sums are
// reduced and stored (only without SPLIT and CS).
// RT = 2 (above 8 tokens without GLU, skinny_plan; not with SPLIT or CS > 1): a block tile is two row
// tiles (32 rows) whose mma tiles share every x fragment a thread loads, so x is read from L2 once per
// 32 rows of W instead of once per 16 (at 16 tokens x is as many bytes as the W tile it multiplies).
// Each thread then loads W rows g + 8 r, r < 4, and a stage holds U = 1 chunk of them (the same ring
// bytes); the sums are those of two 16-row launches, in the same order, so the bits are the same.
template <int WARPS, int NT, int U, int S, bool GLU, bool ADD, bool NORM, bool SPLIT, int CS, bool PERSIST, int RT,
          class OutT>
__global__ void __launch_bounds__(WARPS * 32)
    skinny_gemm_kernel(const bf16* __restrict__ x, int64_t ldx, int M, const bf16* __restrict__ w,
                       int64_t ldw, int N, int K, uint32_t pf_bytes, ParamView bias, bool has_bias,
                       OutT* __restrict__ out, int64_t ldo, SplitKScratch scratch, float norm_eps) {
  static_assert(!(SPLIT && CS > 1), "split-K over the grid or over a cluster, not both");
  static_assert(!(PERSIST && (SPLIT || CS > 1)), "persistent blocks take whole tiles");
  static_assert(!(GLU && ADD), "the activation or the residual add, not both");
  static_assert(!(NORM && (SPLIT || CS > 1)), "the norm's sum of squares needs all of K in every block");
  static_assert(RT == 1 || (RT == 2 && !SPLIT && CS == 1), "two row tiles per block only without split-K");
  pdl_launch_dependents();
  if constexpr (CS > 1) cluster_arrive_relaxed();  // "this block runs"; waited on before the remote stores
  constexpr int NTH = WARPS * 32;
  // The ring follows the static `red` (a multiple of 128 bytes) and must stay 128-byte aligned:
  // add no other static shared variable here.
  extern __shared__ __align__(128) uint4 wring[];  // [S][U][2 RT rows][NTH]: a thread's slots are column tid
  __shared__ float red[WARPS][NORM ? 17 : 16][16];  // [warp][W row | NORM: 16 = sum of squares][token]
  static_assert(sizeof(red) % 128 == 0, "the dynamic ring after `red` must stay 128-byte aligned");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  constexpr int BR = 16 * RT, R = 2 * RT;  // rows of a block tile; W rows a thread loads, g + 8 r
  const int tiles = (N + BR - 1) / BR;
  const int n0 = int(blockIdx.x) / CS * BR;  // the (first) block tile (CS = 1: one block per tile)
  bool row_ok[R];
  const bf16* wrow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) row_ok[r] = n0 + g + 8 * r < N;
#pragma unroll
  for (int r = 0; r < R; ++r) wrow[r] = w + int64_t(row_ok[r] ? n0 + g + 8 * r : 0) * ldw + 8 * t;
  bool tok_ok[NT];
  const bf16* xr[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    tok_ok[j] = g + 8 * j < M;
    xr[j] = x + int64_t(tok_ok[j] ? g + 8 * j : 0) * ldx + 8 * t;
  }

  // 32-wide K chunks [c_lo, c_hi) of this block; warp w takes c_lo + w, c_lo + w + WARPS, ...
  const int nchunks = (K + 31) >> 5;
  int c_lo = 0, c_hi = nchunks;
  if constexpr (SPLIT) {
    c_lo = int(int64_t(nchunks) * blockIdx.y / gridDim.y);
    c_hi = int(int64_t(nchunks) * (blockIdx.y + 1) / gridDim.y);
  } else if constexpr (CS > 1) {
    const int split = int(blockIdx.x) % CS;  // the block's rank in its cluster
    c_lo = nchunks * split / CS;
    c_hi = nchunks * (split + 1) / CS;
  }
  const int span = c_hi - c_lo;
  // Steps per tile: this warp's chunks / U, or with PERSIST the most any warp has (block-uniform, so
  // that the whole block reaches each tile's end together; chunks past c_hi load and add zeros).
  const int my_chunks = PERSIST ? (span + WARPS - 1) / WARPS
                                : (warp < span ? (span - warp + WARPS - 1) / WARPS : 0);
  const int iters = (my_chunks + U - 1) / U;
  const int my_tiles = PERSIST ? (tiles - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x) : 1;
  const int stages = my_tiles * iters;
  // K % 8 == 0: a thread's 16-byte piece of a chunk is all in range or all out.
  auto piece_in = [&](int c) { return c < c_hi && c * 32 + 8 * t < K; };
  auto issue = [&](int st) {  // stage `st` of this thread into ring slot st % S
    uint4* slot = wring + (st % S) * U * R * NTH + tid;
    int it = st;
    const bf16* rp[R];
    bool ok[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      rp[r] = wrow[r];
      ok[r] = row_ok[r];
    }
    if constexpr (PERSIST) {  // step it of tile ti
      const int ti = st / iters, m0 = (int(blockIdx.x) + ti * int(gridDim.x)) * BR;
      it = st - ti * iters;
      // The flags first, then the pointers (the order the 16-row kernels were measured with).
#pragma unroll
      for (int r = 0; r < R; ++r) ok[r] = st < stages && m0 + g + 8 * r < N;
#pragma unroll
      for (int r = 0; r < R; ++r) rp[r] = w + int64_t(ok[r] ? m0 + g + 8 * r : 0) * ldw + 8 * t;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c_lo + warp + WARPS * (it * U + u);
      const bool in = st < stages && piece_in(c);
      const int k = in ? c * 32 : 0;
#pragma unroll
      for (int r = 0; r < R; ++r) cp_async16(slot + (R * u + r) * NTH, rp[r] + k, in && ok[r] ? 16 : 0);
    }
    cp_async_commit();  // always commit (possibly empty) so that group counting stays uniform
  };

  float acc[RT][NT][4];
  float sq[NT];  // NORM: this thread's sum of squares of x row g + 8 j over the tile's K pieces it loaded
  auto clear_acc = [&] {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      sq[j] = 0.0f;
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) acc[rt][j][0] = acc[rt][j][1] = acc[rt][j][2] = acc[rt][j][3] = 0.0f;
    }
  };
  // The block's sums of row tile rt of a block tile: accumulator fragments (c0, c1 = row g, tokens 2t,
  // 2t+1; c2, c3 = row g + 8, same tokens) through `red`, summed over the warps by thread (row, tok) =
  // (tid % 16, tid / 16); `owner`: this thread holds an output element of the row tile at tile_n0 + row.
  // NORM: the sums of squares (over the 4 threads of a row group, then over the warps) scale them.
  constexpr int kTileElems = 16 * 8 * NT;
  const int row = tid & 15, tok = tid >> 4;
  using First = std::integral_constant<int, 0>;
  using Last = std::integral_constant<int, RT - 1>;
  auto block_sum = [&](auto rt_c, int tile_n0, bool& owner) {
    constexpr int rt = decltype(rt_c)::value;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      red[warp][g][8 * j + 2 * t] = acc[rt][j][0];
      red[warp][g][8 * j + 2 * t + 1] = acc[rt][j][1];
      red[warp][g + 8][8 * j + 2 * t] = acc[rt][j][2];
      red[warp][g + 8][8 * j + 2 * t + 1] = acc[rt][j][3];
      if constexpr (NORM) {
        float s = sq[j];
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (t == 0) red[warp][16][g + 8 * j] = s;
      }
    }
    __syncthreads();
    owner = tid < kTileElems && tile_n0 + row < N && tok < M;
    float sum = 0.0f;
    if (owner) {
#pragma unroll
      for (int i = 0; i < WARPS; ++i) sum += red[i][row][tok];
      if constexpr (NORM) {
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < WARPS; ++i) ss += red[i][16][tok];
        sum *= rsqrtf(ss / float(K) + norm_eps);
      }
    }
    return sum;
  };
  // ADD: the residual elements a thread adds to (one per row tile), read early where the storing block
  // is known then.
  constexpr bool kResidualAhead = ADD && !SPLIT && !PERSIST;
  float residual[RT] = {};
  // Bias and store of a row tile's sums; GLU: silu(gate) * up of its 8 activations, gate row r and up
  // row r + 8 meeting in `red` (every thread of the block calls it then).
  auto finish = [&](auto rt_c, int tile_n0, bool owner, float sum) {
    [[maybe_unused]] constexpr int rt = decltype(rt_c)::value;
    if (owner && has_bias) sum += bias[tile_n0 + row];
    if constexpr (GLU) {
      __syncthreads();  // block_sum's reads of `red` are done
      if (owner) red[0][row][tok] = sum;
      __syncthreads();
      const int r = tid & 7, k = tid >> 3;
      if (tid < 8 * 8 * NT && k < M && tile_n0 < N) {  // RT = 2: a last block tile may have one row tile
        const float gate = bf16_round(red[0][r][k]), up = bf16_round(red[0][r + 8][k]);
        store_out(out + int64_t(k) * ldo + tile_n0 / 2 + r, silu(gate) * up);
      }
    } else if (owner) {
      OutT* o = out + int64_t(tok) * ldo + tile_n0 + row;
      if constexpr (ADD) sum = (kResidualAhead ? residual[rt] : to_float(*o)) + out_round<OutT>(sum);
      store_out(o, sum);
    }
  };
  // The first row tile of a two-row-tile block tile, summed and stored.
  auto finish_leading = [&](int tile_n0) {
    if constexpr (RT == 2) {
      bool owner;
      const float sum = block_sum(First{}, tile_n0, owner);
      finish(First{}, tile_n0, owner, sum);
      __syncthreads();  // `red` is read before the next row tile writes it
    }
  };

  clear_acc();
#pragma unroll
  for (int s = 0; s < S - 1; ++s) issue(s);
  if (tid < BR && pf_bytes > 0 && n0 + tid < N)
    prefetch_l2(w + int64_t(n0 + tid) * ldw + c_lo * 32 + skinny_prologue_k<WARPS, U, S>(), pf_bytes);
  // x XD stages ahead (see the top of the file): stage st + XD's loads go out before stage st's
  // products, into the register set stage st frees (set st % XD; the loop below is unrolled by XD so
  // that the set is a compile-time index).
  const uint4 zero = make_uint4(0, 0, 0, 0);
  constexpr int XD = skinny_x_ahead<WARPS, NT>();
  uint4 xq[XD][U][NT];
  auto load_x = [&](int st, uint4 (&xnext)[U][NT]) {
    const int it = PERSIST ? st % iters : st;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c_lo + warp + WARPS * (it * U + u);
      const bool in = st < stages && piece_in(c);
#pragma unroll
      for (int j = 0; j < NT; ++j)
        xnext[u][j] = in && tok_ok[j] ? __ldg(reinterpret_cast<const uint4*>(xr[j] + c * 32)) : zero;
    }
  };
  pdl_wait();  // earlier kernels have completed: x may be read, out written
#pragma unroll
  for (int d = 0; d < XD; ++d) load_x(d, xq[d]);
  if constexpr (kResidualAhead) {
    if (tid < kTileElems && n0 + row < N && tok < M && int(blockIdx.x) % CS == 0)
      residual[0] = to_float(out[int64_t(tok) * ldo + n0 + row]);
    if constexpr (RT == 2) {
      if (tid < kTileElems && n0 + 16 + row < N && tok < M)
        residual[1] = to_float(out[int64_t(tok) * ldo + n0 + 16 + row]);
    }
  }
  auto run_stage = [&](int st, uint4 (&xnext)[U][NT]) {
    uint4 xv[U][NT];  // this stage's x
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < NT; ++j) xv[u][j] = xnext[u][j];
    load_x(st + XD, xnext);
    cp_async_wait<S - 2>();  // stage `st` has landed
    issue(st + S - 1);       // refills the slot read in the previous iteration
    const uint4* slot = wring + (st % S) * U * R * NTH + tid;
    const int it = PERSIST ? st % iters : st;
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        const uint4 wa = slot[(R * u + 2 * rt) * NTH], wb = slot[(R * u + 2 * rt + 1) * NTH];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          mma_16816(acc[rt][j], wa.x, wb.x, wa.y, wb.y, xv[u][j].x, xv[u][j].y);  // k = 8t + {0,1 | 2,3}
          mma_16816(acc[rt][j], wa.z, wb.z, wa.w, wb.w, xv[u][j].z, xv[u][j].w);  // k = 8t + {4,5 | 6,7}
          if constexpr (NORM) {
            if (rt == RT - 1) sq[j] = add_squares(xv[u][j], sq[j]);  // once per x piece
          }
        }
      }
    }
    if constexpr (PERSIST) {
      if (it == iters - 1 && st + 1 < stages) {  // a tile done, another to come: store it meanwhile
        const int tile_n0 = (int(blockIdx.x) + st / iters * int(gridDim.x)) * BR;
        finish_leading(tile_n0);
        bool owner;
        const float sum = block_sum(Last{}, tile_n0 + 16 * (RT - 1), owner);
        finish(Last{}, tile_n0 + 16 * (RT - 1), owner, sum);
        __syncthreads();  // `red` is read before the next tile writes it
        clear_acc();
      }
    }
  };
  if constexpr (XD == 1) {  // the plain loop (unrolled by 1, some instantiations took more registers)
    for (int st = 0; st < stages; ++st) run_stage(st, xq[0]);
  } else {
    for (int st0 = 0; st0 < stages; st0 += XD) {
#pragma unroll
      for (int d = 0; d < XD; ++d)
        if (st0 + d < stages) run_stage(st0 + d, xq[d]);
    }
  }
  cp_async_wait<0>();

  // The last (or only) block tile: its leading row tiles, then the last, which split-K completes.
  const int tile_n0 = PERSIST ? (int(blockIdx.x) + (my_tiles - 1) * int(gridDim.x)) * BR : n0;
  finish_leading(tile_n0);
  const int last_n0 = tile_n0 + 16 * (RT - 1);
  bool owner;
  float sum = block_sum(Last{}, last_n0, owner);
  if constexpr (CS > 1) {
    float* parts = reinterpret_cast<float*>(wring + S * U * R * NTH);  // block 0's: [CS - 1][kTileElems]
    const int split = int(blockIdx.x) % CS;
    cluster_wait();  // every block of the cluster has started
    if (split != 0 && tid < kTileElems) store_cluster_shared(parts + (split - 1) * kTileElems + tid, 0, sum);
    cluster_arrive();
    cluster_wait();  // the partial tiles are in block 0's shared memory
    if (split != 0) return;
    if (owner) {
      for (int s = 0; s < CS - 1; ++s) sum += parts[s * kTileElems + tid];
    }
  }
  if constexpr (SPLIT) {
    const int splits = gridDim.y;
    float* tile_partials = scratch.partials + int64_t(blockIdx.x) * splits * kTileElems;
    if (owner) __stcg(tile_partials + blockIdx.y * kTileElems + tid, sum);
    if (!arrive_last(scratch.counters, blockIdx.x, splits, owner)) return;
    // The last block of this tile: every split's partial is written.
    if (owner) {
      float total = 0.0f;
      for (int s = 0; s < splits; ++s)
        total += s == int(blockIdx.y) ? sum : __ldcg(tile_partials + s * kTileElems + tid);
      sum = total;
    }
  }
  finish(Last{}, last_n0, owner, sum);
}

// ---------------------------------------------------------------------------------------------
// Fallback: 64 x 64 output tiles, K in steps of 32 through shared memory, 4 x 4 outputs per thread,
// scalar loads with bounds checks. Any K, stride or alignment.
// ---------------------------------------------------------------------------------------------
template <class OutT>
__global__ void __launch_bounds__(256)
    linear_fallback_kernel(const bf16* __restrict__ x, int64_t ldx, int M, const bf16* __restrict__ w,
                           int64_t ldw, int N, int K, ParamView bias, bool has_bias, OutT* __restrict__ out,
                           int64_t ldo) {
  __shared__ float xs[32][65];  // [k][m]
  __shared__ float ws[32][65];  // [k][n]
  const int tm = threadIdx.x >> 4, tn = threadIdx.x & 15;
  const int m0 = blockIdx.y * 64, n0 = blockIdx.x * 64;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < K; k0 += 32) {
    for (int i = threadIdx.x; i < 64 * 32; i += 256) {
      const int r = i >> 5, kk = i & 31, k = k0 + kk;
      xs[kk][r] = (m0 + r < M && k < K) ? __bfloat162float(x[int64_t(m0 + r) * ldx + k]) : 0.0f;
      ws[kk][r] = (n0 + r < N && k < K) ? __bfloat162float(w[int64_t(n0 + r) * ldw + k]) : 0.0f;
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < 32; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = xs[kk][tm + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = ws[kk][tn + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = m0 + tm + 16 * i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = n0 + tn + 16 * j;
      if (m < M && n < N) store_out(out + int64_t(m) * ldo + n, acc[i][j] + (has_bias ? bias[n] : 0.0f));
    }
  }
}

// out[m, n] += bias[n] (the CUTLASS path has no bias epilogue; the text decoder has no biases).
__global__ void add_bias_kernel(bf16* __restrict__ out, int64_t ldo, int M, int N, ParamView bias) {
  const int m = blockIdx.y;
  for (int n = blockIdx.x * blockDim.x + threadIdx.x; n < N; n += gridDim.x * blockDim.x) {
    bf16* p = out + int64_t(m) * ldo + n;
    *p = __float2bfloat16_rn(__bfloat162float(*p) + bias[n]);
  }
}

// How one skinny GEMM runs, chosen by skinny_plan from its shape and the backend's switches.
struct SkinnyPlan {
  int ksplit = 1;        // split-K over the grid (grid.y); 1: none
  int cs = 1;            // blocks of a cluster sharing one row tile's K; 1: none
  bool wide = false;     // 16 warps per block instead of 8
  bool persist = false;  // persistent blocks
  int rt = 1;            // row tiles per block tile (2: see skinny_plan; never with split-K)
};

// skinny_gemm_kernel's template parameters other than the epilogue (Epi) and the output type. Ring
// sizes: 64 KiB (8 warps, 4 stages: 3 blocks per SM) and 96 KiB (16 warps, 3 stages: 2 blocks per SM);
// 192 resp. 128 bytes in flight per thread. A stage holds two chunks of 2 rows (RT = 1) or one chunk
// of 4 rows (RT = 2).
template <int WARPS_, int NT_, bool SPLIT_, int CS_, bool PERSIST_, int RT_ = 1> struct SkinnyCfg {
  static constexpr int WARPS = WARPS_, NT = NT_, RT = RT_, U = 2 / RT_, S = WARPS_ == 16 ? 3 : 4, CS = CS_;
  static constexpr bool SPLIT = SPLIT_, PERSIST = PERSIST_;
  static constexpr int smem = skinny_smem_bytes<WARPS, NT, U, S, CS, RT>();
  template <class Epi, class OutT> static constexpr auto kernel() {
    return skinny_gemm_kernel<WARPS, NT, U, S, Epi::GLU, Epi::ADD, Epi::NORM, SPLIT, CS, PERSIST, RT, OutT>;
  }
};

// What a skinny GEMM does besides the product: the MLP activation (GLU), the residual add (ADD), the
// RMSNorm scale (NORM); see skinny_gemm_kernel.
template <bool GLU_, bool ADD_, bool NORM_> struct SkinnyEpi {
  static constexpr bool GLU = GLU_, ADD = ADD_, NORM = NORM_;
};
using EpiStore = SkinnyEpi<false, false, false>;
using EpiGlu = SkinnyEpi<true, false, false>;
using EpiAdd = SkinnyEpi<false, true, false>;
using EpiNorm = SkinnyEpi<false, false, true>;
using EpiNormGlu = SkinnyEpi<true, false, true>;

// Calls f(SkinnyCfg<...>{}) with the configuration of plan p for M tokens (one or two 8-token tiles).
// Epi::NORM: only the configurations without split-K (the plan has none, skinny_plan's whole_k).
template <class Epi, class F> void visit_skinny(const SkinnyPlan& p, int M, F&& f) {
  auto by_m = [&](auto warps, auto split, auto cs, auto persist) {
    constexpr int W = decltype(warps)::value, C = decltype(cs)::value;
    constexpr bool SP = decltype(split)::value, PE = decltype(persist)::value;
    auto by_rt = [&](auto nt) {
      constexpr int T = decltype(nt)::value;
      if constexpr (!SP && C == 1) {
        if (p.rt == 2) return f(SkinnyCfg<W, T, SP, C, PE, 2>{});
      }
      f(SkinnyCfg<W, T, SP, C, PE>{});
    };
    if (M <= 8)
      by_rt(std::integral_constant<int, 1>{});
    else
      by_rt(std::integral_constant<int, 2>{});
  };
  using std::false_type, std::true_type;
  using Eight = std::integral_constant<int, 8>;
  using Sixteen = std::integral_constant<int, 16>;
  using One = std::integral_constant<int, 1>;
  // Cluster split-K: the 8-warp configuration (3 blocks per SM; 2 for M > 8 with 4 per cluster,
  // whose partial tiles take the shared memory a third block would need).
  if constexpr (!Epi::NORM) {
    if (p.cs == 2) return by_m(Eight{}, false_type{}, std::integral_constant<int, 2>{}, false_type{});
    if (p.cs == 4) return by_m(Eight{}, false_type{}, std::integral_constant<int, 4>{}, false_type{});
    if (p.wide && p.ksplit > 1) return by_m(Sixteen{}, true_type{}, One{}, false_type{});
    if (p.ksplit > 1) return by_m(Eight{}, true_type{}, One{}, false_type{});
  }
  if (p.persist) return by_m(Eight{}, false_type{}, One{}, true_type{});
  if (p.wide) return by_m(Sixteen{}, false_type{}, One{}, false_type{});
  by_m(Eight{}, false_type{}, One{}, false_type{});
}

// Raises the kernel's dynamic shared-memory limit (once per instantiation, thread-safe static
// initialisation; allowed during graph capture) and returns how many of its blocks fit on an SM.
template <class Cfg, class Epi, class OutT> int skinny_blocks_per_sm() {
  static const int per_sm = [] {
    auto kernel = Cfg::template kernel<Epi, OutT>();
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::smem),
               "cudaFuncSetAttribute (skinny_gemm_kernel)");
    int n = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Cfg::WARPS * 32, Cfg::smem),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor (skinny_gemm_kernel)");
    return std::max(n, 1);
  }();
  return per_sm;
}

// The grid of a launch: block tiles (16 rt rows) times blocks per cluster, by K splits; persistent: as
// many blocks as fit on the device at once (per_sm each on sm_count SMs), at most one per block tile.
dim3 skinny_grid(const SkinnyPlan& p, int N, int per_sm, int sm_count) {
  const unsigned tiles = unsigned((N + 16 * p.rt - 1) / (16 * p.rt));
  const unsigned x = p.persist ? std::min(tiles, unsigned(per_sm * sm_count)) : tiles * unsigned(p.cs);
  return dim3(x, unsigned(p.ksplit));
}

template <class Cfg, class Epi, class OutT>
void launch_skinny_cfg(const bf16* x, int64_t ldx, int M, const bf16* w, int64_t ldw, int N, int K,
                       ParamView bias, bool has_bias, OutT* out, int64_t ldo, const SkinnyPlan& p,
                       SplitKScratch scratch, float norm_eps, int64_t prefetch_budget, const LaunchCtx& ctx,
                       int sm_count) {
  const int per_sm = skinny_blocks_per_sm<Cfg, Epi, OutT>();
  const dim3 grid = skinny_grid(p, N, per_sm, sm_count);
  // L2 prefetch per row: the rest of the block's K range after the prologue (the shortest range of
  // a split, less one chunk for the last one's ragged end), within the budget (all rows together);
  // whole 128-byte lines; none when it would be too little to matter (many rows).
  constexpr int kpre = skinny_prologue_k<Cfg::WARPS, Cfg::U, Cfg::S>();
  const int splits = p.ksplit * p.cs;
  const int64_t kspan = splits > 1 ? int64_t((K + 31) / 32 / splits - 1) * 32 : K;
  const int64_t rest = kspan > kpre ? (kspan - kpre) * int64_t(sizeof(bf16)) : 0;
  int64_t pf = std::min(rest, prefetch_budget / (int64_t(N) * splits)) & ~int64_t(127);
  if (pf < 1024) pf = 0;
  launch_pdl_cluster(ctx, "skinny_gemm_kernel", Cfg::CS > 1 ? unsigned(Cfg::CS) : 0u, Cfg::template kernel<Epi, OutT>(),
                     grid, Cfg::WARPS * 32, Cfg::smem, x, ldx, M, w, ldw, N, K, uint32_t(pf), bias, has_bias,
                     out, ldo, scratch, norm_eps);
}

// The carving of CudaBackend::splitk_scratch_.
SplitKScratch splitk_scratch(void* base) {
  return {static_cast<unsigned*>(base),
          reinterpret_cast<float*>(static_cast<char*>(base) + CudaBackend::kSplitKCounterBytes)};
}

// Split-K: the K splits per tile (1: none). `mode` is the backend's OCRIA_RT_SKINNY_KSPLIT: split-K
// is off unless asked for (n >= 2), because on the H200 it measured slower than one split per tile
// even for N = 2560 (160 tiles on 132 SMs: o_proj 7.8 -> 10.1 us with 4 splits).
// At most one split per 32-wide chunk and no more (tile, split) blocks than the scratch holds.
int skinny_ksplit(int tiles, int nchunks, int mode) {
  const int64_t ksplit = std::min<int64_t>({std::max(mode, 1), nchunks, CudaBackend::kSplitKSlots / tiles});
  return int(std::max<int64_t>(ksplit, 1));
}

// Cluster split-K, the blocks of a cluster per tile (1: none): `mode` is the backend's
// OCRIA_RT_SKINNY_CLUSTER (2 or 4 ask for it, 0 or any other number never; unset: kSkinnyAuto, the
// measured choice), taken for few row tiles (`wide`, below) when no split-K over the grid is asked for
// and every block gets at least one 32-wide chunk. Auto: 2 blocks above 8 tokens (the speculative
// verify regime), where at 16 tokens o_proj / out_proj take 9.2 against 11.0 us and MLP down 16.9
// against 21.3 alone (H200). None for up to 8 tokens, the decode step: for the 4B's N = 2560 (160
// tiles on 132 SMs, where one block per tile leaves some SMs with twice the bytes of the others) 2
// blocks per tile make the step slower (H200, three alternating runs of one build: 392.2-393.5
// tokens/s with, 395.5-395.8 without), although down alone is faster with them (13.4 against 15.6
// us); for the 0.8B's N = 1024 (64 tiles) slower too (1059 against 1107), and 4 blocks slower
// everywhere.
int skinny_cluster(bool wide, int ksplit, int nchunks, int M, int mode) {
  const int cs = mode == CudaBackend::kSkinnyAuto ? (M > 8 ? 2 : 1) : mode;
  return wide && ksplit == 1 && (cs == 2 || cs == 4) && nchunks >= cs ? cs : 1;
}

// Persistent blocks for the shapes of many row tiles: `mode` is the backend's
// OCRIA_RT_SKINNY_PERSISTENT (1: always, another number: never). Auto: up to 16 tiles per SM, where
// they measured faster (H200, M = 1: in_proj 18.8 -> 17.3 us, qkv 17.2 -> 15.1, gate_up 25.1 -> 24.0)
// but not for the LM head's 15520 tiles (286 -> 295 us).
bool skinny_persistent(int tiles, int sm_count, int mode) {
  return mode == CudaBackend::kSkinnyAuto ? tiles <= 16 * sm_count : mode == 1;
}

// The launch of an [N, K] weight: split-K over the grid only when asked for; few blocks (N = 2560
// without split-K: 160 tiles on 132 SMs) cannot keep enough bytes in flight with 8 warps per block,
// so they get 16 warps (above 8 tokens, or as asked for, cluster split-K instead); persistent blocks
// for many tiles (no split-K).
// Two row tiles per block (x loaded once for 32 rows of W) wherever no K is split, for more than 8
// tokens and no GLU epilogue: at 16 tokens the LM head streams at 91% of copy bandwidth instead of 71%
// and attention's qkv at 63% instead of 59%, while gate_up's GLU store falls from 69% to 60% and at
// one token every shape loses (H200). rows_mode is the backend's
// OCRIA_RT_SKINNY_ROWS (16 or 32 force it, kSkinnyAuto: this rule); the other choices count 16-row
// tiles either way.
SkinnyPlan skinny_plan(int N, int K, int M, bool glu, int sm_count, int ksplit_mode, int cluster_mode,
                       int persistent_mode, int rows_mode) {
  SkinnyPlan p;
  const int tiles = (N + 15) / 16, nchunks = (K + 31) / 32;
  p.ksplit = skinny_ksplit(tiles, nchunks, ksplit_mode);
  p.wide = int64_t(tiles) * p.ksplit < 4 * sm_count;
  p.cs = skinny_cluster(p.wide, p.ksplit, nchunks, M, cluster_mode);
  p.persist = p.cs == 1 && p.ksplit == 1 && !p.wide && skinny_persistent(tiles, sm_count, persistent_mode);
  const bool two_rows = rows_mode == CudaBackend::kSkinnyAuto ? M > 8 && !glu : rows_mode == 32;
  p.rt = two_rows && p.cs == 1 && p.ksplit == 1 ? 2 : 1;
  return p;
}

// A linear op's operands, checked: x [M, K] and W [N, K] BF16 and 2-D, the weight dense, the bias (if
// any) of N elements; `skinny`: M <= 16 and the skinny GEMM's requirements hold (K > 0, K and both row
// strides multiples of 8, 16-byte aligned x and W).
struct LinearArgs {
  const bf16* x = nullptr;
  const bf16* w = nullptr;
  int64_t ldx = 0, ldw = 0;
  int M = 0, N = 0, K = 0;
  ParamView bias{};
  bool has_bias = false;
  bool skinny = false;
};

LinearArgs linear_args(const char* op, const Tensor& x, const LinearWeight& lw) {
  OCRIA_RT_REQUIRE(lw.format == LinearWeight::Format::kDense, op, "only dense weights are supported");
  const Tensor& w = lw.weight;
  require_tensor(x, DType::BF16, op, "x");
  require_tensor(w, DType::BF16, op, "weight");
  OCRIA_RT_REQUIRE(x.ndim == 2 && w.ndim == 2, op,
                   "expected 2-D x and weight, got " + x.shape_str() + ", " + w.shape_str());
  OCRIA_RT_REQUIRE(w.dim(1) == x.dim(1), op, "shape mismatch: x " + x.shape_str() + ", weight " + w.shape_str());
  OCRIA_RT_REQUIRE(x.dim(0) < (int64_t(1) << 31) && w.dim(0) < (int64_t(1) << 31) && w.dim(1) < (int64_t(1) << 31), op,
                   "dimension too large");
  LinearArgs a;
  a.x = x.ptr<bf16>();
  a.w = w.ptr<bf16>();
  a.ldx = x.row_stride;
  a.ldw = w.row_stride;
  a.M = int(x.dim(0));
  a.N = int(w.dim(0));
  a.K = int(w.dim(1));
  a.has_bias = lw.bias.defined();
  if (a.has_bias) {
    a.bias = param_view(lw.bias, op, "bias");
    OCRIA_RT_REQUIRE(lw.bias.numel() == a.N, op,
                     "bias has " + std::to_string(lw.bias.numel()) + " elements, expected " + std::to_string(a.N));
  }
  a.skinny = a.M >= 1 && a.M <= 16 && a.K > 0 && a.K % 8 == 0 && a.ldw % 8 == 0 && a.ldx % 8 == 0 &&
             aligned16(a.x) && aligned16(a.w);
  return a;
}

// The decode GEMM of epilogue Epi on x and W (linear_args' skinny), the launch shape chosen from the
// backend's switches; with Epi::NORM without split-K (every block needs the whole row for its sum of
// squares) and with persistent blocks as linear's.
template <class Epi, class OutT>
void run_skinny(const LinearArgs& a, OutT* out, int64_t ldo, float norm_eps, const SkinnySettings& st) {
  const SkinnyPlan p =
      Epi::NORM ? skinny_plan(a.N, a.K, a.M, Epi::GLU, st.sm_count, 1, 0, st.persistent, st.rows)
                : skinny_plan(a.N, a.K, a.M, Epi::GLU, st.sm_count, st.ksplit, st.cluster, st.persistent, st.rows);
  visit_skinny<Epi>(p, a.M, [&](auto cfg) {
    launch_skinny_cfg<decltype(cfg), Epi>(a.x, a.ldx, a.M, a.w, a.ldw, a.N, a.K, a.bias, a.has_bias, out, ldo, p,
                                          splitk_scratch(st.splitk_scratch), norm_eps, st.prefetch_bytes, st.ctx,
                                          st.sm_count);
  });
}

template <class OutT>
void launch_fallback(const bf16* x, int64_t ldx, int M, const bf16* w, int64_t ldw, int N, int K, ParamView bias,
                     bool has_bias, OutT* out, int64_t ldo, cudaStream_t stream) {
  dim3 grid((N + 63) / 64, (M + 63) / 64);
  OCRIA_RT_REQUIRE(grid.y <= 65535, "linear", "too many rows for the fallback kernel");
  linear_fallback_kernel<OutT><<<grid, 256, 0, stream>>>(x, ldx, M, w, ldw, N, K, bias, has_bias, out, ldo);
  check_launch("linear_fallback_kernel");
}

// W[n, k] = round(W[n, k] * (1 + nw[k])), one thread per element.
__global__ void fold_norm_weight_kernel(bf16* __restrict__ w, int64_t ldw, int64_t N, int64_t K,
                                        const float* __restrict__ nw) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < N * K; i += int64_t(gridDim.x) * blockDim.x) {
    bf16* p = w + (i / K) * ldw + i % K;
    *p = __float2bfloat16_rn(__bfloat162float(*p) * (1.0f + nw[i % K]));
  }
}

}  // namespace
}  // namespace cuda

void CudaBackend::linear(const Tensor& x, const LinearWeight& lw, const Tensor& out) {
  using namespace cuda;
  const char* op = "linear";
  const LinearArgs a = linear_args(op, x, lw);
  require_float(out, op, "out");
  OCRIA_RT_REQUIRE(out.ndim == 2 && out.dim(0) == a.M && out.dim(1) == a.N, op,
                   "shape mismatch: x " + x.shape_str() + ", weight " + lw.weight.shape_str() + ", out " +
                       out.shape_str());
  if (a.M == 0 || a.N == 0) return;
  activate();
  const int64_t ldo = out.row_stride;
  const bool out_bf16 = out.dtype == DType::BF16;
  if (a.skinny) {
    if (out_bf16)
      run_skinny<EpiStore>(a, out.ptr<bf16>(), ldo, 0.0f, skinny_settings());
    else
      run_skinny<EpiStore>(a, out.ptr<float>(), ldo, 0.0f, skinny_settings());
    return;
  }
  if (a.M > 16 && out_bf16 && a.K > 0 &&
      gemm_bf16_sm90(a.x, a.ldx, a.w, a.ldw, out.data, ldo, a.M, a.N, a.K, workspace_, workspace_bytes_, sm_count_,
                     stream_)) {
    if (a.has_bias) {
      OCRIA_RT_REQUIRE(a.M <= 65535, op, "too many rows for the bias kernel");
      add_bias_kernel<<<dim3(unsigned((a.N + 255) / 256), unsigned(a.M)), 256, 0, stream_>>>(out.ptr<bf16>(), ldo, a.M,
                                                                                           a.N, a.bias);
      check_launch("add_bias_kernel");
    }
    return;
  }
  if (out_bf16)
    launch_fallback(a.x, a.ldx, a.M, a.w, a.ldw, a.N, a.K, a.bias, a.has_bias, out.ptr<bf16>(), ldo, stream_);
  else
    launch_fallback(a.x, a.ldx, a.M, a.w, a.ldw, a.N, a.K, a.bias, a.has_bias, out.ptr<float>(), ldo, stream_);
}

namespace cuda {
namespace {
// linear_glu's operands beside linear_args': W [2I, K] with I a multiple of 8, scratch [M, 2I], act [M, I], all BF16.
void check_glu(const char* op, const Tensor& x, const LinearWeight& lw, const Tensor& scratch, const Tensor& act) {
  require_tensor(scratch, DType::BF16, op, "scratch");
  require_tensor(act, DType::BF16, op, "act");
  const int64_t M = x.dim(0), N = lw.weight.dim(0);
  OCRIA_RT_REQUIRE(scratch.ndim == 2 && act.ndim == 2 && N % (2 * kGluGroup) == 0 && scratch.dim(0) == M &&
                       scratch.dim(1) == N && act.dim(0) == M && act.dim(1) == N / 2,
                   op, "shape mismatch: x " + x.shape_str() + ", weight " + lw.weight.shape_str() +
                           " (gate and up, [2I, K] with I a multiple of 8), scratch " + scratch.shape_str() +
                           " ([M, 2I]), act " + act.shape_str() + " ([M, I])");
}
// A BF16 tensor `name` of shape [x rows, cols] beside x [M, K] and W [N, K].
void check_rows(const char* op, const char* name, const Tensor& x, const LinearWeight& lw, const Tensor& t,
                int64_t cols) {
  require_tensor(t, DType::BF16, op, name);
  OCRIA_RT_REQUIRE(t.ndim == 2 && t.dim(0) == x.dim(0) && t.dim(1) == cols, op,
                   std::string("shape mismatch: x ") + x.shape_str() + ", weight " + lw.weight.shape_str() + ", " +
                       name + " " + t.shape_str() + " (expected [" + std::to_string(x.dim(0)) + ", " +
                       std::to_string(cols) + "])");
}
}  // namespace
}  // namespace cuda

void CudaBackend::linear_glu(const Tensor& x, const LinearWeight& lw, const Tensor& scratch, const Tensor& act) {
  using namespace cuda;
  const char* op = "linear_glu";
  const LinearArgs a = linear_args(op, x, lw);
  check_glu(op, x, lw, scratch, act);
  if (!a.skinny) {  // prefill: x · W^T through memory, then the activation
    Backend::linear_glu(x, lw, scratch, act);
    return;
  }
  activate();
  run_skinny<EpiGlu>(a, act.ptr<bf16>(), act.row_stride, 0.0f, skinny_settings());
}

void CudaBackend::rms_norm_linear(const Tensor& x, float eps, const LinearWeight& lw, const Tensor& normed,
                                  const Tensor& out) {
  using namespace cuda;
  const char* op = "rms_norm_linear";
  const LinearArgs a = linear_args(op, x, lw);
  check_rows(op, "normed", x, lw, normed, x.dim(1));
  check_rows(op, "out", x, lw, out, lw.weight.dim(0));
  if (!a.skinny) {  // prefill: the normed rows through memory, then the GEMM
    Backend::rms_norm_linear(x, eps, lw, normed, out);
    return;
  }
  activate();
  run_skinny<EpiNorm>(a, out.ptr<bf16>(), out.row_stride, eps, skinny_settings());
}

void CudaBackend::rms_norm_linear_glu(const Tensor& x, float eps, const LinearWeight& lw, const Tensor& normed,
                                      const Tensor& scratch, const Tensor& act) {
  using namespace cuda;
  const char* op = "rms_norm_linear_glu";
  const LinearArgs a = linear_args(op, x, lw);
  check_glu(op, x, lw, scratch, act);
  check_rows(op, "normed", x, lw, normed, x.dim(1));
  if (!a.skinny) {
    Backend::rms_norm_linear_glu(x, eps, lw, normed, scratch, act);
    return;
  }
  activate();
  run_skinny<EpiNormGlu>(a, act.ptr<bf16>(), act.row_stride, eps, skinny_settings());
}

void CudaBackend::linear_add(const Tensor& x, const LinearWeight& lw, const Tensor& delta, const Tensor& residual) {
  using namespace cuda;
  const char* op = "linear_add";
  const LinearArgs a = linear_args(op, x, lw);
  check_rows(op, "delta", x, lw, delta, lw.weight.dim(0));
  check_rows(op, "residual", x, lw, residual, lw.weight.dim(0));
  if (!a.skinny) {  // prefill: the product through memory, then the add
    Backend::linear_add(x, lw, delta, residual);
    return;
  }
  activate();
  run_skinny<EpiAdd>(a, residual.ptr<bf16>(), residual.row_stride, 0.0f, skinny_settings());
}

void CudaBackend::fold_norm_weight(const Tensor& w, const Tensor& norm_weight) {
  using namespace cuda;
  const char* op = "fold_norm_weight";
  require_tensor(w, DType::BF16, op, "weight");
  require_tensor(norm_weight, DType::F32, op, "norm_weight");
  OCRIA_RT_REQUIRE(w.ndim == 2 && norm_weight.numel() == w.dim(1), op,
                   "weight " + w.shape_str() + " vs norm weight " + norm_weight.shape_str() + " (one per column)");
  if (w.numel() == 0) return;
  activate();
  fold_norm_weight_kernel<<<1024, 256, 0, stream_>>>(w.ptr<bf16>(), w.row_stride, w.dim(0), w.dim(1),
                                                     norm_weight.ptr<const float>());
  check_launch("fold_norm_weight_kernel");
}

}  // namespace ocria_rt
