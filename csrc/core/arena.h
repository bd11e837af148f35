// Arena: all device memory an engine uses is carved from a few large blocks taken at start-up, so
// nothing is allocated while generating. Tensors from an arena live as long as the arena.
#pragma once
#include <algorithm>
#include <initializer_list>
#include <vector>

#include "core/tensor.h"
#include "ops/ops.h"

namespace ocria_rt {

class Arena {
 public:
  explicit Arena(Backend& backend, size_t block_bytes = size_t(64) << 20) : backend_(backend), block_bytes_(block_bytes) {}
  ~Arena() {
    for (void* b : blocks_) backend_.release(b);
  }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  Tensor alloc(DType dtype, std::initializer_list<int64_t> dims) {
    Tensor t(nullptr, dtype, backend_.device(), dims);
    t.data = take(t.nbytes());
    return t;
  }
  size_t bytes_used() const { return used_total_; }

 private:
  void* take(size_t bytes) {
    constexpr size_t kAlign = 256;  // enough for 16-byte vector loads and TMA descriptors
    bytes = (bytes + kAlign - 1) / kAlign * kAlign;
    if (blocks_.empty() || used_ + bytes > block_size_) {
      block_size_ = std::max(block_bytes_, bytes);
      blocks_.push_back(backend_.allocate(block_size_));
      used_ = 0;
    }
    void* p = static_cast<char*>(blocks_.back()) + used_;
    used_ += bytes;
    used_total_ += bytes;
    return p;
  }

  Backend& backend_;
  size_t block_bytes_;
  std::vector<void*> blocks_;
  size_t block_size_ = 0, used_ = 0, used_total_ = 0;
};

}  // namespace ocria_rt
