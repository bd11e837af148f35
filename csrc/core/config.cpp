// config.json -> ModelConfig, read the way transformers 5.x reads Qwen3.5 configs. Every value is read
// through json::Field, so a wrong type, a missing key or a value outside what the math needs fails
// with a ModelError naming the file and the key path.
#include <cfloat>
#include <cmath>
#include <filesystem>

#include "core/json.h"
#include "ocria_rt/config.h"

namespace ocria_rt {

namespace {

using json::Field;
using json::IntRange;
using json::NumRange;

// Bounds well above any real checkpoint. They keep products of two dimensions inside int64 before
// the checkpoint's tensor shapes are compared with them.
constexpr int64_t kMaxDim = int64_t(1) << 24;          // sizes, head counts, vocabulary
constexpr int64_t kMaxSmallDim = 1024;                 // patch and merge sizes, channels, conv taps
constexpr int64_t kMaxPositions = (int64_t(1) << 31) - 1;  // positions are int32
const IntRange kDim = IntRange::between(1, kMaxDim);
const IntRange kSmallDim = IntRange::between(1, kMaxSmallDim);

// RMSNorm's epsilon is added in float32: it must stay positive and finite there.
const NumRange kEps =
    NumRange::between(FLT_MIN, FLT_MAX, "a positive number in the normal float32 range (1.2e-38 to 3.4e38)");
// RoPE frequencies are theta^(-2i/d): theta >= 1 keeps them in (0, 1] (below 1 they grow with i, which
// no model is trained with, and overflow float32 at long positions).
const NumRange kTheta = NumRange::between(1.0, FLT_MAX, "a number in [1, 3.4e38] (finite in float32)");

// A token id or a list of them (eos_token_id), each inside the vocabulary.
std::vector<int32_t> token_ids(const Field& f, int64_t vocab_size) {
  const IntRange in_vocab = IntRange::between(0, vocab_size - 1);
  std::vector<int32_t> ids;
  if (!f.present()) return ids;
  if (f.value()->is_array()) {
    for (int64_t id : f.integers(in_vocab)) ids.push_back(int32_t(id));
  } else {
    if (!f.value()->is_number())
      f.expected("a token id or a list of token ids in [0, " + std::to_string(vocab_size - 1) + "]");
    ids.push_back(int32_t(f.integer(in_vocab)));
  }
  return ids;
}

void read_vision_config(const Field& root, ModelConfig& c) {
  const Field v = root["vision_config"];
  v.object();
  VisionConfig& vc = c.vision;
  vc.depth = v["depth"].integer(kDim);
  vc.hidden_size = v["hidden_size"].integer(kDim);
  vc.num_heads = v["num_heads"].integer(kDim);
  vc.intermediate_size = v["intermediate_size"].integer(kDim);
  vc.in_channels = v["in_channels"].integer_or(3, kSmallDim);
  vc.patch_size = v["patch_size"].integer_or(16, kSmallDim);
  vc.temporal_patch_size = v["temporal_patch_size"].integer_or(2, kSmallDim);
  vc.spatial_merge_size = v["spatial_merge_size"].integer_or(2, kSmallDim);
  vc.out_hidden_size = v["out_hidden_size"].integer(kDim);
  vc.num_position_embeddings = v["num_position_embeddings"].integer(kDim);
  const auto side = int64_t(std::llround(std::sqrt(double(vc.num_position_embeddings))));
  if (side * side != vc.num_position_embeddings)
    v["num_position_embeddings"].fail("must be a perfect square (a square grid of position embeddings), got " +
                                      std::to_string(vc.num_position_embeddings));
  if (vc.hidden_size % vc.num_heads != 0 || vc.head_dim() % 4 != 0)
    v["num_heads"].fail("must divide hidden_size " + std::to_string(vc.hidden_size) +
                        " into heads whose size is a multiple of 4, got " + std::to_string(vc.num_heads));
  if (vc.out_hidden_size != c.hidden_size)
    v["out_hidden_size"].fail("must equal the text hidden_size " + std::to_string(c.hidden_size) + ", got " +
                              std::to_string(vc.out_hidden_size));
  const std::string act = v["hidden_act"].string_or("gelu_pytorch_tanh");
  if (act != "gelu_pytorch_tanh" && act != "gelu")
    v["hidden_act"].fail("is " + json::quote(act) + "; supported: gelu_pytorch_tanh, gelu");
  vc.gelu_tanh = act == "gelu_pytorch_tanh";
  vc.rope_theta = v["rope_parameters"]["rope_theta"].number_or(10000.0, kTheta);

  const IntRange in_vocab = IntRange::between(0, c.vocab_size - 1);
  c.image_token_id = int32_t(root["image_token_id"].integer_or(248056, in_vocab));
  c.vision_start_token_id = int32_t(root["vision_start_token_id"].integer_or(248053, in_vocab));
  c.vision_end_token_id = int32_t(root["vision_end_token_id"].integer_or(248054, in_vocab));
}

}  // namespace

ModelConfig load_model_config(const std::string& model_dir) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(model_dir) / "config.json").string();
  if (!fs::is_directory(model_dir))
    throw Error(ErrorCode::kFileError, "model directory '" + model_dir + "' does not exist");
  if (!fs::exists(path)) throw Error(ErrorCode::kFileError, "cannot read '" + path + "' (missing config.json?)");
  const json::Value doc = json::parse_file(path);
  const Field root(doc, "config '" + path + "'", ErrorCode::kModelError);
  root.object();

  ModelConfig c;
  c.model_type = root["model_type"].string();
  Field text = root;
  if (c.model_type == "qwen3_5") {
    text = root["text_config"];
    text.object();
    c.has_vision = root["vision_config"].present();
  } else if (c.model_type != "qwen3_5_text") {
    root["model_type"].fail("names an unsupported model_type " + json::quote(c.model_type) +
                           " (supported: qwen3_5_text, qwen3_5)");
  }

  c.vocab_size = text["vocab_size"].integer(kDim);
  c.hidden_size = text["hidden_size"].integer(kDim);
  c.intermediate_size = text["intermediate_size"].integer(kDim);
  c.num_layers = text["num_hidden_layers"].integer(kDim);
  c.rms_norm_eps = text["rms_norm_eps"].number_or(1e-6, kEps);
  c.max_position_embeddings = text["max_position_embeddings"].integer_or(32768, IntRange::between(1, kMaxPositions));
  c.num_attention_heads = text["num_attention_heads"].integer(kDim);
  c.num_key_value_heads = text["num_key_value_heads"].integer(kDim);
  c.head_dim = text["head_dim"].integer_or(c.hidden_size / c.num_attention_heads, kDim);
  if (c.head_dim == 0) text["num_attention_heads"].fail("is larger than hidden_size and no head_dim is given");
  c.linear_num_key_heads = text["linear_num_key_heads"].integer_or(16, kDim);
  c.linear_num_value_heads = text["linear_num_value_heads"].integer_or(32, kDim);
  c.linear_key_head_dim = text["linear_key_head_dim"].integer_or(128, kDim);
  c.linear_value_head_dim = text["linear_value_head_dim"].integer_or(128, kDim);
  c.linear_conv_kernel_dim = text["linear_conv_kernel_dim"].integer_or(4, kSmallDim);
  // The top level decides tying for the VLM wrapper; the text config otherwise.
  c.tie_word_embeddings = root["tie_word_embeddings"].present() ? root["tie_word_embeddings"].boolean()
                                                                 : text["tie_word_embeddings"].boolean_or(false);

  if (c.num_attention_heads % c.num_key_value_heads != 0)
    text["num_attention_heads"].fail("must be a multiple of num_key_value_heads (" +
                                     std::to_string(c.num_key_value_heads) + "), got " +
                                     std::to_string(c.num_attention_heads));
  if (c.linear_num_value_heads % c.linear_num_key_heads != 0)
    text["linear_num_value_heads"].fail("must be a multiple of linear_num_key_heads (" +
                                        std::to_string(c.linear_num_key_heads) + "), got " +
                                        std::to_string(c.linear_num_value_heads));
  const std::string act = text["hidden_act"].string_or("silu");
  if (act != "silu") text["hidden_act"].fail("is " + json::quote(act) + "; only 'silu' is supported");
  if (text["attention_bias"].boolean_or(false))
    text["attention_bias"].fail("is true; attention biases are not supported");

  // layer_types, or the default pattern: every full_attention_interval-th layer is full attention.
  if (const Field lt = text["layer_types"]; lt.present()) {
    if (int64_t(lt.size()) != c.num_layers)
      lt.fail("must list one type per layer (" + std::to_string(c.num_layers) + "), got " + std::to_string(lt.size()));
    for (size_t i = 0; i < lt.size(); ++i) {
      const std::string& s = lt[i].string();
      if (s == "full_attention" || s == "attention") c.full_attention.push_back(true);
      else if (s == "linear_attention") c.full_attention.push_back(false);
      else lt[i].fail("is " + json::quote(s) + "; expected 'full_attention' or 'linear_attention'");
    }
  } else {
    const int64_t interval = text["full_attention_interval"].integer_or(4, kDim);
    for (int64_t i = 0; i < c.num_layers; ++i) c.full_attention.push_back((i + 1) % interval == 0);
  }

  // RoPE: rope_scaling, then rope_parameters, then the legacy top-level keys, then defaults.
  const Field rope = text["rope_scaling"].present() ? text["rope_scaling"] : text["rope_parameters"];
  if (rope.present()) rope.object();
  const Field type = rope["rope_type"].present() ? rope["rope_type"] : rope["type"];
  const std::string rope_type = type.string_or("default");
  if (rope_type != "default") type.fail("is " + json::quote(rope_type) + "; only 'default' is supported");
  const Field theta = rope["rope_theta"].present() ? rope["rope_theta"] : text["rope_theta"];
  c.rope_theta = theta.number_or(10000.0, kTheta);
  const Field partial_key =
      rope["partial_rotary_factor"].present() ? rope["partial_rotary_factor"] : text["partial_rotary_factor"];
  const double partial = partial_key.number_or(0.25, NumRange::above_until(0.0, 1.0));
  c.rotary_dim = int64_t(double(c.head_dim) * partial);
  if (c.rotary_dim <= 0 || c.rotary_dim % 2 != 0)
    partial_key.fail("gives a rotary dimension of " + std::to_string(c.rotary_dim) + " for head_dim " +
                     std::to_string(c.head_dim) + " (it must be even and at least 2)");

  if (const Field sec = rope["mrope_section"]; sec.present()) {
    c.mrope_section = sec.integers(IntRange::between(0, c.rotary_dim / 2));
    int64_t total = 0;
    for (int64_t s : c.mrope_section) total += s;
    if (c.mrope_section.size() != 3 || total != c.rotary_dim / 2)
      sec.fail("must hold 3 sizes (t, h, w) adding up to rotary_dim / 2 = " + std::to_string(c.rotary_dim / 2) +
               ", got " + std::to_string(c.mrope_section.size()) + " adding up to " + std::to_string(total));
  }
  if (c.has_vision) read_vision_config(root, c);

  c.eos_token_ids = token_ids(text["eos_token_id"], c.vocab_size);
  if (c.eos_token_ids.empty() && text.path() != root.path())
    c.eos_token_ids = token_ids(root["eos_token_id"], c.vocab_size);
  return c;
}

}  // namespace ocria_rt
