// Tensor: a non-owning view of memory on one device. Dimension 0 may be strided (row_stride, in
// elements) so that a column range of a 2-D activation can be handed to an op without a copy; all
// other dimensions are contiguous. Storage is owned by an Arena (arena.h) or a mapped file.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "ocria_rt/error.h"

namespace ocria_rt {

// U8: raw bytes (NVFP4's packed E2M1 pairs); F8E4M3: float8 e4m3fn bits (FP8 weights, NVFP4 block scales).
enum class DType : uint8_t { F32, BF16, F16, I32, U8, F8E4M3 };
enum class DeviceKind : uint8_t { CPU, CUDA };

size_t dtype_size(DType t);
const char* dtype_name(DType t);

struct Tensor {
  static constexpr int kMaxDims = 4;
  void* data = nullptr;
  DType dtype = DType::F32;
  DeviceKind device = DeviceKind::CPU;
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t row_stride = 0;  // elements between consecutive indices of dimension 0

  Tensor() = default;
  Tensor(void* data, DType dtype, DeviceKind device, std::initializer_list<int64_t> dims);

  bool defined() const { return data != nullptr; }
  int64_t dim(int i) const { return shape[i < 0 ? ndim + i : i]; }
  int64_t numel() const;
  int64_t row_size() const;  // elements in one index of dimension 0
  bool contiguous() const { return ndim <= 1 || row_stride == row_size(); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  template <class T> T* ptr() const { return static_cast<T*>(data); }

  // Same memory, new shape of equal numel (the tensor must be contiguous, or keep dimension 0).
  Tensor view(std::initializer_list<int64_t> dims) const;
  // Rows [begin, begin + count) of dimension 0.
  Tensor rows(int64_t begin, int64_t count) const;
  // Columns [begin, begin + count) of a 2-D tensor: a strided view.
  Tensor cols(int64_t begin, int64_t count) const;
  std::string shape_str() const;
};

// "[d0, d1, ...]"
std::string dims_str(const int64_t* dims, int n);

// Throws Error(kInternal) naming `what` unless t has the given shape (-1 matches any size).
void check_shape(const Tensor& t, std::initializer_list<int64_t> dims, const char* what);

}  // namespace ocria_rt
