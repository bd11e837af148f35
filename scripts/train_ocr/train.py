#!/usr/bin/env python3
"""Train a small Qwen3.5 page-to-Markdown model from scratch on generated pages (transformers + torch).

    python scripts/train_ocr/train.py --out runs/a --minutes 9            # a GPU run (resumes runs/a/ckpt)
    python scripts/train_ocr/train.py --out runs/b --resume runs/a/ckpt   # resume from another directory
    python scripts/train_ocr/train.py --out /tmp/smoke --smoke            # a few CPU steps of a tiny model
    torchrun --standalone --nproc_per_node 4 scripts/train_ocr/train.py --out runs/a --minutes 9   # 4 GPUs

Model: ``Qwen3_5ForConditionalGeneration`` of a preset size (common.PRESETS: a text decoder with the
3:1 Gated DeltaNet : attention pattern, Qwen3.5's vision geometry: patch 16, temporal patch 2, merge 2),
random init. The flash-linear-attention kernels are used by transformers when the `fla` package is
importable; otherwise its torch reference path runs.

Data: every batch is a pure function of (--data-seed, batch number): a page size and a text budget are
drawn for the batch, then pages ``page_seed("train", batch * 64 + j, data_seed)`` are generated (never
held-out seeds) in DataLoader workers, tokenised as ``ocria_rt.chat.build_multimodal_prompt`` does
(the package's chat template, image placeholder expanded), right-padded, with M-RoPE positions. The
images travel as uint8 and are normalised and cut into patches on the device (as ocria_rt.preprocess:
pages are drawn at sizes that need no resize). Loss: cross-entropy on the answer tokens only (the
page's Markdown and <|im_end|>).

Optimisation: AdamW (betas 0.9/0.95, weight decay on matrices), linear warm-up then cosine decay to
--min-lr-ratio at --total-steps (the plan over all runs), gradient clipping, BF16 autocast on CUDA.

Data parallel (launched by torchrun, one process per GPU; NCCL, or gloo on CPU): rank r of W takes the
global batch numbers B + r, B + r + W, ... (B: the checkpoint's batch counter), --accum of them per step,
and DistributedDataParallel averages the gradients; so a step's global batch is W * --accum batches and a
run may resume with another W. Rank 0 alone logs, evaluates and checkpoints (the others wait at a
barrier); the ranks agree on when to stop, evaluate or checkpoint through one small all-reduce per step.

Runs are budgeted (--minutes): training stops early enough to checkpoint and evaluate. Checkpoints
(model, optimizer moments, schedule, step, RNG states, the run history) go to OUT/ckpt (ckpt.py);
a run resumes from --resume, else from OUT/ckpt when it exists. OUT/log.jsonl gets a line every
--log-every steps (loss, lr, throughput, data wait) and one per evaluation (CER and table-structure
exactness of greedy decoding on --eval-pages held-out pages); it carries the previous runs' lines.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import hashlib
import html
import json
import math
import multiprocessing
import os
import random
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the GPU machines need NVLink SHARP / multicast off for NCCL and torch's symmetric memory
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import common  # noqa: E402  (sets up the ocria_rt imports)
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ckpt  # noqa: E402
from common import MERGE, PATCH, PromptBuilder, synthdoc  # noqa: E402

PAGES_PER_STEP_MAX = 256  # --max-batch's limit


def train_page_index(step: int, j: int) -> int:
    """The training-split index of page j of batch `step`: step * 64 + j for the first 64 pages (the
    scheme of every run so far), further pages from disjoint ranges, 2**30 apart per 64 (page_seed takes
    indices below 2**32: steps up to 2**24)."""
    return (j // 64) * 2**30 + step * 64 + j % 64


# --------------------------------------------------------------------------- #
# Data
# --------------------------------------------------------------------------- #
@dataclass
class DataSpec:
    seed: int = 0
    batch_tokens: int = 65536  # padded tokens per step (B * L)
    max_batch: int = 64
    max_seq: int = 4096
    long_side: tuple[int, int] = (768, 1024)
    aspect: tuple[float, float] = (1.25, 1.45)
    landscape: float = 0.04
    body_px: tuple[int, int] = (13, 19)
    chars: tuple[int, int] = (400, 4000)  # per-step text budget range (Markdown characters)
    curriculum_steps: int = 0  # ramp the budget's upper end from chars[0] * 2 to chars[1] over these steps
    noise: float = 1.0
    chars_per_token: float = 2.2  # conservative, to size batches before the pages exist
    locales: tuple[str, ...] | None = None  # faker locales of the page text (None: all of synthdoc's)
    # share of pages that hold a table (report layout, see page_source) instead of synthdoc's usual
    # mix; training only: the held-out pages (ocria-rt eval, training.json) keep the mix
    table_share: float = 0.0

    def page_config(self, size: tuple[int, int] | None = None, max_chars: int | None = None):
        # the same mapping `ocria-rt eval` applies to an exported model's training.json
        return synthdoc.with_overrides(synthdoc.training_data_page_config(asdict(self)), size=size, max_chars=max_chars)

    def max_pixels(self) -> int:
        lo, hi = self.long_side
        short = round(hi / self.aspect[0] / 32) * 32
        return hi * short

    def step_plan(self, step: int, prompt_len: int) -> tuple[tuple[int, int], int, int]:
        """(page size, character budget, pages) of a step."""
        rng = random.Random(f"plan:{self.seed}:{step}")
        m = 32
        long = rng.randint(math.ceil(self.long_side[0] / m), self.long_side[1] // m) * m
        short = max(m, round(long / rng.uniform(*self.aspect) / m) * m)
        size = (long, short) if rng.random() < self.landscape else (short, long)
        lo, hi = self.chars
        if self.curriculum_steps > 0 and step < self.curriculum_steps:
            hi = int(min(hi, lo * 2 + (hi - lo * 2) * step / self.curriculum_steps))
        max_chars = int(round(math.exp(rng.uniform(math.log(lo), math.log(max(lo + 1, hi))))))
        img_tokens = (size[0] // PATCH) * (size[1] // PATCH) // (MERGE * MERGE)
        est = img_tokens + prompt_len + max_chars / self.chars_per_token + 8
        est = min(est, self.max_seq)
        n = int(max(1, min(self.max_batch, PAGES_PER_STEP_MAX, self.batch_tokens // est)))
        return size, max_chars, n


def make_batch(spec: DataSpec, step: int, builder: PromptBuilder, glyphs: bool = False) -> dict:
    """Batch number `step` of the run's global count (the step's number for one rank without --reuse or
    --accum): uint8 images, right-padded ids / labels / M-RoPE positions; with `glyphs`, also the targets
    of AnswerLoss.glyph_loss and .align_loss from where the pages' characters are drawn."""
    size, max_chars, n = spec.step_plan(step, len(builder.prompt_ids))
    cfg = spec.page_config(size=size, max_chars=max_chars)
    images, answers, chars, cells, reading = [], [], 0, [], []
    for j in range(n):
        seed, page_cfg = page_source(spec, cfg, train_page_index(step, j))
        img, md, meta = synthdoc.generate_page(seed, page_cfg, glyphs=glyphs)
        images.append(np.asarray(img, dtype=np.uint8))
        answers.append(md)
        chars += len(md)
        if glyphs:
            h, w = images[-1].shape[:2]
            drawn = [(image_cell(x, y, h, w), ch) for x, y, ch in meta["glyphs"]]
            cells.append(drawn)
            reading.append(token_cells(builder, md, drawn))
    batch = {"step": step, **pack_batch(builder, images, answers, spec.max_seq), "chars": chars}
    if glyphs:
        h, w = images[0].shape[:2]
        batch["glyphs"] = glyph_targets(builder, cells, (h, w))
        batch["reading"] = reading_targets(reading, batch["prompt_len"], batch["labels"].shape[1])
    return batch


# Table pages (--table-share) come from their own seed ranges: base seeds TABLE_SEEDS + data_seed *
# TABLE_TRIES + k (the k-th try of a page index), disjoint from the usual train pages of any data seed
# below 2**29 / TABLE_TRIES and, like every train seed, from the held-out split.
TABLE_SEEDS, TABLE_TRIES = 1 << 29, 32


def page_source(spec: DataSpec, cfg, index: int) -> tuple[int, object]:
    """(generate_page seed, page config) of training page `index`. For a `table_share` of the indices
    (drawn from the index, so a batch is the same whatever the worker) the page is instead the first of
    TABLE_TRIES report-layout pages that holds a table (checked without rendering); if none does, the
    last of them."""
    seed = synthdoc.page_seed("train", index, spec.seed)
    if spec.table_share <= 0 or random.Random(f"table:{spec.seed}:{index}").random() >= spec.table_share:
        return seed, cfg
    report = synthdoc.with_overrides(cfg, layout="report")
    layout_only = synthdoc.with_overrides(report, render=False)
    for k in range(TABLE_TRIES):
        seed = synthdoc.page_seed("train", index, TABLE_SEEDS + spec.seed * TABLE_TRIES + k)
        if synthdoc.generate_page(seed, layout_only)[2]["tables"]:
            break
    return seed, report


def image_cell(x: float, y: float, h: int, w: int) -> int:
    """The merged image token (its 32 x 32 px cell, in the raster order the merger emits them) that holds
    pixel (x, y) of an h x w image; -1 outside the image."""
    cell = MERGE * PATCH
    return int(y) // cell * (w // cell) + int(x) // cell if 0 <= x < w and 0 <= y < h else -1


_MARKUP = re.compile(r"<[^>]*>|&(?:amp|lt|gt|quot|#\d+|#x[0-9a-fA-F]+);")


def md_glyph_index(md: str, drawn: list[str]) -> list[int]:
    """For each character of a page's Markdown, the index of the drawn glyph it is (-1: markup or not drawn),
    matching the drawn characters in reading order against the Markdown's (they are a subsequence of it,
    tests/test_synthdoc.py) and skipping HTML tags; an entity (&amp;) stands for its character at its '&'."""
    plain: list[tuple[int, str]] = []  # (index in md, character) of what could be drawn
    i = 0
    for m in _MARKUP.finditer(md):
        plain += [(k, md[k]) for k in range(i, m.start())]
        if m.group(0).startswith("&"):
            plain.append((m.start(), html.unescape(m.group(0))))
        i = m.end()
    plain += [(k, md[k]) for k in range(i, len(md))]
    out = [-1] * len(md)
    g = 0
    for k, ch in plain:
        if g < len(drawn) and ch == drawn[g]:
            out[k] = g
            g += 1
    return out


def token_cells(builder: PromptBuilder, md: str, drawn: list[tuple[int, str]]) -> list[list[int]]:
    """For each answer token of a page (builder.answer's, <|im_end|> last), the merged-token cells that show
    its characters (empty for markup, spaces and <|im_end|>)."""
    glyph_of = md_glyph_index(md, [ch for _, ch in drawn])
    enc = builder.tok.encode(md, add_special_tokens=False)
    out = []
    for a, b in enc.offsets:
        out.append(sorted({drawn[g][0] for g in glyph_of[a:b] if g >= 0 and drawn[g][0] >= 0}))
    return out + [[]]


def reading_targets(pages: list[list[list[int]]], prompt_len: int, seq_len: int) -> tuple[torch.Tensor, ...]:
    """AnswerLoss.align_loss's targets: (page, query position, cell), one row per cell of an answer token, the
    query being the position that predicts that token (prompt_len + k - 1 for answer token k)."""
    rows = [(j, prompt_len + k - 1, c) for j, toks in enumerate(pages) for k, tok_cells in enumerate(toks)
            for c in tok_cells if prompt_len + k < seq_len]
    page, query, cell = zip(*rows) if rows else ((), (), ())
    return tuple(torch.tensor(v, dtype=torch.long) for v in (page, query, cell))


def glyph_targets(builder: PromptBuilder, cells: list[list[tuple[int, str]]],
                  image_hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AnswerLoss.glyph_loss's targets from each image's glyphs as (merged-token cell, character; cell -1: off
    the image, left out), the images all image_hw pixels: (cell over the batch, token id, weight), a
    character's token ids (one, or a few bytes' for rare characters) and the characters of one cell sharing
    the cell's weight of 1."""
    cells_per_image = (image_hw[0] // (MERGE * PATCH)) * (image_hw[1] // (MERGE * PATCH))
    per_cell: dict[int, list[int]] = {}
    for j, image_cells in enumerate(cells):
        for cell, ch in image_cells:
            if cell >= 0:
                per_cell.setdefault(j * cells_per_image + cell, []).extend(builder.char_ids(ch))
    flat = [(cell, t, 1.0 / len(toks)) for cell, toks in per_cell.items() for t in toks]
    cell_t, id_t, w_t = zip(*flat) if flat else ((), (), ())
    return (torch.tensor(cell_t, dtype=torch.long), torch.tensor(id_t, dtype=torch.long),
            torch.tensor(w_t, dtype=torch.float32))


def pack_batch(builder: PromptBuilder, images: list[np.ndarray], answers: list[str], max_seq: int) -> dict:
    """Images of one size (uint8 [H, W, 3], sides multiples of 32) and their answers (text) -> the training
    tensors: images [B, H, W, 3], right-padded ids / labels (-100 but on the answer tokens) / M-RoPE
    positions [3, B, L] (L a multiple of 64), and prompt_len (the answers start there)."""
    h, w = images[0].shape[:2]
    gh, gw = h // PATCH, w // PATCH
    prompt = builder.prompt(gh, gw)
    pad_id = builder.ids["<|endoftext|>"]
    img_id = builder.ids["<|image_pad|>"]
    seqs, labs, n_ans = [], [], 0
    for text in answers:
        ans = builder.answer(text)[: max(1, max_seq - len(prompt))]
        seqs.append(prompt + ans)
        labs.append([-100] * len(prompt) + ans)
        n_ans += len(ans)
    n = len(seqs)
    L = max(len(s) for s in seqs)
    L = int(math.ceil(L / 64) * 64)
    ids = np.full((n, L), pad_id, dtype=np.int64)
    labels = np.full((n, L), -100, dtype=np.int64)
    pos = np.zeros((3, n, L), dtype=np.int64)
    base = common.mrope_positions(prompt, img_id, gh, gw)
    for i, (s, lab) in enumerate(zip(seqs, labs)):
        ids[i, : len(s)] = s
        labels[i, : len(lab)] = lab
        pos[:, i, : len(prompt)] = base
        nxt = base[0, -1] + 1
        pos[:, i, len(prompt):] = nxt + np.arange(L - len(prompt))
    return {"images": torch.from_numpy(np.stack(images)), "input_ids": torch.from_numpy(ids),
            "labels": torch.from_numpy(labels), "position_ids": torch.from_numpy(pos),
            "tokens": sum(len(s) for s in seqs), "answer_tokens": n_ans, "pages": n, "prompt_len": len(prompt)}


class StepBatches(torch.utils.data.IterableDataset):
    """Batches number start, start + stride, start + 2 * stride, ...: worker w makes the (w + k * workers)-th,
    and the DataLoader hands them out round-robin, so they arrive in that order."""

    def __init__(self, spec: DataSpec, start: int, stride: int, tok_dir: str, glyphs: bool = False) -> None:
        self.spec, self.start, self.stride, self.tok_dir, self.glyphs = spec, start, stride, tok_dir, glyphs

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        builder = PromptBuilder(Path(self.tok_dir))
        k = wid
        while True:
            yield make_batch(self.spec, self.start + k * self.stride, builder, self.glyphs)
            k += nw


def ignore_sigterm(worker_id: int) -> None:  # noqa: ARG001 - DataLoader's worker_init_fn
    """torchrun's shutdown (and a timeout) sends SIGTERM to the whole process group: the workers leave it to
    the training process, which stops at an agreed step, checkpoints, then shuts them down."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def pixels_on_device(images: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [B, H, W, 3] -> (pixel_values [B*gh*gw, 3*2*16*16] float32, image_grid_thw [B, 3]) exactly
    as ocria_rt.preprocess / transformers' processor order them (mean = std = 0.5, no resize)."""
    x = images.to(device, non_blocking=True).permute(0, 3, 1, 2).float()
    x = x * (2.0 / 255.0) - 1.0
    b, c, h, w = x.shape
    gh, gw = h // PATCH, w // PATCH
    x = x.reshape(b, c, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)  # b, block_row, block_col, in_row, in_col, C, patch_row, patch_col
    x = x.unsqueeze(6).expand(*x.shape[:6], 2, PATCH, PATCH)
    pv = x.reshape(b * gh * gw, c * 2 * PATCH * PATCH)
    grid = torch.tensor([[1, gh, gw]] * b, dtype=torch.long, device=device)
    return pv, grid


# --------------------------------------------------------------------------- #
# Schedule, model, optimizer
# --------------------------------------------------------------------------- #
@dataclass
class Schedule:
    lr: float = 1.5e-3
    warmup: int = 500
    total_steps: int = 30000
    min_lr_ratio: float = 0.05
    rewarm: int = 0  # after a resume from approximate moments: ramp over this many steps
    rewarm_from: int = 0

    def at(self, step: int) -> float:
        if step < self.warmup:
            f = (step + 1) / self.warmup
        else:
            t = min(1.0, (step - self.warmup) / max(1, self.total_steps - self.warmup))
            f = self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))
        if self.rewarm and self.rewarm_from <= step < self.rewarm_from + self.rewarm:
            f *= (step - self.rewarm_from + 1) / self.rewarm
        return self.lr * f


def build_model(config, attn: str):
    from transformers import Qwen3_5ForConditionalGeneration

    config._attn_implementation = attn
    config.text_config.use_cache = False
    model = Qwen3_5ForConditionalGeneration(config)
    return model


class AnswerLoss(torch.nn.Module):
    """The training forward: cross-entropy on the answer tokens, the LM head applied at those positions only
    (never at image or prompt positions). One module, so that DistributedDataParallel wraps the whole of it.

    image_aux > 0 adds that multiple of image_bag_loss: a direct signal for the vision tower, which otherwise
    learns only through a decoder that cannot use it yet (probe_reading.py: without it the image features
    collapse to one vector within ~50 steps and the answer never depends on the image). glyph_aux and
    align_aux add glyph_loss (what each image cell shows) and align_loss (where to read each answer token),
    given the targets that make_batch(..., glyphs=True) derives from where the characters were drawn."""

    def __init__(self, model, autocast: bool, image_aux: float = 0.0, end_id: int = -100,
                 image_center: float = 0.0, glyph_aux: float = 0.0, align_aux: float = 0.0) -> None:
        super().__init__()
        self.model, self.autocast, self.image_aux, self.end_id = model, autocast, image_aux, end_id
        self.image_center, self.glyph_aux, self.align_aux = image_center, glyph_aux, align_aux

    def forward(self, ids, labels, pos, pv, grid, glyphs=None, reading=None):
        feats: list[torch.Tensor] = []
        attn_inputs: list[tuple] = []  # (attention module, its hidden_states, position_embeddings)
        hooks = []
        if self.image_aux or self.image_center or (self.glyph_aux and glyphs is not None):
            hooks.append(self.model.model.visual.merger.register_forward_hook(lambda m, i, out: feats.append(out)))
        if self.align_aux and reading is not None:
            for layer in self.model.model.language_model.layers:
                if hasattr(layer, "self_attn"):  # the full-attention layers
                    hooks.append(layer.self_attn.register_forward_pre_hook(
                        lambda m, a, kw: attn_inputs.append((m, kw["hidden_states"], kw["position_embeddings"])),
                        with_kwargs=True))
        try:
            with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                hidden = self.model.model(input_ids=ids, pixel_values=pv, image_grid_thw=grid, position_ids=pos,
                                          use_cache=False).last_hidden_state
                tgt = labels[:, 1:]
                sel = tgt != -100
                logits = self.model.lm_head(hidden[:, :-1][sel])
        finally:
            for hook in hooks:
                hook.remove()
        loss = F.cross_entropy(logits.float(), tgt[sel])
        if not hooks:
            return loss
        self.terms = {"answer": loss.detach()}  # the last call's parts, unweighted (logged by rank 0)
        if attn_inputs:
            image_start = int((ids[0] == self.model.config.image_token_id).nonzero()[0, 0])
            self.terms["align_aux"] = torch.stack([self.align_loss(*a, reading, image_start) for a in attn_inputs]).mean()
            loss = loss + self.align_aux * self.terms["align_aux"]
        if not feats:
            return loss
        logp = self.image_token_logp(feats[0]) if self.image_aux or (self.glyph_aux and glyphs is not None) else None
        if self.image_aux:
            self.terms["image_aux"] = self.image_bag_loss(logp, labels, grid)
            loss = loss + self.image_aux * self.terms["image_aux"]
        if self.glyph_aux and glyphs is not None:
            self.terms["glyph_aux"] = self.glyph_loss(logp, glyphs)
            loss = loss + self.glyph_aux * self.terms["glyph_aux"]
        if self.image_center:
            f = feats[0].float()
            self.terms["image_center"] = f.mean(0).square().sum() / f.square().sum(1).mean()
            loss = loss + self.image_center * self.terms["image_center"]
        return loss

    def align_loss(self, attn, hidden, position_embeddings, reading, image_start: int):
        """Guided attention for reading (cf. attention-drift correction in scene-text recognition): head 0 of
        a full-attention layer, at the position that predicts an answer token, should put its attention on
        the image cells that show that token's characters: -log sum_(target cells) softmax(q . k / sqrt(d)),
        averaged over the supervised positions. q and k are recomputed for head 0 exactly as the layer
        computes them (q_proj's first head without its gate half, q/k RMSNorm, M-RoPE); causal.
        reading = (page, query position, cell), three 1-D tensors (train.reading_targets)."""
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

        page, query, cell = reading
        if page.numel() == 0:
            return hidden.sum() * 0.0
        hd = attn.head_dim
        with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            q = attn.q_norm(F.linear(hidden, attn.q_proj.weight[:hd],
                                     None if attn.q_proj.bias is None else attn.q_proj.bias[:hd]))
            k = attn.k_norm(F.linear(hidden, attn.k_proj.weight[:hd],
                                     None if attn.k_proj.bias is None else attn.k_proj.bias[:hd]))
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q.float()[:, None], k.float()[:, None], cos.float(), sin.float())
        scores = (q[:, 0] @ k[:, 0].transpose(1, 2)) * attn.scaling  # [B, L, L]
        # one row per supervised (page, query); its target cells as a mask over the keys
        key = torch.stack([page, query], 1)
        rows, row_of = torch.unique(key, dim=0, return_inverse=True)
        s_rows = scores[rows[:, 0], rows[:, 1]]  # [R, L]
        keys = torch.arange(s_rows.shape[1], device=s_rows.device)
        s_rows = s_rows.masked_fill(keys[None, :] > rows[:, 1:2], float("-inf"))
        target = torch.zeros_like(s_rows, dtype=torch.bool)
        target[row_of, image_start + cell] = True
        return (torch.logsumexp(s_rows, 1) - torch.logsumexp(s_rows.masked_fill(~target, float("-inf")), 1)).mean()

    def image_token_logp(self, feats):
        """Log-probabilities of the merged image tokens read through the tied LM head as if they were token
        embeddings (RMS-normalised): [image tokens of the batch, V]."""
        with torch.autocast(feats.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model.lm_head(F.rms_norm(feats, (feats.shape[-1],)))
        return logits.float().log_softmax(-1)

    @staticmethod
    def glyph_loss(logp, glyphs):
        """Dense supervision of the vision tower from the renderer's layout: every merged image token whose
        32 x 32 px cell holds glyph centres must predict those characters' token ids (a soft target, the
        weights of one cell summing to 1): -sum_(cell, id) w log p_cell(id) / (cells with glyphs).
        glyphs = (cell index over the batch's image tokens, token id, weight), three 1-D tensors."""
        cells, ids, weights = glyphs
        if cells.numel() == 0:
            return logp.sum() * 0.0
        return -(weights * logp[cells, ids]).sum() / weights.sum()

    def image_bag_loss(self, logp, labels, grid):
        """Each image's merged tokens (image_token_logp) must together predict the bag of its answer's tokens
        (<|im_end|> left out): -sum_v q(v) log( mean_t p_t(v) ), q the answer's token frequencies."""
        keep = (labels != -100) & (labels != self.end_id)
        q = torch.zeros(labels.shape[0], logp.shape[-1], device=logp.device)
        q.scatter_add_(1, labels.clamp_min(0), keep.float())
        q = q / q.sum(1, keepdim=True).clamp_min(1.0)
        n = (grid.prod(-1) // (MERGE * MERGE)).tolist()
        mix = torch.stack([torch.logsumexp(lp, 0) - math.log(lp.shape[0]) for lp in logp.split(n)])  # [B, V]
        has_text = keep.any(1)  # the mean over the pages whose answer has tokens (a blank page has no bag)
        return -(q * mix).sum(1)[has_text].sum() / has_text.sum().clamp_min(1)


def make_optimizer(model: torch.nn.Module, sched: Schedule, weight_decay: float, device: torch.device):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if (p.ndim >= 2 and "embed" not in name and "pos_embed" not in name) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=sched.at(0), betas=(0.9, 0.95), eps=1e-8, **kw)


def rng_state() -> dict:
    import base64

    def enc(t: torch.Tensor) -> str:
        return base64.b64encode(t.cpu().numpy().tobytes()).decode()

    version, internal, gauss = random.getstate()
    st = {"torch": enc(torch.get_rng_state()), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available():
        st["cuda"] = [enc(s) for s in torch.cuda.get_rng_state_all()]
    return st


def set_rng_state(st: dict) -> None:
    import base64

    def dec(s: str) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy())

    torch.set_rng_state(dec(st["torch"]))
    version, internal, gauss = st["python"]
    random.setstate((version, tuple(internal), gauss))
    if torch.cuda.is_available() and "cuda" in st and len(st["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([dec(s) for s in st["cuda"]])


def gdn_self_check(model, device: torch.device, autocast: bool, tol: float = 0.05) -> dict:
    """Where transformers picked flash-linear-attention's kernels, checks one Gated DeltaNet layer
    (forward and input gradient, BF16 autocast) against transformers' torch reference; on an error or
    a relative difference above `tol`, switches the model to the reference (slower, correct)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    chunk, recur = mq.torch_chunk_gated_delta_rule, mq.torch_recurrent_gated_delta_rule
    ref_chunk, ref_recur = getattr(chunk, "__wrapped__", None), getattr(recur, "__wrapped__", None)
    impl = gdn_implementation(chunk)
    if ref_chunk is None or not impl.startswith("fla"):
        return {"gdn_kernels": f"torch reference ({impl}; {fla_status()})"}
    layer = next(lay.linear_attn for lay in model.model.language_model.layers if hasattr(lay, "linear_attn"))
    g = torch.Generator(device="cpu").manual_seed(1)
    x0 = torch.randn(2, 300, layer.hidden_size, generator=g).to(device)

    def run():
        x = x0.clone().requires_grad_(True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
        y.float().square().mean().backward()
        model.zero_grad(set_to_none=True)
        return y.detach().float(), x.grad.detach().float()

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    try:
        y_k, g_k = run()
        mq.torch_chunk_gated_delta_rule = ref_chunk
        y_r, g_r = run()
        errs = {"out": rel(y_k, y_r), "grad": rel(g_k, g_r)}
    except Exception as e:  # noqa: BLE001 - any kernel failure means: use the reference
        mq.torch_chunk_gated_delta_rule, mq.torch_recurrent_gated_delta_rule = ref_chunk, ref_recur or recur
        return {"gdn_kernels": "torch reference (flash-linear-attention failed)", "error": f"{type(e).__name__}: {e}"[:300]}
    if max(errs.values()) > tol:
        mq.torch_recurrent_gated_delta_rule = ref_recur or recur
        return {"gdn_kernels": "torch reference (flash-linear-attention disagreed)", "rel_err": errs}
    mq.torch_chunk_gated_delta_rule = chunk
    return {"gdn_kernels": f"{impl} ({fla_status()})", "rel_err_vs_torch": errs}


def use_reference_chunk_size(size: int) -> None:
    """Makes transformers' torch Gated DeltaNet reference work in chunks of `size` tokens (its default
    is 64). The chunked form is exact for any chunk size; longer chunks mean fewer iterations of its
    Python loop over chunks (each a handful of small kernels, forward and backward), which is what made
    training steps CPU-bound on the H200. Checked equal to the default in smoke.py."""
    import functools

    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    ref = mq.torch_chunk_gated_delta_rule
    ref = getattr(ref, "func", ref)  # an earlier partial
    ref = getattr(ref, "__wrapped__", ref)  # the hub-kernel wrapper
    mq.torch_chunk_gated_delta_rule = functools.partial(ref, chunk_size=size)


def batch_equal_images_in_vision_attention() -> None:
    """transformers' vision attention (SDPA / eager) runs one attention call per image, in a Python
    loop: with 64 pages a step that is hundreds of small kernels and the step becomes CPU-bound.
    Training batches hold pages of one size, so the images' patch sequences have equal lengths and
    can go through one batched call: [1, heads, B*L, hd] -> [B, heads, L, hd]. Calls with unequal
    lengths keep transformers' loop. Checked equal to it in smoke.py."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    cls = mq.Qwen3_5VisionAttention
    if getattr(cls, "_batched_equal_images", False):
        return
    original = cls.forward

    def forward(self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        if mq.is_flash_attention_requested(self.config) or lengths.numel() < 2 or bool((lengths != lengths[0]).any()):
            return original(self, hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)
        n, L = hidden_states.shape[0], int(lengths[0])
        q, k, v = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = position_embeddings
        q, k = mq.apply_rotary_pos_emb_vision(q, k, cos, sin)
        q, k, v = (t.reshape(n // L, L, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))  # [B, heads, L, hd]
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scaling)
        return self.proj(out.transpose(1, 2).reshape(n, -1))

    cls.forward = forward
    cls._batched_equal_images = True
    cls._per_image_forward = original


def gdn_implementation(fn) -> str:
    """The module of the function transformers' kernel wrapper calls (fla.* or transformers' own)."""
    import inspect

    fn = getattr(fn, "func", fn)  # use_reference_chunk_size's partial
    try:
        impl = inspect.getclosurevars(fn).nonlocals.get("implementation", fn)
    except (TypeError, ValueError):
        impl = fn
    return f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', '?')}"


def fla_status() -> str:
    try:
        import fla  # noqa: F401

        return f"flash-linear-attention {getattr(fla, '__version__', '?')}"
    except Exception as e:  # noqa: BLE001
        return f"torch reference ({type(e).__name__})"


# --------------------------------------------------------------------------- #
# Evaluation: greedy decoding of held-out pages
# --------------------------------------------------------------------------- #
@torch.no_grad()
def greedy_markdown(model, builder: PromptBuilder, images: list, device, max_new_tokens: int,
                    autocast: bool, return_ids: bool = False, return_logits: bool = False) -> list:
    """Greedy answers for page images (PIL) in one left-padded batch, through transformers' generate."""
    from transformers import GenerationConfig

    pad = builder.ids["<|endoftext|>"]
    img_id = builder.ids["<|image_pad|>"]
    prompts, pvs, grids = [], [], []
    for im in images:
        arr = torch.from_numpy(np.array(im.convert("RGB"), dtype=np.uint8))[None]
        pv, grid = pixels_on_device(arr, device)
        pvs.append(pv)
        grids.append(grid)
        prompts.append(builder.prompt(int(grid[0, 1]), int(grid[0, 2])))
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    gc = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, num_beams=1,
                          eos_token_id=[builder.ids["<|im_end|>"], builder.ids["<|endoftext|>"]], pad_token_id=pad,
                          bos_token_id=None, use_cache=True)
    was_training = model.training
    model.eval()
    model.model.rope_deltas = None
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        out = model.generate(input_ids=ids, attention_mask=mask, pixel_values=torch.cat(pvs),
                             image_grid_thw=torch.cat(grids), mm_token_type_ids=(ids == img_id).int(),
                             generation_config=gc, return_dict_in_generate=True, output_logits=return_logits)
    model.model.rope_deltas = None
    model.train(was_training)
    if return_logits:  # [steps, B, V] float32
        return torch.stack([lg.float() for lg in out.logits]).cpu()
    rows = out.sequences[:, L:].tolist()
    if return_ids:
        return rows
    return [builder.tok.decode(row, skip_special_tokens=True).strip() for row in rows]


def evaluate(model, builder, pages, device, autocast: bool, batch: int, max_new: int) -> dict:
    t0 = time.perf_counter()
    scores, samples = [], []
    for i in range(0, len(pages), batch):
        chunk = pages[i:i + batch]
        need = max(len(builder.answer(md)) for _, md, _ in chunk)
        preds = greedy_markdown(model, builder, [im for im, _, _ in chunk], device,
                                min(max_new, int(need * 1.25) + 16), autocast)
        for (im, md, meta), pred in zip(chunk, preds):
            scores.append(synthdoc.score_page(pred, md))
            if len(samples) < 2:
                samples.append({"seed": meta["seed"], "pred": pred[:400], "ref": md[:400]})
    out = synthdoc.summarize(scores)
    out.update(seconds=round(time.perf_counter() - t0, 2), samples=samples)
    return out


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #
@dataclass
class RunState:
    step: int = 0
    batches: int = 0  # fresh batches consumed by all ranks (= step * ranks * accum unless --reuse > 1)
    pages: int = 0
    tokens: int = 0
    answer_tokens: int = 0
    train_seconds: float = 0.0
    skipped_steps: int = 0  # steps whose gradient was not finite (the optimizer skipped them)
    runs: list = field(default_factory=list)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="run directory: log.jsonl and ckpt/")
    ap.add_argument("--resume", type=Path, default=None, help="checkpoint directory (default: OUT/ckpt if present)")
    ap.add_argument("--fresh", action="store_true", help="ignore OUT/ckpt and start from scratch")
    ap.add_argument("--smoke", action="store_true", help="tiny model, tiny pages, CPU-sized: proves the machinery")
    ap.add_argument("--preset", default="small", choices=sorted(common.PRESETS))
    ap.add_argument("--tokenizer", type=Path, default=common.DEFAULT_TOKENIZER_DIR)
    ap.add_argument("--minutes", type=float, default=0.0, help="wall-clock budget of this run (0: none)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop at this global step (0: none)")
    ap.add_argument("--lr", type=float, default=None, help="peak LR (default 1.5e-3; a resumed run keeps its own)")
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--total-steps", type=int, default=None,
                    help="the cosine schedule's length over all runs (default 30000; a resumed run keeps its own)")
    ap.add_argument("--min-lr-ratio", type=float, default=None, help="final LR / peak (default 0.05)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--max-bad-steps", type=int, default=10,
                    help="stop with an error (no checkpoint) after this many non-finite gradients in a row")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="padded tokens per fresh batch (default 65536; a resumed run keeps its own unless given)")
    ap.add_argument("--max-batch", type=int, default=None,
                    help=f"at most this many pages per batch (default 64, at most {PAGES_PER_STEP_MAX}); with "
                    "--batch-tokens the way to fill a GPU whose steps are bound by fixed per-step costs")
    ap.add_argument("--max-seq", type=int, default=4096)
    # the page distribution: defaults for a fresh run; given to a resumed run, they replace its own
    ap.add_argument("--chars", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                    help="Markdown characters per page (default 400 4000)")
    ap.add_argument("--long-side", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                    help="page long side in pixels (default 768 1024)")
    ap.add_argument("--body-px", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                    help="body font size at a long side of 1024 (default 13 19)")
    ap.add_argument("--curriculum-steps", type=int, default=None,
                    help="ramp the character budget's upper end over these batches (default 2000)")
    ap.add_argument("--locales", nargs="+", default=None, help="faker locales of the page text (default: all)")
    ap.add_argument("--noise", type=float, default=None, help="scan-noise strength (default 1; 0: clean renders)")
    ap.add_argument("--table-share", type=float, default=None,
                    help="share of training pages that hold a table (report layout; default 0: synthdoc's mix; "
                         "the held-out pages keep the mix)")
    ap.add_argument("--image-aux", type=float, default=0.0,
                    help="weight of AnswerLoss.image_bag_loss (each image's tokens predict its answer's token bag "
                         "through the LM head); probe_reading.py needs it to learn to read at all")
    ap.add_argument("--image-center", type=float, default=0.0,
                    help="weight of the penalty on the common component of the image features (|mean f|^2 / mean |f|^2): "
                         "without it they collapse to one vector within the first ~50 steps")
    ap.add_argument("--glyph-aux", type=float, default=0.0,
                    help="weight of AnswerLoss.glyph_loss (each merged image token predicts the characters drawn in its "
                         "32 x 32 px cell, from the generator's layout; 0: off)")
    ap.add_argument("--align-aux", type=float, default=0.0,
                    help="weight of AnswerLoss.align_loss (head 0 of each attention layer, predicting an answer token, "
                         "attends to the image cells that show it; 0: off)")
    ap.add_argument("--reuse", type=int, default=1,
                    help="steps per fresh batch: the others replay one of the last --replay-batches (when data-bound)")
    ap.add_argument("--replay-batches", type=int, default=8)
    ap.add_argument("--accum", type=int, default=1,
                    help="fresh batches per rank per step, their gradients averaged (a step's global batch: ranks * accum)")
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0, help="model initialisation")
    ap.add_argument("--workers", type=int, default=-1, help="DataLoader workers per rank (-1: CPUs / ranks - 1)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every-minutes", type=float, default=4.0)
    ap.add_argument("--eval-pages", type=int, default=8)
    ap.add_argument("--eval-batch", type=int, default=8)
    ap.add_argument("--eval-max-new", type=int, default=2048)
    ap.add_argument("--eval-seed", type=int, default=0)
    ap.add_argument("--ckpt-every-minutes", type=float, default=4.0)
    ap.add_argument("--ckpt-format", default="compact", choices=["compact", "full"])
    ap.add_argument("--rewarm", type=int, default=50, help="LR re-warm-up steps after resuming a compact checkpoint")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--gdn", default="auto", choices=["auto", "torch"],
                    help="auto: flash-linear-attention when importable and it agrees with the torch reference")
    ap.add_argument("--gdn-chunk", type=int, default=64,
                    help="chunk length of transformers' torch Gated DeltaNet reference, when it is used (128 overflows: "
                         "the inverse of the chunk's unit-triangular system grows like 2^chunk)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="profile this many steps (after 10 warm-up steps of the run) and print the top ops by GPU time")
    args = ap.parse_args(argv)
    if args.max_batch is not None and not 1 <= args.max_batch <= PAGES_PER_STEP_MAX:
        ap.error(f"--max-batch must be in 1..{PAGES_PER_STEP_MAX}, got {args.max_batch}")
    if args.table_share is not None and not 0.0 <= args.table_share <= 1.0:
        ap.error(f"--table-share must be in 0..1, got {args.table_share}")
    if args.table_share and args.data_seed >= TABLE_SEEDS // TABLE_TRIES:
        ap.error(f"--table-share needs --data-seed below {TABLE_SEEDS // TABLE_TRIES}, got {args.data_seed}")
    if args.smoke:
        args.preset = "smoke"
        args.batch_tokens = min(args.batch_tokens or 1536, 1536)
        args.max_seq = min(args.max_seq, 640)
        args.chars = (60, 200)
        args.long_side = (256, 320)
        args.warmup = min(args.warmup, 4)
        args.total_steps = args.total_steps or 50
        args.curriculum_steps = 0
        args.eval_pages = min(args.eval_pages, 2)
        args.eval_batch = min(args.eval_batch, 2)
        args.eval_max_new = min(args.eval_max_new, 24)
        args.log_every = 1
        if args.workers < 0:
            args.workers = 2
    return args


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """Sums over the ranks (the values themselves in a single process)."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv=None) -> dict:
    """Trains (see the module docstring): returns the model, the run's end event and its state."""
    try:
        return run(parse_args(argv))
    finally:
        # The data workers ignore SIGTERM (ignore_sigterm). After an error (one of theirs included) the
        # DataLoader is not shut down, and at exit multiprocessing would terminate and then join them
        # forever: a hang instead of the error. Kill whatever is left (after a clean end: nothing), with
        # torch's SIGCHLD handler (which would report each kill as one more error) out of the way.
        children = multiprocessing.active_children()
        if children:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for child in children:
            child.kill()


def run(args: argparse.Namespace) -> dict:
    t_start = time.perf_counter()
    deadline = t_start + args.minutes * 60 if args.minutes > 0 else math.inf
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    lead = rank == 0  # logs, evaluates and checkpoints
    if world > 1:  # launched by torchrun: one process per GPU
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        # generous: the other ranks wait in a barrier while rank 0 evaluates (about a minute) or checkpoints
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=30),
                                device_id=device if device.type == "cuda" else None)
    autocast = device.type == "cuda"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "log.jsonl"
    ckpt_dir = out / "ckpt"

    resume = args.resume
    if resume is None and not args.fresh and (ckpt_dir / "state.json").exists():
        resume = ckpt_dir

    import transformers

    transformers.logging.set_verbosity_error()
    from transformers import Qwen3_5Config

    # ---- what to train: from the checkpoint, or fresh ----
    if resume is not None:
        saved, tensors = ckpt.load(resume)
        import tempfile

        tok_dir = Path(tempfile.mkdtemp(prefix="ocr-tokenizer-"))  # not under OUT: what comes back is counted
        for name, text in saved["tokenizer_files"].items():
            (tok_dir / name).write_text(text)
        config = Qwen3_5Config.from_dict(saved["model_config"])
        spec = DataSpec(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in saved["data"].items()})
        sched = Schedule(**saved["schedule"])
        # a run may change the plan's length, peak LR or final LR ratio
        for k in ("total_steps", "lr", "min_lr_ratio"):
            if getattr(args, k) is not None:
                setattr(sched, k, getattr(args, k))
        if args.batch_tokens is not None:
            spec.batch_tokens = args.batch_tokens
        if args.max_batch is not None:
            spec.max_batch = args.max_batch
        rs = RunState(**{"batches": saved["run"]["step"], **saved["run"]})
        preset = saved.get("preset", "?")
        if lead and log_path.resolve() != (Path(resume) / "log.jsonl").resolve() and (Path(resume) / "log.jsonl").exists():
            if not log_path.exists() or log_path.stat().st_size == 0:
                log_path.write_bytes((Path(resume) / "log.jsonl").read_bytes())
    else:
        tok_dir = args.tokenizer
        tok = common.load_tokenizer(tok_dir)
        config = common.model_config(args.preset, tok.get_vocab_size(), common.token_ids(tok), max_positions=args.max_seq * 2)
        spec = DataSpec(seed=args.data_seed, batch_tokens=args.batch_tokens or 65536, max_seq=args.max_seq,
                        max_batch=args.max_batch or 64, curriculum_steps=2000)
        sched = Schedule(lr=args.lr or 1.5e-3, warmup=args.warmup, total_steps=args.total_steps or 30000,
                         min_lr_ratio=0.05 if args.min_lr_ratio is None else args.min_lr_ratio)
        rs = RunState()
        preset = args.preset
        saved, tensors = None, None
        if lead and args.fresh and log_path.exists():
            log_path.unlink()
    for field in ("chars", "long_side", "body_px", "curriculum_steps", "locales", "noise", "table_share"):
        value = getattr(args, field)
        if value is not None:
            setattr(spec, field, tuple(value) if isinstance(value, (list, tuple)) else value)

    # what this machine draws the pages' text and fonts from (export.py puts it into training.json, where
    # `ocria-rt eval` checks it); raises here, before any step, where faker is missing
    page_sources = synthdoc.page_sources(spec.page_config())
    sources_before = saved.get("page_sources") if saved is not None else None
    if sources_before is not None and sources_before != page_sources:
        print(f"warning: the checkpoint was trained on pages drawn from {json.dumps(sources_before)}; this "
              f"machine draws them from {json.dumps(page_sources)} (other text or fonts for the same seeds)",
              flush=True)

    builder = PromptBuilder(tok_dir)
    torch.manual_seed(args.seed)
    model = build_model(config, args.attn)
    if tensors is not None:
        missing, unexpected = model.load_state_dict(ckpt.model_weights(tensors), strict=False)
        assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
        if config.tie_word_embeddings:
            model.tie_weights()
    model.to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model, sched, args.weight_decay, device)
    if saved is not None:
        restored = ckpt.restore_optimizer(model, opt, tensors, rs.step, saved["format"])
        if saved["format"] == "compact" and args.rewarm > 0:
            sched.rewarm, sched.rewarm_from = args.rewarm, rs.step
        set_rng_state(saved["rng"])
    else:
        restored = 0

    def log(rec: dict) -> None:
        if not lead:
            return
        rec = {"time": round(time.time(), 1), **rec}
        with open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    batch_equal_images_in_vision_attention()
    gdn = gdn_self_check(model, device, autocast) if args.gdn == "auto" else {"gdn_kernels": "torch reference (forced)"}
    if args.gdn == "torch":
        from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            fn = getattr(mq, name)
            setattr(mq, name, getattr(fn, "__wrapped__", fn))
    if gdn["gdn_kernels"].startswith("torch reference"):
        use_reference_chunk_size(args.gdn_chunk)
        gdn["gdn_chunk"] = args.gdn_chunk
    run_info = {"event": "start", "step": rs.step, "preset": preset, "params": n_params, "device": str(device),
                "ranks": world, "accum": args.accum, "image_aux": args.image_aux, "image_center": args.image_center,
                **gdn, "resumed_from": str(resume) if resume else None,
                "optimizer_tensors_restored": restored, "torch": torch.__version__,
                "transformers": transformers.__version__, "schedule": asdict(sched), "data": asdict(spec),
                "page_sources": page_sources, "minutes": args.minutes}
    if sources_before is not None and sources_before != page_sources:
        run_info["page_sources_before"] = sources_before
    if device.type == "cuda":
        run_info["gpu"] = torch.cuda.get_device_name()
    log(run_info)
    if lead:
        print(json.dumps({k: v for k, v in run_info.items() if k not in ("data",)}), flush=True)

    # ---- held-out pages for the metric (the run's page distribution, named in each eval record) ----
    eval_pages = list(synthdoc.iter_dataset("heldout", args.eval_pages, args.eval_seed,
                                            spec.page_config(max_chars=spec.chars[1]))) if args.eval_pages and lead else []

    # rank r of W: the global batch numbers rs.batches + r + k * W, in order
    workers = max(0, (os.cpu_count() or 2) // world - 1) if args.workers < 0 else args.workers
    loader = torch.utils.data.DataLoader(
        StepBatches(spec, rs.batches + rank, world, str(tok_dir), glyphs=args.glyph_aux > 0 or args.align_aux > 0),
        batch_size=None, num_workers=workers,
        pin_memory=device.type == "cuda", prefetch_factor=2 if workers else None, persistent_workers=False,
        worker_init_fn=ignore_sigterm)
    forward = answer_loss = AnswerLoss(model, autocast, image_aux=args.image_aux, end_id=builder.ids["<|im_end|>"],
                                       image_center=args.image_center, glyph_aux=args.glyph_aux,
                                       align_aux=args.align_aux)
    if world > 1:  # averages the gradients over the ranks during backward
        forward = torch.nn.parallel.DistributedDataParallel(forward, device_ids=[device.index] if device.type == "cuda" else None)

    def save_ckpt(reason: str) -> float:
        t0 = time.perf_counter()
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise RuntimeError(f"not saving a checkpoint at step {rs.step}: non-finite weights in {bad[:3]}")
        state = {
            "preset": preset, "model_config": config.to_dict(), "schedule": asdict(sched), "data": asdict(spec),
            "page_sources": page_sources, "run": asdict(rs), "rng": rng_state(),
            "tokenizer_files": {n: (Path(tok_dir) / n).read_text() for n in ("tokenizer.json", "tokenizer_config.json")},
            "preprocessor_config": common.preprocessor_config(spec.max_pixels()),
        }
        files = ckpt.save(ckpt_dir, model, opt, state, fmt=args.ckpt_format, extra_files={"log.jsonl": log_path})
        dt = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in files)
        log({"event": "checkpoint", "step": rs.step, "reason": reason, "bytes": size, "files": len(files),
             "seconds": round(dt, 2)})
        print(f"checkpoint step {rs.step} ({reason}): {size / 2**20:.1f} MiB in {len(files)} files, {dt:.1f} s", flush=True)
        return dt

    def run_eval() -> float:
        if not eval_pages:
            return 0.0
        t0 = time.perf_counter()
        try:
            r = evaluate(model, builder, eval_pages, device, autocast, args.eval_batch, args.eval_max_new)
        except Exception as e:  # noqa: BLE001 - a failing metric must not lose the run
            model.train()
            msg = f"{type(e).__name__}: {e}"[:500]
            log({"event": "eval_error", "step": rs.step, "error": msg})
            print(f"eval failed at step {rs.step}: {msg}", flush=True)
            return time.perf_counter() - t0
        log({"event": "eval", "step": rs.step, **r, "long_side": list(spec.long_side), "body_px": list(spec.body_px),
             "chars": spec.chars[1], "locales": list(spec.locales) if spec.locales else None, "noise": spec.noise})
        print(f"eval step {rs.step}: cer {r['cer']:.4f} (micro {r['cer_micro']:.4f}), tables "
              f"{r['tables_exact']}/{r['tables']}, {r['seconds']:.1f} s", flush=True)
        return r["seconds"]

    def on_rank0(fn) -> float:
        """fn() (evaluate or checkpoint: returns its seconds) on rank 0 while the other ranks wait."""
        seconds = fn() if lead else 0.0
        if world > 1:
            dist.barrier()
        return seconds

    stop = {"flag": False}

    def on_signal(signum, frame):  # noqa: ARG001
        stop["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    eval_cost, ckpt_cost = (30.0 if device.type == "cuda" else 5.0), 5.0
    last_eval = last_ckpt = time.perf_counter()
    win = {"t": time.perf_counter(), "tok": 0, "ans": 0, "pages": 0, "wait": 0.0, "loss": 0.0, "n": 0,
           "step0": rs.step}
    bad_in_a_row = 0
    start_step = rs.step
    replay: collections.deque = collections.deque(maxlen=max(1, args.replay_batches))
    it = iter(loader)
    run_t0 = time.perf_counter()
    profiler = None

    def agree(stats: list[float]) -> tuple[list[float], bool, bool, bool]:
        """Sums a step's stats over the ranks and decides, the same on every rank, what comes before the next
        step: stop (a signal on any rank, --max-steps, rank 0's clock), evaluate, checkpoint (rank 0's clock)."""
        now = time.perf_counter()
        halt = stop["flag"] or bool(args.max_steps and rs.step >= args.max_steps)
        eval_due = ckpt_due = False
        if lead:
            halt = halt or now + eval_cost + ckpt_cost + 20.0 > deadline
            eval_due = now - last_eval > args.eval_every_minutes * 60 and rs.step > start_step
            ckpt_due = now - last_ckpt > args.ckpt_every_minutes * 60 and rs.step > start_step
        *sums, halt, eval_due, ckpt_due = all_sum([*stats, float(halt), float(eval_due), float(ckpt_due)], device)
        return sums, halt > 0, eval_due > 0, ckpt_due > 0

    _, halt, eval_due, ckpt_due = agree([])
    while not halt:
        if args.profile_steps and rs.step == start_step + 10:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                              + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []))
            profiler.__enter__()
        if profiler is not None and rs.step == start_step + 10 + args.profile_steps:
            profiler.__exit__(None, None, None)
            sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
            if lead:
                print(f"profile of {args.profile_steps} steps:\n" + profiler.key_averages().table(sort_by=sort, row_limit=30),
                      flush=True)
            profiler = None
        if eval_due:
            eval_cost = max(on_rank0(run_eval), 1.0)
            last_eval = time.perf_counter()
        if ckpt_due:
            ckpt_cost = max(on_rank0(lambda: save_ckpt("periodic")), 1.0)
            last_ckpt = time.perf_counter()

        t0 = time.perf_counter()
        if args.reuse > 1 and rs.step % args.reuse and replay:  # recent batches again (data-bound runs)
            group = replay[random.Random(f"replay:{spec.seed}:{rs.step}").randrange(len(replay))]
        else:
            group = []
            for _ in range(args.accum):
                batch = next(it)
                assert batch["step"] == rs.batches + rank, (batch["step"], rs.batches + rank)
                rs.batches += world
                group.append(batch)
            if args.reuse > 1:
                replay.append(group)
        win["wait"] += time.perf_counter() - t0
        lr = sched.at(rs.step)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        parts = []
        for i, batch in enumerate(group):
            ids, labels, pos = (batch[k].to(device, non_blocking=True) for k in ("input_ids", "labels", "position_ids"))
            pv, grid = pixels_on_device(batch["images"], device)
            # the ranks average their gradients once, in the group's last backward
            with forward.no_sync() if world > 1 and i + 1 < len(group) else contextlib.nullcontext():
                glyphs, reading = (tuple(t.to(device, non_blocking=True) for t in batch[k]) if k in batch else None
                                   for k in ("glyphs", "reading"))
                part = forward(ids, labels, pos, pv, grid, glyphs, reading) / len(group)
                part.backward()
            parts.append(part.detach())
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        # the ranks hold the same averaged gradient, so they agree on skipping a non-finite one
        if torch.isfinite(gnorm):
            opt.step()
            bad_in_a_row = 0
        else:
            rs.skipped_steps += 1
            bad_in_a_row += 1
            log({"event": "skipped", "step": rs.step, "grad_norm": str(float(gnorm)), "in_a_row": bad_in_a_row})
            if bad_in_a_row >= args.max_bad_steps:
                raise RuntimeError(f"training diverged: {bad_in_a_row} non-finite gradients in a row up to step "
                                   f"{rs.step}; no checkpoint written (the last one is left as it was)")
        rs.step += 1
        stats = [float(sum(parts))] + [sum(b[k] for b in group) for k in ("pages", "tokens", "answer_tokens")]
        (loss_sum, pages, tokens, answers), halt, eval_due, ckpt_due = agree(stats)
        rs.pages += int(pages)
        rs.tokens += int(tokens)
        rs.answer_tokens += int(answers)
        win["tok"] += tokens
        win["ans"] += answers
        win["pages"] += pages
        if math.isfinite(loss_sum):
            win["loss"] += loss_sum / world
            win["n"] += 1
        if rs.step % args.log_every == 0 or rs.step == 1:
            dt = time.perf_counter() - win["t"]
            rec = {"event": "train", "step": rs.step, "loss": round(win["loss"] / win["n"], 5) if win["n"] else None, "lr": lr,
                   "grad_norm": round(float(gnorm), 4), "tokens_per_s": round(win["tok"] / dt),
                   "answer_tokens_per_s": round(win["ans"] / dt), "pages_per_s": round(win["pages"] / dt, 2),
                   "steps_per_s": round((rs.step - win["step0"]) / dt, 3), "data_wait_frac": round(win["wait"] / dt, 3),
                   "batch_pages": batch["pages"], "seq_len": int(ids.shape[1]), "image_hw": list(batch["images"].shape[1:3])}
            if args.image_aux or args.image_center:  # the loss above includes the image terms; rank 0's last batch:
                rec["loss_terms"] = {k: round(float(v.detach()), 4) for k, v in answer_loss.terms.items()}
            if device.type == "cuda":
                rec["max_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            log(rec)
            if lead:
                print(json.dumps(rec), flush=True)
            win = {"t": time.perf_counter(), "tok": 0, "ans": 0, "pages": 0, "wait": 0.0, "loss": 0.0, "n": 0,
                   "step0": rs.step}
    rs.train_seconds += time.perf_counter() - run_t0
    steps = rs.step - start_step
    rs.runs.append({"from_step": start_step, "to_step": rs.step, "seconds": round(time.perf_counter() - t_start, 1),
                    "device": str(device), "ranks": world})
    # the checkpoint first: under torchrun a SIGTERM leaves 30 s before the kill
    if steps > 0 or resume is None:
        on_rank0(lambda: save_ckpt("end"))
    if steps > 0:
        on_rank0(run_eval)
    elapsed = time.perf_counter() - t_start
    final = {"event": "end", "step": rs.step, "steps_this_run": steps, "seconds": round(elapsed, 1),
             "steps_per_s": round(steps / max(1e-9, time.perf_counter() - run_t0), 3)}
    if world > 1:  # the replicas must have stayed equal, bit for bit
        digests = [None] * world
        dist.all_gather_object(digests, weights_digest(model))
        final["ranks_weights_equal"] = len(set(digests)) == 1
    log(final)
    if lead and (ckpt_dir / "state.json").exists():  # the checkpoint carries the whole log, this run's end included
        import shutil

        shutil.copyfile(log_path, ckpt_dir / "log.jsonl")
    if lead:
        print(json.dumps(final), flush=True)
    del it, loader
    if world > 1:
        dist.destroy_process_group()
    return {"model": model, "final": final, "run": rs}


if __name__ == "__main__":
    main()
