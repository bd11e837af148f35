// Launchers shared between linear.cu (dispatch, skinny GEMM, fallback) and linear_gemm_sm90.cu
// (the CUTLASS instantiation, in its own translation unit because it is slow to compile).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace ocria_rt {
namespace cuda {

// D[M, N] = A[M, K] · B[N, K]^T in BF16 with fp32 accumulation on Hopper tensor cores (TMA + wgmma,
// warp-specialized persistent kernel). All three matrices are row-major with the given leading
// dimensions (elements). Returns false without launching when CUTLASS cannot take the problem
// (alignment: K, lda, ldb, ldd multiples of 8 and 16-byte aligned pointers) or when its workspace
// does not fit `workspace_bytes`; throws Error(kDeviceError) when a launch fails.
bool gemm_bf16_sm90(const void* A, int64_t lda, const void* B, int64_t ldb, void* D, int64_t ldd, int M, int N,
                    int K, void* workspace, size_t workspace_bytes, int sm_count, cudaStream_t stream);

}  // namespace cuda
}  // namespace ocria_rt
