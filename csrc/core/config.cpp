// config.json -> ModelConfig, read the way transformers 5.x reads Qwen3.5 configs.
#include <cmath>
#include <optional>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/json.h"
#include "ocria_rt/config.h"

namespace ocria_rt {

namespace {

class ConfigReader {
 public:
  ConfigReader(const json::Value& obj, std::string path, std::string prefix)
      : obj_(obj), path_(std::move(path)), prefix_(std::move(prefix)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& why) const {
    throw Error(ErrorCode::kModelError, "config '" + path_ + "': key '" + prefix_ + key + "' " + why);
  }
  const json::Value* find(const std::string& key) const {
    const json::Value* v = obj_.find(key);
    return v && !v->is_null() ? v : nullptr;
  }
  int64_t positive_int(const std::string& key, std::optional<int64_t> fallback = std::nullopt) const {
    const json::Value* v = find(key);
    if (!v) {
      if (fallback) return *fallback;
      fail(key, "is missing");
    }
    int64_t n = 0;
    try {
      n = v->as_int();
    } catch (const std::runtime_error&) {
      fail(key, "must be an integer");
    }
    if (n <= 0) fail(key, "must be positive (got " + std::to_string(n) + ")");
    return n;
  }
  double number(const std::string& key, double fallback) const {
    const json::Value* v = find(key);
    if (!v) return fallback;
    if (!v->is_number()) fail(key, "must be a number");
    return v->as_number();
  }
  bool boolean(const std::string& key, bool fallback) const {
    const json::Value* v = find(key);
    if (!v) return fallback;
    if (!v->is_bool()) fail(key, "must be true or false");
    return v->as_bool();
  }
  const json::Value& obj() const { return obj_; }

 private:
  const json::Value& obj_;
  std::string path_;
  std::string prefix_;
};

std::vector<int32_t> read_token_ids(const json::Value* v) {
  std::vector<int32_t> ids;
  if (!v || v->is_null()) return ids;
  if (v->is_array()) {
    for (const auto& x : v->as_array()) ids.push_back(int32_t(x.as_int()));
  } else {
    ids.push_back(int32_t(v->as_int()));
  }
  return ids;
}

}  // namespace

ModelConfig load_model_config(const std::string& model_dir) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(model_dir) / "config.json").string();
  if (!fs::is_directory(model_dir))
    throw Error(ErrorCode::kFileError, "model directory '" + model_dir + "' does not exist");
  std::ifstream in(path);
  if (!in) throw Error(ErrorCode::kFileError, "cannot read '" + path + "' (missing config.json?)");
  std::stringstream ss;
  ss << in.rdbuf();
  json::Value root;
  try {
    root = json::Value::parse(ss.str());
    root.as_object();
  } catch (const std::runtime_error& e) {
    throw Error(ErrorCode::kFileError, "'" + path + "': " + e.what());
  }

  ModelConfig c;
  const json::Value* type = root.find("model_type");
  if (!type || !type->is_string()) throw Error(ErrorCode::kModelError, "config '" + path + "' has no 'model_type'");
  c.model_type = type->as_string();
  const json::Value* text = &root;
  std::string prefix;
  if (c.model_type == "qwen3_5") {
    text = root.find("text_config");
    if (!text || !text->is_object())
      throw Error(ErrorCode::kModelError, "config '" + path + "': model_type 'qwen3_5' needs a 'text_config' object");
    c.has_vision = root.find("vision_config") != nullptr;
    prefix = "text_config.";
  } else if (c.model_type != "qwen3_5_text") {
    throw Error(ErrorCode::kModelError, "config '" + path + "': unsupported model_type '" + c.model_type +
                                            "' (supported: qwen3_5_text, qwen3_5)");
  }
  ConfigReader r(*text, path, prefix);

  c.vocab_size = r.positive_int("vocab_size");
  c.hidden_size = r.positive_int("hidden_size");
  c.intermediate_size = r.positive_int("intermediate_size");
  c.num_layers = r.positive_int("num_hidden_layers");
  c.rms_norm_eps = r.number("rms_norm_eps", 1e-6);
  c.max_position_embeddings = r.positive_int("max_position_embeddings", 32768);
  c.num_attention_heads = r.positive_int("num_attention_heads");
  c.num_key_value_heads = r.positive_int("num_key_value_heads");
  c.head_dim = r.positive_int("head_dim", c.hidden_size / c.num_attention_heads);
  c.linear_num_key_heads = r.positive_int("linear_num_key_heads", 16);
  c.linear_num_value_heads = r.positive_int("linear_num_value_heads", 32);
  c.linear_key_head_dim = r.positive_int("linear_key_head_dim", 128);
  c.linear_value_head_dim = r.positive_int("linear_value_head_dim", 128);
  c.linear_conv_kernel_dim = r.positive_int("linear_conv_kernel_dim", 4);
  // The top level decides tying for the VLM wrapper; the text config otherwise.
  const json::Value* tie = root.find("tie_word_embeddings");
  if (tie && tie->is_bool()) c.tie_word_embeddings = tie->as_bool();
  else c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);

  if (c.num_attention_heads % c.num_key_value_heads != 0)
    r.fail("num_attention_heads", "must be a multiple of num_key_value_heads");
  if (c.linear_num_value_heads % c.linear_num_key_heads != 0)
    r.fail("linear_num_value_heads", "must be a multiple of linear_num_key_heads");
  const std::string act = r.find("hidden_act") ? r.find("hidden_act")->as_string() : "silu";
  if (act != "silu") r.fail("hidden_act", "is '" + act + "'; only 'silu' is supported");
  if (r.boolean("attention_bias", false)) r.fail("attention_bias", "is true; attention biases are not supported");

  // layer_types, or the default pattern: every full_attention_interval-th layer is full attention.
  if (const json::Value* lt = r.find("layer_types")) {
    if (!lt->is_array() || int64_t(lt->as_array().size()) != c.num_layers)
      r.fail("layer_types", "must list one type per layer (" + std::to_string(c.num_layers) + ")");
    for (const auto& t : lt->as_array()) {
      const std::string s = t.is_string() ? t.as_string() : "";
      if (s == "full_attention" || s == "attention") c.full_attention.push_back(true);
      else if (s == "linear_attention") c.full_attention.push_back(false);
      else r.fail("layer_types", "holds unknown layer type '" + s + "'");
    }
  } else {
    int64_t interval = r.positive_int("full_attention_interval", 4);
    for (int64_t i = 0; i < c.num_layers; ++i) c.full_attention.push_back((i + 1) % interval == 0);
  }

  // RoPE: rope_scaling, then rope_parameters, then the legacy top-level keys, then defaults.
  const json::Value* rope = r.find("rope_scaling");
  if (!rope) rope = r.find("rope_parameters");
  if (rope && !rope->is_object()) r.fail("rope_parameters", "must be an object");
  static const json::Value kEmpty;
  ConfigReader rr(rope ? *rope : kEmpty, path, prefix + "rope_parameters.");
  std::string rope_type = "default";
  if (rope) {
    const json::Value* t = rope->find("rope_type");
    if (!t) t = rope->find("type");
    if (t && t->is_string()) rope_type = t->as_string();
  }
  if (rope_type != "default")
    throw Error(ErrorCode::kModelError, "config '" + path + "': rope type '" + rope_type + "' is not supported (only 'default')");
  c.rope_theta = rr.number("rope_theta", r.number("rope_theta", 10000.0));
  const double partial = rr.number("partial_rotary_factor", r.number("partial_rotary_factor", 0.25));
  c.rotary_dim = int64_t(double(c.head_dim) * partial);
  if (c.rotary_dim <= 0 || c.rotary_dim > c.head_dim || c.rotary_dim % 2 != 0)
    r.fail("partial_rotary_factor", "gives a rotary dimension of " + std::to_string(c.rotary_dim) +
                                        " for head_dim " + std::to_string(c.head_dim) + " (must be even, 2.." +
                                        std::to_string(c.head_dim) + ")");
  if (!(c.rope_theta > 0)) r.fail("rope_theta", "must be positive");

  if (rope) {
    if (const json::Value* sec = rope->find("mrope_section")) {
      int64_t total = 0;
      for (const auto& v : sec->as_array()) total += c.mrope_section.emplace_back(v.as_int());
      if (c.mrope_section.size() != 3 || total != c.rotary_dim / 2)
        rr.fail("mrope_section", "must hold 3 sizes adding up to rotary_dim / 2 = " + std::to_string(c.rotary_dim / 2));
    }
  }
  if (c.has_vision) {
    ConfigReader v(*root.find("vision_config"), path, "vision_config.");
    VisionConfig& vc = c.vision;
    vc.depth = v.positive_int("depth");
    vc.hidden_size = v.positive_int("hidden_size");
    vc.num_heads = v.positive_int("num_heads");
    vc.intermediate_size = v.positive_int("intermediate_size");
    vc.in_channels = v.positive_int("in_channels", 3);
    vc.patch_size = v.positive_int("patch_size", 16);
    vc.temporal_patch_size = v.positive_int("temporal_patch_size", 2);
    vc.spatial_merge_size = v.positive_int("spatial_merge_size", 2);
    vc.out_hidden_size = v.positive_int("out_hidden_size");
    vc.num_position_embeddings = v.positive_int("num_position_embeddings");
    const auto side = int64_t(std::llround(std::sqrt(double(vc.num_position_embeddings))));
    if (side * side != vc.num_position_embeddings) v.fail("num_position_embeddings", "must be a perfect square");
    if (vc.hidden_size % vc.num_heads != 0 || vc.head_dim() % 4 != 0)
      v.fail("num_heads", "must divide hidden_size into heads whose size is a multiple of 4");
    if (vc.out_hidden_size != c.hidden_size)
      v.fail("out_hidden_size", "must equal the text hidden_size " + std::to_string(c.hidden_size));
    const std::string act = v.find("hidden_act") ? v.find("hidden_act")->as_string() : "gelu_pytorch_tanh";
    if (act != "gelu_pytorch_tanh" && act != "gelu") v.fail("hidden_act", "is '" + act + "'; supported: gelu_pytorch_tanh, gelu");
    vc.gelu_tanh = act == "gelu_pytorch_tanh";
    if (const json::Value* vr = v.find("rope_parameters"))
      if (const json::Value* th = vr->find("rope_theta")) vc.rope_theta = th->as_number();
    ConfigReader top(root, path, "");
    auto token = [&](const char* key, int64_t fallback) {
      const int64_t id = top.positive_int(key, fallback);
      if (id >= c.vocab_size) top.fail(key, "is outside the vocabulary (" + std::to_string(c.vocab_size) + ")");
      return int32_t(id);
    };
    c.image_token_id = token("image_token_id", 248056);
    c.vision_start_token_id = token("vision_start_token_id", 248053);
    c.vision_end_token_id = token("vision_end_token_id", 248054);
  }

  c.eos_token_ids = read_token_ids(r.find("eos_token_id"));
  if (c.eos_token_ids.empty()) c.eos_token_ids = read_token_ids(root.find("eos_token_id"));
  return c;
}

}  // namespace ocria_rt
