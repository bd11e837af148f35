// The one CUTLASS 3.x instantiation of the backend: a BF16 "TN" GEMM for the M > 16 linear path
// (prefill), D[M, N] = X[M, K] · W[N, K]^T, fp32 accumulation. TMA loads, wgmma, warp-specialized
// cooperative persistent kernel, 128 x 256 x 64 tiles, 2 x 1 clusters (the shape that the CUTLASS
// profiler favours for large BF16 problems on H100/H200). Kept in its own file: it takes most of the
// backend's compile time.
// Device-side asserts inside the CUTLASS kernel are calls that make ptxas serialise the wgmma
// pipeline (warning C7510): compile this unit without them whatever the build type.
#ifndef NDEBUG
#define NDEBUG
#endif
#include "ops/cuda/linear.cuh"

#include <string>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "ocria_rt/error.h"

namespace ocria_rt {
namespace cuda {
namespace {

using namespace cute;

using ElementA = cutlass::bfloat16_t;  // X [M, K] row-major (K contiguous)
using LayoutA = cutlass::layout::RowMajor;
using ElementB = cutlass::bfloat16_t;  // W [N, K] row-major == B [K, N] column-major
using LayoutB = cutlass::layout::ColumnMajor;
using ElementD = cutlass::bfloat16_t;  // D [M, N] row-major
using LayoutD = cutlass::layout::RowMajor;
using ElementAcc = float;
constexpr int kAlign = 8;  // elements per 16-byte access

using TileShape = Shape<_128, _256, _64>;
using ClusterShape = Shape<_2, _1, _1>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementAcc,
    void, LayoutD, kAlign,  // no source matrix C: D = alpha * acc
    ElementD, LayoutD, kAlign, cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlign, ElementB, LayoutB, kAlign,
    ElementAcc, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

using GemmKernel =
    cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

}  // namespace

bool gemm_bf16_sm90(const void* A, int64_t lda, const void* B, int64_t ldb, void* D, int64_t ldd, int M, int N,
                    int K, void* workspace, size_t workspace_bytes, int sm_count, cudaStream_t stream) {
  auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  if (M <= 0 || N <= 0 || K <= 0) return false;
  if (K % kAlign || lda % kAlign || ldb % kAlign || ldd % kAlign || N % kAlign) return false;
  if (!aligned(A) || !aligned(B) || !aligned(D)) return false;

  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideC = typename GemmKernel::StrideC;
  using StrideD = typename GemmKernel::StrideD;
  // (M, K, L), (N, K, L), (M, N, L) strides: leading dimension, unit, batch (unused, L = 1).
  StrideA stride_a{};
  get<0>(stride_a) = lda;
  StrideB stride_b{};
  get<0>(stride_b) = ldb;
  StrideD stride_d{};
  get<0>(stride_d) = ldd;
  StrideC stride_c = stride_d;
  static_assert(is_static_v<decltype(get<1>(stride_a))> && is_static_v<decltype(get<1>(stride_d))>,
                "K-major A/B and row-major D expected");

  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sm_count;

  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {M, N, K, 1},
      {static_cast<const ElementA*>(A), stride_a, static_cast<const ElementB*>(B), stride_b},
      {{1.0f, 0.0f}, nullptr, stride_c, static_cast<ElementD*>(D), stride_d},
      hw};

  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
  if (Gemm::get_workspace_size(args) > workspace_bytes) return false;
  cutlass::Status st = gemm.initialize(args, workspace, stream);
  if (st != cutlass::Status::kSuccess)
    throw Error(ErrorCode::kDeviceError, std::string("CUDA linear: CUTLASS GEMM initialize failed: ") +
                                             cutlassGetStatusString(st));
  st = gemm.run(stream);
  cudaError_t err = cudaGetLastError();
  if (st != cutlass::Status::kSuccess || err != cudaSuccess)
    throw Error(ErrorCode::kDeviceError,
                std::string("CUDA linear: CUTLASS GEMM launch failed (M=") + std::to_string(M) +
                    ", N=" + std::to_string(N) + ", K=" + std::to_string(K) + "): " + cutlassGetStatusString(st) +
                    " / " + cudaGetErrorString(err));
  return true;
}

}  // namespace cuda
}  // namespace ocria_rt
