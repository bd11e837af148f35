"""How long `ocria-rt quantize --recipe mixed` takes, stage by stage, on a random-weight VLM.

    python bench/quantize_time.py OUT.json [--shape ocria1-4b|tiny] [--layers N] [--vocab V]
                                           [--vision-depth D] [--pages 64] [--device cuda] [--threads 0]
                                           [--recipe mixed] [--method awq|gptq|rtn] [--workdir DIR]
                                           [--host-groups]

Writes a random BF16 checkpoint of the shape (numpy only, no torch: the decoder of bench/common.py's
SHAPES with the OCRia-1 vision encoder, the tokenizer and chat template of the package's tiny-vlm),
then runs ocria_rt.quantize on it with that many synthetic calibration pages (synthdoc's default
pages for ocria1-4b, small pages of Pillow's font for tiny) and prints the seconds of each stage the
report records (its "seconds"), the checkpoint's writing apart. --layers / --vocab / --vision-depth
cut the shape (for profiling a part of it on a small machine); a cut to fewer than 4 layers keeps one
attention layer last. The JSON goes to OUT.json; the Markdown table comes last.

The issue's figure: `python bench/quantize_time.py OUT.json --device cuda` (the whole 4B shape, 64 pages).
`--host-groups` times only the host's share of the sensitivity stage (host_groups), no engine needed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OCRIA1_VISION, SHAPES, full_config, markdown_table, vision_weight_shapes, weight_shapes  # noqa: E402

TINY = dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=32, vocab_size=2048, tie_word_embeddings=True)
TINY_VISION = dict(OCRIA1_VISION, depth=1, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=128)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def layer_types(n: int) -> list[str]:
    """The 3:1 DeltaNet : attention pattern of n layers; fewer than 4 layers end with the attention layer."""
    if n < 4:
        return ["linear_attention"] * (n - 1) + ["full_attention"] if n > 1 else ["linear_attention"]
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


def tensor_shapes(text: dict, types: list[str], vision: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the VLM checkpoint: each layer's tensors as bench/common.py names them for a layer
    of its kind (layer 0: DeltaNet, 3: attention, of the 4-layer pattern), renumbered."""
    four = weight_shapes(full_config({**text, "num_hidden_layers": 4}))
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in four.items():
        if ".layers." not in name:
            out[name.replace("model.", "model.language_model.", 1)] = shape
    for i, kind in enumerate(types):
        src = "model.layers.3." if kind == "full_attention" else "model.layers.0."
        for name, shape in four.items():
            if name.startswith(src):
                out[f"model.language_model.layers.{i}." + name[len(src):]] = shape
    out.update(vision_weight_shapes(vision))
    return out


PIECE = 1 << 24  # values drawn at a time (a tensor is drawn in pieces, each seeded by its index)


def random_piece(name: str, shape: tuple[int, ...], piece: int, seed: int) -> np.ndarray:
    """BF16 bits of values piece * PIECE .. of a tensor initialised as bench/common.make_random_checkpoint
    does (activations O(1))."""
    n = min(PIECE, int(np.prod(shape)) - piece * PIECE)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode()), piece])
    if ("visual" in name and ".norm" in name and name.endswith("weight")) or name.endswith("dt_bias") or (
            name.endswith("norm.weight") and "linear_attn" in name):
        t = np.ones(n, np.float32)
    elif name.endswith("A_log"):
        t = np.log(rng.random(n, np.float32) * 15 + 1)
    elif name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith(".bias"):
        t = np.zeros(n, np.float32)
    elif name.endswith("conv1d.weight"):
        t = rng.standard_normal(n, np.float32) * np.float32(0.3)
    elif name.endswith("pos_embed.weight"):
        t = rng.standard_normal(n, np.float32) * np.float32(0.02)
    else:
        t = rng.standard_normal(n, np.float32) * np.float32(int(np.prod(shape[1:])) ** -0.5)
    u = t.view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def write_random_checkpoint(directory: Path, text: dict, vision: dict, seed: int = 0, threads: int = 0) -> Path:
    """The random VLM directory (config, processor, tokenizer, one model.safetensors written piece by piece
    as threads draw them). An existing one (config.json present) is kept."""
    import ocria_rt

    if (directory / "config.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    types = layer_types(text["num_hidden_layers"])
    shapes = tensor_shapes(text, types, vision)
    names = sorted(shapes)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        nbytes = 2 * int(np.prod(shapes[name]))
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    pieces = [(n, p) for n in names for p in range(-(-int(np.prod(shapes[n])) // PIECE))]
    workers = threads or os.cpu_count() or 1
    with open(directory / "model.safetensors", "wb") as f, ThreadPoolExecutor(workers) as pool:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for i in range(0, len(pieces), workers):  # a window of pieces in flight, written in order
            for t in pool.map(lambda np_: random_piece(np_[0], shapes[np_[0]], np_[1], seed), pieces[i:i + workers]):
                f.write(t.tobytes())

    small = Path(ocria_rt.__file__).resolve().parent / "models" / "tiny-vlm"
    small_cfg = json.loads((small / "config.json").read_text())
    for name in TOKENIZER_FILES:
        shutil.copyfile(small / name, directory / name)
    shutil.copyfile(small / "preprocessor_config.json", directory / "preprocessor_config.json")
    tc = full_config(text)
    tc.update(layer_types=types, eos_token_id=small_cfg["text_config"]["eos_token_id"])
    half = int(tc["head_dim"] * tc["partial_rotary_factor"]) // 2  # M-RoPE's sections split the rotary half
    tc["rope_parameters"]["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
    config = dict(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"], text_config=tc,
                  vision_config=vision, tie_word_embeddings=tc["tie_word_embeddings"],
                  **{k: small_cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                               "vision_end_token_id")})
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def stage_rows(seconds: dict[str, float]) -> list[dict]:
    """The table's rows: each stage (its own figure, else the sum of its parts), its parts indented under
    it, what no stage holds, the total last."""
    total = seconds["total"]
    tops = list(dict.fromkeys(k.split("/")[0] for k in seconds if k != "total"))
    rows, accounted = [], 0.0
    for top in tops:
        parts = {k.split("/", 1)[1]: v for k, v in seconds.items() if k.startswith(top + "/")}
        v = seconds.get(top, sum(parts.values()))
        accounted += v
        rows.append({"stage": top, "seconds": f"{v:.2f}", "share": f"{v / total:.1%}"})
        rows += [{"stage": "  " + name, "seconds": f"{part:.2f}", "share": f"{part / total:.1%}"}
                 for name, part in parts.items()]
    other = total - accounted
    rows.append({"stage": "other (the plan, the report, moving files)", "seconds": f"{other:.2f}",
                 "share": f"{other / total:.1%}"})
    rows.append({"stage": "total", "seconds": f"{total:.2f}", "share": "100%"})
    return rows


LM_HEAD_SLICE = 16384  # rows of the LM head quantized in --host-groups (its time scaled to the vocabulary)


def host_groups(text: dict, method: str, threads: int) -> list[dict]:
    """The sensitivity stage's host work without the engine: one projection group of each kind of the
    shape quantized in FP8 and in NVFP4 (awq.quantize_group), random weights and the statistics of a
    random input whose channels have spread-out scales (its second moment only up to the engine's
    MAX_SECOND_MOMENT_FEATURES inputs, as the engine collects them); seconds each and times the groups of the model
    (the LM head from a slice of LM_HEAD_SLICE rows, scaled to the vocabulary)."""
    from ocria_rt import _core
    from ocria_rt.quantization.awq import quantize_group

    H, I, hd = text["hidden_size"], text["intermediate_size"], text["head_dim"]
    q, kv = text["num_attention_heads"] * hd, text["num_key_value_heads"] * hd
    kdim = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    vdim = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    types = layer_types(text["num_hidden_layers"])
    n_gdn, n_attn = types.count("linear_attention"), types.count("full_attention")
    vocab_rows = min(LM_HEAD_SLICE, text["vocab_size"])
    kinds = [("DeltaNet in_proj (qkv, z)", [2 * kdim + vdim, vdim], H, n_gdn),
             ("DeltaNet out_proj", [H], vdim, n_gdn),
             ("attention q, k, v", [2 * q, kv, kv], H, n_attn),
             ("attention o_proj", [H], q, n_attn),
             ("MLP gate, up", [I, I], H, len(types)),
             ("MLP down", [H], I, len(types)),
             ("LM head", [vocab_rows], H, text["vocab_size"] / vocab_rows)]
    rng = np.random.default_rng(0)
    rows = []
    for name, part_rows, K, count in kinds:
        x = rng.standard_normal((2048, K), dtype=np.float32) * rng.gamma(1.0, 1.0, K).astype(np.float32)
        stats = dict(abs_max=np.abs(x).max(0), abs_mean=np.abs(x).mean(0), square_mean=(x * x).mean(0),
                     second_moment=(x.T @ x) / len(x) if K <= _core.MAX_SECOND_MOMENT_FEATURES else None)
        parts = [rng.standard_normal((r, K), dtype=np.float32) * np.float32(K**-0.5) for r in part_rows]
        sec = {}
        for fmt in ("fp8", "nvfp4"):
            t0 = time.perf_counter()
            quantize_group(parts, fmt, stats, method, None, threads)
            sec[fmt] = time.perf_counter() - t0
        rows.append({"group": name, "shape": f"{sum(part_rows)} x {K}", "groups in the model": round(count, 2),
                     "fp8 s": round(sec["fp8"], 4), "nvfp4 s": round(sec["nvfp4"], 4),
                     "model s": round(count * (sec["fp8"] + sec["nvfp4"]), 2)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the JSON result")
    ap.add_argument("--shape", choices=("ocria1-4b", "tiny"), default="ocria1-4b")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    ap.add_argument("--vocab", type=int, help="vocabulary size (default: the shape's)")
    ap.add_argument("--vision-depth", type=int, help="vision encoder blocks (default: the shape's)")
    ap.add_argument("--pages", type=int, default=64, help="synthetic calibration pages (a quarter held out)")
    ap.add_argument("--recipe", default="mixed", choices=("mixed", "fp8", "nvfp4"))
    ap.add_argument("--method", default="awq", choices=("awq", "gptq", "rtn"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", type=int, default=0, help="engine threads (0: all cores)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ocria-bench"))
    ap.add_argument("--host-groups", action="store_true",
                    help="only the host's quantization of one group of each kind (no checkpoint, no engine): host_groups()")
    args = ap.parse_args(argv)

    import ocria_rt
    from ocria_rt.synthdoc import PageConfig

    text = dict(SHAPES[args.shape] if args.shape != "tiny" else TINY)
    vision = dict(OCRIA1_VISION if args.shape != "tiny" else TINY_VISION, out_hidden_size=text["hidden_size"])
    if args.layers:
        text["num_hidden_layers"] = args.layers
    if args.vocab:
        text["vocab_size"] = args.vocab
    if args.vision_depth:
        vision["depth"] = args.vision_depth
    if args.host_groups:
        rows = host_groups(text, args.method, args.threads)
        total = sum(r["model s"] for r in rows)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"shape": args.shape, "text_config": text, "method": args.method,
                                        "threads": args.threads, "cpu_count": os.cpu_count(), "groups": rows,
                                        "model_seconds": round(total, 1)}, indent=1) + "\n")
        print(f"{args.shape}: the host's quantization of every projection group in FP8 and NVFP4 ({args.method}, "
              f"{args.threads or os.cpu_count()} threads): {total / 60:.1f} min")
        print(markdown_table(rows, ["group", "shape", "groups in the model", "fp8 s", "nvfp4 s", "model s"]))
        return 0
    tag = f"{args.shape}-l{text['num_hidden_layers']}-v{text['vocab_size']}-d{vision['depth']}"
    t0 = time.perf_counter()
    model_dir = write_random_checkpoint(args.workdir / f"quantize-{tag}", text, vision, threads=args.threads)
    write_s = time.perf_counter() - t0
    pages = (PageConfig(long_side=(160, 192), body_px=(14, 16), max_chars=40, fonts="pillow", use_faker=False)
             if args.shape == "tiny" else None)
    out_dir = args.workdir / f"quantized-{tag}"
    res = ocria_rt.quantize(model_dir, out_dir, args.recipe, calib_synthetic=args.pages, device=args.device,
                            method=args.method, num_threads=args.threads, page_config=pages, force=True, progress="always")
    r = res.report
    formats = list(res.plan.values())
    result = {
        "shape": args.shape, "text_config": text, "vision_config": vision, "device": args.device,
        "recipe": args.recipe, "method": args.method, "pages": args.pages, "build": ocria_rt.build_info(), "cpu_count": os.cpu_count(),
        "checkpoint_write_seconds": round(write_s, 3), "seconds": r["seconds"],
        "calibration": r["calibration"], "trials": sum(len(g["kl"]) for g in r["groups"]),
        "groups": len(r["groups"]), "plan": {f: formats.count(f) for f in sorted(set(formats))},
        "bits_per_weight": r["total"]["bits_per_weight"], "summed_kl": r["total"]["summed_kl"],
        "measured_kl": r["total"]["measured_kl"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.shape} ({text['num_hidden_layers']} layers, vocab {text['vocab_size']}, vision depth "
          f"{vision['depth']}) on {args.device}, {args.recipe} {args.method}: {args.pages} pages, {result['trials']} trials of {result['groups']} "
          f"groups, plan {result['plan']}; checkpoint written in {write_s:.1f} s")
    print(markdown_table(stage_rows(r["seconds"]), ["stage", "seconds", "share"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
