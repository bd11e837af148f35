// Tensor-core and async-copy primitives (sm_80+ PTX) shared by the kernels that use mma.sync:
// the skinny GEMM (linear.cu) and flash attention (attention.cu).
//
// mma.sync m16n8k16 fragments (g = lane / 4, t = lane % 4; each register holds two BF16 of
// consecutive columns, the lower column in the low half):
//   A (16 x 16, row-major): a0 = (row g, cols 2t, 2t+1), a1 = (row g+8, cols 2t..), a2 = (row g, cols 2t+8..),
//                           a3 = (row g+8, cols 2t+8..)
//   B (16 x 8, k x n):      b0 = (k rows 2t, 2t+1, col g), b1 = (k rows 2t+8, 2t+9, col g)
//   C (16 x 8, fp32):       c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, cols 2t, 2t+1)
#pragma once
#include <cstdint>

namespace ocria_rt {
namespace cuda {

// 16 bytes global -> shared, L2 only; src_bytes < 16 zero-fills the rest (0: nothing is read).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
// 4 bytes global -> shared through L1, src_bytes 0 or 4 (0: zero-filled, nothing read).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int src_bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Waits until at most N of this thread's committed groups are still in flight.
// A compiler memory barrier too: shared-memory reads after it are not hoisted above it.
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// Brings `bytes` (a multiple of 16) of global memory at a 16-byte aligned address into L2 (a hint,
// carried out asynchronously by the TMA unit).
__device__ __forceinline__ void prefetch_l2(const void* gmem, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(gmem), "r"(bytes) : "memory");
}
// Brings the 128-byte line holding `gmem` into L2 (a hint). L2 is the point of coherence of global
// memory, so a line prefetched before pdl_wait() can only make a later read faster, never stale.
__device__ __forceinline__ void prefetch_l2_line(const void* gmem) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(gmem) : "memory");
}

// c += A(16x16, row) · B(16x8, col), BF16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four 8x8 BF16 matrices from shared memory: lanes 8i .. 8i+7 give the addresses (shared window,
// 16-byte aligned) of the 8 rows of matrix i, which lands in r[i]; lane l receives row l / 4,
// columns 2 (l % 4), +1. The .trans form delivers the transpose: rows 2 (l % 4), +1 of column l / 4.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

}  // namespace cuda
}  // namespace ocria_rt
