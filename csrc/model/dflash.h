// The DFlash / DFlash2 drafter (z-lab's checkpoint format) written once as calls on a Backend.
//
// A few Qwen3 decoder layers without embeddings or LM head of their own: a block [anchor, mask x
// (B-1)] enters as the target's embeddings, and the drafter's final-normed hidden states go through the
// target's LM head. The target's hidden states at the tapped layers enter only as keys and values:
// ctx = hidden_norm(fc · [taps]), and each layer keeps K = k_norm(W_k ctx) (RoPE at the token's
// position) and V = W_v ctx of every token before the block in its context cache. DFlash2 adds a
// grouped dynamic causal convolution around each sublayer and a candidate selector over the top-K
// logits of each block position.
#pragma once
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/safetensors.h"
#include "ocria_rt/config.h"
#include "ops/ops.h"

namespace ocria_rt {

struct DraftConfig {
  std::string path;           // the config.json read
  bool dflash2 = false;       // DFlash2DraftModel (else DFlashDraftModel)
  int64_t hidden_size = 0;    // = the target's
  int64_t vocab_size = 0;     // = the target's
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::vector<int64_t> target_layer_ids;  // target decoder layers tapped, from 0
  int64_t block_size = 16;                // B: the anchor and B - 1 drafted tokens
  int32_t mask_token_id = 0;
  std::vector<DraftMask> masks;           // per layer
  float output_multiplier = 1.0f;         // logits = softcap(lm_head(h) * output_multiplier)
  float final_logit_softcapping = 0.0f;   // <= 0: none
  float input_embedding_scale = 1.0f;
  // DFlash2
  int64_t conv_kernel_size = 0, conv_group_size = 0;
  int64_t selector_rank = 0, selector_top_k = 0;
};

// Reads <dir>/config.json and checks it against the target it will draft for. Throws
// Error(kFileError / kModelError) naming the file and key.
DraftConfig load_draft_config(const std::string& dir, const ModelConfig& target);

// The drafter's per-sequence state: each layer's context K/V rows, one per sequence position.
struct DraftState {
  std::vector<Tensor> k_cache, v_cache;  // per layer [rows, Hkv, hd]
};

// Activations: a block of B tokens, and context updates of up to max_context_tokens tokens.
struct DraftWorkspace {
  Tensor x, normed, conv, delta;  // [B, H]
  Tensor proj;                    // [B, max(qkv width, 2I)]
  Tensor attn;                    // [B, Hq*hd]
  Tensor act;                     // [B, I]
  Tensor dyn;                     // [B, 2*K*G] DFlash2's dynamic kernels of one sublayer
  Tensor hidden;                  // [B, H] the final-normed output
  Tensor ctx, ctx_normed;         // [max_context_tokens, H]
  Tensor ctx_kv;                  // [max_context_tokens, 2*Hkv*hd]
};

class DFlashDrafter {
 public:
  DFlashDrafter(const DraftConfig& config, const Checkpoint& checkpoint, Backend& backend, Arena& weights);

  DraftState make_state(Arena& arena, int64_t rows) const;
  DraftWorkspace make_workspace(Arena& arena, int64_t max_context_tokens) const;

  // Appends tokens to the context: taps [T, n_taps * H] (HiddenTaps::out rows) of the tokens at
  // `positions` (I32 [T]) become each layer's K/V rows at those positions.
  void push_context(const Tensor& taps, const Tensor& positions, DraftState& state, DraftWorkspace& ws) const;

  // Runs the block `ids` (I32 [B]: the anchor, then mask tokens) at `positions` (I32 [B]) over the
  // context rows before positions[0]; embed_table is the target's embedding. Leaves the final-normed
  // hidden states in ws.hidden (row k predicts block token k, k >= 1). Writes the block's own K/V into
  // the cache rows at `positions` (context pushed later overwrites them).
  void forward_block(const Tensor& ids, const Tensor& positions, const Tensor& embed_table, DraftState& state,
                     DraftWorkspace& ws) const;

  // DFlash2: h [R, rank] = the selector's projection of hidden rows [R, H].
  void selector_projection(const Tensor& hidden, const Tensor& out) const { be_.linear(hidden, selector_proj_, out); }
  const Tensor& predecessor_codebook() const { return predecessor_; }
  const Tensor& successor_codebook() const { return successor_; }

  const DraftConfig& config() const { return cfg_; }

 private:
  struct Layer {
    Tensor input_norm, post_norm;  // zero-centred form (w - 1) of Qwen3's plain RMSNorm weights
    Tensor q_norm, k_norm;         // the same, [hd]
    LinearWeight qkv;              // [Hq*hd + 2*Hkv*hd, H]: q | k | v
    LinearWeight kv;               // the k | v rows of qkv (a view): the context's projection
    LinearWeight o, gate_up, down; // gate_up in the GLU layout (ops.h)
    // DFlash2: kernel_projection [2*K*G, H]; base kernels [K, H] for the input (side 0) and output (side 1)
    LinearWeight attn_kernel, mlp_kernel;
    Tensor attn_base[2], mlp_base[2];
  };
  // x [B, H] += the sublayer f around its DFlash2 convolution, from the normed input.
  template <class Sublayer>
  void convolved(const Tensor& normed, const LinearWeight& kernel, const Tensor* base, DraftWorkspace& ws,
                 const Tensor& x, Sublayer&& f) const;

  DraftConfig cfg_;
  Backend& be_;
  AttentionParams attn_;
  std::vector<Layer> layers_;
  LinearWeight fc_;
  Tensor hidden_norm_, final_norm_;
  LinearWeight selector_proj_;
  Tensor predecessor_, successor_;  // [V, rank], weight dtype
};

}  // namespace ocria_rt
