"""Shared pieces of the OCR training scripts: imports, token ids, model presets, prompts and batches.

Import this first: it makes ``ocria_rt.synthdoc``, ``ocria_rt.chat``, ``ocria_rt.preprocess`` and
``ocria_rt.pipeline`` importable from the repository's ``python/`` folder even where the compiled
engine (``ocria_rt._core``) is not built, as on a training machine: those modules are pure Python.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PY_DIR = REPO / "python"
DEFAULT_TOKENIZER_DIR = HERE / "tokenizer"
TINY_VLM_DIR = PY_DIR / "ocria_rt" / "models" / "tiny-vlm"


def setup_imports() -> bool:
    """Makes ocria_rt importable with this repository's subpackages; True when the compiled engine loads.

    An installed (or in-tree built) ocria_rt is used when it imports, with the repository's
    ``python/ocria_rt`` appended to its package path (so ``ocria_rt.synthdoc`` resolves even against an
    older install); otherwise a bare package over ``python/ocria_rt`` stands in, without ``Engine``."""
    repo_pkg = str(PY_DIR / "ocria_rt")
    mod = sys.modules.get("ocria_rt")
    if mod is None:
        try:
            mod = importlib.import_module("ocria_rt")
        except ImportError:
            for name in [n for n in sys.modules if n == "ocria_rt" or n.startswith("ocria_rt.")]:
                del sys.modules[name]
            mod = types.ModuleType("ocria_rt")
            mod.__path__ = [repo_pkg]  # no __init__: nothing of the compiled engine is imported
            mod.__file__ = None
            sys.modules["ocria_rt"] = mod
    if repo_pkg not in list(mod.__path__):
        mod.__path__.append(repo_pkg)
    return hasattr(mod, "Engine")


HAS_ENGINE = setup_imports()

from ocria_rt import synthdoc  # noqa: E402
from ocria_rt.chat import apply_chat_template, expand_image_tokens  # noqa: E402
from ocria_rt.pipeline import DEFAULT_PROMPT  # noqa: E402

# Qwen3.5's special tokens, in the order they get ids after the BPE vocabulary.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
# HTML table tags as ordinary (not special) added tokens: one token each, kept by decode().
HTML_TOKENS = ["<table>", "</table>", "<tr>", "</tr>", "<th>", "</th>", "<td>", "</td>"]

PATCH, TEMPORAL, MERGE = 16, 2, 2
FACTOR = PATCH * MERGE


def preprocessor_config(max_pixels: int, min_pixels: int = 128 * 128) -> dict:
    """Qwen3.5's image processor settings with this model's pixel range (pages of up to max_pixels
    pixels, sides multiples of 32, go to the encoder unresized)."""
    return {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": PATCH,
        "temporal_patch_size": TEMPORAL,
        "merge_size": MERGE,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "size": {"shortest_edge": int(min_pixels), "longest_edge": int(max_pixels)},
    }


def token_ids(tok) -> dict[str, int]:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise SystemExit(f"tokenizer lacks {missing}")
    return ids


def load_tokenizer(tok_dir: Path):
    from tokenizers import Tokenizer

    path = Path(tok_dir) / "tokenizer.json"
    if not path.is_file():
        raise SystemExit(f"no tokenizer at {path}: run scripts/train_ocr/tokenizer.py first")
    return Tokenizer.from_file(str(path))


# --------------------------------------------------------------------------- #
# Model presets
# --------------------------------------------------------------------------- #
# rotary: the rotated fraction of an attention head. Qwen3.5 rotates 64 of 256 dims (32 frequencies,
# [11, 11, 10] over t / h / w); a quarter of a 64-dim head leaves 8 frequencies, of which the image
# columns get two, 0.018 and 4e-5 rad per column at theta 1e7: the decoder can hardly tell the columns
# of a page apart. The presets rotate the whole head (small: 32 frequencies, Qwen3.5's split and angles):
# in probe_reading.py (smoke preset, 3-6 characters) that reads 100 % exact at step 1200, a quarter 0 %.
PRESETS: dict[str, dict] = {
    # a few seconds a step on a laptop CPU: for proving the machinery, learns nothing useful
    "smoke": dict(hidden=64, layers=4, inter=128, heads=2, kv=1, head_dim=32, lin_k=1, lin_v=2, lin_dim=32,
                  v_hidden=32, v_depth=1, v_heads=1, v_inter=64, v_pos=2304, rotary=1.0),
    # 9.3M parameters (18.6 MB in BF16, a 36 MiB compact checkpoint): the model to ship
    "small": dict(hidden=256, layers=8, inter=512, heads=4, kv=2, head_dim=64, lin_k=2, lin_v=4, lin_dim=64,
                  v_hidden=192, v_depth=4, v_heads=3, v_inter=576, v_pos=2304, rotary=1.0),
    # 12.2M (24.3 MB in BF16, just under the package limit; a 47 MiB compact checkpoint, too big to carry
    # with the repository through a 64 MiB device transfer): more vision and MLP width
    "medium": dict(hidden=256, layers=8, inter=704, heads=4, kv=2, head_dim=64, lin_k=2, lin_v=4, lin_dim=64,
                   v_hidden=256, v_depth=4, v_heads=4, v_inter=640, v_pos=2304, rotary=1.0),
}


def model_config(preset: str, vocab: int, ids: dict[str, int], max_positions: int = 8192):
    """A Qwen3_5Config (3:1 Gated DeltaNet : attention text decoder, Qwen3.5 vision geometry)."""
    from transformers import Qwen3_5Config

    p = PRESETS[preset]
    layers = p["layers"]
    text = dict(
        vocab_size=vocab, hidden_size=p["hidden"], intermediate_size=p["inter"], num_hidden_layers=layers,
        num_attention_heads=p["heads"], num_key_value_heads=p["kv"], head_dim=p["head_dim"],
        linear_num_key_heads=p["lin_k"], linear_num_value_heads=p["lin_v"], linear_key_head_dim=p["lin_dim"],
        linear_value_head_dim=p["lin_dim"], linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6,
        max_position_embeddings=max_positions, tie_word_embeddings=True, attention_bias=False,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": p["rotary"],
                         "mrope_interleaved": True, "mrope_section": _mrope_section(p["head_dim"], p["rotary"])},
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=None,
    )
    vision = dict(depth=p["v_depth"], hidden_size=p["v_hidden"], num_heads=p["v_heads"],
                  intermediate_size=p["v_inter"], out_hidden_size=p["hidden"], hidden_act="gelu_pytorch_tanh",
                  in_channels=3, patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE,
                  num_position_embeddings=p["v_pos"])
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True,
                         image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                         vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def _mrope_section(head_dim: int, rotary: float) -> list[int]:
    """Qwen3.5's [11, 11, 10] split of the rotary half-dimension (32 of 256 * 0.25 / 2), scaled."""
    half = int(head_dim * rotary) // 2
    t = round(half * 11 / 32)
    h = round(half * 11 / 32)
    return [t, h, half - t - h]


# --------------------------------------------------------------------------- #
# Prompts and examples
# --------------------------------------------------------------------------- #
def page_messages(prompt: str = DEFAULT_PROMPT) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": "page"}, {"type": "text", "text": prompt}]}]


class PromptBuilder:
    """Token ids of the chat prompt for one page, exactly as ocria_rt.chat.build_multimodal_prompt
    builds them (template rendered by ocria_rt.chat, encoded by the tokenizer, image placeholder
    expanded), and of the answer."""

    def __init__(self, tok_dir: Path, tok=None, prompt: str = DEFAULT_PROMPT) -> None:
        self.tok = tok or load_tokenizer(tok_dir)
        self.ids = token_ids(self.tok)
        text = apply_chat_template(Path(tok_dir), page_messages(prompt), add_generation_prompt=True)
        self.prompt_ids = list(self.tok.encode(text, add_special_tokens=False).ids)
        assert self.prompt_ids.count(self.ids["<|image_pad|>"]) == 1, text
        self._char_ids: dict[str, list[int]] = {}

    def prompt(self, grid_h: int, grid_w: int) -> list[int]:
        return expand_image_tokens(self.prompt_ids, np.array([[1, grid_h, grid_w]]), self.ids["<|image_pad|>"], MERGE)

    def answer(self, markdown: str) -> list[int]:
        return list(self.tok.encode(markdown, add_special_tokens=False).ids) + [self.ids["<|im_end|>"]]

    def char_ids(self, ch: str) -> list[int]:
        """The token ids of one character on its own (byte-level: one id, or one per UTF-8 byte)."""
        if ch not in self._char_ids:
            self._char_ids[ch] = list(self.tok.encode(ch, add_special_tokens=False).ids)
        return self._char_ids[ch]


def mrope_positions(ids: list[int], image_token_id: int, grid_h: int, grid_w: int) -> np.ndarray:
    """[3, len(ids)] M-RoPE positions (as transformers' get_rope_index for one image): text tokens
    count up on all three axes; the image's tokens take (t, row, col) offsets from where it starts;
    after it the count resumes at start + max(rows, cols)."""
    n = len(ids)
    pos = np.zeros((3, n), dtype=np.int64)
    arr = np.asarray(ids)
    img = np.flatnonzero(arr == image_token_id)
    hh, ww = grid_h // MERGE, grid_w // MERGE
    if len(img) == 0:
        pos[:] = np.arange(n)
        return pos
    s, e = int(img[0]), int(img[-1]) + 1
    assert e - s == hh * ww == len(img), (e - s, hh, ww)
    pos[:, :s] = np.arange(s)
    rows = np.repeat(np.arange(hh), ww)
    cols = np.tile(np.arange(ww), hh)
    pos[0, s:e] = s
    pos[1, s:e] = s + rows
    pos[2, s:e] = s + cols
    nxt = s + max(hh, ww)
    pos[:, e:] = nxt + np.arange(n - e)
    return pos


def write_json(path: Path, obj) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
