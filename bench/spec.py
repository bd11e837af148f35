"""Speculative decoding with a DFlash2 drafter, batch 1: tokens/s at forced acceptance lengths against
the ceiling, the step split into draft / verify / commit, and plain decoding of the same target in the
same process.

    python bench/spec.py OUT.json [--shapes ocria1-4b,tiny] [--quant bf16,nvfp4] [--taus 1,4,8,12,16]
                                  [--prompt 1024] [--new-tokens 256] [--reps 3] [--device cuda|cpu]

Models: random weights. The target is a shape of bench/common.py (or `tiny`, a few hundred thousand
weights that smoke-test the script on the CPU in seconds), written as decode.py writes it, and in the
formats of --quant (bench/quant_checkpoint.py). Its drafter (DRAFTERS) is a DFlash2 checkpoint in
z-lab's format; for the 4B target 5 layers at its hidden size 2560, block 16, taps of 5 target layers,
selector rank 256 (the layout of z-lab's published DFlash2 config, at the 4B's width).

Forced acceptance: a random drafter accepts next to nothing, so every speculative figure comes from an
engine with benchmark_forced_acceptance = tau, whose steps emit tau tokens each (the first tau - 1
drafts as if accepted, then the target's token after them: not the model's output, timing only). The
step is the one the engine always runs (captured once, one launch per step, the host a step ahead);
only the count it emits is forced.

Figures, each a median over --reps generations of --new-tokens tokens after a --prompt-token prompt:
- tokens/s: tokens after the first / the wall time of generate() (host loop included), with its
  ceiling tau x copy bandwidth / the bytes a speculative step must move (spec_step_bytes: the target's
  weights as stored, the LM head once more for the drafter's logits, the drafter's weights, the fc and
  k/v projections once more for the context push, KV caches of target and drafter, the DeltaNet states
  read by the verify and read and written by the commit); plain decode beside its own ceiling
  (common.bytes_per_decode_step);
- the phases: a second engine with benchmark_phase_timing replays the step as three graphs (draft:
  the drafter's block, its logits through the target's LM head, the candidate walk; verify: the
  target's forward of the block, its logits, the acceptance; commit: the DeltaNet commit, the
  drafter's context push, the post and the advance) with CUDA events between them: device time per
  phase, each beside the time its bytes take at copy bandwidth. On the CPU the host clock times them.
The copy bandwidth is measured in the run (bench/common.py); on the CPU there is no ceiling.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (SHAPES, bytes_per_decode_step, full_config, layer_is_attention, make_random_checkpoint,  # noqa: E402
                    markdown_table, measure_copy_bandwidth, weight_shapes)
from quant_checkpoint import FORMATS, linear_bytes, module_format, write_quantized_checkpoint  # noqa: E402

# A target small enough for the CPU (the smoke test).
TINY = dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=32, vocab_size=1024, tie_word_embeddings=True)
TARGETS = {**SHAPES, "tiny": TINY}

# DFlash2 drafters per target shape (z-lab's config.json fields). The 4B's: z-lab's published DFlash2
# layout (5 layers, 32 heads of 128, 8 kv heads, two-sided sliding window 2048, conv kernel 2 in groups
# of 16, selector rank 256 and top 16, the output multiplier and softcap) at the 4B's hidden size, with
# Qwen3-4B's MLP width and z-lab's default spread of 5 taps over 32 target layers.
DRAFTERS = {
    "ocria1-4b": dict(num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      intermediate_size=9728, sliding_window=2048, target_layer_ids=[1, 8, 15, 22, 29],
                      conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16,
                      output_multiplier=0.19611613513818404, final_logit_softcapping=20.0),
    "qwen3.5-0.8b": dict(num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                         intermediate_size=3072, sliding_window=2048, target_layer_ids=[1, 6, 11, 16, 21],
                         conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16,
                         output_multiplier=0.19611613513818404, final_logit_softcapping=20.0),
    "tiny": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                 sliding_window=2048, target_layer_ids=[0, 2, 3], conv_kernel_size=2, conv_group_size=16,
                 selector_rank=16, selector_top_k=16, output_multiplier=0.5, final_logit_softcapping=20.0),
}
BLOCK = 16


def drafter_config(c: dict, d: dict) -> dict:
    """z-lab's config.json of the DFlash2 drafter `d` for target config `c`."""
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_act": "silu", "attention_bias": False,
        "hidden_size": c["hidden_size"], "vocab_size": c["vocab_size"], "intermediate_size": d["intermediate_size"],
        "num_hidden_layers": d["num_hidden_layers"], "num_attention_heads": d["num_attention_heads"],
        "num_key_value_heads": d["num_key_value_heads"], "head_dim": d["head_dim"], "rms_norm_eps": 1e-6,
        "num_target_layers": c["num_hidden_layers"], "is_causal": False,
        "layer_types": ["sliding_attention"] * d["num_hidden_layers"], "use_sliding_window": True,
        "sliding_window": d["sliding_window"], "max_window_layers": d["num_hidden_layers"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "tie_word_embeddings": False,
        "dflash_config": {"block_size": BLOCK, "mask_token_id": c["vocab_size"] - 1,
                          "target_layer_ids": d["target_layer_ids"], "conv_kernel_size": d["conv_kernel_size"],
                          "conv_group_size": d["conv_group_size"], "selector_rank": d["selector_rank"],
                          "selector_top_k": d["selector_top_k"], "output_multiplier": d["output_multiplier"],
                          "final_logit_softcapping": d["final_logit_softcapping"]},
    }


def drafter_shapes(c: dict, d: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the drafter (z-lab's names; the codebooks without `.weight`)."""
    H, hd, L = c["hidden_size"], d["head_dim"], d["num_hidden_layers"]
    hq, hkv, I, K = d["num_attention_heads"] * hd, d["num_key_value_heads"] * hd, d["intermediate_size"], d["conv_kernel_size"]
    s: dict[str, tuple[int, ...]] = {"fc.weight": (H, len(d["target_layer_ids"]) * H), "hidden_norm.weight": (H,),
                                     "norm.weight": (H,),
                                     "candidate_selector.hidden_projection.weight": (d["selector_rank"], H),
                                     "candidate_selector.predecessor_codebook": (c["vocab_size"], d["selector_rank"]),
                                     "candidate_selector.successor_codebook": (c["vocab_size"], d["selector_rank"])}
    for i in range(L):
        p = f"layers.{i}."
        s.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                  p + "self_attn.q_proj.weight": (hq, H), p + "self_attn.k_proj.weight": (hkv, H),
                  p + "self_attn.v_proj.weight": (hkv, H), p + "self_attn.o_proj.weight": (H, hq),
                  p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                  p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I)})
        for conv in ("attention_conv", "mlp_conv"):
            s[p + conv + ".base_kernel"] = (2, K, H)
            s[p + conv + ".kernel_projection.weight"] = (2 * K * H // d["conv_group_size"], H)
    return s


def random_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random weights that keep activations O(1) (common.make_random_checkpoint's rules; the drafter's
    Qwen3 norms multiply by w, so theirs are 1; base kernels the identity; codebooks N(0, 1))."""
    if name.endswith("A_log"):
        return np.log(rng.random(shape, np.float32) * 15 + 1)
    if name.endswith("dt_bias") or (name.endswith("norm.weight") and "linear_attn" in name):
        return np.ones(shape, np.float32)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return np.zeros(shape, np.float32) if name.startswith("model.") else np.ones(shape, np.float32)
    if name.endswith("base_kernel"):
        w = np.zeros(shape, np.float32)
        w[:, 0] = 1
        return w
    if name.endswith("conv1d.weight"):
        return rng.standard_normal(shape, np.float32) * 0.3
    if "codebook" in name:
        return rng.standard_normal(shape, np.float32)
    fan_in = int(np.prod(shape[1:]))
    scale = 0.3 if "kernel_projection" in name else 1.0
    return rng.standard_normal(shape, np.float32) * (scale / fan_in**0.5)


def write_random(directory: Path, config: dict, shapes: dict[str, tuple[int, ...]], seed: int) -> Path:
    """A BF16 checkpoint of random weights written with numpy (kept if it exists)."""
    from ocria_rt.quantization.safetensors_io import bf16_bits, write_checkpoint

    if (directory / "config.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    write_checkpoint(directory, {n: ("BF16", bf16_bits(random_tensor(n, s, rng))) for n, s in shapes.items()})
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def target_config(shape: str) -> dict:
    c = full_config(TARGETS[shape])
    if shape == "tiny":  # M-RoPE sections that fit its 4 rotary frequencies (32 dims x 0.25 / 2)
        c["rope_parameters"] = {**c["rope_parameters"], "mrope_section": [2, 1, 1]}
    return c


def target_checkpoint(shape: str, directory: Path, device: str) -> Path:
    if device == "cuda" and shape in SHAPES:
        return make_random_checkpoint(shape, directory)  # drawn on the GPU: minutes less for the 4B
    c = target_config(shape)
    return write_random(directory, c, weight_shapes(c), seed=0)


# ---- ceilings ----

def spec_step_bytes(c: dict, d: dict, context: int, quant: str) -> dict[str, float]:
    """The fewest bytes each phase of one speculative step moves, as the engine runs it: draft (the
    drafter's layers but fc, the target's LM head for B - 1 rows, its own K/V over its window, the
    walk's codebook rows), verify (the target's weights as stored, its KV cache, the DeltaNet states
    read), commit (the DeltaNet states read and written, the drafter's fc and k/v projections for the
    context push)."""
    decode = bytes_per_decode_step(c, context, quant)
    H, V, hd = c["hidden_size"], c["vocab_size"], d["head_dim"]
    hkv = d["num_key_value_heads"] * hd
    drafter = 0
    for name, shp in drafter_shapes(c, d).items():
        if "codebook" not in name and not name.startswith("fc."):
            drafter += 2 * int(np.prod(shp))
    fc = 2 * H * len(d["target_layer_ids"]) * H
    kv_proj = d["num_hidden_layers"] * 2 * 2 * hkv * H
    walk = 2 * (BLOCK - 1) * (d["selector_top_k"] + 1) * d["selector_rank"]
    draft_kv = d["num_hidden_layers"] * min(context + BLOCK, d["sliding_window"]) * 2 * hkv * 2
    lm_head = linear_bytes(V, H, module_format("lm_head", quant))
    draft = drafter + lm_head + draft_kv + walk
    verify = decode["weights"] + decode["kv_cache"] + decode["gdn_state"] / 2
    commit = decode["gdn_state"] + fc + kv_proj
    return {"draft": float(draft), "verify": float(verify), "commit": float(commit),
            "total": float(draft + verify + commit)}


# ---- measurements ----

def generate_times(eng, prompt: list[int], new_tokens: int, reps: int, speculative: bool) -> dict:
    """Median tokens/s and wall time per step of `reps` generations (after a warm-up that captures the
    step), and the acceptance lengths of the last."""
    eng.generate(prompt, new_tokens, stop_token_ids=[], speculative=speculative)
    rates, step_s, lengths = [], [], []
    for _ in range(reps):
        r = eng.generate(prompt, new_tokens, stop_token_ids=[], speculative=speculative)
        assert len(r.token_ids) == new_tokens
        rates.append(r.decode_tokens_per_second)
        steps = len(r.acceptance_lengths) if speculative else new_tokens - 1
        step_s.append(r.decode_seconds / steps)
        lengths = list(r.acceptance_lengths)
    return {"tokens_per_s": statistics.median(rates), "ms_per_step": 1e3 * statistics.median(step_s),
            "acceptance_lengths": lengths}


def bench_tau(model_dir: Path, drafter_dir: Path, device: str, prompt: list[int], new_tokens: int, reps: int,
              tau: int, plain: bool) -> dict:
    """Forced acceptance tau: tokens/s of the one-launch step, then the phase split from an engine that
    times them; with `plain`, plain decoding of the first engine too."""
    import ocria_rt

    max_context = len(prompt) + new_tokens + 8
    out: dict = {"tau": tau}
    eng = ocria_rt.Engine(model_dir, device=device, drafter=drafter_dir, max_context=max_context,
                          benchmark_forced_acceptance=tau)
    out["speculative"] = generate_times(eng, prompt, new_tokens, reps, speculative=True)
    lengths = out["speculative"].pop("acceptance_lengths")
    out["forced_ok"] = bool(lengths) and all(a == tau for a in lengths[:-1]) and 1 <= lengths[-1] <= tau
    s = eng.stats()
    out["speculative"].update(kernels_per_step=s["kernels_per_speculative_step"],
                              launches_per_step=s["launches_per_speculative_step"])
    if plain:
        out["plain"] = generate_times(eng, prompt, new_tokens, reps, speculative=False)
        del out["plain"]["acceptance_lengths"]
        s = eng.stats()
        out["plain"].update(kernels_per_step=s["kernels_per_decode_step"], launches_per_step=s["launches_per_decode_step"])
    del eng
    eng = ocria_rt.Engine(model_dir, device=device, drafter=drafter_dir, max_context=max_context,
                          benchmark_forced_acceptance=tau, benchmark_phase_timing=True)
    eng.generate(prompt, new_tokens, stop_token_ids=[])  # warm-up: the three graphs captured
    phases = []
    for _ in range(reps):
        eng.generate(prompt, new_tokens, stop_token_ids=[])
        s = eng.stats()
        n = s["timed_speculative_steps"]
        phases.append({p: 1e3 * s[f"speculative_{p}_seconds"] / n for p in ("draft", "verify", "commit")})
    out["phases_ms"] = {p: statistics.median(x[p] for x in phases) for p in ("draft", "verify", "commit")}
    out["phase_launches_per_step"] = eng.stats()["launches_per_speculative_step"]
    del eng
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="JSON output path")
    ap.add_argument("--shapes", default="ocria1-4b", help=f"target shapes, of {','.join(TARGETS)}")
    ap.add_argument("--quant", default="bf16,nvfp4", help=f"target weight formats, of {','.join(FORMATS)}")
    ap.add_argument("--taus", default="1,4,8,12,16", help=f"forced acceptance lengths (1..{BLOCK})")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ocria-bench"))
    args = ap.parse_args(argv)
    shapes, formats = args.shapes.split(","), args.quant.split(",")
    taus = [int(t) for t in args.taus.split(",")]
    for s in shapes:
        if s not in TARGETS or s not in DRAFTERS:
            ap.error(f"--shapes: unknown shape {s!r} (one of {', '.join(DRAFTERS)})")
    for fmt in formats:
        if fmt not in FORMATS:
            ap.error(f"--quant: unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    if not all(1 <= t <= BLOCK for t in taus):
        ap.error(f"--taus: each must be in 1..{BLOCK}")

    if args.device == "cuda":
        import torch

        bw = measure_copy_bandwidth()
        device_name = torch.cuda.get_device_name()
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    else:
        import platform

        bw, device_name = None, f"cpu ({platform.processor() or platform.machine()})"
    result = {"device": device_name, "copy_bandwidth_Bps": bw, "block_size": BLOCK, "prompt": args.prompt,
              "new_tokens": args.new_tokens, "reps": args.reps, "runs": []}
    rows = []
    rng = np.random.default_rng(0)
    for shape in shapes:
        c, d = target_config(shape), DRAFTERS[shape]
        root = args.workdir / (shape if args.device == "cuda" else f"{shape}-cpu")
        bf16_dir = target_checkpoint(shape, root, args.device)
        drafter_dir = write_random(args.workdir / f"{shape}-dflash2", drafter_config(c, d), drafter_shapes(c, d), seed=1)
        prompt = [int(t) for t in rng.integers(0, c["vocab_size"] - 1, args.prompt)]
        context = args.prompt + args.new_tokens // 2
        for fmt in formats:
            model_dir = bf16_dir if fmt == "bf16" else write_quantized_checkpoint(
                bf16_dir, bf16_dir.with_name(f"{bf16_dir.name}-{fmt}"), fmt, device=args.device)
            need = spec_step_bytes(c, d, context, fmt)
            plain_need = bytes_per_decode_step(c, context, fmt)["total"]
            run = {"shape": shape, "weights": fmt, "spec_step_bytes": need, "decode_step_bytes": plain_need,
                   "taus": []}
            for i, tau in enumerate(taus):
                r = bench_tau(model_dir, drafter_dir, args.device, prompt, args.new_tokens, args.reps, tau, plain=i == 0)
                if bw:
                    r["ceiling_tokens_per_s"] = tau * bw / need["total"]
                    r["phase_ceiling_ms"] = {p: 1e3 * need[p] / bw for p in ("draft", "verify", "commit")}
                if "plain" in r:
                    run["plain"] = r.pop("plain")
                    if bw:
                        run["plain"]["ceiling_tokens_per_s"] = bw / plain_need
                run["taus"].append(r)
                args.out.write_text(json.dumps({**result, "runs": result["runs"] + [run]}, indent=1))
                print(json.dumps({"shape": shape, "weights": fmt, **r}), flush=True)
            result["runs"].append(run)
            rows += table_rows(run)
    args.out.write_text(json.dumps(result, indent=1))
    print()
    print(f"Device: {device_name}; " + (f"copy bandwidth {bw / 1e12:.2f} TB/s (measured in this run). " if bw else
                                        "no ceilings on the CPU. ")
          + f"Batch 1, prompt {args.prompt} tokens, {args.new_tokens} new tokens, medians of {args.reps}; "
          f"DFlash2 drafter of block {BLOCK}, random weights, acceptance forced to tau "
          f"(benchmark_forced_acceptance: timing only). tok/s: generate() wall time (host loop included); "
          f"ceiling: tau x copy bandwidth / the bytes of a speculative step (plain: of a decode step). "
          + ("draft / verify / commit: device time per step from CUDA events between the phases, each "
             "replayed as its own graph (ceiling: its bytes at copy bandwidth)." if bw else
             "draft / verify / commit: host clock per step between the phases."))
    print(markdown_table(rows, list(rows[0].keys())))
    return 0


def table_rows(run: dict) -> list[dict]:
    def ceil(x: dict, key: str, fmt: str) -> str:
        return fmt.format(x[key]) if key in x else "-"

    plain = run.get("plain")
    out = []
    if plain:
        out.append({"model": run["shape"], "weights": run["weights"], "tau": "plain decode",
                    "tok/s": f"{plain['tokens_per_s']:.1f}", "ceiling tok/s": ceil(plain, "ceiling_tokens_per_s", "{:.1f}"),
                    "% ceiling": (f"{100 * plain['tokens_per_s'] / plain['ceiling_tokens_per_s']:.1f}"
                                  if "ceiling_tokens_per_s" in plain else "-"),
                    "vs plain": "1.00x", "ms/step": f"{plain['ms_per_step']:.3f}", "draft ms": "-", "verify ms": "-",
                    "commit ms": "-", "kernels/step": plain["kernels_per_step"],
                    "launches/step": plain["launches_per_step"], "forced ok": "-"})
    for r in run["taus"]:
        sp, ph, pc = r["speculative"], r["phases_ms"], r.get("phase_ceiling_ms", {})

        def phase(p: str) -> str:
            return f"{ph[p]:.3f}" + (f" ({pc[p]:.3f})" if p in pc else "")

        out.append({"model": run["shape"], "weights": run["weights"], "tau": r["tau"],
                    "tok/s": f"{sp['tokens_per_s']:.1f}", "ceiling tok/s": ceil(r, "ceiling_tokens_per_s", "{:.1f}"),
                    "% ceiling": (f"{100 * sp['tokens_per_s'] / r['ceiling_tokens_per_s']:.1f}"
                                  if "ceiling_tokens_per_s" in r else "-"),
                    "vs plain": f"{sp['tokens_per_s'] / plain['tokens_per_s']:.2f}x" if plain else "-",
                    "ms/step": f"{sp['ms_per_step']:.3f}", "draft ms": phase("draft"), "verify ms": phase("verify"),
                    "commit ms": phase("commit"), "kernels/step": sp["kernels_per_step"],
                    "launches/step": sp["launches_per_step"], "forced ok": "yes" if r["forced_ok"] else "NO"})
    return out


if __name__ == "__main__":
    sys.exit(main())
