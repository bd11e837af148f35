#include "model/vision_grid.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace ocria_rt {

namespace {

// (row, col) of the i-th patch of one frame in block-major order.
void patch_row_col(int64_t i, int64_t w, int64_t merge, int64_t* row, int64_t* col) {
  const int64_t blocks_w = w / merge;
  const int64_t in_col = i % merge, in_row = (i / merge) % merge;
  const int64_t block_col = (i / (merge * merge)) % blocks_w, block_row = i / (merge * merge * blocks_w);
  *row = block_row * merge + in_row;
  *col = block_col * merge + in_col;
}

// align_corners bilinear taps along one axis: source coordinate index * (side-1) / (size-1).
void taps(int64_t index, int64_t size, int64_t side, int64_t* lo, int64_t* hi, float* w_hi) {
  const float src = float(index) * float(side - 1) / float(std::max<int64_t>(size - 1, 1));
  const float f = std::floor(src);
  *lo = std::clamp<int64_t>(int64_t(f), 0, side - 1);
  *hi = std::clamp<int64_t>(int64_t(f) + 1, 0, side - 1);
  *w_hi = src - f;
}

}  // namespace

std::vector<int32_t> vision_patch_positions(const std::vector<ImageGrid>& grids, int64_t merge) {
  std::vector<int32_t> pos;
  for (const ImageGrid& g : grids)
    for (int64_t f = 0; f < g.t; ++f)
      for (int64_t i = 0; i < g.h * g.w; ++i) {
        int64_t r, c;
        patch_row_col(i, g.w, merge, &r, &c);
        pos.push_back(int32_t(r));
        pos.push_back(int32_t(c));
      }
  return pos;
}

void vision_position_interpolation(const std::vector<ImageGrid>& grids, int64_t side, int64_t merge,
                                   std::vector<int32_t>& rows, std::vector<float>& weights) {
  rows.clear();
  weights.clear();
  for (const ImageGrid& g : grids)
    for (int64_t f = 0; f < g.t; ++f)
      for (int64_t i = 0; i < g.h * g.w; ++i) {
        int64_t r, c, r0, r1, c0, c1;
        float wr, wc;
        patch_row_col(i, g.w, merge, &r, &c);
        taps(r, g.h, side, &r0, &r1, &wr);
        taps(c, g.w, side, &c0, &c1, &wc);
        const int64_t idx[4] = {r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1};
        const float w[4] = {(1 - wr) * (1 - wc), (1 - wr) * wc, wr * (1 - wc), wr * wc};
        for (int k = 0; k < 4; ++k) {
          rows.push_back(int32_t(idx[k]));
          weights.push_back(w[k]);
        }
      }
}

std::vector<int32_t> mrope_positions(const std::vector<int32_t>& tokens, int32_t image_token_id,
                                     const std::vector<ImageGrid>& grids, int64_t merge, int64_t* delta) {
  std::vector<int32_t> pos;
  pos.reserve(tokens.size() * 3);
  int64_t current = 0;
  size_t image = 0;
  for (size_t i = 0; i < tokens.size();) {
    if (tokens[i] != image_token_id) {
      pos.insert(pos.end(), 3, int32_t(current++));
      ++i;
      continue;
    }
    size_t end = i;
    while (end < tokens.size() && tokens[end] == image_token_id) ++end;
    if (image >= grids.size())
      throw Error(ErrorCode::kInvalidArgument, "the tokens hold more image-token runs than images were given (" +
                                                   std::to_string(grids.size()) + ")");
    const ImageGrid& g = grids[image++];
    const int64_t gh = g.h / merge, gw = g.w / merge;
    if (int64_t(end - i) != g.t * gh * gw)
      throw Error(ErrorCode::kInvalidArgument, "image " + std::to_string(image - 1) + " has " +
                                                   std::to_string(g.t * gh * gw) + " merged patches but its run holds " +
                                                   std::to_string(end - i) + " image tokens");
    for (int64_t t = 0; t < g.t; ++t)
      for (int64_t y = 0; y < gh; ++y)
        for (int64_t x = 0; x < gw; ++x) {
          pos.push_back(int32_t(current + t));
          pos.push_back(int32_t(current + y));
          pos.push_back(int32_t(current + x));
        }
    current += std::max(gh, gw);
    i = end;
  }
  if (image != grids.size())
    throw Error(ErrorCode::kInvalidArgument, std::to_string(grids.size()) + " images were given but the tokens hold " +
                                                 std::to_string(image) + " image-token runs");
  int32_t mx = -1;
  for (int32_t p : pos) mx = std::max(mx, p);
  *delta = int64_t(mx) + 1 - int64_t(tokens.size());
  return pos;
}

}  // namespace ocria_rt
