// The CUDA entry points when the library is built without CUDA.
#include "ocria_rt/engine.h"
#include "ops/ops.h"

namespace ocria_rt {

#ifndef OCRIA_RT_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend(int) {
  throw Error(ErrorCode::kDeviceError, "device 'cuda' requested but ocria_rt was built without CUDA support "
                                       "(rebuild with nvcc available, or OCRIA_RT_CUDA=ON)");
}

int cuda_device_count() { return 0; }
#endif

}  // namespace ocria_rt
