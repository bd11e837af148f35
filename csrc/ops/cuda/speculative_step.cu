// The bookkeeping between two speculative steps on the device (ops.h, speculative_advance), so that
// a captured step needs nothing from the host to run the next one.
#include "ops/cuda/backend.cuh"

namespace ocria_rt {

namespace {

// One block: every thread reads the count, then advances its share of the positions; thread 0 sets
// the anchors and the step index. No pointer is __restrict__: with const __restrict__ the compiler
// may load count as invariant memory (LDG.CONSTANT) and schedule that load above pdl_wait(), before
// speculative_accept has written it (backend.cuh, "programmatic dependent launch").
__global__ void speculative_advance_kernel(const int32_t* count, const int32_t* tokens, int32_t* positions,
                                           int32_t* rope_positions, int32_t B, int32_t* draft_anchor,
                                           int32_t* verify_anchor, int32_t* step) {
  cuda::pdl_launch_dependents();
  cuda::pdl_wait();
  const int32_t n = *count;
  for (int32_t i = threadIdx.x; i < B; i += blockDim.x) positions[i] += n;
  for (int32_t i = threadIdx.x; i < 3 * B; i += blockDim.x) rope_positions[i] += n;
  if (threadIdx.x == 0) {
    const int32_t anchor = tokens[n - 1];
    *draft_anchor = anchor;
    *verify_anchor = anchor;
    *step += 1;
  }
}

}  // namespace

void CudaBackend::speculative_advance(const Tensor& count, const Tensor& tokens, const Tensor& positions,
                                      const Tensor& rope_positions, const Tensor& draft_ids, const Tensor& verify_ids,
                                      const Tensor& step) {
  const char* op = "speculative_advance";
  cuda::require_tensor(count, DType::I32, op, "count");
  cuda::require_tensor(tokens, DType::I32, op, "tokens");
  cuda::require_tensor(positions, DType::I32, op, "positions");
  cuda::require_tensor(rope_positions, DType::I32, op, "rope_positions");
  cuda::require_tensor(draft_ids, DType::I32, op, "draft_ids");
  cuda::require_tensor(verify_ids, DType::I32, op, "verify_ids");
  cuda::require_tensor(step, DType::I32, op, "step");
  const int64_t B = positions.numel();
  OCRIA_RT_REQUIRE(count.numel() == 1 && step.numel() == 1 && tokens.numel() >= B && rope_positions.numel() == 3 * B &&
                       draft_ids.numel() >= 1 && verify_ids.numel() >= 1,
                   op, "count " + count.shape_str() + ", tokens " + tokens.shape_str() + ", positions " +
                           positions.shape_str() + ", rope_positions " + rope_positions.shape_str() + ", step " +
                           step.shape_str());
  OCRIA_RT_REQUIRE(positions.contiguous() && rope_positions.contiguous() && tokens.contiguous(), op,
                   "positions, rope_positions and tokens must be contiguous");
  activate();
  cuda::launch_pdl(launch_ctx(), "speculative_advance_kernel", speculative_advance_kernel, 1, 64, 0,
                   count.ptr<int32_t>(), tokens.ptr<int32_t>(), positions.ptr<int32_t>(), rope_positions.ptr<int32_t>(),
                   int32_t(B), draft_ids.ptr<int32_t>(), verify_ids.ptr<int32_t>(), step.ptr<int32_t>());
}

}  // namespace ocria_rt
