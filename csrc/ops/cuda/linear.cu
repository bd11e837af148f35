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
// Quantized weights (ops.h LinearWeight kFp8 / kNvfp4): for M <= 16 the skinny GEMM streams their
// bytes and decodes them to BF16 in registers (the notes before skinny_gemm_kernel); above that, and
// for shapes it cannot take, linear_dequantized writes BF16 rows into a scratch a slab at a time and
// runs the dense GEMM on them.
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

// ---- quantized weights (LinearWeight kFp8 / kNvfp4): the same 64-byte chunks of a row ----
//
// A thread's 16-byte piece of a 64-byte row chunk holds PK = 8 (BF16), 16 (FP8) or 32 (NVFP4) K
// values, so a chunk spans KC = 4 PK of K and the ring, its cp.async pieces and the bytes in flight
// are those of the BF16 kernel. Thread t's piece is K [c KC + PK t, + PK) of its rows, and it loads
// the same K range of x (PK / 8 16-byte loads per token). The weight is decoded to BF16 in registers,
// in an order of K pairs that the x fragments follow:
//  - FP8: word i of the piece (K 4i .. 4i+3) gives the pairs (4i, 4i+1) and (4i+2, 4i+3), the a0 / a2
//    (row g) and a1 / a3 (row g + 8) words of one k16 mma step whose B words are x words 2i, 2i+1.
//    e4m3 bits s.eeee.mmm placed at BF16 bits 15 and 4..10 read as e4m3 * 2^-120 (subnormals too),
//    and one BF16 multiply by 2^120 makes them exact.
//  - NVFP4: word i (K 8i .. 8i+7, in the device layout below) gives the pairs (2m, 2m + 1), m < 4, the
//    pairs of the x words: each value's sign at BF16 bit 15 / 31 and its 3 magnitude bits at bits 6..8
//    / 22..24 (exponent LSBs and top mantissa bit), which reads as e2m1 * 2^-126. One BF16 multiply by
//    the block scale times 2^118 (bf16x2, both halves) gives e2m1 * scale * 2^-8 exactly (at most 6
//    significant bits, normal), and the row scale applied to the fp32 sums carries the 2^8. The
//    piece's 32 K are the two 16-element scale blocks 2t and 2t + 1 of the chunk; a thread copies the
//    aligned 4-byte word holding both into a second ring of 4-byte slots.
//
// NVFP4 device layout (CudaBackend::prepare_quantized_weight rewrites the checkpoint's nibbles, element
// j of a 32-bit word at bits 4j .. 4j+3, once at load): within each word, the bits of pair m are
// placed where a few instructions move them to the target bits T = {6, 7, 8, 15, 22, 23, 24, 31}
// (low element's magnitude bits 0-2 and sign, then the high element's):
//    pair 0 at T itself                         p0 = q & T
//    pair 1 at T rotated right by 10            p1 = rotl(q, 10) & T
//    pair 2 at T rotated right by 13            p2 = rotl(q, 13) & T
//    pair 3 in the 8 bits left, each placed 2, 7 or 12 bits below its target, where no two shifted
//    copies of them meet:                       p3 = ((q & D) * (2^2 + 2^7 + 2^12)) & T
// 8 integer instructions a word instead of 15 for the checkpoint's order, and the pairs come out in
// x's own order (no permutation of x). kNvfp4Bit[j][b] is the bit of element j's code bit b.
// row_scale multiplies a row's fp32 sums before the bias, input_scale multiplies x (loaded a stage
// ahead) just before its products, rounded to BF16; NORM's sum of squares is of the x before it.
enum class WFmt : int { kBf16 = 0, kFp8 = 1, kNvfp4 = 2 };
template <WFmt F> constexpr int wfmt_k_per_chunk() { return 32 << int(F); }

// The scales of a quantized weight (unused for BF16): block_scale rows of ldbs bytes (NVFP4),
// row_scale [N], input_scale [K] or null.
struct QuantView {
  const uint8_t* block_scale = nullptr;
  int64_t ldbs = 0;
  const float* row_scale = nullptr;
  const float* input_scale = nullptr;
};

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
constexpr uint32_t kBf16x2Pow2_120 = 0x7B807B80u;  // (2^120, 2^120)
constexpr uint32_t kBf16x2Pow2_118 = 0x7A807A80u;  // (2^118, 2^118)
// The NVFP4 products come out 2^-8 of their value (see above).
constexpr float kNvfp4SumScale = 256.0f;
// Two e4m3 bytes, placed by the prmt selector `sel` as [b0, sign(b0), b1, sign(b1)], as a bf16x2 of
// their values times 2^-120 (BF16 bits 15 and 4..10; the sign byte supplies bit 15 after the shift).
__device__ __forceinline__ uint32_t e4m3x2_raw(uint32_t q, uint32_t sel) {
  return (prmt(q, 0u, sel) << 4) & 0x87F087F0u;
}
// FP8 word q (K 4i .. 4i+3) -> the BF16 pairs (4i, 4i+1) in lo and (4i+2, 4i+3) in hi, exact.
__device__ __forceinline__ void fp8_pairs(uint32_t q, uint32_t& lo, uint32_t& hi) {
  lo = bf16x2_mul(e4m3x2_raw(q, 0x9180u), kBf16x2Pow2_120);
  hi = bf16x2_mul(e4m3x2_raw(q, 0xB3A2u), kBf16x2Pow2_120);
}
// NVFP4 device layout (see above): kNvfp4Bit[j][b] = the bit of word that holds bit b of element j's
// e2m1 code (b = 0..2 the magnitude, 3 the sign).
__host__ __device__ constexpr int kNvfp4Bit[8][4] = {{6, 7, 8, 15},   {22, 23, 24, 31}, {28, 29, 30, 5},
                                                     {12, 13, 14, 21}, {25, 26, 27, 2},  {9, 10, 11, 18},
                                                     {4, 0, 1, 3},     {20, 16, 17, 19}};
constexpr uint32_t kNvfp4PairBits = 0x81C081C0u;  // T: bits 6-8, 15, 22-24, 31
constexpr uint32_t kNvfp4Pair3Bits = 0x001B001Bu;  // pair 3's bits in the device layout
constexpr uint32_t kNvfp4Pair3Shifts = (1u << 2) | (1u << 7) | (1u << 12);
// NVFP4 word q (device layout) -> p[m] = the pair (element 2m, 2m + 1) times `scale` (a bf16x2
// broadcast of the block scale times 2^118), i.e. e2m1 * block scale * 2^-8.
__device__ __forceinline__ void nvfp4_pairs(uint32_t q, uint32_t scale, uint32_t (&p)[4]) {
  p[0] = bf16x2_mul(q & kNvfp4PairBits, scale);
  p[1] = bf16x2_mul(__funnelshift_l(q, q, 10) & kNvfp4PairBits, scale);
  p[2] = bf16x2_mul(__funnelshift_l(q, q, 13) & kNvfp4PairBits, scale);
  p[3] = bf16x2_mul(((q & kNvfp4Pair3Bits) * kNvfp4Pair3Shifts) & kNvfp4PairBits, scale);
}
// A thread's two NVFP4 block scales from the 4-byte word holding them (bytes sel-chosen, see the
// kernel) -> bf16x2 broadcasts of scale * 2^118: s0 for the piece's K 0..15, s1 for K 16..31.
__device__ __forceinline__ void nvfp4_scales(uint32_t word, uint32_t sel, uint32_t& s0, uint32_t& s1) {
  const uint32_t s = bf16x2_mul(bf16x2_mul(e4m3x2_raw(word, sel), kBf16x2Pow2_120), kBf16x2Pow2_118);
  s0 = prmt(s, 0u, 0x1010u);
  s1 = prmt(s, 0u, 0x3232u);
}
// The 8 BF16 x values of v (K k .. k+7) times input_scale[k .. k+7], rounded to BF16.
__device__ __forceinline__ uint4 scale_x(const uint4& v, const float* __restrict__ in_scale) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(in_scale)), b = __ldg(reinterpret_cast<const float4*>(in_scale) + 1);
  auto mul = [](uint32_t w, float s_lo, float s_hi) {
    const __nv_bfloat162 r =
        __floats2bfloat162_rn(__uint_as_float(w << 16) * s_lo, __uint_as_float(w & 0xffff0000u) * s_hi);
    return *reinterpret_cast<const uint32_t*>(&r);
  };
  return make_uint4(mul(v.x, a.x, a.y), mul(v.y, a.z, a.w), mul(v.z, b.x, b.y), mul(v.w, b.z, b.w));
}
// Word i (0..3) of a 16-byte piece.
__device__ __forceinline__ uint32_t word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// Dynamic shared memory: the ring (S stages of U chunks of 2 RT rows per thread; NVFP4: then the
// ring of their 4-byte block-scale words), then (cluster split-K) the partial tiles of blocks 1 .. CS-1.
template <int WARPS, int U, int S, int RT, WFmt F> constexpr int skinny_ring_bytes() {
  return S * U * 2 * RT * WARPS * 32 * (F == WFmt::kNvfp4 ? 20 : 16);
}
// Quantized weights at up to 8 tokens may stage x in shared memory once per block (XS, where
// skinny_can_stage_x): at most kStagedXElems BF16 values, M rows of K (every 4B projection's K at one token).
constexpr int kStagedXElems = 9216;
template <WFmt F, int NT, int CS> constexpr bool skinny_can_stage_x() { return F != WFmt::kBf16 && NT == 1 && CS == 1; }
template <int WARPS, int NT, int U, int S, int CS, int RT, WFmt F, bool XS> constexpr int skinny_smem_bytes() {
  return skinny_ring_bytes<WARPS, U, S, RT, F>() + (CS - 1) * 16 * 8 * NT * int(sizeof(float)) +
         (XS ? kStagedXElems * int(sizeof(bf16)) : 0);
}
// How many stages ahead of its use a thread loads x (into that many register sets). Its loads queue
// behind the weight bytes the SM has in flight, (S - 1) stages of them, so one stage ahead is not
// enough: ncu put a quarter of in_proj's stall samples at 1 token on the move of the x registers
// (long scoreboard), and a third at 16 tokens on the mma that reads them (H200). The 8-warp blocks
// of one token tile load 3 ahead (a thread stays within the 80 registers of 3 blocks per SM): alone, in_proj 16.3 -> 15.8 us and qkv 14.5 -> 14.2 at 1 token, the
// LM head 307 -> 291 us at 4; the decode step is unchanged (4B 402.6 against 402.5 / 403.5 tokens/s).
// The others, whose registers are spent, keep 1.
// Quantized weights keep 1: their x pieces are 2 or 4 times as many registers.
template <int WARPS, int NT, WFmt F> constexpr int skinny_x_ahead() {
  return F == WFmt::kBf16 && WARPS == 8 && NT == 1 ? 3 : 1;
}
// The chunks [0, kpre) of a block's range issued before pdl_wait().
template <int WARPS, int U, int S> constexpr int skinny_prologue_chunks() { return (S - 1) * U * WARPS; }

// Split-K scratch (CudaBackend::splitk_scratch_): one counter per row tile, zero between launches,
// and one partial tile of 16 rows x 8 NT tokens per (tile, split), [tile][split][token][row].
struct SplitKScratch {
  unsigned* counters = nullptr;
  float* partials = nullptr;
};

// Requirements (checked by the caller): K a multiple of the piece (PK = 8, 16, 32 K for BF16, FP8,
// NVFP4; NVFP4 also K % 64 == 0 so that a scale word never passes a row's end), ldx % 8 == 0, ldw
// (bytes) % 16 == 0, x and w 16-byte aligned, NVFP4's block_scale 4-byte aligned with ldbs % 4 == 0,
// input_scale (if any) 16-byte aligned, 1 <= M <= 8 * NT; pf_bytes a multiple of 16 with the
// prologue's bytes + pf_bytes no larger than a block's bytes of a row (or 0). Dynamic shared memory:
// skinny_smem_bytes<WARPS, NT, U, S, CS, RT, F, XS>(). F: the weight format (the notes above).
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
// XS (skinny_can_stage_x: quantized weights, one 8-token tile, no cluster): after the PDL wait the block
// copies x [M, K] (M K <= kStagedXElems) into shared memory, times input_scale and rounded to BF16,
// and NORM's sums of squares per token with it; the stages read their x pieces there. No global x
// load waits in the stages (ncu: 15-26% of the quantized kernels' stall samples at one token), and
// input_scale is applied once per block, not once per row tile.
template <int WARPS, int NT, int U, int S, bool GLU, bool ADD, bool NORM, bool SPLIT, int CS, bool PERSIST, int RT,
          WFmt F, bool XS, class OutT>
__global__ void __launch_bounds__(WARPS * 32)
    skinny_gemm_kernel(const bf16* __restrict__ x, int64_t ldx, int M, const uint8_t* __restrict__ w,
                       int64_t ldw, int N, int K, uint32_t pf_bytes, ParamView bias, bool has_bias,
                       OutT* __restrict__ out, int64_t ldo, SplitKScratch scratch, float norm_eps, QuantView qv) {
  static_assert(!(SPLIT && CS > 1), "split-K over the grid or over a cluster, not both");
  static_assert(!(PERSIST && (SPLIT || CS > 1)), "persistent blocks take whole tiles");
  static_assert(!(GLU && ADD), "the activation or the residual add, not both");
  static_assert(!(NORM && (SPLIT || CS > 1)), "the norm's sum of squares needs all of K in every block");
  static_assert(RT == 1 || (RT == 2 && !SPLIT && CS == 1), "two row tiles per block only without split-K");
  static_assert(F == WFmt::kBf16 || !SPLIT, "quantized weights without split-K over the grid");
  constexpr bool QUANT = F != WFmt::kBf16;
  static_assert(!XS || skinny_can_stage_x<F, NT, CS>(), "x staged only for quantized weights, one token tile, no cluster");
  constexpr int KC = wfmt_k_per_chunk<F>(), PK = KC / 4, XW = PK / 8;  // K per chunk, per piece; x loads per piece
  pdl_launch_dependents();
  if constexpr (CS > 1) cluster_arrive_relaxed();  // "this block runs"; waited on before the remote stores
  constexpr int NTH = WARPS * 32;
  // The ring follows the static `red` (a multiple of 128 bytes) and must stay 128-byte aligned:
  // add no other static shared variable here.
  extern __shared__ __align__(128) uint4 wring[];  // [S][U][2 RT rows][NTH]: a thread's slots are column tid
  // NVFP4: the block-scale words, [S][U][2 RT rows][NTH] after the ring.
  uint32_t* const sring = reinterpret_cast<uint32_t*>(wring + S * U * 2 * RT * WARPS * 32);
  // XS: x [M, K] after the ring(s), times input_scale, rounded to BF16 (16-byte pieces)
  uint4* const xs = reinterpret_cast<uint4*>(sring + (F == WFmt::kNvfp4 ? S * U * 2 * RT * WARPS * 32 : 0));
  __shared__ float red[WARPS][NORM ? 17 : 16][16];  // [warp][W row | NORM: 16 = sum of squares][token]
  static_assert(sizeof(red) % 128 == 0, "the dynamic ring after `red` must stay 128-byte aligned");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  constexpr int BR = 16 * RT, R = 2 * RT;  // rows of a block tile; W rows a thread loads, g + 8 r
  const int tiles = (N + BR - 1) / BR;
  const int n0 = int(blockIdx.x) / CS * BR;  // the (first) block tile (CS = 1: one block per tile)
  bool row_ok[R];
  const uint8_t* wrow[R];  // this thread's 16 bytes of chunk 0 of its rows
#pragma unroll
  for (int r = 0; r < R; ++r) row_ok[r] = n0 + g + 8 * r < N;
#pragma unroll
  for (int r = 0; r < R; ++r) wrow[r] = w + int64_t(row_ok[r] ? n0 + g + 8 * r : 0) * ldw + 16 * t;
  // NVFP4: the 4-byte word of chunk 0's scales holding blocks 2t, 2t + 1 (8 blocks a chunk), and the
  // prmt selector of those two bytes in it (e4m3x2_raw's [b0, sign, b1, sign]).
  const int64_t sword = 4 * (t >> 1);
  const uint32_t ssel = (t & 1) ? 0xB3A2u : 0x9180u;
  const uint8_t* srow[R] = {};
  if constexpr (F == WFmt::kNvfp4) {
#pragma unroll
    for (int r = 0; r < R; ++r) srow[r] = qv.block_scale + int64_t(row_ok[r] ? n0 + g + 8 * r : 0) * qv.ldbs + sword;
  }
  bool tok_ok[NT];
  const bf16* xr[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    tok_ok[j] = g + 8 * j < M;
    xr[j] = x + int64_t(tok_ok[j] ? g + 8 * j : 0) * ldx + PK * t;
  }

  // KC-wide K chunks [c_lo, c_hi) of this block; warp w takes c_lo + w, c_lo + w + WARPS, ...
  const int nchunks = (K + KC - 1) / KC;
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
  // K a multiple of PK: a thread's 16-byte piece of a chunk is all in range or all out.
  auto piece_in = [&](int c) { return c < c_hi && c * KC + PK * t < K; };
  auto issue = [&](int st) {  // stage `st` of this thread into ring slot st % S
    uint4* slot = wring + (st % S) * U * R * NTH + tid;
    int it = st;
    const uint8_t* rp[R];
    const uint8_t* sp[R];  // NVFP4: the rows' scale words
    bool ok[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      rp[r] = wrow[r];
      sp[r] = srow[r];
      ok[r] = row_ok[r];
    }
    if constexpr (PERSIST) {  // step it of tile ti
      const int ti = st / iters, m0 = (int(blockIdx.x) + ti * int(gridDim.x)) * BR;
      it = st - ti * iters;
      // The flags first, then the pointers (the order the 16-row kernels were measured with).
#pragma unroll
      for (int r = 0; r < R; ++r) ok[r] = st < stages && m0 + g + 8 * r < N;
#pragma unroll
      for (int r = 0; r < R; ++r) rp[r] = w + int64_t(ok[r] ? m0 + g + 8 * r : 0) * ldw + 16 * t;
      if constexpr (F == WFmt::kNvfp4) {
#pragma unroll
        for (int r = 0; r < R; ++r) sp[r] = qv.block_scale + int64_t(ok[r] ? m0 + g + 8 * r : 0) * qv.ldbs + sword;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c_lo + warp + WARPS * (it * U + u);
      const bool in = st < stages && piece_in(c);
      const int64_t k = in ? int64_t(c) * 64 : 0;  // the chunk's byte offset in a row
#pragma unroll
      for (int r = 0; r < R; ++r) cp_async16(slot + (R * u + r) * NTH, rp[r] + k, in && ok[r] ? 16 : 0);
      if constexpr (F == WFmt::kNvfp4) {
        uint32_t* sslot = sring + (st % S) * U * R * NTH + tid;
        const int64_t sk = in ? int64_t(c) * 8 : 0;  // 8 scale bytes a chunk
#pragma unroll
        for (int r = 0; r < R; ++r) cp_async4(sslot + (R * u + r) * NTH, sp[r] + sk, in && ok[r] ? 4 : 0);
      }
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
      if constexpr (NORM && !XS) {  // XS: the sums of squares are in `red` since x was staged
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
    if constexpr (QUANT) {
      if (owner) sum *= qv.row_scale[tile_n0 + row] * (F == WFmt::kNvfp4 ? kNvfp4SumScale : 1.0f);
    }
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
    prefetch_l2(w + int64_t(n0 + tid) * ldw + int64_t(c_lo + skinny_prologue_chunks<WARPS, U, S>()) * 64, pf_bytes);
  // x XD stages ahead (see the top of the file): stage st + XD's loads go out before stage st's
  // products, into the register set stage st frees (set st % XD; the loop below is unrolled by XD so
  // that the set is a compile-time index).
  const uint4 zero = make_uint4(0, 0, 0, 0);
  constexpr int XD = skinny_x_ahead<WARPS, NT, F>();
  uint4 xq[XD][U][NT][XW];
  auto load_x = [&](int st, uint4 (&xnext)[U][NT][XW]) {
    const int it = PERSIST ? st % iters : st;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c_lo + warp + WARPS * (it * U + u);
      const bool in = st < stages && piece_in(c);
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < XW; ++i)
          xnext[u][j][i] = in && tok_ok[j] ? __ldg(reinterpret_cast<const uint4*>(xr[j] + c * KC) + i) : zero;
    }
  };
  pdl_wait();  // earlier kernels have completed: x may be read, out written
  if constexpr (XS) {
    // x [M, K] into shared memory by all threads, each piece times input_scale; NORM: the sums of
    // squares of x (before input_scale) per token, per warp into red[warp][16][token].
    const int K8 = K / 8, pieces = M * K8;  // M * K <= kStagedXElems (visit_skinny)
    float part[8] = {};
#pragma unroll 4
    for (int p = tid; p < pieces; p += NTH) {
      const int m = p / K8, k = (p - m * K8) * 8;
      uint4 v = __ldg(reinterpret_cast<const uint4*>(x + int64_t(m) * ldx + k));
      if constexpr (NORM) {
        const float sq_v = add_squares(v, 0.0f);
#pragma unroll
        for (int mm = 0; mm < 8; ++mm)
          if (mm == m) part[mm] += sq_v;
      }
      if (qv.input_scale != nullptr) v = scale_x(v, qv.input_scale + k);
      xs[p] = v;
    }
    if constexpr (NORM) {
#pragma unroll
      for (int mm = 0; mm < 8; ++mm) {
        float v = part[mm];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) red[warp][16][mm] = v;
      }
    }
    __syncthreads();
  } else {
#pragma unroll
    for (int d = 0; d < XD; ++d) load_x(d, xq[d]);
  }
  if constexpr (kResidualAhead) {
    if (tid < kTileElems && n0 + row < N && tok < M && int(blockIdx.x) % CS == 0)
      residual[0] = to_float(out[int64_t(tok) * ldo + n0 + row]);
    if constexpr (RT == 2) {
      if (tid < kTileElems && n0 + 16 + row < N && tok < M)
        residual[1] = to_float(out[int64_t(tok) * ldo + n0 + 16 + row]);
    }
  }
  auto run_stage = [&](int st, uint4 (&xnext)[U][NT][XW]) {
    uint4 xv[U][NT][XW];  // this stage's x
    const int it = PERSIST ? st % iters : st;
    if constexpr (XS) {  // from shared memory, already scaled (NT = 1)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c_lo + warp + WARPS * (it * U + u);
        const bool in = st < stages && piece_in(c);
#pragma unroll
        for (int i = 0; i < XW; ++i) xv[u][0][i] = in && tok_ok[0] ? xs[(g * K + c * KC + PK * t) / 8 + i] : zero;
      }
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int i = 0; i < XW; ++i) xv[u][j][i] = xnext[u][j][i];
      load_x(st + XD, xnext);
    }
    if constexpr (QUANT && !XS) {  // x as the products read it: its squares first, then input_scale
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c_lo + warp + WARPS * (it * U + u);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          if constexpr (NORM) {
#pragma unroll
            for (int i = 0; i < XW; ++i) sq[j] = add_squares(xv[u][j][i], sq[j]);
          }
        }
        if (qv.input_scale != nullptr && st < stages && piece_in(c)) {
#pragma unroll
          for (int i = 0; i < XW; ++i) {
            const float* s_in = qv.input_scale + int64_t(c) * KC + PK * t + 8 * i;
#pragma unroll
            for (int j = 0; j < NT; ++j) xv[u][j][i] = scale_x(xv[u][j][i], s_in);
          }
        }
      }
    }
    cp_async_wait<S - 2>();  // stage `st` has landed
    issue(st + S - 1);       // refills the slot read in the previous iteration
    const uint4* slot = wring + (st % S) * U * R * NTH + tid;
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        const uint4 wa = slot[(R * u + 2 * rt) * NTH], wb = slot[(R * u + 2 * rt + 1) * NTH];
        if constexpr (F == WFmt::kBf16) {
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const uint4& xp = xv[u][j][0];
            mma_16816(acc[rt][j], wa.x, wb.x, wa.y, wb.y, xp.x, xp.y);  // k = 8t + {0,1 | 2,3}
            mma_16816(acc[rt][j], wa.z, wb.z, wa.w, wb.w, xp.z, xp.w);  // k = 8t + {4,5 | 6,7}
            if constexpr (NORM) {
              if (rt == RT - 1) sq[j] = add_squares(xp, sq[j]);  // once per x piece
            }
          }
        } else if constexpr (F == WFmt::kFp8) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {  // word i: K 4i .. 4i+3 of the piece, x words 2i, 2i + 1
            uint32_t a0, a2, a1, a3;
            fp8_pairs(word(wa, i), a0, a2);
            fp8_pairs(word(wb, i), a1, a3);
#pragma unroll
            for (int j = 0; j < NT; ++j) {
              const uint4& xp = xv[u][j][i / 2];
              mma_16816(acc[rt][j], a0, a1, a2, a3, word(xp, 2 * (i % 2)), word(xp, 2 * (i % 2) + 1));
            }
          }
        } else {
          const uint32_t* sslot = sring + (st % S) * U * R * NTH + tid;
          uint32_t sa[2], sb[2];  // block scales of rows g, g + 8: K 0..15, 16..31 of the piece
          nvfp4_scales(sslot[(R * u + 2 * rt) * NTH], ssel, sa[0], sa[1]);
          nvfp4_scales(sslot[(R * u + 2 * rt + 1) * NTH], ssel, sb[0], sb[1]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {  // word i: K 8i .. 8i+7 of the piece, x piece i
            uint32_t pa[4], pb[4];
            nvfp4_pairs(word(wa, i), sa[i / 2], pa);
            nvfp4_pairs(word(wb, i), sb[i / 2], pb);
#pragma unroll
            for (int j = 0; j < NT; ++j) {
              const uint4& xp = xv[u][j][i];
              mma_16816(acc[rt][j], pa[0], pb[0], pa[1], pb[1], xp.x, xp.y);  // K pairs (0, 1), (2, 3)
              mma_16816(acc[rt][j], pa[2], pb[2], pa[3], pb[3], xp.z, xp.w);  // K pairs (4, 5), (6, 7)
            }
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
    // block 0's: [CS - 1][kTileElems], after the ring(s)
    float* parts = reinterpret_cast<float*>(sring + (F == WFmt::kNvfp4 ? S * U * R * NTH : 0));
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

// Stages of the ring of a quantized weight (one chunk a stage: its x pieces are 2 or 4 times the
// registers of a BF16 chunk's): about the BF16 ring's bytes, 64 KiB for 8 warps and 96 KiB for 16
// (NVFP4 a stage fewer where its scale words would pass that by much), at least 3.
// Where x is staged (XS), its bytes come out of that budget.
template <int WARPS, int RT, WFmt F, bool XS> constexpr int skinny_quant_stages() {
  constexpr int per_thread = (WARPS == 16 ? 192 : 256) - (XS ? kStagedXElems * int(sizeof(bf16)) / (WARPS * 32) : 0);
  constexpr int row_bytes = 2 * RT * (F == WFmt::kNvfp4 ? 20 : 16);
  constexpr int s = per_thread / row_bytes;
  return s < 3 ? 3 : s;
}

// skinny_gemm_kernel's template parameters other than the epilogue (Epi) and the output type. Ring
// sizes (BF16): 64 KiB (8 warps, 4 stages: 3 blocks per SM) and 96 KiB (16 warps, 3 stages: 2 blocks
// per SM); 192 resp. 128 bytes in flight per thread. A stage holds two chunks of 2 rows (RT = 1) or
// one chunk of 4 rows (RT = 2); quantized weights one chunk (skinny_quant_stages).
template <int WARPS_, int NT_, bool SPLIT_, int CS_, bool PERSIST_, int RT_ = 1, WFmt F_ = WFmt::kBf16, bool XS_ = false>
struct SkinnyCfg {
  static constexpr WFmt F = F_;
  static constexpr int WARPS = WARPS_, NT = NT_, RT = RT_, CS = CS_;
  static constexpr int U = F == WFmt::kBf16 ? 2 / RT_ : 1;
  static constexpr int S = F == WFmt::kBf16 ? (WARPS_ == 16 ? 3 : 4)
                                             : skinny_quant_stages<WARPS_, RT_, F_, XS_>();
  static constexpr bool SPLIT = SPLIT_, PERSIST = PERSIST_, XS = XS_;
  static constexpr int smem = skinny_smem_bytes<WARPS, NT, U, S, CS, RT, F, XS>();
  template <class Epi, class OutT> static constexpr auto kernel() {
    return skinny_gemm_kernel<WARPS, NT, U, S, Epi::GLU, Epi::ADD, Epi::NORM, SPLIT, CS, PERSIST, RT, F, XS, OutT>;
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
// Quantized weights (Fmt): no split-K over the grid, clusters of 2 (run_skinny); one 8-token tile
// stages x (XS) where its M rows of K fit, else reads it from global memory.
template <class Epi, WFmt Fmt, class F> void visit_skinny(const SkinnyPlan& p, int M, int K, F&& f) {
  auto by_m = [&](auto warps, auto split, auto cs, auto persist) {
    constexpr int W = decltype(warps)::value, C = decltype(cs)::value;
    constexpr bool SP = decltype(split)::value, PE = decltype(persist)::value;
    auto by_rt = [&](auto nt, auto xs) {
      constexpr int T = decltype(nt)::value;
      constexpr bool X = decltype(xs)::value;
      if constexpr (!SP && C == 1) {
        if (p.rt == 2) return f(SkinnyCfg<W, T, SP, C, PE, 2, Fmt, X>{});
      }
      f(SkinnyCfg<W, T, SP, C, PE, 1, Fmt, X>{});
    };
    using OneTile = std::integral_constant<int, 1>;
    if (M > 8) return by_rt(std::integral_constant<int, 2>{}, std::false_type{});
    if constexpr (skinny_can_stage_x<Fmt, 1, C>()) {
      if (int64_t(M) * K <= kStagedXElems) return by_rt(OneTile{}, std::true_type{});
    }
    by_rt(OneTile{}, std::false_type{});
  };
  using std::false_type, std::true_type;
  using Eight = std::integral_constant<int, 8>;
  using Sixteen = std::integral_constant<int, 16>;
  using One = std::integral_constant<int, 1>;
  // Cluster split-K: the 8-warp configuration (3 blocks per SM; 2 for M > 8 with 4 per cluster,
  // whose partial tiles take the shared memory a third block would need).
  if constexpr (!Epi::NORM) {
    if (p.cs == 2) return by_m(Eight{}, false_type{}, std::integral_constant<int, 2>{}, false_type{});
    if constexpr (Fmt == WFmt::kBf16) {
      if (p.cs == 4) return by_m(Eight{}, false_type{}, std::integral_constant<int, 4>{}, false_type{});
      if (p.wide && p.ksplit > 1) return by_m(Sixteen{}, true_type{}, One{}, false_type{});
      if (p.ksplit > 1) return by_m(Eight{}, true_type{}, One{}, false_type{});
    }
  }
  if (p.persist) return by_m(Eight{}, false_type{}, One{}, true_type{});
  // Quantized weights above 8 tokens: 8 warps (16 would spill their x registers, 128 a thread).
  if (p.wide && !(Fmt != WFmt::kBf16 && M > 8)) return by_m(Sixteen{}, false_type{}, One{}, false_type{});
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
void launch_skinny_cfg(const bf16* x, int64_t ldx, int M, const uint8_t* w, int64_t ldw, int N, int K,
                       ParamView bias, bool has_bias, OutT* out, int64_t ldo, const SkinnyPlan& p,
                       SplitKScratch scratch, float norm_eps, const QuantView& qv, int64_t prefetch_budget,
                       const LaunchCtx& ctx, int sm_count) {
  const int per_sm = skinny_blocks_per_sm<Cfg, Epi, OutT>();
  const dim3 grid = skinny_grid(p, N, per_sm, sm_count);
  // L2 prefetch per row (BF16 weights only): the rest of the block's K range after the prologue (the
  // shortest range of a split, less one chunk for the last one's ragged end), within the budget (all
  // rows together); whole 128-byte lines; none when it would be too little to matter (many rows).
  int64_t pf = 0;
  if constexpr (Cfg::F == WFmt::kBf16) {
    constexpr int kpre = skinny_prologue_chunks<Cfg::WARPS, Cfg::U, Cfg::S>() * 32;
    const int splits = p.ksplit * p.cs;
    const int64_t kspan = splits > 1 ? int64_t((K + 31) / 32 / splits - 1) * 32 : K;
    const int64_t rest = kspan > kpre ? (kspan - kpre) * int64_t(sizeof(bf16)) : 0;
    pf = std::min(rest, prefetch_budget / (int64_t(N) * splits)) & ~int64_t(127);
    if (pf < 1024) pf = 0;
  }
  launch_pdl_cluster(ctx, "skinny_gemm_kernel", Cfg::CS > 1 ? unsigned(Cfg::CS) : 0u, Cfg::template kernel<Epi, OutT>(),
                     grid, Cfg::WARPS * 32, Cfg::smem, x, ldx, M, w, ldw, N, K, uint32_t(pf), bias, has_bias,
                     out, ldo, scratch, norm_eps, qv);
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
SkinnyPlan skinny_plan(int N, int K, int kc, int M, bool glu, int sm_count, int ksplit_mode, int cluster_mode,
                       int persistent_mode, int rows_mode) {
  SkinnyPlan p;
  const int tiles = (N + 15) / 16, nchunks = (K + kc - 1) / kc;  // kc: K per chunk of the weight's format
  p.ksplit = skinny_ksplit(tiles, nchunks, ksplit_mode);
  p.wide = int64_t(tiles) * p.ksplit < 4 * sm_count;
  p.cs = skinny_cluster(p.wide, p.ksplit, nchunks, M, cluster_mode);
  p.persist = p.cs == 1 && p.ksplit == 1 && !p.wide && skinny_persistent(tiles, sm_count, persistent_mode);
  const bool two_rows = rows_mode == CudaBackend::kSkinnyAuto ? M > 8 && !glu : rows_mode == 32;
  p.rt = two_rows && p.cs == 1 && p.ksplit == 1 ? 2 : 1;
  return p;
}

// A linear op's operands, checked: x [M, K] BF16 and 2-D, W [N, K] in its format (ops.h LinearWeight:
// BF16; FP8 with row_scale; NVFP4 [N, K / 2] with block_scale [N, K / 16] and row_scale; input_scale [K]
// only for the quantized formats), the bias (if any) of N elements; `skinny`: M <= 16 and the skinny
// GEMM's requirements hold (K > 0 a multiple of the format's piece, NVFP4 of 64; row strides and
// alignments as skinny_gemm_kernel needs them).
struct LinearArgs {
  const bf16* x = nullptr;
  const uint8_t* w = nullptr;
  int64_t ldx = 0, ldw = 0;  // ldw in bytes
  int M = 0, N = 0, K = 0;
  WFmt fmt = WFmt::kBf16;
  QuantView qv{};
  ParamView bias{};
  bool has_bias = false;
  bool skinny = false;
};

// A quantized weight's F32 vector `name` of n elements, contiguous.
const float* quant_vector(const char* op, const char* name, const Tensor& t, int64_t n) {
  require_tensor(t, DType::F32, op, name);
  OCRIA_RT_REQUIRE(t.contiguous() && t.numel() == n, op,
                   std::string(name) + " must be a contiguous F32 vector of " + std::to_string(n) + " elements, got " +
                       t.shape_str());
  return t.ptr<const float>();
}

LinearArgs linear_args(const char* op, const Tensor& x, const LinearWeight& lw) {
  const Tensor& w = lw.weight;
  using Fmt = LinearWeight::Format;
  require_tensor(x, DType::BF16, op, "x");
  require_tensor(w, lw.format == Fmt::kDense ? DType::BF16 : lw.format == Fmt::kFp8 ? DType::F8E4M3 : DType::U8, op,
                 "weight");
  OCRIA_RT_REQUIRE(x.ndim == 2 && w.ndim == 2, op,
                   "expected 2-D x and weight, got " + x.shape_str() + ", " + w.shape_str());
  OCRIA_RT_REQUIRE(lw.in_features() == x.dim(1), op,
                   "shape mismatch: x " + x.shape_str() + ", weight " + w.shape_str() + " (" +
                       std::to_string(lw.in_features()) + " input features)");
  OCRIA_RT_REQUIRE(x.dim(0) < (int64_t(1) << 31) && w.dim(0) < (int64_t(1) << 31) && lw.in_features() < (int64_t(1) << 31),
                   op, "dimension too large");
  LinearArgs a;
  a.x = x.ptr<bf16>();
  a.w = w.ptr<uint8_t>();
  a.ldx = x.row_stride;
  a.ldw = w.row_stride * int64_t(dtype_size(w.dtype));
  a.M = int(x.dim(0));
  a.N = int(w.dim(0));
  a.K = int(lw.in_features());
  a.has_bias = lw.bias.defined();
  if (a.has_bias) {
    a.bias = param_view(lw.bias, op, "bias");
    OCRIA_RT_REQUIRE(lw.bias.numel() == a.N, op,
                     "bias has " + std::to_string(lw.bias.numel()) + " elements, expected " + std::to_string(a.N));
  }
  // piece: the K of a thread's 16-byte load (skinny_gemm_kernel)
  int piece = 8;
  bool layout_ok = aligned16(a.w) && a.ldw % 16 == 0;
  if (lw.format == Fmt::kDense) {
    OCRIA_RT_REQUIRE(!lw.input_scale.defined() && !lw.row_scale.defined() && !lw.block_scale.defined(), op,
                     "a dense weight has no row, block or input scale");
  } else {
    a.fmt = lw.format == Fmt::kFp8 ? WFmt::kFp8 : WFmt::kNvfp4;
    a.qv.row_scale = quant_vector(op, "row_scale", lw.row_scale, a.N);
    if (lw.input_scale.defined()) {
      a.qv.input_scale = quant_vector(op, "input_scale", lw.input_scale, a.K);
      layout_ok = layout_ok && aligned16(a.qv.input_scale);
    }
    if (lw.format == Fmt::kFp8) {
      OCRIA_RT_REQUIRE(!lw.block_scale.defined(), op, "an FP8 weight has no block scale");
      piece = 16;
    } else {
      const Tensor& bs = lw.block_scale;
      require_tensor(bs, DType::F8E4M3, op, "block_scale");
      OCRIA_RT_REQUIRE(a.K % LinearWeight::kNvfp4Block == 0 && bs.ndim == 2 && bs.dim(0) == a.N &&
                           bs.dim(1) == a.K / LinearWeight::kNvfp4Block,
                       op, "NVFP4 weight " + w.shape_str() + " needs K a multiple of 16 and block_scale [" +
                               std::to_string(a.N) + ", " + std::to_string(a.K / 16) + "], got " + bs.shape_str());
      OCRIA_RT_REQUIRE(a.K == 0 || (reinterpret_cast<uintptr_t>(a.w) % 4 == 0 && a.ldw % 4 == 0), op,
                       "NVFP4 weight rows must be 4-byte aligned (the device layout is of 32-bit words)");
      a.qv.block_scale = bs.ptr<uint8_t>();
      a.qv.ldbs = bs.row_stride;
      piece = 64;  // 32 K a piece, and a scale word (4 blocks) never past a row's end
      layout_ok = layout_ok && reinterpret_cast<uintptr_t>(a.qv.block_scale) % 4 == 0 && a.qv.ldbs % 4 == 0;
    }
  }
  a.skinny = a.M >= 1 && a.M <= 16 && a.K > 0 && a.K % piece == 0 && a.ldx % 8 == 0 && aligned16(a.x) && layout_ok;
  return a;
}

// The decode GEMM of epilogue Epi on x and W (linear_args' skinny), the launch shape chosen from the
// backend's switches; with Epi::NORM without split-K (every block needs the whole row for its sum of
// squares) and with persistent blocks as linear's. Quantized weights: no split-K over the grid, and
// clusters of 2 where 4 are asked for.
template <class Epi, class OutT>
void run_skinny(const LinearArgs& a, OutT* out, int64_t ldo, float norm_eps, const SkinnySettings& st) {
  auto run = [&](auto fmt) {
    constexpr WFmt Fmt = decltype(fmt)::value;
    constexpr bool quant = Fmt != WFmt::kBf16;
    const int kc = wfmt_k_per_chunk<Fmt>(), cluster = quant && st.cluster == 4 ? 2 : st.cluster;
    const SkinnyPlan p = Epi::NORM || quant
                             ? skinny_plan(a.N, a.K, kc, a.M, Epi::GLU, st.sm_count, 1, Epi::NORM ? 0 : cluster,
                                           st.persistent, st.rows)
                             : skinny_plan(a.N, a.K, kc, a.M, Epi::GLU, st.sm_count, st.ksplit, st.cluster,
                                           st.persistent, st.rows);
    visit_skinny<Epi, Fmt>(p, a.M, a.K, [&](auto cfg) {
      launch_skinny_cfg<decltype(cfg), Epi>(a.x, a.ldx, a.M, a.w, a.ldw, a.N, a.K, a.bias, a.has_bias, out, ldo, p,
                                            splitk_scratch(st.splitk_scratch), norm_eps, a.qv, st.prefetch_bytes,
                                            st.ctx, st.sm_count);
    });
  };
  switch (a.fmt) {
    case WFmt::kBf16: return run(std::integral_constant<WFmt, WFmt::kBf16>{});
    case WFmt::kFp8: return run(std::integral_constant<WFmt, WFmt::kFp8>{});
    case WFmt::kNvfp4: return run(std::integral_constant<WFmt, WFmt::kNvfp4>{});
  }
}

template <class OutT>
void launch_fallback(const bf16* x, int64_t ldx, int M, const bf16* w, int64_t ldw, int N, int K, ParamView bias,
                     bool has_bias, OutT* out, int64_t ldo, cudaStream_t stream) {
  dim3 grid((N + 63) / 64, (M + 63) / 64);
  OCRIA_RT_REQUIRE(grid.y <= 65535, "linear", "too many rows for the fallback kernel");
  linear_fallback_kernel<OutT><<<grid, 256, 0, stream>>>(x, ldx, M, w, ldw, N, K, bias, has_bias, out, ldo);
  check_launch("linear_fallback_kernel");
}

// e4m3fn bits -> float (bias 7, subnormals; the NaN code is not expected in weights).
__device__ __forceinline__ float e4m3_to_float(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  const float v = e == 0 ? float(m) * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));  // m 2^-9
  return (b & 0x80u) ? -v : v;
}
__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const float v = e == 0 ? 0.5f * float(m) : float(1u << (e - 1)) * (1.0f + 0.5f * float(m));
  return (code & 8u) ? -v : v;
}

// dst [rows, K] (BF16, contiguous) = rows n0 .. n0 + rows - 1 of the quantized W (fmt, qv) times
// input_scale per column where there is one, each element rounded once. Block (., r) takes row n0 + r.
__global__ void dequantize_kernel(const uint8_t* __restrict__ w, int64_t ldw, WFmt fmt, QuantView qv, int K, int n0,
                                  bf16* __restrict__ dst) {
  const int64_t n = n0 + int64_t(blockIdx.y);
  const uint8_t* wr = w + n * ldw;
  const float rs = qv.row_scale[n];
  for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < K; k += gridDim.x * blockDim.x) {
    float v;
    if (fmt == WFmt::kFp8) {
      v = e4m3_to_float(wr[k]);
    } else {  // the device layout: element k % 8 of the word k / 8
      const uint32_t word = reinterpret_cast<const uint32_t*>(wr)[k >> 3];
      const int j = k & 7;
      uint32_t code = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) code |= ((word >> kNvfp4Bit[j][b]) & 1u) << b;
      v = e2m1_to_float(code) * e4m3_to_float(qv.block_scale[n * qv.ldbs + k / 16]);
    }
    v *= rs;
    if (qv.input_scale) v *= qv.input_scale[k];
    dst[int64_t(blockIdx.y) * K + k] = __float2bfloat16_rn(v);
  }
}

// out[M, N] (+)= x · W^T (+ bias) for a BF16 W (a.w, a.ldw bytes): CUTLASS above 16 tokens, else (or
// where CUTLASS cannot take the problem) the tiled fallback. Both launch the ordinary way, so W may
// have been written by the kernel just before.
template <class OutT>
void dense_gemm(const LinearArgs& a, OutT* out, int64_t ldo, void* workspace, size_t workspace_bytes, int sm_count,
                cudaStream_t stream) {
  const bf16* w = reinterpret_cast<const bf16*>(a.w);
  const int64_t ldw = a.ldw / int64_t(sizeof(bf16));
  if constexpr (std::is_same_v<OutT, bf16>) {
    if (a.M > 16 && a.K > 0 &&
        gemm_bf16_sm90(a.x, a.ldx, w, ldw, out, ldo, a.M, a.N, a.K, workspace, workspace_bytes, sm_count, stream)) {
      if (a.has_bias) {
        OCRIA_RT_REQUIRE(a.M <= 65535, "linear", "too many rows for the bias kernel");
        add_bias_kernel<<<dim3(unsigned((a.N + 255) / 256), unsigned(a.M)), 256, 0, stream>>>(out, ldo, a.M, a.N,
                                                                                             a.bias);
        check_launch("add_bias_kernel");
      }
      return;
    }
  }
  launch_fallback(a.x, a.ldx, a.M, w, ldw, a.N, a.K, a.bias, a.has_bias, out, ldo, stream);
}

// The quantized weight a.w dequantized into `scratch` (CudaBackend::kDequantScratchBytes) a slab of
// rows at a time (a multiple of 128 rows where there are several, so that every slab's output columns
// stay 16-byte aligned for CUTLASS), each slab's product formed by dense_gemm into its columns of out.
// input_scale is folded into the slab's columns.
template <class OutT>
void linear_dequantized(const LinearArgs& a, OutT* out, int64_t ldo, bf16* scratch, void* workspace,
                        size_t workspace_bytes, int sm_count, cudaStream_t stream) {
  if (a.K == 0) {  // no products and no rows to dequantize: out = bias (dense_gemm reads no W then)
    dense_gemm(a, out, ldo, workspace, workspace_bytes, sm_count, stream);
    return;
  }
  const int64_t row_bytes = int64_t(a.K) * int64_t(sizeof(bf16));
  int64_t slab = std::min<int64_t>(int64_t(CudaBackend::kDequantScratchBytes) / row_bytes, 32768);
  OCRIA_RT_REQUIRE(slab >= 1, "linear", "K = " + std::to_string(a.K) + " too large for the dequantization scratch");
  if (slab < a.N) slab = std::max<int64_t>(slab / 128 * 128, 1);
  const size_t bias_esz = a.bias.is_bf16 ? sizeof(bf16) : sizeof(float);
  for (int64_t n0 = 0; n0 < a.N; n0 += slab) {
    const int nc = int(std::min<int64_t>(slab, a.N - n0));
    const unsigned kblocks = unsigned(std::min<int64_t>((a.K + 255) / 256, 64));
    dequantize_kernel<<<dim3(kblocks, unsigned(nc)), 256, 0, stream>>>(a.w, a.ldw, a.fmt, a.qv, a.K, int(n0), scratch);
    check_launch("dequantize_kernel");
    LinearArgs d = a;
    d.fmt = WFmt::kBf16;
    d.w = reinterpret_cast<const uint8_t*>(scratch);
    d.ldw = row_bytes;
    d.N = nc;
    if (a.has_bias) d.bias.ptr = static_cast<const char*>(a.bias.ptr) + size_t(n0) * bias_esz;
    dense_gemm(d, out + n0, ldo, workspace, workspace_bytes, sm_count, stream);
  }
}

// W[n, k] = round(W[n, k] * (1 + nw[k])), one thread per element.
__global__ void fold_norm_weight_kernel(bf16* __restrict__ w, int64_t ldw, int64_t N, int64_t K,
                                        const float* __restrict__ nw) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < N * K; i += int64_t(gridDim.x) * blockDim.x) {
    bf16* p = w + (i / K) * ldw + i % K;
    *p = __float2bfloat16_rn(__bfloat162float(*p) * (1.0f + nw[i % K]));
  }
}

// Each 32-bit word of an NVFP4 weight (rows of ldw bytes, words_per_row words each) from the
// checkpoint's nibble order (element j at bits 4j .. 4j+3) to the device layout (kNvfp4Bit).
__global__ void nvfp4_device_layout_kernel(uint8_t* __restrict__ w, int64_t ldw, int64_t rows, int64_t words_per_row) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * words_per_row;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t* p = reinterpret_cast<uint32_t*>(w + (i / words_per_row) * ldw) + i % words_per_row;
    const uint32_t q = *p;
    uint32_t out = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int b = 0; b < 4; ++b) out |= ((q >> (4 * j + b)) & 1u) << kNvfp4Bit[j][b];
    *p = out;
  }
}

}  // namespace
}  // namespace cuda

void CudaBackend::prepare_quantized_weight(const LinearWeight& lw) {
  using namespace cuda;
  if (lw.format != LinearWeight::Format::kNvfp4) return;
  const char* op = "prepare_quantized_weight";
  const Tensor& w = lw.weight;
  require_tensor(w, DType::U8, op, "weight");
  OCRIA_RT_REQUIRE(w.ndim == 2, op, "an NVFP4 weight is 2-D, got " + w.shape_str());
  if (w.numel() == 0) return;
  OCRIA_RT_REQUIRE(w.dim(1) % 8 == 0 && reinterpret_cast<uintptr_t>(w.ptr<uint8_t>()) % 4 == 0 && w.row_stride % 4 == 0,
                   op, "an NVFP4 weight needs K a multiple of 16 and 4-byte aligned rows, got " + w.shape_str());
  activate();
  nvfp4_device_layout_kernel<<<1024, 256, 0, stream_>>>(w.ptr<uint8_t>(), w.row_stride, w.dim(0), w.dim(1) / 4);
  check_launch("nvfp4_device_layout_kernel");
}

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
  if (a.fmt != WFmt::kBf16) {  // prefill, or a shape the skinny GEMM cannot take: through BF16 rows
    if (!dequant_scratch_) {
      OCRIA_RT_REQUIRE(!capturing_, op,
                       "a quantized weight of this shape needs the dequantization scratch, which cannot be "
                       "allocated during graph capture (run the op once before capturing)");
      check_cuda(cudaMalloc(&dequant_scratch_, kDequantScratchBytes), "cudaMalloc (dequantization scratch)");
    }
    if (out_bf16)
      linear_dequantized(a, out.ptr<bf16>(), ldo, static_cast<bf16*>(dequant_scratch_), workspace_, workspace_bytes_,
                         sm_count_, stream_);
    else
      linear_dequantized(a, out.ptr<float>(), ldo, static_cast<bf16*>(dequant_scratch_), workspace_,
                         workspace_bytes_, sm_count_, stream_);
    return;
  }
  if (out_bf16)
    dense_gemm(a, out.ptr<bf16>(), ldo, workspace_, workspace_bytes_, sm_count_, stream_);
  else
    dense_gemm(a, out.ptr<float>(), ldo, workspace_, workspace_bytes_, sm_count_, stream_);
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
