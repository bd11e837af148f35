// The Qwen3.5 vision encoder (model.visual.*): Conv3d patch embedding (a linear map of each
// flattened C x T x P x P patch), bilinearly resampled learned position embeddings, pre-LayerNorm
// ViT blocks with 2-D rotary attention inside each image, and the 2 x 2 patch merger that maps to
// the text model's hidden size. Written once as calls on a Backend, like the decoder.
#pragma once
#include <vector>

#include "core/arena.h"
#include "core/safetensors.h"
#include "model/vision_grid.h"
#include "ocria_rt/config.h"
#include "ops/ops.h"

namespace ocria_rt {

class Qwen35Vision {
 public:
  // Workspaces are sized for up to max_patches patches per encode() call.
  Qwen35Vision(const ModelConfig& config, const Checkpoint& ck, Backend& backend, Arena& weights, Arena& work,
               int64_t max_patches);

  // pixel_values: host fp32 [sum of t*h*w, patch_dim] in the image processor's patch order.
  // Returns the merged embeddings [patches / 4, text hidden] (a view of the workspace, valid until
  // the next call).
  Tensor encode(const float* pixel_values, const std::vector<ImageGrid>& grids);

  int64_t max_patches() const { return max_patches_; }
  const VisionConfig& config() const { return vc_; }

 private:
  struct Block {
    Tensor norm1_w, norm1_b, norm2_w, norm2_b;
    LinearWeight qkv, proj, fc1, fc2;
  };
  VisionConfig vc_;
  Backend& be_;
  int64_t max_patches_;
  LinearWeight patch_embed_;
  Tensor pos_table_;  // F32 [num_position_embeddings, hidden], resampled per patch by gather_blend_add
  std::vector<Block> blocks_;
  Tensor merger_norm_w_, merger_norm_b_;
  LinearWeight merger_fc1_, merger_fc2_;
  // workspace
  Tensor pixels_, x_, normed_, qkv_, attn_, delta_, mlp_, merged_, out_, tap_rows_, tap_weights_, patch_pos_, cu_seqlens_;
};

}  // namespace ocria_rt
