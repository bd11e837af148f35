// The text-decoder configuration of a Qwen3.5 checkpoint, as read from its config.json.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ocria_rt/error.h"

namespace ocria_rt {

// The ViT encoder of a Qwen3.5 VLM checkpoint (config.json "vision_config").
struct VisionConfig {
  int64_t depth = 0;
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  int64_t intermediate_size = 0;
  int64_t in_channels = 3;
  int64_t patch_size = 16;
  int64_t temporal_patch_size = 2;
  int64_t spatial_merge_size = 2;
  int64_t out_hidden_size = 0;          // the text model's hidden size
  int64_t num_position_embeddings = 0;  // a square grid of learned position embeddings
  double rope_theta = 10000.0;
  bool gelu_tanh = true;                // blocks' MLP activation (gelu_pytorch_tanh)

  int64_t head_dim() const { return hidden_size / num_heads; }
  int64_t patch_dim() const { return in_channels * temporal_patch_size * patch_size * patch_size; }
  int64_t merge_unit() const { return spatial_merge_size * spatial_merge_size; }
};

struct ModelConfig {
  std::string model_type;  // "qwen3_5_text" or "qwen3_5" (the text_config of the latter)
  bool has_vision = false;  // a VLM checkpoint: `vision` and the token ids below are set
  VisionConfig vision;
  int32_t image_token_id = -1, vision_start_token_id = -1, vision_end_token_id = -1;
  std::vector<int64_t> mrope_section;  // M-RoPE frequency split over (t, h, w); empty: plain RoPE
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  std::vector<bool> full_attention;  // per layer: true = gated attention, false = Gated DeltaNet
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;
  // gated attention
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;  // head_dim * partial_rotary_factor, even
  double rope_theta = 0;
  // Gated DeltaNet
  int64_t linear_num_key_heads = 0;    // HK
  int64_t linear_num_value_heads = 0;  // HV, a multiple of HK
  int64_t linear_key_head_dim = 0;     // dk
  int64_t linear_value_head_dim = 0;   // dv
  int64_t linear_conv_kernel_dim = 0;
  std::vector<int32_t> eos_token_ids;

  int64_t num_full_attention_layers() const {
    int64_t n = 0;
    for (bool a : full_attention) n += a;
    return n;
  }
  int64_t gdn_conv_dim() const {
    return 2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads * linear_value_head_dim;
  }
};

// Reads <model_dir>/config.json. Throws ocria_rt::Error naming the file and key on any problem.
ModelConfig load_model_config(const std::string& model_dir);

}  // namespace ocria_rt
