#include "model/quant_config.h"

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "core/json.h"

namespace ocria_rt {

namespace {

namespace fs = std::filesystem;
using Format = LinearWeight::Format;

[[noreturn]] void fail(const std::string& file, const std::string& key, const std::string& why) {
  throw Error(ErrorCode::kModelError, "quantization config '" + file + "': key '" + key + "' " + why);
}

json::Value read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw Error(ErrorCode::kFileError, "cannot read '" + path.string() + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    json::Value v = json::Value::parse(ss.str());
    v.as_object();
    return v;
  } catch (const std::runtime_error& e) {
    throw Error(ErrorCode::kFileError, "'" + path.string() + "': " + e.what());
  }
}

// Typed members of a JSON object, failing with the file and the key's full path.
struct Reader {
  const json::Value& obj;
  std::string file, prefix;

  const json::Value* find(const std::string& key) const {
    const json::Value* v = obj.find(key);
    return v && !v->is_null() ? v : nullptr;
  }
  [[noreturn]] void fail(const std::string& key, const std::string& why) const { ocria_rt::fail(file, prefix + key, why); }
  std::string string(const std::string& key, const std::string& fallback = "") const {
    const json::Value* v = find(key);
    if (!v) return fallback;
    if (!v->is_string()) fail(key, "must be a string");
    return v->as_string();
  }
  const json::Value* object(const std::string& key) const {
    const json::Value* v = find(key);
    if (v && !v->is_object()) fail(key, "must be an object");
    return v;
  }
  std::vector<std::string> strings(const std::string& key) const {
    std::vector<std::string> out;
    const json::Value* v = find(key);
    if (!v) return out;
    if (!v->is_array()) fail(key, "must be a list of strings");
    for (const json::Value& s : v->as_array()) {
      if (!s.is_string()) fail(key, "must be a list of strings");
      out.push_back(s.as_string());
    }
    return out;
  }
  int64_t integer(const std::string& key, int64_t fallback) const {
    const json::Value* v = find(key);
    if (!v) return fallback;
    try {
      return v->as_int();
    } catch (const std::runtime_error&) {
      fail(key, "must be an integer");
    }
  }
  Reader member(const std::string& key) const { return {*object(key), file, prefix + key + "."}; }
};

// ModelOpt's quant_algo of one layer (or of all of them): its storage format.
Format modelopt_format(const Reader& r, const std::string& key) {
  const std::string algo = r.string(key);
  if (algo == "FP8" || algo == "FP8_PER_CHANNEL_PER_TOKEN") return Format::kFp8;
  if (algo == "NVFP4" || algo == "W4A16_NVFP4" || algo == "NVFP4_AWQ") {
    const int64_t group = r.integer("group_size", LinearWeight::kNvfp4Block);
    if (group != LinearWeight::kNvfp4Block)
      r.fail("group_size", "is " + std::to_string(group) + "; NVFP4 needs 16");
    return Format::kNvfp4;
  }
  r.fail(key, "is '" + algo + "', which is not supported (supported: FP8, FP8_PER_CHANNEL_PER_TOKEN, NVFP4, " +
                  "W4A16_NVFP4, NVFP4_AWQ and MIXED_PRECISION of these)");
}

// A compressed-tensors group's weights: its storage format, checked against the group's `format`.
Format compressed_tensors_format(const Reader& group, const std::string& format) {
  const Reader w = group.member("weights");
  const std::string type = w.string("type", "int");
  const int64_t bits = w.integer("num_bits", 0);
  const std::string strategy = w.string("strategy", "tensor");
  Format f;
  if (type == "float" && bits == 4) {
    const int64_t size = w.integer("group_size", 0);
    if (strategy != "tensor_group" || size != LinearWeight::kNvfp4Block)
      w.fail("strategy", "is '" + strategy + "' with group_size " + std::to_string(size) +
                             "; 4-bit float weights need NVFP4's 'tensor_group' with group_size 16");
    f = Format::kNvfp4;
  } else if (type == "float" && bits == 8) {
    if (strategy != "tensor" && strategy != "channel")
      w.fail("strategy", "is '" + strategy + "'; FP8 weights need a 'tensor' or 'channel' scale");
    f = Format::kFp8;
  } else {
    w.fail("type", "is '" + type + "' with num_bits " + std::to_string(bits) +
                       "; supported weights: float 8-bit (FP8 E4M3) and float 4-bit (NVFP4)");
  }
  const char* expected = f == Format::kNvfp4 ? "nvfp4-pack-quantized" : "float-quantized";
  if (!format.empty() && format != expected)
    group.fail("format", "is '" + format + "' but its weights are " + (f == Format::kNvfp4 ? "NVFP4" : "FP8") +
                             " (stored as '" + expected + "')");
  return f;
}

}  // namespace

bool QuantConfig::Pattern::matches(const std::string& module) const {
  switch (kind) {
    case Kind::kAnyLinear: return true;
    case Kind::kExact: return module == text;
    case Kind::kRegex:  // compressed-tensors' re.match: anchored at the start only
      return std::regex_search(module, regex, std::regex_constants::match_continuous);
    case Kind::kGlob: {  // `*` any run of characters, `?` one character
      size_t p = 0, m = 0, star = std::string::npos, resume = 0;
      while (m < module.size()) {
        if (p < text.size() && (text[p] == '?' || text[p] == module[m])) {
          ++p, ++m;
        } else if (p < text.size() && text[p] == '*') {
          star = p++;
          resume = m;
        } else if (star != std::string::npos) {
          p = star + 1;
          m = ++resume;
        } else {
          return false;
        }
      }
      while (p < text.size() && text[p] == '*') ++p;
      return p == text.size();
    }
  }
  return false;
}

namespace {

// The same module under both key layouts: model.language_model.* (VLM; ModelOpt always) and model.*.
std::vector<std::string> module_aliases(const std::string& module) {
  static const std::string vlm = "model.language_model.", text = "model.";
  if (module.rfind(vlm, 0) == 0) return {module, text + module.substr(vlm.size())};
  if (module.rfind(text, 0) == 0) return {module, vlm + module.substr(text.size())};
  return {module};
}

}  // namespace

bool QuantConfig::excluded(const std::string& module) const {
  for (const std::string& name : module_aliases(module))
    for (const Pattern& p : exclude_)
      if (p.matches(name)) return true;
  return false;
}

Format QuantConfig::format_of(const std::string& module) const {
  if (!quantized() || excluded(module)) return Format::kDense;
  for (auto rule = quantize_.rbegin(); rule != quantize_.rend(); ++rule)
    for (const std::string& name : module_aliases(module))
      if (rule->pattern.matches(name)) return rule->format;
  return Format::kDense;
}

void QuantConfig::check_names(const Checkpoint& ck) const {
  if (producer_ != QuantProducer::kModelOpt) return;  // compressed-tensors' exact targets may be class names
  for (const Rule& rule : quantize_) {
    if (rule.pattern.kind != Pattern::Kind::kExact) continue;
    bool found = false;
    for (const std::string& name : module_aliases(rule.pattern.text))
      found |= ck.find(name + ".weight") != nullptr || ck.find(name + ".weight_packed") != nullptr;
    if (!found)
      throw Error(ErrorCode::kModelError, "quantization config '" + source_ + "' names layer '" + rule.pattern.text +
                                              "', but checkpoint '" + ck.dir() + "' has no tensor '" + rule.pattern.text +
                                              ".weight'");
  }
}

QuantConfig QuantConfig::load(const std::string& model_dir) {
  QuantConfig q;
  const fs::path hf_quant = fs::path(model_dir) / "hf_quant_config.json", config = fs::path(model_dir) / "config.json";
  auto glob_or_regex = [&](const std::string& s, bool compressed_tensors) {
    Pattern p;
    p.text = s;
    if (compressed_tensors && s.rfind("re:", 0) == 0) {
      p.kind = Pattern::Kind::kRegex;
      p.text = s.substr(3);
      try {
        p.regex = std::regex(p.text);
      } catch (const std::regex_error& e) {
        throw Error(ErrorCode::kModelError, "quantization config '" + q.source_ + "': module pattern '" + s +
                                                "' is not a valid regular expression (" + e.what() + ")");
      }
    } else if (compressed_tensors && s == "Linear") {
      p.kind = Pattern::Kind::kAnyLinear;
    } else if (!compressed_tensors && s.find_first_of("*?") != std::string::npos) {
      p.kind = Pattern::Kind::kGlob;
    }
    return p;
  };

  Pattern any_linear;
  any_linear.kind = Pattern::Kind::kAnyLinear;

  // ModelOpt: hf_quant_config.json's "quantization", or config.json's quantization_config.
  auto read_modelopt = [&](const Reader& r) {
    q.producer_ = QuantProducer::kModelOpt;
    if (!r.find("quant_algo")) {  // e.g. only the KV cache quantized: the weights are dense
      q.producer_ = QuantProducer::kNone;
      return;
    }
    if (r.string("quant_algo") == "MIXED_PRECISION") {
      const json::Value* layers = r.object("quantized_layers");
      if (!layers) r.fail("quantized_layers", "is missing (quant_algo MIXED_PRECISION)");
      const Reader lr = r.member("quantized_layers");
      for (const auto& [module, spec] : layers->as_object()) {
        if (!spec.is_object()) lr.fail(module, "must be an object with a quant_algo");
        const Format f = modelopt_format(lr.member(module), "quant_algo");
        q.quantize_.push_back({glob_or_regex(module, false), f});
      }
    } else {
      const Format f = modelopt_format(r, "quant_algo");
      q.quantize_.push_back({any_linear, f});
    }
    // hf_quant_config.json calls the dense modules exclude_modules, config.json ignore.
    for (const char* key : {"exclude_modules", "ignore"})
      for (const std::string& s : r.strings(key)) q.exclude_.push_back(glob_or_regex(s, false));
  };

  if (fs::exists(hf_quant)) {
    const json::Value root = read_json(hf_quant);
    q.source_ = hf_quant.string();
    const Reader top{root, q.source_, ""};
    if (!top.object("quantization")) top.fail("quantization", "is missing");
    read_modelopt(top.member("quantization"));
    return q;
  }
  if (!fs::exists(config)) return q;
  const json::Value root = read_json(config);
  q.source_ = config.string();
  const Reader top{root, q.source_, ""};
  if (!top.object("quantization_config")) return q;
  const Reader r = top.member("quantization_config");
  const std::string method = r.string("quant_method");
  if (method == "modelopt") {
    read_modelopt(r);
    return q;
  }
  if (method != "compressed-tensors")
    r.fail("quant_method", "is '" + method + "', which is not supported (supported: modelopt, compressed-tensors)");

  q.producer_ = QuantProducer::kCompressedTensors;
  const std::string status = r.string("quantization_status", "compressed");
  if (status != "compressed")
    r.fail("quantization_status", "is '" + status + "'; only compressed checkpoints (save_compressed=True) can be loaded");
  const std::string format = r.string("format");
  if (!format.empty() && format != "float-quantized" && format != "nvfp4-pack-quantized" && format != "mixed-precision")
    r.fail("format", "is '" + format + "', which is not supported (supported: float-quantized, nvfp4-pack-quantized, " +
                         "mixed-precision)");
  const json::Value* groups = r.object("config_groups");
  if (!groups) r.fail("config_groups", "is missing");
  const Reader gr = r.member("config_groups");
  for (const auto& [name, group] : groups->as_object()) {
    if (!group.is_object()) gr.fail(name, "must be an object");
    const Reader g = gr.member(name);
    if (!g.object("weights")) continue;  // activations only: the weights stay dense
    const std::string group_format = g.string("format", format == "mixed-precision" ? "" : format);
    const Format f = compressed_tensors_format(g, group_format);
    const std::vector<std::string> targets = g.strings("targets");
    if (targets.empty()) g.fail("targets", "must list the modules the group quantizes");
    for (const std::string& t : targets) {
      Pattern target = glob_or_regex(t, true);
      q.quantize_.push_back({std::move(target), f});
    }
  }
  for (const std::string& s : r.strings("ignore")) q.exclude_.push_back(glob_or_regex(s, true));
  return q;
}

}  // namespace ocria_rt
