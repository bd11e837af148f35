#include "model/qwen35.h"

#include "core/float_convert.h"
#include "model/weight_loader.h"

#include <cmath>

namespace ocria_rt {

Qwen35Model::Qwen35Model(const ModelConfig& config, const QuantConfig& quant, const Checkpoint& ck, Backend& backend,
                         Arena& arena)
    : cfg_(config), be_(backend) {
  const ModelConfig& c = cfg_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const int64_t HK = c.linear_num_key_heads, HV = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, K = c.linear_conv_kernel_dim;
  attn_ = {Hq, Hkv, hd, c.rotary_dim, float(c.rope_theta), {0, 0, 0}, float(c.rms_norm_eps),
           float(1.0 / std::sqrt(double(hd)))};
  for (size_t a = 0; a < 3 && a < c.mrope_section.size(); ++a) attn_.mrope_section[a] = int32_t(c.mrope_section[a]);
  gdn_ = {HK, HV, dk, dv, K, float(c.rms_norm_eps)};
  const int64_t C = gdn_.conv_dim();
  be_.check_model_shapes(attn_, gdn_);

  // Text-only checkpoints keep the decoder under model.*, the VLM under model.language_model.*.
  const std::string base = ck.has_prefix("model.language_model.") ? "model.language_model." : "model.";
  quant.check_names(ck);
  WeightLoader w(ck, be_, arena, base, quant, quantized_bytes_);
  const DType wt = be_.weight_dtype(), f32 = DType::F32;
  // Each projection is recorded as a LinearSlot: its checkpoint modules and its folded norm's 1 + w.
  auto slot = [&](LinearWeight& dst, const std::string& prefix, const std::vector<WeightLoader::Part>& parts,
                  int64_t in, const std::string& norm, bool glu) {
    LinearSlot s;
    for (const WeightLoader::Part& part : parts) {
      s.modules.push_back(prefix + part.name);
      s.rows.push_back(part.rows);
    }
    s.in_features = in;
    s.glu = glu;
    s.weight = &dst;
    if (!norm.empty()) {
      const TensorRecord& rec = ck.require(prefix + norm, {in});
      s.norm_scale.resize(size_t(in));
      convert_to_f32(rec.data, rec.dtype, s.norm_scale.data(), in);
      for (float& v : s.norm_scale) v = 1.0f + v;
    }
    slots_.push_back(std::move(s));
  };
  auto project = [&](LinearWeight& dst, const std::vector<WeightLoader::Part>& parts, int64_t in,
                     const std::string& norm = "", bool glu = false) {
    dst = w.projection(parts, in, norm, glu);
    slot(dst, base, parts, in, norm, glu);
  };
  embed_ = w.load("embed_tokens.weight", {c.vocab_size, H}, wt);
  final_norm_ = w.load("norm.weight", {H}, f32);
  if (c.tie_word_embeddings) {
    lm_head_.weight = embed_;
  } else {
    lm_head_ = WeightLoader(ck, be_, arena, "", quant, quantized_bytes_).projection({{"lm_head", c.vocab_size}}, H);
  }

  layers_.reserve(size_t(c.num_layers));  // the slots point at the layers' weights
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    DecoderLayer& L = layers_.emplace_back();
    L.full_attention = c.full_attention[i];
    // The two RMSNorms' weights go into the projections that read their output (folded into dense
    // weights, ops.h fold_norm_weight; a quantized one's input_scale): the forward normalises
    // without a weight.
    const std::string input_norm = p + "input_layernorm.weight", post_norm = p + "post_attention_layernorm.weight";
    if (L.full_attention) {
      const std::string a = p + "self_attn.";
      project(L.attn.qkv, {{a + "q_proj", Hq * 2 * hd}, {a + "k_proj", Hkv * hd}, {a + "v_proj", Hkv * hd}}, H,
              input_norm);
      project(L.attn.o, {{a + "o_proj", H}}, Hq * hd);
      L.attn.q_norm = w.load(a + "q_norm.weight", {hd}, f32);
      L.attn.k_norm = w.load(a + "k_norm.weight", {hd}, f32);
    } else {
      const std::string g = p + "linear_attn.";
      const std::vector<WeightLoader::Part> qkvz = {{g + "in_proj_qkv", C}, {g + "in_proj_z", HV * dv}};
      const std::vector<WeightLoader::Part> ba = {{g + "in_proj_b", HV}, {g + "in_proj_a", HV}};
      if (w.format_of(qkvz) == w.format_of(ba)) {
        std::vector<WeightLoader::Part> all = qkvz;
        all.insert(all.end(), ba.begin(), ba.end());
        project(L.gdn.in_proj, all, H, input_norm);
      } else {
        project(L.gdn.in_proj, qkvz, H, input_norm);
        project(L.gdn.in_proj_ba, ba, H, input_norm);
      }
      project(L.gdn.out, {{g + "out_proj", H}}, HV * dv);
      // conv1d.weight is [C, 1, K] in the checkpoint.
      const TensorRecord& cw = ck.require(base + g + "conv1d.weight", {C, 1, K});
      L.gdn.conv_weight = arena.alloc(f32, {C, K});
      be_.copy_from_host(L.gdn.conv_weight, cw.data, cw.dtype);
      L.gdn.A_log = w.load(g + "A_log", {HV}, f32);
      L.gdn.dt_bias = w.load(g + "dt_bias", {HV}, f32);
      L.gdn.norm = w.load(g + "norm.weight", {dv}, f32);
    }
    project(L.gate_up, {{p + "mlp.gate_proj", I}, {p + "mlp.up_proj", I}}, H, post_norm, /*glu=*/true);
    project(L.down, {{p + "mlp.down_proj", H}}, I);
  }
  slot(lm_head_, "", {{"lm_head", c.vocab_size}}, H, "", false);
}

void Qwen35Model::set_linear_rows(const std::string& module, const float* w, int64_t count, Arena& arena) {
  // The module under either key layout (model.language_model.* or model.*).
  auto same = [](const std::string& a, const std::string& b) {
    static const std::string vlm = "model.language_model.", text = "model.";
    auto strip = [&](const std::string& m) {
      return m.rfind(vlm, 0) == 0 ? m.substr(vlm.size()) : m.rfind(text, 0) == 0 ? m.substr(text.size()) : m;
    };
    return a == b || strip(a) == strip(b);
  };
  for (size_t si = 0; si < slots_.size(); ++si) {
    const LinearSlot& s = slots_[si];
    for (size_t part = 0; part < s.modules.size(); ++part) {
      if (!same(s.modules[part], module)) continue;
      LinearWeight& lw = *s.weight;
      if (lw.quantized())
        throw Error(ErrorCode::kInvalidArgument, "set_linear_weight: '" + module +
                                                     "' is stored quantized; only dense projections can be replaced");
      const int64_t K = s.in_features, rows = s.rows[part];
      if (count != rows * K)
        throw Error(ErrorCode::kInvalidArgument, "set_linear_weight: '" + module + "' is [" + std::to_string(rows) + ", " +
                                                     std::to_string(K) + "], got " + std::to_string(count) + " values");
      bool saved = false;
      for (const auto& [slot, original] : saved_) saved |= slot == si;
      const bool tied = lw.weight.data == embed_.data;
      if (!saved) {
        Tensor original;
        if (!tied) {
          original = arena.alloc(lw.weight.dtype, {lw.weight.dim(0), lw.weight.dim(1)});
          be_.copy(original, lw.weight);
        }
        saved_.emplace_back(si, original);
      }
      if (tied) {  // a tied LM head: a copy of its own, so the embeddings stay
        lw.weight = arena.alloc(embed_.dtype, {embed_.dim(0), embed_.dim(1)});
        be_.copy(lw.weight, embed_);
      }
      std::vector<float> staged;  // w with the norm scale folded in, where the slot has one
      if (!s.norm_scale.empty()) {
        staged.resize(size_t(rows * K));
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < K; ++k) staged[r * K + k] = w[r * K + k] * s.norm_scale[k];
      }
      const float* src = staged.empty() ? w : staged.data();
      if (s.glu) {  // this part's groups of kGluGroup rows alternate with the other part's: one strided copy
        const Tensor tiles = lw.weight.view({lw.weight.dim(0) / (2 * kGluGroup), 2 * kGluGroup * K});
        be_.copy_from_host(tiles.cols(int64_t(part) * kGluGroup * K, kGluGroup * K), src, DType::F32);
      } else {
        int64_t first = 0;
        for (size_t q = 0; q < part; ++q) first += s.rows[q];
        be_.copy_from_host(lw.weight.rows(first, rows), src, DType::F32);
      }
      return;
    }
  }
  throw Error(ErrorCode::kInvalidArgument, "set_linear_weight: the model has no projection module '" + module + "'");
}

void Qwen35Model::restore_linears() {
  for (const auto& [si, original] : saved_) {
    LinearWeight& lw = *slots_[si].weight;
    if (original.defined()) {
      be_.copy(lw.weight, original);
    } else {
      lw.weight = embed_;  // the LM head ties to the embeddings again
    }
  }
  saved_.clear();
}

SequenceState Qwen35Model::make_state(Arena& arena, int64_t max_context) const {
  SequenceState s;
  s.max_context = max_context;
  const DType act = be_.activation_dtype();
  for (const DecoderLayer& L : layers_) {
    SequenceState::Layer sl;
    if (L.full_attention) {
      sl.k_cache = arena.alloc(act, {max_context, attn_.num_kv_heads, attn_.head_dim});
      sl.v_cache = arena.alloc(act, {max_context, attn_.num_kv_heads, attn_.head_dim});
    } else {
      sl.conv_state = arena.alloc(DType::F32, {gdn_.conv_dim(), gdn_.conv_kernel - 1});
      sl.recurrent = arena.alloc(DType::F32, {gdn_.num_v_heads, gdn_.k_head_dim, gdn_.v_head_dim});
    }
    s.layers.push_back(sl);
  }
  reset(s);
  return s;
}

void Qwen35Model::reset(SequenceState& s) const {
  for (auto& sl : s.layers) {
    if (sl.conv_state.defined()) be_.fill_zero(sl.conv_state);
    if (sl.recurrent.defined()) be_.fill_zero(sl.recurrent);
  }
}

Workspace Qwen35Model::make_workspace(Arena& arena, int64_t T) const {
  const ModelConfig& c = cfg_;
  const DType act = be_.activation_dtype();
  const int64_t H = c.hidden_size, vdim = gdn_.num_v_heads * gdn_.v_head_dim;
  const int64_t attn_qkv = (2 * attn_.num_q_heads + 2 * attn_.num_kv_heads) * attn_.head_dim;
  const int64_t gdn_proj = gdn_.conv_dim() + vdim + 2 * gdn_.num_v_heads;
  Workspace ws;
  ws.max_tokens = T;
  ws.residual = arena.alloc(act, {T, H});
  ws.normed = arena.alloc(act, {T, H});
  ws.delta = arena.alloc(act, {T, H});
  ws.proj = arena.alloc(act, {T, std::max({attn_qkv, gdn_proj, 2 * c.intermediate_size})});
  ws.q = arena.alloc(act, {T, attn_.num_q_heads, attn_.head_dim});
  ws.mixed = arena.alloc(act, {T, std::max({attn_.num_q_heads * attn_.head_dim, gdn_.conv_dim(), c.intermediate_size})});
  ws.gdn_out = arena.alloc(act, {T, vdim});
  ws.gated = arena.alloc(act, {T, vdim});
  return ws;
}

void Qwen35Model::forward(const Tensor& ids, const Tensor& positions, const Tensor& rope_positions,
                          SequenceState& state, Workspace& ws, bool chunked_gdn) const {
  embed(ids, ws);
  forward_embedded(ids.dim(0), positions, rope_positions, state, ws, chunked_gdn);
}

void Qwen35Model::embed(const Tensor& ids, Workspace& ws) const {
  if (ids.dim(0) > ws.max_tokens) throw Error(ErrorCode::kInternal, "embed: more tokens than the workspace holds");
  be_.embedding(embed_, ids, ws.residual.rows(0, ids.dim(0)));
}

void Qwen35Model::forward_embedded(int64_t T, const Tensor& positions, const Tensor& rope_positions,
                                   SequenceState& state, Workspace& ws, bool chunked_gdn, const HiddenTaps* taps) const {
  run_layers(T, positions, rope_positions, state, ws, chunked_gdn ? GdnMode::kChunked : GdnMode::kDecode, nullptr, taps);
}

void Qwen35Model::verify(const Tensor& ids, const Tensor& positions, const Tensor& rope_positions, SequenceState& state,
                         Workspace& ws, const std::vector<GdnReplay>& replay, const HiddenTaps* taps) const {
  embed(ids, ws);
  run_layers(ids.dim(0), positions, rope_positions, state, ws, GdnMode::kVerify, &replay, taps);
}

void Qwen35Model::commit(SequenceState& state, const std::vector<GdnReplay>& replay, const Tensor& keep) const {
  for (size_t li = 0; li < layers_.size(); ++li)
    if (!layers_[li].full_attention)
      be_.gdn_commit(replay[li], keep, gdn_, state.layers[li].conv_state, state.layers[li].recurrent);
}

std::vector<GdnReplay> Qwen35Model::make_replay(Arena& arena, int64_t T) const {
  std::vector<GdnReplay> replay(layers_.size());
  for (size_t li = 0; li < layers_.size(); ++li) {
    if (layers_[li].full_attention) continue;
    GdnReplay& r = replay[li];
    r.conv_in = arena.alloc(be_.activation_dtype(), {T, gdn_.conv_dim()});
    r.k = arena.alloc(DType::F32, {T, gdn_.num_k_heads * gdn_.k_head_dim});
    r.g = arena.alloc(DType::F32, {T, gdn_.num_v_heads});
    r.u = arena.alloc(DType::F32, {T, gdn_.num_v_heads * gdn_.v_head_dim});
  }
  return replay;
}

void Qwen35Model::run_layers(int64_t T, const Tensor& positions, const Tensor& rope_positions, SequenceState& state,
                             Workspace& ws, GdnMode mode, const std::vector<GdnReplay>* replay,
                             const HiddenTaps* taps) const {
  const int64_t I = cfg_.intermediate_size, H = cfg_.hidden_size;
  const float eps = float(cfg_.rms_norm_eps);
  if (T > ws.max_tokens) throw Error(ErrorCode::kInternal, "forward: more tokens than the workspace holds");
  Tensor x = ws.residual.rows(0, T), normed = ws.normed.rows(0, T), delta = ws.delta.rows(0, T);
  Tensor proj = ws.proj.rows(0, T), mixed = ws.mixed.rows(0, T);

  // Each residual block: x += f(rms_norm(x)), the norm's weight folded into f's first projection.
  for (size_t li = 0; li < layers_.size(); ++li) {
    const DecoderLayer& L = layers_[li];
    SequenceState::Layer& S = state.layers[li];
    if (L.full_attention) {
      const int64_t hq = attn_.num_q_heads * attn_.head_dim;
      Tensor qkv = proj.cols(0, L.attn.qkv.out_features());
      Tensor q = ws.q.rows(0, T), attn_out = mixed.cols(0, hq);
      be_.rms_norm_linear(x, eps, L.attn.qkv, normed, qkv);
      be_.attention_decode(qkv, L.attn.q_norm, L.attn.k_norm, positions, rope_positions, attn_, q, S.k_cache,
                           S.v_cache, attn_out);
      be_.linear_add(attn_out, L.attn.o, delta, x);
    } else {
      const int64_t C = gdn_.conv_dim(), vdim = gdn_.num_v_heads * gdn_.v_head_dim, HV = gdn_.num_v_heads;
      const int64_t width = C + vdim + 2 * HV;
      Tensor all = proj.cols(0, width);
      Tensor conv_out = mixed.cols(0, C), o = ws.gdn_out.rows(0, T), gated = ws.gated.rows(0, T);
      if (L.gdn.in_proj_ba.weight.defined()) {
        // Two linears of one norm, into the column ranges of one output.
        be_.rms_norm_linear(x, eps, L.gdn.in_proj, normed, all.cols(0, C + vdim));
        be_.rms_norm_linear(x, eps, L.gdn.in_proj_ba, normed, all.cols(C + vdim, 2 * HV));
      } else {
        be_.rms_norm_linear(x, eps, L.gdn.in_proj, normed, all);
      }
      if (mode == GdnMode::kChunked) {
        be_.gdn_conv(all.cols(0, C), L.gdn.conv_weight, S.conv_state, conv_out);
        be_.gdn_chunked(conv_out, all.cols(C + vdim, 2 * HV), L.gdn.A_log, L.gdn.dt_bias, S.recurrent, gdn_, o);
        be_.gdn_gated_norm(o, all.cols(C, vdim), L.gdn.norm, gdn_, gated);
      } else if (mode == GdnMode::kVerify) {
        be_.gdn_verify(all, L.gdn.conv_weight, S.conv_state, L.gdn.A_log, L.gdn.dt_bias, L.gdn.norm, S.recurrent, gdn_,
                       conv_out, o, gated, (*replay)[li]);
      } else {
        be_.gdn_decode(all, L.gdn.conv_weight, S.conv_state, L.gdn.A_log, L.gdn.dt_bias, L.gdn.norm, S.recurrent, gdn_,
                       conv_out, o, gated);
      }
      be_.linear_add(gated, L.gdn.out, delta, x);
    }
    // SwiGLU MLP
    Tensor gate_up = proj.cols(0, 2 * I), act = mixed.cols(0, I);
    be_.rms_norm_linear_glu(x, eps, L.gate_up, normed, gate_up, act);
    be_.linear_add(act, L.down, delta, x);
    if (taps)
      for (size_t i = 0; i < taps->layers.size(); ++i)
        if (taps->layers[i] == int64_t(li) && li + 1 < layers_.size())
          be_.copy(taps->out.rows(0, T).cols(int64_t(i) * H, H), x);
  }
  be_.rms_norm(x, final_norm_, normed, eps);
  if (taps)
    for (size_t i = 0; i < taps->layers.size(); ++i)
      if (taps->layers[i] + 1 == int64_t(layers_.size())) be_.copy(taps->out.rows(0, T).cols(int64_t(i) * H, H), normed);
}

void Qwen35Model::logits(const Tensor& hidden, const Tensor& out) const { be_.linear(hidden, lm_head_, out); }

}  // namespace ocria_rt
