// Memory-mapped safetensors checkpoints: one file or a sharded set (model.safetensors.index.json).
// Every header is validated when opened; tensors are checked for shape and dtype when requested.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace ocria_rt {

struct TensorRecord {
  std::string name;
  std::string file;       // the safetensors file that holds it
  std::string dtype_str;  // as written in the header ("BF16", "F32", "I64", ...)
  // dtype_supported: the dtype maps to a DType (F32, BF16, F16; U8 and F8_E4M3 as the raw bytes of
  // quantized weights and their scales).
  bool dtype_supported = false;
  DType dtype = DType::F32;  // valid when dtype_supported
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t nbytes = 0;

  std::string shape_str() const;
};

class MappedFile;

class Checkpoint {
 public:
  // Opens <dir>/model.safetensors.index.json (sharded) or <dir>/model.safetensors.
  static Checkpoint open(const std::string& dir);
  // Opens one safetensors file.
  static Checkpoint open_file(const std::string& path);

  const TensorRecord* find(const std::string& name) const;
  // The tensor `name`, checked to have exactly `shape` and a float dtype (BF16/F16/F32).
  const TensorRecord& require(const std::string& name, const std::vector<int64_t>& shape) const;
  // The tensor `name`, checked to have exactly `shape` and dtype `raw` (U8 or F8E4M3: quantized data).
  const TensorRecord& require_raw(const std::string& name, const std::vector<int64_t>& shape, DType raw) const;
  const std::string& dir() const { return dir_; }
  bool has_prefix(const std::string& prefix) const;
  const std::map<std::string, TensorRecord>& tensors() const { return tensors_; }

 private:
  void add_file(const std::string& path);
  std::string dir_;
  std::vector<std::shared_ptr<MappedFile>> files_;
  std::map<std::string, TensorRecord> tensors_;
};

}  // namespace ocria_rt
