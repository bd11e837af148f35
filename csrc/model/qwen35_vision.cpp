#include "model/qwen35_vision.h"

#include <cmath>

#include "model/weight_loader.h"

namespace ocria_rt {

Qwen35Vision::Qwen35Vision(const ModelConfig& config, const Checkpoint& ck, Backend& backend, Arena& weights,
                           Arena& work, int64_t max_patches)
    : vc_(config.vision), be_(backend), max_patches_(max_patches) {
  const VisionConfig& v = vc_;
  const int64_t D = v.hidden_size, I = v.intermediate_size, M = D * v.merge_unit();
  WeightLoader w(ck, be_, weights, "model.visual.");
  const DType f32 = DType::F32;

  // Conv3d weight [D, C, T, P, P] with stride = kernel: a linear map of each flattened patch.
  const TensorRecord& pw = ck.require("model.visual.patch_embed.proj.weight",
                                      {D, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size});
  patch_embed_.weight = weights.alloc(be_.weight_dtype(), {D, v.patch_dim()});
  be_.copy_from_host(patch_embed_.weight, pw.data, pw.dtype);
  patch_embed_.bias = w.load("patch_embed.proj.bias", {D}, f32);

  pos_table_ = w.load("pos_embed.weight", {v.num_position_embeddings, D}, f32);

  for (int64_t i = 0; i < v.depth; ++i) {
    const std::string p = "blocks." + std::to_string(i) + ".";
    Block b;
    b.norm1_w = w.load(p + "norm1.weight", {D}, f32);
    b.norm1_b = w.load(p + "norm1.bias", {D}, f32);
    b.norm2_w = w.load(p + "norm2.weight", {D}, f32);
    b.norm2_b = w.load(p + "norm2.bias", {D}, f32);
    b.qkv = w.linear_with_bias(p + "attn.qkv", 3 * D, D);
    b.proj = w.linear_with_bias(p + "attn.proj", D, D);
    b.fc1 = w.linear_with_bias(p + "mlp.linear_fc1", I, D);
    b.fc2 = w.linear_with_bias(p + "mlp.linear_fc2", D, I);
    blocks_.push_back(std::move(b));
  }
  merger_norm_w_ = w.load("merger.norm.weight", {D}, f32);
  merger_norm_b_ = w.load("merger.norm.bias", {D}, f32);
  merger_fc1_ = w.linear_with_bias("merger.linear_fc1", M, M);
  merger_fc2_ = w.linear_with_bias("merger.linear_fc2", v.out_hidden_size, M);

  const DType act = be_.activation_dtype();
  const int64_t P = max_patches_;
  pixels_ = work.alloc(act, {P, v.patch_dim()});
  x_ = work.alloc(act, {P, D});
  normed_ = work.alloc(act, {P, D});
  qkv_ = work.alloc(act, {P, 3 * D});
  attn_ = work.alloc(act, {P, D});
  delta_ = work.alloc(act, {P, D});
  mlp_ = work.alloc(act, {P, I});
  merged_ = work.alloc(act, {P / v.merge_unit(), M});
  out_ = work.alloc(act, {P / v.merge_unit(), v.out_hidden_size});
  tap_rows_ = work.alloc(DType::I32, {P, 4});
  tap_weights_ = work.alloc(f32, {P, 4});
  patch_pos_ = work.alloc(DType::I32, {P, 2});
  cu_seqlens_ = work.alloc(DType::I32, {P / v.merge_unit() + 1});
}

Tensor Qwen35Vision::encode(const float* pixel_values, const std::vector<ImageGrid>& grids) {
  const VisionConfig& v = vc_;
  const int64_t D = v.hidden_size, side = int64_t(std::llround(std::sqrt(double(v.num_position_embeddings))));
  int64_t N = 0;
  std::vector<int32_t> cu{0};
  for (const ImageGrid& g : grids) {
    for (int64_t f = 0; f < g.t; ++f) cu.push_back(int32_t(N += g.h * g.w));  // one attention range per frame
  }
  if (N > max_patches_)
    throw Error(ErrorCode::kResourceError, "images hold " + std::to_string(N) + " patches, more than the " +
                                               std::to_string(max_patches_) + " this engine was sized for (max_image_patches)");
  const int64_t images = int64_t(cu.size()) - 1;

  // Host-side index work: the patch positions and each patch's 4 bilinear taps into the position
  // table, which gather_blend_add resamples on the device.
  std::vector<int32_t> rows;
  std::vector<float> weights;
  vision_position_interpolation(grids, side, v.spatial_merge_size, rows, weights);
  const std::vector<int32_t> patch_pos = vision_patch_positions(grids, v.spatial_merge_size);

  Tensor pixels = pixels_.rows(0, N), x = x_.rows(0, N), normed = normed_.rows(0, N), qkv = qkv_.rows(0, N);
  Tensor attn = attn_.rows(0, N), delta = delta_.rows(0, N), mlp = mlp_.rows(0, N);
  Tensor tap_rows = tap_rows_.rows(0, N), tap_weights = tap_weights_.rows(0, N);
  Tensor ppos = patch_pos_.rows(0, N), cu_t = cu_seqlens_.rows(0, images + 1);
  be_.copy_from_host(pixels, pixel_values, DType::F32);
  be_.copy_from_host(tap_rows, rows.data(), DType::I32);
  be_.copy_from_host(tap_weights, weights.data(), DType::F32);
  be_.copy_from_host(ppos, patch_pos.data(), DType::I32);
  be_.copy_from_host(cu_t, cu.data(), DType::I32);

  be_.linear(pixels, patch_embed_, x);
  be_.gather_blend_add(pos_table_, tap_rows, tap_weights, x);
  const float eps = 1e-6f;
  for (const Block& b : blocks_) {
    be_.layer_norm(x, b.norm1_w, b.norm1_b, normed, eps);
    be_.linear(normed, b.qkv, qkv);
    be_.vision_attention(qkv, ppos, cu_t, v.num_heads, float(v.rope_theta), attn);
    be_.linear(attn, b.proj, delta);
    be_.add(x, delta);
    be_.layer_norm(x, b.norm2_w, b.norm2_b, normed, eps);
    be_.linear(normed, b.fc1, mlp);
    be_.gelu(mlp, mlp, v.gelu_tanh);
    be_.linear(mlp, b.fc2, delta);
    be_.add(x, delta);
  }
  // Merger: LayerNorm per patch, then each 2 x 2 window (4 consecutive patches) as one row.
  const int64_t G = N / v.merge_unit();
  be_.layer_norm(x, merger_norm_w_, merger_norm_b_, normed, eps);
  Tensor windows = normed.view({G, D * v.merge_unit()});
  Tensor merged = merged_.rows(0, G), out = out_.rows(0, G);
  be_.linear(windows, merger_fc1_, merged);
  be_.gelu(merged, merged, /*tanh_approximation=*/false);
  be_.linear(merged, merger_fc2_, out);
  return out;
}

}  // namespace ocria_rt
