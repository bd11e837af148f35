// Index arithmetic of the Qwen3.5 vision path, done on the host: where each patch sits, how the
// learned position grid is resampled to it, and the 3-axis (t, h, w) M-RoPE positions of a token
// sequence holding images. Patches are ordered block-major over spatial_merge x spatial_merge
// windows (block_row, block_col, in_row, in_col), the order the image processor emits them in.
#pragma once
#include <cstdint>
#include <vector>

#include "ocria_rt/config.h"

namespace ocria_rt {

struct ImageGrid {
  int64_t t = 1, h = 0, w = 0;  // in patches
  int64_t patches() const { return t * h * w; }
};

// Per patch: (row, col) of the patch in its image, [N, 2] row-major.
std::vector<int32_t> vision_patch_positions(const std::vector<ImageGrid>& grids, int64_t merge);

// Bilinear resampling (align_corners) of the side x side learned position table to each image:
// per patch 4 table rows and their weights, [N, 4] each.
void vision_position_interpolation(const std::vector<ImageGrid>& grids, int64_t side, int64_t merge,
                                   std::vector<int32_t>& rows, std::vector<float>& weights);

// M-RoPE positions [T, 3] of `tokens`: text tokens advance all three axes together; each run of
// image tokens is one image laid out on its merged (t, h, w) grid starting at the current position,
// after which text continues from the largest position + 1. Returns max position + 1 - T in *delta
// (the offset decode steps add to their sequence index). Throws if the runs and grids disagree.
std::vector<int32_t> mrope_positions(const std::vector<int32_t>& tokens, int32_t image_token_id,
                                     const std::vector<ImageGrid>& grids, int64_t merge, int64_t* delta);

}  // namespace ocria_rt
