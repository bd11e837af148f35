// Device queries that need no backend.
#include <cuda_runtime.h>

#include "ocria_rt/engine.h"
#include "ops/ops.h"

namespace ocria_rt {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

}  // namespace ocria_rt
