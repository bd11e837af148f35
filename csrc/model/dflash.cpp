#include "model/dflash.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "core/float_convert.h"
#include "core/json.h"
#include "model/weight_loader.h"

namespace ocria_rt {

namespace {

// config.json keys of a drafter: dflash_config first, then the top level (older checkpoints keep
// block_size and the like there).
class DraftKeys {
 public:
  DraftKeys(const json::Value& root, std::string path) : root_(root), path_(std::move(path)) {
    const json::Value* d = root.find("dflash_config");
    if (d && !d->is_null() && !d->is_object()) fail("dflash_config", "must be an object");
    draft_ = d && d->is_object() ? d : nullptr;
  }
  [[noreturn]] void fail(const std::string& key, const std::string& why) const {
    throw Error(ErrorCode::kModelError, "drafter config '" + path_ + "': key '" + key + "' " + why);
  }
  // A top-level key (null counts as absent).
  const json::Value* top(const std::string& key) const { return present(root_.find(key)); }
  // dflash_config.key, else the top-level key; `name` receives where it was found.
  const json::Value* draft(const std::string& key, std::string* name = nullptr) const {
    if (draft_)
      if (const json::Value* v = present(draft_->find(key))) {
        if (name) *name = "dflash_config." + key;
        return v;
      }
    if (name) *name = key;
    return top(key);
  }
  int64_t integer(const json::Value* v, const std::string& key, std::optional<int64_t> fallback, int64_t min) const {
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
    if (n < min) fail(key, "must be at least " + std::to_string(min) + " (got " + std::to_string(n) + ")");
    return n;
  }
  int64_t top_int(const std::string& key, std::optional<int64_t> fallback = std::nullopt, int64_t min = 1) const {
    return integer(top(key), key, fallback, min);
  }
  int64_t draft_int(const std::string& key, std::optional<int64_t> fallback = std::nullopt, int64_t min = 1) const {
    std::string name;
    const json::Value* v = draft(key, &name);
    return integer(v, name, fallback, min);
  }
  double number(const json::Value* v, const std::string& key, double fallback) const {
    if (!v) return fallback;
    if (!v->is_number()) fail(key, "must be a number");
    if (!std::isfinite(v->as_number())) fail(key, "must be finite");
    return v->as_number();
  }
  double draft_number(const std::string& key, double fallback) const {
    std::string name;
    const json::Value* v = draft(key, &name);
    return number(v, name, fallback);
  }
  bool boolean(const std::string& key, bool fallback) const {
    const json::Value* v = top(key);
    if (!v) return fallback;
    if (!v->is_bool()) fail(key, "must be true or false");
    return v->as_bool();
  }

 private:
  static const json::Value* present(const json::Value* v) { return v && !v->is_null() ? v : nullptr; }
  const json::Value& root_;
  const json::Value* draft_ = nullptr;
  std::string path_;
};

json::Value read_json(const std::string& path, const std::string& dir) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) throw Error(ErrorCode::kFileError, "drafter directory '" + dir + "' does not exist");
  std::ifstream in(path);
  if (!in) throw Error(ErrorCode::kFileError, "cannot read '" + path + "' (missing config.json?)");
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    json::Value root = json::Value::parse(ss.str());
    root.as_object();
    return root;
  } catch (const std::runtime_error& e) {
    throw Error(ErrorCode::kFileError, "'" + path + "': " + e.what());
  }
}

// Qwen3's RMSNorm multiplies by its weight w; the backend's norms by (1 + w'): w' = w - 1.
Tensor load_plain_norm(const Checkpoint& ck, Backend& be, Arena& arena, const std::string& name, int64_t n) {
  const TensorRecord& r = ck.require(name, {n});
  std::vector<float> host(static_cast<size_t>(n));
  convert_to_f32(r.data, r.dtype, host.data(), n);
  for (float& v : host) v -= 1.0f;
  Tensor t = arena.alloc(DType::F32, {n});
  be.copy_from_host(t, host.data(), DType::F32);
  return t;
}

}  // namespace

DraftConfig load_draft_config(const std::string& dir, const ModelConfig& target) {
  DraftConfig c;
  c.path = (std::filesystem::path(dir) / "config.json").string();
  const json::Value root = read_json(c.path, dir);
  DraftKeys r(root, c.path);

  const json::Value* arch = r.top("architectures");
  std::string kind;
  if (arch && arch->is_array())
    for (const json::Value& a : arch->as_array())
      if (a.is_string() && (a.as_string() == "DFlashDraftModel" || a.as_string() == "DFlash2DraftModel")) kind = a.as_string();
  if (kind.empty()) r.fail("architectures", "must name DFlashDraftModel or DFlash2DraftModel");
  c.dflash2 = kind == "DFlash2DraftModel";
  if (const json::Value* t = r.top("model_type"); t && (!t->is_string() || t->as_string() != "qwen3"))
    r.fail("model_type", "must be 'qwen3' (a DFlash drafter is built of Qwen3 layers)");

  c.hidden_size = r.top_int("hidden_size");
  if (c.hidden_size != target.hidden_size)
    r.fail("hidden_size", "is " + std::to_string(c.hidden_size) + " but the target's is " +
                              std::to_string(target.hidden_size) + " (the drafter reads the target's embeddings)");
  if (r.top("vocab_size") && r.top_int("vocab_size") != target.vocab_size)
    r.fail("vocab_size", "is " + std::to_string(r.top_int("vocab_size")) + " but the target's is " +
                             std::to_string(target.vocab_size));
  c.vocab_size = target.vocab_size;
  c.intermediate_size = r.top_int("intermediate_size");
  c.num_layers = r.top_int("num_hidden_layers");
  c.num_heads = r.top_int("num_attention_heads");
  c.num_kv_heads = r.top_int("num_key_value_heads", c.num_heads);
  c.head_dim = r.top_int("head_dim", 128);  // transformers' Qwen3Config default
  if (c.num_heads % c.num_kv_heads != 0) r.fail("num_attention_heads", "must be a multiple of num_key_value_heads");
  if (c.head_dim % 2 != 0) r.fail("head_dim", "must be even (RoPE turns pairs of dimensions)");
  c.rms_norm_eps = r.number(r.top("rms_norm_eps"), "rms_norm_eps", 1e-6);
  if (const json::Value* a = r.top("hidden_act"); a && (!a->is_string() || a->as_string() != "silu"))
    r.fail("hidden_act", "must be 'silu'");
  if (r.boolean("attention_bias", false)) r.fail("attention_bias", "is true; attention biases are not supported");

  const json::Value* rope = r.top("rope_parameters");
  if (rope && !rope->is_object()) r.fail("rope_parameters", "must be an object");
  c.rope_theta = r.number(r.top("rope_theta"), "rope_theta", 10000.0);
  if (rope) {
    if (const json::Value* t = rope->find("rope_type"); t && t->is_string() && t->as_string() != "default")
      r.fail("rope_parameters.rope_type", "is '" + t->as_string() + "'; only 'default' is supported");
    c.rope_theta = r.number(rope->find("rope_theta"), "rope_parameters.rope_theta", c.rope_theta);
    if (const json::Value* f = rope->find("partial_rotary_factor"); f && !f->is_null() && f->as_number() != 1.0)
      r.fail("rope_parameters.partial_rotary_factor", "must be 1 (the drafter rotates whole heads)");
  }
  if (!(c.rope_theta > 0)) r.fail("rope_theta", "must be positive");

  // The tapped target layers; without the key, z-lab's default spread over the target's layers.
  std::string ids_key;
  const json::Value* ids = r.draft("target_layer_ids", &ids_key);
  if (r.top("num_target_layers") && r.top_int("num_target_layers") != target.num_layers)
    r.fail("num_target_layers", "is " + std::to_string(r.top_int("num_target_layers")) + " but the target has " +
                                    std::to_string(target.num_layers) + " layers");
  if (ids) {
    if (!ids->is_array() || ids->as_array().empty()) r.fail(ids_key, "must be a non-empty list of layer indices");
    for (const json::Value& v : ids->as_array()) {
      const int64_t id = r.integer(&v, ids_key, std::nullopt, 0);
      if (id >= target.num_layers)
        r.fail(ids_key, "holds layer " + std::to_string(id) + " but the target has " + std::to_string(target.num_layers) +
                            " layers");
      c.target_layer_ids.push_back(id);
    }
  } else if (c.num_layers == 1) {
    c.target_layer_ids = {target.num_layers / 2};
  } else {
    const double first = 1, span = double(target.num_layers - 3) - first;
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const int64_t id = int64_t(std::nearbyint(first + double(i) * span / double(c.num_layers - 1)));
      if (id < 0 || id >= target.num_layers)
        r.fail("target_layer_ids", "is missing and the default spread does not fit a target of " +
                                       std::to_string(target.num_layers) + " layers");
      c.target_layer_ids.push_back(id);
    }
  }

  c.block_size = r.draft_int("block_size", 16, 2);
  c.mask_token_id = int32_t(r.draft_int("mask_token_id", std::nullopt, 0));
  if (c.mask_token_id >= target.vocab_size)
    r.fail("dflash_config.mask_token_id", "is outside the target's vocabulary (" + std::to_string(target.vocab_size) + ")");

  // Per layer, as z-lab's attention reads it: an explicit is_causal wins, else sliding_attention
  // layers are causal; a sliding window (Qwen3Config: only with use_sliding_window) applies to
  // sliding_attention layers, one-sided when causal and two-sided when not.
  std::optional<int64_t> window;
  if (r.boolean("use_sliding_window", false) && r.top("sliding_window")) window = r.top_int("sliding_window");
  std::vector<std::string> types;
  if (const json::Value* lt = r.top("layer_types")) {
    if (!lt->is_array() || int64_t(lt->as_array().size()) != c.num_layers)
      r.fail("layer_types", "must list one type per layer (" + std::to_string(c.num_layers) + ")");
    for (const json::Value& t : lt->as_array()) {
      const std::string s = t.is_string() ? t.as_string() : "";
      if (s != "full_attention" && s != "sliding_attention") r.fail("layer_types", "holds unknown layer type '" + s + "'");
      types.push_back(s);
    }
  } else {
    const int64_t max_window_layers = r.top_int("max_window_layers", 28, 0);
    for (int64_t i = 0; i < c.num_layers; ++i)
      types.push_back(window && i >= max_window_layers ? "sliding_attention" : "full_attention");
  }
  const json::Value* causal = r.top("is_causal");
  if (causal && !causal->is_bool()) r.fail("is_causal", "must be true, false or null");
  for (const std::string& t : types) {
    DraftMask m;
    const bool sliding = t == "sliding_attention";
    m.causal = causal ? causal->as_bool() : sliding;
    m.window = sliding && window ? *window : 0;
    c.masks.push_back(m);
  }

  c.output_multiplier = float(r.draft_number("output_multiplier", 1.0));
  c.final_logit_softcapping = float(r.draft_number("final_logit_softcapping", 0.0));
  c.input_embedding_scale = float(r.draft_number("input_embedding_scale", 1.0));
  if (!(c.output_multiplier > 0)) r.fail("dflash_config.output_multiplier", "must be positive");

  if (c.dflash2) {
    c.conv_kernel_size = r.draft_int("conv_kernel_size");
    c.conv_group_size = r.draft_int("conv_group_size");
    c.selector_rank = r.draft_int("selector_rank");
    c.selector_top_k = r.draft_int("selector_top_k");
    if (c.hidden_size % c.conv_group_size != 0)
      r.fail("dflash_config.conv_group_size", "must divide hidden_size " + std::to_string(c.hidden_size));
    if (c.selector_top_k > target.vocab_size) r.fail("dflash_config.selector_top_k", "exceeds the vocabulary");
  }
  return c;
}

DFlashDrafter::DFlashDrafter(const DraftConfig& config, const Checkpoint& ck, Backend& backend, Arena& arena)
    : cfg_(config), be_(backend) {
  const DraftConfig& c = cfg_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads, taps = int64_t(c.target_layer_ids.size());
  attn_ = {Hq, Hkv, hd, hd, float(c.rope_theta), {0, 0, 0}, float(c.rms_norm_eps), float(1.0 / std::sqrt(double(hd)))};
  WeightLoader w(ck, be_, arena, "");
  fc_ = w.linear({{"fc.weight", {H, taps * H}}});
  hidden_norm_ = load_plain_norm(ck, be_, arena, "hidden_norm.weight", H);
  final_norm_ = load_plain_norm(ck, be_, arena, "norm.weight", H);
  const int64_t G = c.dflash2 ? H / c.conv_group_size : 0, K = c.conv_kernel_size;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    Layer L;
    L.input_norm = load_plain_norm(ck, be_, arena, p + "input_layernorm.weight", H);
    L.post_norm = load_plain_norm(ck, be_, arena, p + "post_attention_layernorm.weight", H);
    L.q_norm = load_plain_norm(ck, be_, arena, p + "self_attn.q_norm.weight", hd);
    L.k_norm = load_plain_norm(ck, be_, arena, p + "self_attn.k_norm.weight", hd);
    L.qkv = w.linear({{p + "self_attn.q_proj.weight", {Hq * hd, H}},
                      {p + "self_attn.k_proj.weight", {Hkv * hd, H}},
                      {p + "self_attn.v_proj.weight", {Hkv * hd, H}}});
    L.kv.weight = L.qkv.weight.rows(Hq * hd, 2 * Hkv * hd);
    L.o = w.linear({{p + "self_attn.o_proj.weight", {H, Hq * hd}}});
    L.gate_up = w.glu_linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", I, H);
    L.down = w.linear({{p + "mlp.down_proj.weight", {H, I}}});
    if (c.dflash2) {  // base_kernel [2, K, H]: side 0 (the sublayer's input), side 1 (its output)
      auto conv = [&](const std::string& n, LinearWeight& kernel, Tensor* base) {
        kernel = w.linear({{n + "kernel_projection.weight", {2 * K * G, H}}});
        const TensorRecord& rec = ck.require(n + "base_kernel", {2, K, H});
        const Tensor b = arena.alloc(DType::F32, {2 * K, H});
        be_.copy_from_host(b, rec.data, rec.dtype);
        base[0] = b.rows(0, K);
        base[1] = b.rows(K, K);
      };
      conv(p + "attention_conv.", L.attn_kernel, L.attn_base);
      conv(p + "mlp_conv.", L.mlp_kernel, L.mlp_base);
    }
    layers_.push_back(std::move(L));
  }
  if (c.dflash2) {
    const std::string sel = "candidate_selector.";
    selector_proj_ = w.linear({{sel + "hidden_projection.weight", {c.selector_rank, H}}});
    predecessor_ = w.load(sel + "predecessor_codebook", {c.vocab_size, c.selector_rank}, be_.weight_dtype());
    successor_ = w.load(sel + "successor_codebook", {c.vocab_size, c.selector_rank}, be_.weight_dtype());
  }
}

DraftState DFlashDrafter::make_state(Arena& arena, int64_t rows) const {
  DraftState s;
  for (int64_t i = 0; i < cfg_.num_layers; ++i) {
    s.k_cache.push_back(arena.alloc(be_.activation_dtype(), {rows, attn_.num_kv_heads, attn_.head_dim}));
    s.v_cache.push_back(arena.alloc(be_.activation_dtype(), {rows, attn_.num_kv_heads, attn_.head_dim}));
  }
  return s;
}

DraftWorkspace DFlashDrafter::make_workspace(Arena& arena, int64_t ctx_tokens) const {
  const DraftConfig& c = cfg_;
  const DType act = be_.activation_dtype();
  const int64_t B = c.block_size, H = c.hidden_size, hq = c.num_heads * c.head_dim, kv = 2 * c.num_kv_heads * c.head_dim;
  DraftWorkspace ws;
  for (Tensor* t : {&ws.x, &ws.normed, &ws.conv, &ws.delta, &ws.hidden}) *t = arena.alloc(act, {B, H});
  ws.proj = arena.alloc(act, {B, std::max(hq + kv, 2 * c.intermediate_size)});
  ws.attn = arena.alloc(act, {B, hq});
  ws.act = arena.alloc(act, {B, c.intermediate_size});
  if (c.dflash2) ws.dyn = arena.alloc(act, {B, 2 * c.conv_kernel_size * (H / c.conv_group_size)});
  ws.ctx = arena.alloc(act, {ctx_tokens, H});
  ws.ctx_normed = arena.alloc(act, {ctx_tokens, H});
  ws.ctx_kv = arena.alloc(act, {ctx_tokens, kv});
  return ws;
}

void DFlashDrafter::push_context(const Tensor& taps, const Tensor& positions, DraftState& state, DraftWorkspace& ws) const {
  const int64_t T = taps.dim(0);
  if (T > ws.ctx.dim(0)) throw Error(ErrorCode::kInternal, "push_context: more tokens than the drafter's workspace holds");
  const Tensor ctx = ws.ctx.rows(0, T), normed = ws.ctx_normed.rows(0, T), kv = ws.ctx_kv.rows(0, T);
  be_.linear(taps, fc_, ctx);
  be_.rms_norm(ctx, hidden_norm_, normed, float(cfg_.rms_norm_eps));
  for (size_t l = 0; l < layers_.size(); ++l) {
    be_.linear(normed, layers_[l].kv, kv);
    be_.draft_store_kv(kv, layers_[l].k_norm, positions, attn_, state.k_cache[l], state.v_cache[l]);
  }
}

template <class Sublayer>
void DFlashDrafter::convolved(const Tensor& normed, const LinearWeight& kernel, const Tensor* base, DraftWorkspace& ws,
                              const Tensor& x, Sublayer&& f) const {
  const int64_t B = normed.dim(0);
  const Tensor delta = ws.delta.rows(0, B);
  if (!cfg_.dflash2) {
    f(normed, delta);
    be_.add(x, delta);
    return;
  }
  // DFlash2: the dynamic kernels of both sides come from the normed input; side 0 convolves the
  // sublayer's input, side 1 its output.
  const int64_t KG = kernel.out_features() / 2;
  const Tensor dyn = ws.dyn.rows(0, B), conv = ws.conv.rows(0, B);
  be_.linear(normed, kernel, dyn);
  be_.dynamic_conv(normed, dyn.cols(0, KG), base[0], cfg_.conv_group_size, conv);
  f(conv, delta);
  be_.dynamic_conv(delta, dyn.cols(KG, KG), base[1], cfg_.conv_group_size, conv);
  be_.add(x, conv);
}

void DFlashDrafter::forward_block(const Tensor& ids, const Tensor& positions, const Tensor& embed_table, DraftState& state,
                                  DraftWorkspace& ws) const {
  const DraftConfig& c = cfg_;
  const int64_t B = ids.dim(0), hq = c.num_heads * c.head_dim, kv = 2 * c.num_kv_heads * c.head_dim;
  const float eps = float(c.rms_norm_eps);
  if (B > ws.x.dim(0)) throw Error(ErrorCode::kInternal, "forward_block: more tokens than the block size");
  const Tensor x = ws.x.rows(0, B), normed = ws.normed.rows(0, B);
  be_.embedding(embed_table, ids, x);
  if (c.input_embedding_scale != 1.0f) be_.scale_softcap(x, c.input_embedding_scale, 0.0f);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    be_.rms_norm(x, L.input_norm, normed, eps);
    convolved(normed, L.attn_kernel, L.attn_base, ws, x, [&](const Tensor& in, const Tensor& out) {
      const Tensor qkv = ws.proj.rows(0, B).cols(0, hq + kv), attn = ws.attn.rows(0, B);
      be_.linear(in, L.qkv, qkv);
      be_.draft_store_kv(qkv.cols(hq, kv), L.k_norm, positions, attn_, state.k_cache[l], state.v_cache[l]);
      be_.draft_attention(qkv.cols(0, hq), L.q_norm, positions, state.k_cache[l], state.v_cache[l], attn_, c.masks[l], attn);
      be_.linear(attn, L.o, out);
    });
    be_.rms_norm(x, L.post_norm, normed, eps);
    convolved(normed, L.mlp_kernel, L.mlp_base, ws, x, [&](const Tensor& in, const Tensor& out) {
      const Tensor act = ws.act.rows(0, B);
      be_.linear_glu(in, L.gate_up, ws.proj.rows(0, B).cols(0, 2 * c.intermediate_size), act);
      be_.linear(act, L.down, out);
    });
  }
  be_.rms_norm(x, final_norm_, ws.hidden.rows(0, B), eps);
}

}  // namespace ocria_rt
