"""Index computations for Qwen3.5 vision input, in numpy (what the runtime builds once on the CPU).

Two families, both matching transformers 5.17 (``transformers/vision_utils.py`` and
``Qwen3_5Model.get_rope_index``) value for value:

1. Vision encoder, per patch (patches in ``pixel_values`` order, i.e. merge-window-major: for each
   ``merge x merge`` window in row-major window order, its patches row-major):

   - ``vision_rotary_position_ids``: the patch's (row, col) on the image's patch grid, the input of
     the encoder's 2-D rotary embedding;
   - ``vision_rotary_cos_sin``: the cos/sin tables ``[N, head_dim]`` that rotary embedding applies
     (layout ``[row freqs | col freqs | row freqs | col freqs]``, rotate-half over the whole head);
   - ``vision_pos_embed_interpolation``: 4 gather indices into the learned ``side x side`` position
     table and 4 bilinear weights (``align_corners=True``, border clamp), float32;
   - ``vision_cu_seqlens``: attention segment boundaries (one segment per image frame).

2. Text decoder: ``mrope_position_ids`` gives the 3-axis (t, h, w) M-RoPE positions of a prompt with
   image placeholder tokens, and the ``rope_delta`` that continues the positions during decoding
   (``position = cache_position + rope_delta`` on all three axes).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .errors import InvalidArgumentError


def _grids(grid_thw) -> np.ndarray:
    g = np.asarray(grid_thw, dtype=np.int64)
    if g.ndim == 1:
        g = g[None, :]
    if g.ndim != 2 or g.shape[1] != 3 or (g.size and g.min() <= 0):
        raise InvalidArgumentError(f"grid_thw must be [num_images, 3] positive integers, got {g.tolist()}")
    return g


def _check_merge(g: np.ndarray, merge_size: int) -> None:
    for t, h, w in g.tolist():
        if h % merge_size or w % merge_size:
            raise InvalidArgumentError(f"grid (t={t}, h={h}, w={w}) is not a multiple of merge_size {merge_size}")


def patch_rows_cols(h: int, w: int, merge_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch of one frame, in merge-window-major order."""
    m = merge_size
    grid_rows = np.arange(h).reshape(h // m, 1, m, 1)
    grid_cols = np.arange(w).reshape(1, w // m, 1, m)
    rows = np.broadcast_to(grid_rows, (h // m, w // m, m, m)).reshape(-1)
    cols = np.broadcast_to(grid_cols, (h // m, w // m, m, m)).reshape(-1)
    return rows, cols


def vision_rotary_position_ids(grid_thw, merge_size: int) -> np.ndarray:
    """``[total_patches, 2]`` int64 (row, col) per patch; frames of a video repeat the same ids."""
    g = _grids(grid_thw)
    _check_merge(g, merge_size)
    out = []
    for t, h, w in g.tolist():
        rows, cols = patch_rows_cols(h, w, merge_size)
        out.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
    return np.concatenate(out, axis=0).astype(np.int64)


def vision_rotary_inv_freq(head_dim: int, theta: float = 10000.0) -> np.ndarray:
    """``[head_dim // 4]`` float32: ``1 / theta ** (arange(0, head_dim // 2, 2) / (head_dim // 2))``."""
    spatial = head_dim // 2
    exponent = np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial)
    return (1.0 / (np.float64(theta) ** exponent.astype(np.float64))).astype(np.float32)


def vision_rotary_cos_sin(
    position_ids: np.ndarray, head_dim: int, theta: float = 10000.0
) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin ``[N, head_dim]`` float32 for (row, col) ``position_ids`` ``[N, 2]``.

    Per patch the angle vector is ``[row * f | col * f | row * f | col * f]`` with ``f`` the
    ``head_dim // 4`` inverse frequencies; q and k are rotated with rotate-half over all head_dim
    dims: ``q * cos + rotate_half(q) * sin``, ``rotate_half(x) = [-x[hd/2:], x[:hd/2]]``.
    """
    inv = vision_rotary_inv_freq(head_dim, theta)
    pos = np.asarray(position_ids, dtype=np.float32)
    freqs = pos[:, :, None] * inv[None, None, :]  # [N, 2, hd/4], float32 like torch
    hw = np.concatenate([freqs[:, 0], freqs[:, 1]], axis=-1)
    ang = np.concatenate([hw, hw], axis=-1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def vision_pos_embed_interpolation(
    grid_thw, num_grid_per_side: int, merge_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear resampling of the learned ``side x side`` position table onto each image's patch grid.

    Returns ``indices`` ``[total_patches, 4]`` int64 into the flattened table (``r * side + c``) and
    ``weights`` ``[total_patches, 4]`` float32; the patch's position embedding is
    ``sum_k weights[:, k] * table[indices[:, k]]``. Tap order: (r0, c0), (r0, c1), (r1, c0), (r1, c1)
    with ``r1 = min(r0 + 1, side - 1)`` (border clamp; the clamped tap gets weight 0 or the source
    sits exactly on the last row). Source coordinate, as ``F.interpolate(align_corners=True)``:
    ``src = i * (side - 1) / max(n - 1, 1)``, computed in float32.
    """
    g = _grids(grid_thw)
    _check_merge(g, merge_size)
    side = int(num_grid_per_side)
    idx_all, w_all = [], []
    for t, h, w in g.tolist():
        rows, cols = patch_rows_cols(h, w, merge_size)
        rt, rw_ = _axis_taps(rows, h, side)
        ct, cw = _axis_taps(cols, w, side)
        idx = (rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4)
        wt = (rw_[:, :, None] * cw[:, None, :]).reshape(-1, 4)
        idx_all.append(np.tile(idx, (t, 1)))
        w_all.append(np.tile(wt, (t, 1)))
    return np.concatenate(idx_all).astype(np.int64), np.concatenate(w_all).astype(np.float32)


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    # float32 throughout, in transformers' operation order, so the weights agree bit for bit
    i = index.astype(np.float32)
    src = (i * np.float32(side - 1)) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2)
    raw = floor.astype(np.int64)[:, None] + offsets
    taps = np.clip(raw, 0, side - 1)
    dist = np.abs((src[:, None] - floor[:, None]) - offsets.astype(np.float32))
    weights = np.maximum(np.float32(1.0) - dist, np.float32(0.0)).astype(np.float32)
    return taps, weights


def vision_cu_seqlens(grid_thw) -> np.ndarray:
    """``[num_frames + 1]`` int32 boundaries of the encoder's attention segments (one per frame):
    patches attend only within their own image (frame)."""
    g = _grids(grid_thw)
    seqlens = np.repeat(g[:, 1] * g[:, 2], g[:, 0])
    return np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)


def merged_token_counts(grid_thw, merge_size: int) -> np.ndarray:
    """Image placeholder tokens per image: ``t * h * w / merge_size**2``."""
    g = _grids(grid_thw)
    return (g.prod(axis=1) // (merge_size * merge_size)).astype(np.int64)


def mrope_position_ids(
    input_ids: Sequence[int] | np.ndarray,
    image_grid_thw,
    image_token_id: int,
    merge_size: int,
) -> tuple[np.ndarray, int]:
    """M-RoPE positions ``[3, T]`` int64 (t, h, w) for one prompt, and its ``rope_delta``.

    Text tokens take ``p, p, p`` with ``p`` one past the previous token's largest position. An image
    whose merged grid is ``gh x gw`` (``gh = h / merge``) starts at ``s`` = the next text position;
    its tokens, row-major over the merged grid, get ``t = s``, ``h = s + row``, ``w = s + col``; the
    text after it continues at ``s + max(gh, gw)`` (= its largest position + 1). ``vision_start`` /
    ``vision_end`` tokens are ordinary text tokens. During decoding, a token at cache position ``c``
    takes ``c + rope_delta`` on all three axes, ``rope_delta = max(positions) + 1 - T``.

    Images are consumed in order, each by ``t*h*w / merge**2`` consecutive image tokens (two images
    back to back without a separator are split by those counts).
    """
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
    grids = _grids(image_grid_thw) if image_grid_thw is not None and len(image_grid_thw) else np.zeros((0, 3), np.int64)
    if len(grids):
        _check_merge(grids, merge_size)
    is_img = ids == image_token_id
    n_needed = int(merged_token_counts(grids, merge_size).sum()) if len(grids) else 0
    if int(is_img.sum()) != n_needed:
        raise InvalidArgumentError(
            f"the prompt has {int(is_img.sum())} image tokens (id {image_token_id}) but the images need "
            f"{n_needed} ({', '.join(str(x) for x in merged_token_counts(grids, merge_size).tolist()) or 'no images'})"
        )
    pos = np.zeros((3, len(ids)), dtype=np.int64)
    cur = 0
    i = 0
    img = 0
    T = len(ids)
    while i < T:
        if not is_img[i]:
            j = i
            while j < T and not is_img[j]:
                j += 1
            pos[:, i:j] = cur + np.arange(j - i)
            cur += j - i
            i = j
            continue
        t, h, w = grids[img].tolist()
        gh, gw = h // merge_size, w // merge_size
        n = t * gh * gw
        if i + n > T or not is_img[i : i + n].all():
            raise InvalidArgumentError(
                f"image {img} needs {n} consecutive image tokens starting at position {i}"
            )
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pos[0, i : i + n] = tt.reshape(-1) + cur
        pos[1, i : i + n] = hh.reshape(-1) + cur
        pos[2, i : i + n] = ww.reshape(-1) + cur
        cur += max(gh, gw)
        i += n
        img += 1
    rope_delta = int(pos.max()) + 1 - T if T else 0
    return pos, rope_delta


def expand_image_tokens(
    input_ids: Sequence[int], image_grid_thw, image_token_id: int, merge_size: int
) -> list[int]:
    """Replace the k-th single ``image_token_id`` of a prompt by as many copies as image k needs
    (what the transformers processor does to ``<|image_pad|>`` in the text)."""
    counts = merged_token_counts(image_grid_thw, merge_size).tolist()
    out: list[int] = []
    k = 0
    for tok in input_ids:
        if tok == image_token_id:
            if k >= len(counts):
                raise InvalidArgumentError(f"the prompt has more image tokens than the {len(counts)} images")
            out.extend([image_token_id] * counts[k])
            k += 1
        else:
            out.append(int(tok))
    if k != len(counts):
        raise InvalidArgumentError(f"the prompt has {k} image tokens for {len(counts)} images")
    return out


__all__ = [
    "expand_image_tokens",
    "merged_token_counts",
    "mrope_position_ids",
    "patch_rows_cols",
    "vision_cu_seqlens",
    "vision_pos_embed_interpolation",
    "vision_rotary_cos_sin",
    "vision_rotary_inv_freq",
    "vision_rotary_position_ids",
]
