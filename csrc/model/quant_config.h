// The quantization of a checkpoint's linear layers, as its producer describes it:
// - ModelOpt: hf_quant_config.json ({"quantization": {...}}), or config.json's quantization_config
//   with quant_method "modelopt". One quant_algo for every linear except exclude_modules (`*`
//   wildcards), or MIXED_PRECISION with a quantized_layers map (layers missing from it are dense).
// - compressed-tensors (llm-compressor): config.json's quantization_config with quant_method
//   "compressed-tensors": config_groups whose targets (class names, "re:" regexes, module names)
//   are quantized as the group's weights describe, except the modules of `ignore`.
// Formats are the weight-only storage formats of ops.h: FP8 E4M3 (scale per tensor or per output
// channel) and NVFP4 (E2M1 in blocks of 16 with E4M3 block scales and an fp32 global scale).
// Activation settings (input scales, dynamic quantization) are read and ignored: activations stay
// in the activation dtype.
#pragma once
#include <regex>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "ops/ops.h"

namespace ocria_rt {

// Where a checkpoint's quantized tensors live and what they are called.
enum class QuantProducer {
  kNone,               // a dense checkpoint
  kModelOpt,           // weight, weight_scale, weight_scale_2 (NVFP4), pre_quant_scale (AWQ)
  kCompressedTensors,  // weight / weight_packed (NVFP4), weight_scale, weight_global_scale (NVFP4)
};

// Device bytes of the quantized linears loaded (weights and all their scales), by format.
struct QuantizedBytes {
  int64_t fp8 = 0, nvfp4 = 0;
};

class QuantConfig {
 public:
  // A dense checkpoint.
  QuantConfig() = default;
  // The quantization described in model_dir (hf_quant_config.json first, then config.json's
  // quantization_config); dense when neither describes one. Throws Error(kModelError) naming the file
  // and key for an unknown quant_method, quant_algo or format, and for settings this runtime cannot
  // load (integer weights, block-wise FP8 scales, NVFP4 groups other than 16).
  static QuantConfig load(const std::string& model_dir);

  QuantProducer producer() const { return producer_; }
  bool quantized() const { return producer_ != QuantProducer::kNone; }
  // The storage format of the linear layer `module`: its checkpoint name without ".weight" (e.g.
  // "model.language_model.layers.0.mlp.up_proj"); names under model.language_model.* and model.*
  // are the same module.
  LinearWeight::Format format_of(const std::string& module) const;
  // Throws Error(kModelError) for an entry of ModelOpt's quantized_layers that names no layer of the
  // checkpoint.
  void check_names(const Checkpoint& checkpoint) const;

 private:
  // A set of module names: exact names, `*` wildcards (ModelOpt), "re:" regexes (compressed-tensors),
  // or the class name "Linear" (every linear layer).
  struct Pattern {
    enum class Kind { kExact, kGlob, kRegex, kAnyLinear };
    Kind kind = Kind::kExact;
    std::string text;
    std::regex regex;  // kRegex
    bool matches(const std::string& module) const;
  };
  struct Rule {
    Pattern pattern;
    LinearWeight::Format format;
  };
  bool excluded(const std::string& module) const;

  QuantProducer producer_ = QuantProducer::kNone;
  std::string source_;           // the file the description came from, for messages
  std::vector<Rule> quantize_;   // later rules win
  std::vector<Pattern> exclude_;  // any match: dense
};

}  // namespace ocria_rt
