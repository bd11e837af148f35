// The Qwen3.5 text decoder written once as calls on a Backend: hybrid Gated DeltaNet / gated
// attention layers, each followed by a SwiGLU MLP. Projections that read the same input are fused
// at load time (attention q|k|v, DeltaNet qkv|z|b|a, MLP gate|up) so each is one weight stream.
#pragma once
#include <vector>

#include "core/arena.h"
#include "core/safetensors.h"
#include "model/quant_config.h"
#include "ocria_rt/config.h"
#include "ops/ops.h"

namespace ocria_rt {

struct AttentionLayer {
  LinearWeight qkv, o;     // qkv: [Hq*2*hd + 2*Hkv*hd, H]
  Tensor q_norm, k_norm;   // [hd]
};

struct DeltaNetLayer {
  // in_proj: [conv_dim + HV*dv + 2*HV, H] = q | k | v | z | b | a. Where qkv | z and b | a are stored
  // in different formats (in_proj_b / in_proj_a stay unquantized in quantized checkpoints), in_proj
  // holds q | k | v | z and in_proj_ba the b | a rows, each writing its columns of the one output.
  LinearWeight in_proj, in_proj_ba, out;
  Tensor conv_weight;         // [conv_dim, K]
  Tensor A_log, dt_bias;      // [HV]
  Tensor norm;                // [dv]
};

struct DecoderLayer {
  // The input and post-attention RMSNorms have no tensors of their own: their weights are folded into
  // the columns of qkv / in_proj and of gate_up (Backend::fold_norm_weight).
  bool full_attention = false;
  AttentionLayer attn;
  DeltaNetLayer gdn;
  LinearWeight gate_up, down;    // gate_up: [2I, H] in the GLU layout (ops.h)
};

// A projection of the model as the checkpoint stores it (for calibration: its inputs are observed and
// its weight can be edited in memory).
struct LinearSlot {
  std::vector<std::string> modules;  // the checkpoint modules fused into it, without ".weight"
  std::vector<int64_t> rows;         // each module's output features
  int64_t in_features = 0;
  bool glu = false;                  // two modules, gate and up, in the GLU layout (ops.h)
  std::vector<float> norm_scale;     // [in_features] the (1 + w) of the RMSNorm folded into it; empty: none
  LinearWeight* weight = nullptr;   // the model's projection
};

// Per-sequence caches: KV rows for attention layers, conv + recurrent state for DeltaNet layers.
struct SequenceState {
  struct Layer {
    Tensor k_cache, v_cache;        // [max_ctx, Hkv, hd]
    Tensor conv_state, recurrent;   // [conv_dim, K-1], [HV, dk, dv] (F32)
  };
  std::vector<Layer> layers;
  int64_t max_context = 0;
};

// Activations for up to max_tokens tokens per forward.
struct Workspace {
  int64_t max_tokens = 0;
  Tensor residual, normed, delta;  // [T, H]
  Tensor proj;                     // [T, widest fused projection]
  Tensor q;                        // [T, Hq, hd]
  Tensor mixed;                    // [T, max(Hq*hd, conv_dim, I)]: attention output / conv output / MLP act
  Tensor gdn_out, gated;           // [T, HV*dv]
};

// Where a forward leaves the hidden states a drafter reads (its "taps"): the output residual stream of
// decoder layer layers[i] (for the last layer, the final-normed output, as transformers numbers
// hidden_states[i + 1]) into columns [i*H, (i+1)*H) of out rows 0..T-1.
struct HiddenTaps {
  std::vector<int64_t> layers;
  Tensor out;  // [max tokens, layers.size() * H]
};

class Qwen35Model {
 public:
  // Projections are stored as `quant` describes (dense for a dense checkpoint).
  Qwen35Model(const ModelConfig& config, const QuantConfig& quant, const Checkpoint& checkpoint, Backend& backend,
              Arena& weights);

  SequenceState make_state(Arena& arena, int64_t max_context) const;
  Workspace make_workspace(Arena& arena, int64_t max_tokens) const;
  void reset(SequenceState& state) const;  // zero the DeltaNet states (KV rows are overwritten as used)

  // Runs T = ids.dim(0) tokens through the decoder, reading and updating `state`: `positions`
  // (I32 [T], device) are their indices in the sequence (cache rows), `rope_positions` (I32 [T, 3])
  // their (t, h, w) rotary positions. Leaves the final-normed hidden states in ws.normed[0:T].
  // `chunked_gdn` picks the chunked DeltaNet form (prefill) over gdn_decode, the recurrence with the
  // conv and the gated norm in one op (decode, verify).
  void forward(const Tensor& ids, const Tensor& positions, const Tensor& rope_positions, SequenceState& state,
               Workspace& ws, bool chunked_gdn) const;
  // The same in two steps, so that the caller can replace rows of the embeddings (image features)
  // in ws.residual[0:T] between them.
  void embed(const Tensor& ids, Workspace& ws) const;
  void forward_embedded(int64_t T, const Tensor& positions, const Tensor& rope_positions, SequenceState& state,
                        Workspace& ws, bool chunked_gdn, const HiddenTaps* taps = nullptr) const;

  // Speculative verification (ReplaySSM): forward() of T tokens, except that the DeltaNet layers
  // leave their states as they are and record the tokens in `replay` (gdn_verify); attention layers
  // write their K/V rows as usual. commit() then advances the DeltaNet states past the first keep[0]
  // tokens (I32 [1], device); K/V rows past them are overwritten by later forwards.
  void verify(const Tensor& ids, const Tensor& positions, const Tensor& rope_positions, SequenceState& state,
              Workspace& ws, const std::vector<GdnReplay>& replay, const HiddenTaps* taps) const;
  void commit(SequenceState& state, const std::vector<GdnReplay>& replay, const Tensor& keep) const;
  // Per layer: the replay records of up to max_tokens tokens (empty for attention layers).
  std::vector<GdnReplay> make_replay(Arena& arena, int64_t max_tokens) const;
  // logits [R, V] of hidden rows [R, H].
  void logits(const Tensor& hidden, const Tensor& out) const;

  const ModelConfig& config() const { return cfg_; }
  const AttentionParams& attention_params() const { return attn_; }
  const GdnParams& gdn_params() const { return gdn_; }
  // Device bytes of the quantized linears (weights and their scales), by format.
  const QuantizedBytes& quantized_bytes() const { return quantized_bytes_; }
  const Tensor& embedding_table() const { return embed_; }

  // The decoder's projections, layer by layer, then the LM head.
  const std::vector<LinearSlot>& linear_slots() const { return slots_; }
  // Overwrites the rows of checkpoint module `module` in its (dense) projection with w [rows, in]
  // (`count` fp32 values, checkpoint layout), folding the slot's norm_scale in as the loader folds it.
  // The first edit of a projection keeps a copy of it in `arena` (on the device); a tied LM head first
  // gets a weight of its own from `arena`. Error(kInvalidArgument) for an unknown module, a wrong count
  // or a quantized projection.
  void set_linear_rows(const std::string& module, const float* w, int64_t count, Arena& arena);
  // Puts back every projection that set_linear_rows changed (the LM head ties to the embeddings again).
  void restore_linears();

 private:
  enum class GdnMode { kChunked, kDecode, kVerify };
  void run_layers(int64_t T, const Tensor& positions, const Tensor& rope_positions, SequenceState& state, Workspace& ws,
                  GdnMode mode, const std::vector<GdnReplay>* replay, const HiddenTaps* taps) const;

  ModelConfig cfg_;
  Backend& be_;
  AttentionParams attn_;
  GdnParams gdn_;
  Tensor embed_, final_norm_;
  LinearWeight lm_head_;
  std::vector<DecoderLayer> layers_;
  QuantizedBytes quantized_bytes_;
  std::vector<LinearSlot> slots_;
  // slot, a copy of its original weight (undefined for a tied LM head: the embeddings are the original)
  std::vector<std::pair<size_t, Tensor>> saved_;
};

}  // namespace ocria_rt
