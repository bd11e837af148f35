// The bookkeeping between two speculative steps (ops.h, speculative_advance).
#include "ops/cpu/backend.h"

namespace ocria_rt {

void CpuBackend::speculative_advance(const Tensor& count, const Tensor& tokens, const Tensor& positions,
                                     const Tensor& rope_positions, const Tensor& draft_ids, const Tensor& verify_ids,
                                     const Tensor& step) {
  const int64_t B = positions.numel(), n = ids_i32(count)[0];
  if (n < 1 || n > B || tokens.numel() < n || rope_positions.numel() != 3 * B)
    throw Error(ErrorCode::kInternal, "speculative_advance: count " + std::to_string(n) + ", tokens " + tokens.shape_str() +
                                          ", positions " + positions.shape_str() + ", rope_positions " +
                                          rope_positions.shape_str());
  for (int64_t i = 0; i < B; ++i) positions.ptr<int32_t>()[i] += int32_t(n);
  for (int64_t i = 0; i < 3 * B; ++i) rope_positions.ptr<int32_t>()[i] += int32_t(n);
  const int32_t anchor = ids_i32(tokens)[n - 1];
  draft_ids.ptr<int32_t>()[0] = anchor;
  verify_ids.ptr<int32_t>()[0] = anchor;
  step.ptr<int32_t>()[0] += 1;
}

}  // namespace ocria_rt
