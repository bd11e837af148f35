// Defaults of the optional Backend ops, and the CUDA entry points when built without CUDA.
#include "ocria_rt/engine.h"
#include "ops/ops.h"

namespace ocria_rt {

static Error not_on_backend(const Backend& b, const char* op) {
  return Error(ErrorCode::kInternal, std::string(op) + " is not implemented on the " + b.name() + " backend yet");
}
void Backend::layer_norm(const Tensor&, const Tensor&, const Tensor&, const Tensor&, float) { throw not_on_backend(*this, "layer_norm"); }
void Backend::gelu(const Tensor&, const Tensor&, bool) { throw not_on_backend(*this, "gelu"); }
void Backend::vision_attention(const Tensor&, const Tensor&, const Tensor&, int64_t, float, const Tensor&) {
  throw not_on_backend(*this, "vision_attention");
}

#ifndef OCRIA_RT_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend(int) {
  throw Error(ErrorCode::kDeviceError, "device 'cuda' requested but ocria_rt was built without CUDA support "
                                       "(rebuild with nvcc available, or OCRIA_RT_CUDA=ON)");
}

int cuda_device_count() { return 0; }
#endif

}  // namespace ocria_rt
