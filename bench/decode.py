"""Batch-1 decode (and prefill) of Qwen3.5 text shapes on one GPU: ocria_rt against the roofline
and against transformers + flash-linear-attention on the same weights, in the same process.

    python bench/decode.py OUT.json [--shapes ocria1-4b,qwen3.5-0.8b] [--prompts 1024,8192]
                                    [--new-tokens 512] [--peer-tokens 32] [--no-peer] [--no-pdl-off]
                                    [--breakdown STEPS]

Every figure sits beside its ceiling: decode against bytes-per-step / measured copy bandwidth,
prefill against FLOPs / the measured BF16 matmul rate. Medians over --reps runs. Decode is also
measured with programmatic dependent launch off (OCRIA_RT_PDL=0) unless --no-pdl-off.
--breakdown STEPS adds where a decode step's GPU time goes, kernel by kernel (see decode_breakdown).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (SHAPES, bytes_per_decode_step, full_config, layer_is_attention, linear_params,  # noqa: E402
                    make_random_checkpoint, markdown_table, measure_copy_bandwidth, measure_matmul_rate,
                    profiled_trace_events)


def prefill_flops(c: dict, n: int) -> float:
    attn_layers = sum(layer_is_attention(i) for i in range(c["num_hidden_layers"]))
    causal_attn = 2 * 2 * (n * n / 2) * c["num_attention_heads"] * c["head_dim"] * attn_layers
    return 2.0 * linear_params(c) * n + causal_attn


def decode_breakdown(eng, prompt: list[int], steps: int, top: int = 16) -> dict:
    """GPU time per decode step, kernel by kernel: a profiled generate of 1 + `steps` tokens minus one
    of 1 token (which is the prefill alone), divided by `steps`. kernels_per_step counts what CUPTI saw
    (the engine's own count is kernels_per_step of the run); kernel_us_per_step is their summed
    duration, so wall_us_per_step - kernel_us_per_step is time the GPU spent between kernels (PDL
    overlap makes kernels' intervals overlap, which can make it negative)."""
    per_run = []
    for n in (1, 1 + steps):
        box = {}
        events = profiled_trace_events(lambda: box.update(r=eng.generate(prompt, max_new_tokens=n, stop_token_ids=[])))
        by_name: dict[str, list[float]] = {}
        for e in events:
            if e.get("ph") == "X" and e.get("cat") == "kernel":
                by_name.setdefault(e.get("name", "?"), []).append(float(e["dur"]))
        per_run.append((by_name, box["r"]))
    (base, _), (full, r) = per_run
    rows = []
    for name, durs in full.items():
        us = (sum(durs) - sum(base.get(name, []))) / steps
        calls = (len(durs) - len(base.get(name, []))) / steps
        if calls > 0:
            rows.append({"name": name[:140], "us_per_step": us, "calls_per_step": calls})
    rows.sort(key=lambda x: -x["us_per_step"])
    if not rows:
        return {"error": "the profiler recorded no kernels in the decode steps"}
    return {"steps": steps, "wall_us_per_step": 1e6 / r.decode_tokens_per_second,
            "kernel_us_per_step": sum(x["us_per_step"] for x in rows),
            "kernels_per_step": sum(x["calls_per_step"] for x in rows), "top": rows[:top]}


def bench_ours(model_dir: Path, prompt: list[int], new_tokens: int, reps: int, pdl: bool = True,
               breakdown_steps: int = 0) -> dict:
    import ocria_rt

    os.environ["OCRIA_RT_PDL"] = "1" if pdl else "0"  # read when the engine's backend is constructed
    eng = ocria_rt.Engine(model_dir, device="cuda", max_context=len(prompt) + new_tokens + 8)
    eng.generate(prompt[:64], max_new_tokens=8, stop_token_ids=[])  # warm-up: graph capture, module load
    decode, prefill = [], []
    for _ in range(reps):
        r = eng.generate(prompt, max_new_tokens=new_tokens, stop_token_ids=[])
        assert len(r.token_ids) == new_tokens
        decode.append(r.decode_tokens_per_second)
        prefill.append(r.prefill_seconds)
    stats = eng.stats()
    out = {"decode_tokens_per_s": statistics.median(decode), "prefill_s": statistics.median(prefill),
           "launches_per_step": stats["launches_per_decode_step"], "kernels_per_step": stats["kernels_per_decode_step"]}
    if breakdown_steps:
        try:
            out["breakdown"] = decode_breakdown(eng, prompt, breakdown_steps)
        except Exception as e:  # diagnostic: a profiler failure must not lose the timings
            out["breakdown"] = {"error": f"{type(e).__name__}: {e}"}
    del eng
    return out


def bench_peer(model_dir: Path, prompt: list[int], new_tokens: int) -> dict:
    """transformers 5.x with flash-linear-attention kernels (when importable), BF16, greedy: the
    prompt is prefilled once, then `new_tokens` single-token forwards with the cache are timed."""
    import torch
    import transformers

    try:
        import fla

        fla_version = getattr(fla, "__version__", "yes")
    except ImportError:
        fla_version = None
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        model(ids[:, :64], use_cache=True)  # warm-up (kernel compilation)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            out = model(tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        decode = time.perf_counter() - t0
    del model, cache, out
    torch.cuda.empty_cache()
    return {"decode_tokens_per_s": new_tokens / decode, "prefill_s": prefill, "fla": fla_version, "tokens": new_tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="JSON output path")
    ap.add_argument("--shapes", default="ocria1-4b,qwen3.5-0.8b")
    ap.add_argument("--prompts", default="1024,8192")
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--peer-tokens", type=int, default=32, help="tokens the (slow) peer generates")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--no-pdl-off", action="store_true", help="skip the decode run with OCRIA_RT_PDL=0")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ocria-bench"))
    ap.add_argument("--breakdown", type=int, default=0, metavar="STEPS",
                    help="also profile STEPS decode steps: GPU time per kernel name (0: off)")
    args = ap.parse_args()

    import torch

    bw = measure_copy_bandwidth()
    mm = measure_matmul_rate()
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw, "bf16_matmul_flops": mm, "runs": []}
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        c = full_config(SHAPES[shape])
        model_dir = make_random_checkpoint(shape, args.workdir / shape)
        for n in (int(x) for x in args.prompts.split(",")):
            prompt = [int(t) for t in rng.integers(0, c["vocab_size"], n)]
            ours = bench_ours(model_dir, prompt, args.new_tokens, args.reps, breakdown_steps=args.breakdown)
            mid_context = n + args.new_tokens // 2
            need = bytes_per_decode_step(c, mid_context)
            roof_tps = bw / need["total"]
            flops = prefill_flops(c, n)
            run = {"shape": shape, "prompt": n, "new_tokens": args.new_tokens, "ours": ours, "bytes_per_step": need,
                   "roofline_tokens_per_s": roof_tps, "prefill_flops": flops}
            if not args.no_pdl_off:
                run["ours_pdl_off"] = bench_ours(model_dir, prompt, args.new_tokens, args.reps, pdl=False)
            if not args.no_peer:
                run["peer"] = bench_peer(model_dir, prompt, args.peer_tokens)
            result["runs"].append(run)
            rows.append({
                "model": shape, "prompt": n,
                "ours tok/s": f"{ours['decode_tokens_per_s']:.1f}",
                "ms/step": f"{1e3 / ours['decode_tokens_per_s']:.2f}",
                "ms/step PDL off": (f"{1e3 / run['ours_pdl_off']['decode_tokens_per_s']:.2f}"
                                    if "ours_pdl_off" in run else "-"),
                "roofline tok/s": f"{roof_tps:.1f}",
                "% roofline": f"{100 * ours['decode_tokens_per_s'] / roof_tps:.1f}",
                "launches/step": ours["launches_per_step"], "kernels/step": ours["kernels_per_step"],
                "prefill tok/s": f"{n / ours['prefill_s']:.0f}",
                "prefill % matmul": f"{100 * flops / ours['prefill_s'] / mm:.1f}",
                "peer tok/s": f"{run['peer']['decode_tokens_per_s']:.1f}" if "peer" in run else "-",
                "peer prefill tok/s": f"{n / run['peer']['prefill_s']:.0f}" if "peer" in run else "-",
                "speed-up": f"{ours['decode_tokens_per_s'] / run['peer']['decode_tokens_per_s']:.1f}x" if "peer" in run else "-",
            })
            args.out.write_text(json.dumps(result, indent=1))
            print(rows[-1], flush=True)
    print()
    print(f"Device: {result['device']}; copy bandwidth {bw / 1e12:.2f} TB/s; BF16 matmul {mm / 1e12:.0f} TFLOP/s "
          f"(both measured in this run). Roofline = bytes per step (weights + KV at mid-generation context + "
          f"DeltaNet state) / copy bandwidth. Peer: transformers + flash-linear-attention, {args.peer_tokens} tokens.")
    print(markdown_table(rows, list(rows[0].keys())))
    for run in result["runs"]:
        b = run["ours"].get("breakdown")
        if b is None:
            continue
        print(f"\nDecode step breakdown, {run['shape']}, prompt {run['prompt']}: "
              + (b["error"] if "error" in b else
                 f"{b['kernels_per_step']:.0f} kernels, {b['kernel_us_per_step']:.0f} us of kernel time in a "
                 f"{b['wall_us_per_step']:.0f} us step (profiled; {b['steps']} steps)"))
        if "top" in b:
            print(markdown_table([{"kernel": x["name"][:90], "us/step": f"{x['us_per_step']:.1f}",
                                   "calls/step": f"{x['calls_per_step']:.1f}"} for x in b["top"]],
                                 ["kernel", "us/step", "calls/step"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
