#include "ops/cpu/backend.h"

#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/float_convert.h"

namespace ocria_rt {

CpuBackend::CpuBackend(int num_threads) {
  if (num_threads < 0) throw Error(ErrorCode::kInvalidArgument, "num_threads must be >= 0 (0: all cores), got " + std::to_string(num_threads));
  threads_ = num_threads > 0 ? num_threads : int(std::max(1u, std::thread::hardware_concurrency()));
}

std::unique_ptr<Backend> make_cpu_backend(int num_threads) { return std::make_unique<CpuBackend>(num_threads); }

void expect_cpu_f32(const Tensor& t, const char* what) {
  if (t.device != DeviceKind::CPU || t.dtype != DType::F32)
    throw Error(ErrorCode::kInternal, std::string("cpu op: ") + what + " must be an F32 CPU tensor");
}

void* CpuBackend::allocate(size_t bytes) {
  constexpr size_t kAlign = 64;
  void* p = std::aligned_alloc(kAlign, std::max(kAlign, (bytes + kAlign - 1) / kAlign * kAlign));
  if (!p) throw Error(ErrorCode::kResourceError, "cpu: out of memory allocating " + std::to_string(bytes) + " bytes");
  return p;
}

void CpuBackend::release(void* ptr) { std::free(ptr); }

void CpuBackend::copy_from_host(const Tensor& dst, const void* src, DType src_dtype) {
  const int64_t rows = dst.ndim == 0 ? 1 : dst.dim(0), cols = dst.ndim == 0 ? 1 : dst.row_size();
  if (dst.dtype == DType::I32 || dst.dtype == DType::U8 || dst.dtype == DType::F8E4M3) {
    // Integers and quantized weights' raw bytes are copied as they are.
    if (src_dtype != dst.dtype)
      throw Error(ErrorCode::kInternal, std::string("copy_from_host: ") + dtype_name(dst.dtype) + " destination needs " +
                                            dtype_name(dst.dtype) + " data, got " + dtype_name(src_dtype));
    const size_t esz = dtype_size(dst.dtype);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(static_cast<char*>(dst.data) + size_t(r * dst.row_stride) * esz,
                  static_cast<const char*>(src) + size_t(r * cols) * esz, size_t(cols) * esz);
    return;
  }
  expect_cpu_f32(dst, "copy_from_host destination");
#pragma omp parallel for num_threads(threads_) if (rows * cols > (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const size_t offset = size_t(r * cols) * dtype_size(src_dtype);
    convert_to_f32(static_cast<const char*>(src) + offset, src_dtype, row_f32(dst, r), cols);
  }
}

void CpuBackend::copy_to_host(void* dst, const Tensor& src) {
  if (src.dtype != DType::F32 && src.dtype != DType::I32)
    throw Error(ErrorCode::kInternal, std::string("copy_to_host: cannot read back a ") + dtype_name(src.dtype) + " tensor");
  const int64_t rows = src.ndim == 0 ? 1 : src.dim(0), cols = src.ndim == 0 ? 1 : src.row_size();
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(static_cast<char*>(dst) + r * cols * 4, static_cast<const char*>(src.data) + r * src.row_stride * 4, cols * 4);
}

void CpuBackend::copy(const Tensor& dst, const Tensor& src) {
  if (dst.dtype != src.dtype || dst.numel() != src.numel() || dst.row_size() != src.row_size())
    throw Error(ErrorCode::kInternal, "copy: " + dst.shape_str() + " <- " + src.shape_str());
  const size_t row_bytes = size_t(src.row_size()) * dtype_size(src.dtype);
  for (int64_t r = 0; r < src.dim(0); ++r)
    std::memcpy(static_cast<char*>(dst.data) + r * dst.row_stride * dtype_size(dst.dtype),
                static_cast<const char*>(src.data) + r * src.row_stride * dtype_size(src.dtype), row_bytes);
}

void CpuBackend::fill_zero(const Tensor& t) {
  const int64_t rows = t.ndim == 0 ? 1 : t.dim(0), cols = t.ndim == 0 ? 1 : t.row_size();
  for (int64_t r = 0; r < rows; ++r)
    std::memset(static_cast<char*>(t.data) + r * t.row_stride * dtype_size(t.dtype), 0, cols * dtype_size(t.dtype));
}

}  // namespace ocria_rt
