#include "core/tensor.h"


namespace ocria_rt {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::I32: return 4;
    case DType::U8: return 1;
    case DType::F8E4M3: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::I32: return "I32";
    case DType::U8: return "U8";
    case DType::F8E4M3: return "F8_E4M3";
  }
  return "?";
}

Tensor::Tensor(void* data_, DType dtype_, DeviceKind device_, std::initializer_list<int64_t> dims)
    : data(data_), dtype(dtype_), device(device_) {
  if (dims.size() > kMaxDims) throw Error(ErrorCode::kInternal, "Tensor: more than 4 dimensions");
  for (int64_t d : dims) shape[ndim++] = d;
  row_stride = row_size();
}

int64_t Tensor::numel() const {
  if (ndim == 0) return data ? 1 : 0;
  return shape[0] * row_size();
}

int64_t Tensor::row_size() const {
  int64_t n = 1;
  for (int i = 1; i < ndim; ++i) n *= shape[i];
  return n;
}

Tensor Tensor::view(std::initializer_list<int64_t> dims) const {
  Tensor t = *this;
  t.ndim = 0;
  for (int64_t d : dims) t.shape[t.ndim++] = d;
  bool same_rows = t.shape[0] == shape[0];
  if (t.numel() != numel() || (!contiguous() && !same_rows))
    throw Error(ErrorCode::kInternal, "Tensor::view: cannot view " + shape_str() + " as " + t.shape_str());
  t.row_stride = contiguous() ? t.row_size() : row_stride;
  return t;
}

Tensor Tensor::rows(int64_t begin, int64_t count) const {
  if (begin < 0 || count < 0 || begin + count > shape[0])
    throw Error(ErrorCode::kInternal, "Tensor::rows out of range on " + shape_str());
  Tensor t = *this;
  t.data = static_cast<char*>(data) + size_t(begin * row_stride) * dtype_size(dtype);
  t.shape[0] = count;
  return t;
}

Tensor Tensor::cols(int64_t begin, int64_t count) const {
  if (ndim != 2 || begin < 0 || count < 0 || begin + count > shape[1])
    throw Error(ErrorCode::kInternal, "Tensor::cols out of range on " + shape_str());
  Tensor t = *this;
  t.data = static_cast<char*>(data) + size_t(begin) * dtype_size(dtype);
  t.shape[1] = count;
  return t;
}

std::string Tensor::shape_str() const { return dims_str(shape, ndim); }

std::string dims_str(const int64_t* dims, int n) {
  std::string s = "[";
  for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

void check_shape(const Tensor& t, std::initializer_list<int64_t> dims, const char* what) {
  bool ok = t.ndim == int(dims.size());
  int i = 0;
  for (int64_t d : dims) {
    if (ok && d >= 0 && t.shape[i] != d) ok = false;
    ++i;
  }
  if (!ok) throw Error(ErrorCode::kInternal, std::string(what) + ": unexpected shape " + t.shape_str());
}

}  // namespace ocria_rt
