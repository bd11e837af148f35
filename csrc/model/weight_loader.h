// Loads checkpoint tensors into backend memory: shape and dtype checked, converted to the
// backend's dtype, and several projections stacked into one weight where they share an input (the
// MLP's gate and up interleaved in the GLU layout of ops.h). Projections of a quantized checkpoint
// are loaded in the storage format its QuantConfig gives them (ops.h LinearWeight).
#pragma once
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/arena.h"
#include "ocria_rt/error.h"
#include "core/safetensors.h"
#include "model/quant_config.h"
#include "ops/ops.h"

namespace ocria_rt {

// Loads tensors from the checkpoint into backend memory, concatenating parts along dimension 0.
class WeightLoader {
 public:
  WeightLoader(const Checkpoint& ck, Backend& be, Arena& arena, std::string prefix)
      : ck_(ck), be_(be), arena_(arena), prefix_(std::move(prefix)) {}
  // The same for a decoder whose projections may be quantized as `quant` describes; the device bytes
  // of quantized linears are added to *bytes.
  WeightLoader(const Checkpoint& ck, Backend& be, Arena& arena, std::string prefix, const QuantConfig& quant,
               QuantizedBytes& bytes)
      : ck_(ck), be_(be), arena_(arena), prefix_(std::move(prefix)), quant_(&quant), quantized_bytes_(&bytes) {}

  // One part of a projection: the module prefix + name (its tensors name.weight, name.weight_scale,
  // ...) with `rows` output features.
  struct Part {
    std::string name;
    int64_t rows;
  };
  // The storage format the quant config gives these parts; Error(kModelError) naming the tensors
  // unless they all share one (a fused projection is one LinearWeight).
  LinearWeight::Format format_of(const std::vector<Part>& parts) const;
  // The parts [rows_i, in] as one projection, stacked along the output rows or (glu: two parts, gate
  // and up) interleaved in the GLU layout, in their format_of. `norm`: the name of the zero-centred
  // RMSNorm weight [in] whose output the projection reads, or "": folded into a dense weight
  // (Backend::fold_norm_weight), and as its (1 + w) into the input_scale of a quantized one, times
  // the AWQ pre_quant_scale where the checkpoint has one.
  LinearWeight projection(const std::vector<Part>& parts, int64_t in, const std::string& norm = "", bool glu = false);

  // One tensor named prefix + name with exactly `shape` (at most 2-D here: [rows] or [rows, cols]).
  Tensor load(const std::string& name, std::vector<int64_t> shape, DType dtype) {
    return concat({{name, shape}}, dtype);
  }
  // Several [rows_i, cols] tensors stacked into one [sum rows_i, cols].
  Tensor concat(const std::vector<std::pair<std::string, std::vector<int64_t>>>& parts, DType dtype) {
    int64_t rows = 0;
    std::vector<const TensorRecord*> recs;
    for (const auto& [name, shape] : parts) {
      recs.push_back(&ck_.require(prefix_ + name, shape));
      rows += shape[0];
    }
    const std::vector<int64_t>& s0 = parts[0].second;
    const int64_t cols = s0.size() == 1 ? 1 : s0[1];
    Tensor t = s0.size() == 1 ? arena_.alloc(dtype, {rows}) : arena_.alloc(dtype, {rows, cols});
    int64_t r = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t n = parts[i].second[0];
      Tensor dst = t.rows(r, n);
      if (dst.ndim == 1) dst = dst.view({n, 1});
      be_.copy_from_host(dst, recs[i]->data, recs[i]->dtype);
      r += n;
    }
    return t;
  }
  LinearWeight linear(const std::vector<std::pair<std::string, std::vector<int64_t>>>& parts) {
    LinearWeight w;
    w.weight = concat(parts, be_.weight_dtype());
    return w;
  }
  // The gate and up projections [I, in] of a SwiGLU MLP as one weight [2I, in] in the GLU layout
  // (ops.h: kGluGroup rows of gate, the same rows of up, the next kGluGroup rows of gate, ...),
  // interleaved on the host in the checkpoint's dtype and then copied (and converted) at once.
  LinearWeight glu_linear(const std::string& gate, const std::string& up, int64_t I, int64_t in) {
    check_glu(gate, I);
    const TensorRecord& g = ck_.require(prefix_ + gate, {I, in});
    const TensorRecord& u = ck_.require(prefix_ + up, {I, in});
    if (g.dtype != u.dtype)
      throw Error(ErrorCode::kModelError, "tensors '" + prefix_ + gate + "' (" + g.dtype_str + ") and '" + prefix_ + up +
                                              "' (" + u.dtype_str + ") must have the same dtype");
    const size_t group_bytes = size_t(kGluGroup) * size_t(in) * dtype_size(g.dtype);
    std::vector<char> staged(2 * size_t(I / kGluGroup) * group_bytes);
    for (int64_t j = 0; j < I / kGluGroup; ++j) {
      std::memcpy(staged.data() + 2 * j * group_bytes, static_cast<const char*>(g.data) + j * group_bytes, group_bytes);
      std::memcpy(staged.data() + (2 * j + 1) * group_bytes, static_cast<const char*>(u.data) + j * group_bytes,
                  group_bytes);
    }
    LinearWeight w;
    w.weight = arena_.alloc(be_.weight_dtype(), {2 * I, in});
    be_.copy_from_host(w.weight, staged.data(), g.dtype);
    return w;
  }
  // name.weight [out, in] and name.bias [out].
  LinearWeight linear_with_bias(const std::string& name, int64_t out, int64_t in) {
    LinearWeight w = linear({{name + ".weight", {out, in}}});
    w.bias = load(name + ".bias", {out}, DType::F32);
    return w;
  }

 private:
  void check_glu(const std::string& gate, int64_t I) const {
    if (I % kGluGroup != 0)
      throw Error(ErrorCode::kModelError, "tensor '" + prefix_ + gate + "' has " + std::to_string(I) +
                                              " rows (intermediate_size); the MLP needs a multiple of 8");
  }
  LinearWeight quantized_projection(LinearWeight::Format format, const std::vector<Part>& parts, int64_t in,
                                    const std::string& norm, bool glu);

  const Checkpoint& ck_;
  Backend& be_;
  Arena& arena_;
  std::string prefix_;
  const QuantConfig* quant_ = nullptr;
  QuantizedBytes* quantized_bytes_ = nullptr;
};

}  // namespace ocria_rt
