"""Batch-1 decode (and prefill) of Qwen3.5 text shapes on one GPU: ocria_rt against the roofline
and against two peers on the same weights, in the same process.

    python bench/decode.py OUT.json [--shapes ocria1-4b,qwen3.5-0.8b] [--prompts 1024,8192]
                                    [--quant bf16,fp8,nvfp4,mixed] [--new-tokens 512] [--peer-tokens 32]
                                    [--check-tokens 128] [--check-margin 0.5] [--no-peer] [--no-graph-peer]
                                    [--no-eager-peer] [--no-pdl-off] [--breakdown STEPS]

Peers (BF16): the graph peer, bench/torch_peer.py, runs the model the way serving engines do at
batch 1 (cuBLAS GEMMs, fla's fused DeltaNet / conv / norm kernels, torch's flash attention over a
static KV cache, greedy on the GPU, the step captured in one CUDA graph); its greedy tokens are
checked against ours step by step (teacher-forced on our tokens: compare_greedy). The eager peer is
transformers + flash-linear-attention run token by token.

--quant: each format's checkpoint is written from the BF16 random weights on the device in ModelOpt's
format (bench/quant_checkpoint.py) and decoded by ours beside its own roofline (the bytes of its
quantized step) and the BF16 graph peer.

Every figure sits beside its ceiling: decode against bytes-per-step / measured copy bandwidth,
prefill against FLOPs / the measured BF16 matmul rate. Medians over --reps runs. Decode is also
measured with programmatic dependent launch off (OCRIA_RT_PDL=0) unless --no-pdl-off.
--breakdown STEPS adds where a BF16 decode step's GPU time goes, kernel group by kernel group, against
the bytes each must move (see decode_breakdown), for PDL on and (unless --no-pdl-off) off.
"""

from __future__ import annotations

import argparse
import itertools
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
from quant_checkpoint import FORMATS, write_quantized_checkpoint  # noqa: E402


def prefill_flops(c: dict, n: int) -> float:
    attn_layers = sum(layer_is_attention(i) for i in range(c["num_hidden_layers"]))
    causal_attn = 2 * 2 * (n * n / 2) * c["num_attention_heads"] * c["head_dim"] * attn_layers
    return 2.0 * linear_params(c) * n + causal_attn


def engine_linears(c: dict) -> list[dict]:
    """The weight streams of one decode step as the engine fuses them (csrc/model/qwen35.h): name, N
    (outputs), K (inputs), how many per step, and `epi`, what its skinny GEMM does besides the product
    (the template arguments GLU, ADD, NORM): the MLP activation applied as it stores (gate_up), the
    residual add (the projections that end a residual block), the RMSNorm scale (those that start one).
    `after`: how the name of the kernel before it in a decode step starts, which tells apart linears
    that are one kernel on one grid (the 4B's 2560-output projections: o_proj follows attention,
    out_proj the DeltaNet kernel, down gate_up's skinny GEMM)."""
    H, I, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    Hq, Hkv = c["num_attention_heads"], c["num_key_value_heads"]
    HK, HV, dk, dv = c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
    L = c["num_hidden_layers"]
    n_attn = sum(layer_is_attention(i) for i in range(L))
    norm, add, glu_norm, plain = (False, False, True), (False, True, False), (True, False, True), (False, False, False)
    gemm = "skinny_gemm_kernel"
    return [dict(name="attn qkv", N=Hq * 2 * hd + 2 * Hkv * hd, K=H, count=n_attn, epi=norm, after=gemm),
            dict(name="attn o", N=H, K=Hq * hd, count=n_attn, epi=add, after="attention"),
            dict(name="gdn in_proj", N=2 * HK * dk + 2 * HV * dv + 2 * HV, K=H, count=L - n_attn, epi=norm, after=gemm),
            dict(name="gdn out", N=H, K=HV * dv, count=L - n_attn, epi=add, after="gdn_"),
            dict(name="mlp gate_up", N=2 * I, K=H, count=L, epi=glu_norm, after=gemm),
            dict(name="mlp down", N=H, K=I, count=L, epi=add, after=gemm),
            dict(name="lm_head", N=c["vocab_size"], K=H, count=1, epi=plain, after="rms_norm")]


def short_kernel_name(name: str) -> str:
    """'void ns::(anonymous namespace)::f<a, b>(args...)' -> 'f<a, b>'."""
    name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    depth = 0
    for i, ch in enumerate(name):
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0:
            name = name[:i]
            break
    head = name.split("<", 1)[0]  # the namespaces end before the template arguments
    return name[head.rfind("::") + 2:] if "::" in head else name


def kernel_time_by_group(events: list[dict]) -> tuple[dict, float]:
    """Kernels of a Chrome trace grouped by (short name, grid): calls, summed duration and time on the
    critical path (us). Sorted by start, a kernel's critical-path time is how far its end moves the
    GPU's finished front, end - max(front, start): overlapping kernels (programmatic dependent launch)
    share an interval once, so the groups' critical-path times plus the idle gaps sum to the span from
    the first kernel's start to the last one's end. Each group also has the same three figures by the
    kernel that started before (its name without template arguments), in `before`; the idle gaps are
    also summed by the kernels on either side (the one whose end was the front, the one that started:
    names without template arguments). Returns
    ({key: {calls, us, crit_us, before: {name: {calls, us, crit_us}}}}, idle_us, {(after, before): us})."""
    ks = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e) for e in events
                if e.get("ph") == "X" and e.get("cat") == "kernel")
    groups: dict[tuple, dict] = {}
    front, idle, previous, front_name = None, 0.0, "", ""
    gaps: dict[tuple[str, str], float] = {}
    for start, end, e in ks:
        name = short_kernel_name(e.get("name", "?"))
        base_name = name.split("<", 1)[0]
        g = groups.setdefault((name, tuple(e.get("args", {}).get("grid", ()))),
                              {"calls": 0, "us": 0.0, "crit_us": 0.0, "before": {}})
        part = g["before"].setdefault(previous, {"calls": 0, "us": 0.0, "crit_us": 0.0})
        previous = base_name
        crit = end - start if front is None else max(0.0, end - max(front, start))
        if front is not None and start > front:
            idle += start - front
            gaps[(front_name, base_name)] = gaps.get((front_name, base_name), 0.0) + start - front
        if front is None or end > front:
            front, front_name = end, base_name
        for s in (g, part):
            s["calls"] += 1
            s["us"] += end - start
            s["crit_us"] += crit
    return groups, idle, gaps


def linears_by_calls(candidates: list[dict], calls: float | None) -> list[dict]:
    """The one subset of `candidates` whose calls per step (their layer counts) add up to `calls`;
    none when no subset or several do."""
    fits = [sub for n in range(1, len(candidates) + 1) for sub in itertools.combinations(candidates, n)
            if calls is not None and sum(l["count"] for l in sub) == round(calls)]
    return list(fits[0]) if len(fits) == 1 else []


def label_groups(rows: list[dict], c: dict, context: int) -> None:
    """Names each group's work and the bytes it must move per step (weights of the linears a skinny
    GEMM's grid matches, or for persistent launches its calls per step; the KV cache for attention,
    the DeltaNet states for their decode kernel)."""
    need = bytes_per_decode_step(c, context)
    linears = engine_linears(c)
    for r in rows:
        name, grid = r["kernel"], r["grid"]
        r["work"], r["bytes_per_step"] = "", None
        if name.startswith("skinny_gemm_kernel<") and grid:
            # WARPS, NT, U, S, GLU, ADD, NORM, SPLIT, CS, PERSIST, RT, OutT
            targs = [a.strip() for a in name.split("<", 1)[1].split(",")]
            epi, blocks_per_tile, persistent = tuple(a == "true" for a in targs[4:7]), int(targs[8]), targs[9] == "true"
            rows = 16 * int(targs[10]) if len(targs) > 11 else 16  # a block tile's rows
            same_kind = [l for l in linears if l["epi"] == epi]
            if persistent:  # the grid is the blocks that fit at once, not the tiles
                tall_enough = [l for l in same_kind if -(-l["N"] // rows) >= grid[0]]
                hits = linears_by_calls(tall_enough, r.get("calls_per_step"))
            else:
                hits = [l for l in same_kind if -(-l["N"] // rows) == grid[0] // blocks_per_tile]
            if hits:
                r["work"] = " / ".join(l["name"] for l in hits)
                r["bytes_per_step"] = float(sum(2 * l["N"] * l["K"] * l["count"] for l in hits))
        elif name.startswith(("attention_kernel", "attention_decode_kernel")):
            r["work"], r["bytes_per_step"] = "attention (KV cache)", need["kv_cache"]
        elif name.startswith("gdn_decode_kernel"):
            r["work"], r["bytes_per_step"] = "DeltaNet (state in and out)", need["gdn_state"]


def split_by_predecessor(rows: list[dict], c: dict) -> list[dict]:
    """Rows whose work is several linears (one kernel on one grid) split into a row per linear where
    the kernel before each call tells them apart (engine_linears' `after`) and each linear's calls
    all follow one kind of kernel; other rows as they are. A row's `parts` are its figures by
    predecessor."""
    linears = {l["name"]: l for l in engine_linears(c)}
    out = []
    for r in rows:
        names = r["work"].split(" / ") if r["work"] else []
        parts = r.get("parts", {})
        if len(names) < 2 or not all(n in linears for n in names):
            out.append(r)
            continue
        owner = {p: [n for n in names if p.startswith(linears[n]["after"])] for p in parts}
        if any(len(o) != 1 for o in owner.values()) or sorted(o[0] for o in owner.values()) != sorted(names):
            out.append(r)
            continue
        for p, (n,) in owner.items():
            l = linears[n]
            out.append({**r, **parts[p], "work": n, "after": p, "parts": {},
                        "bytes_per_step": float(2 * l["N"] * l["K"] * l["count"])})
    return out


def decode_breakdown(eng, prompt: list[int], steps: int, c: dict, bw: float) -> dict:
    """Where a decode step's GPU time goes, kernel group by kernel group (name and grid): a profiled
    generate of 1 + `steps` tokens minus one of 1 token (the prefill alone), divided by `steps`.
    Per group: calls, summed kernel duration, critical-path time (kernel_time_by_group), the bytes
    its work must move and that at the copy bandwidth `bw`, and the excess of its critical-path time
    over that ideal. kernels_per_step counts what CUPTI saw (the engine's own count is in the run)."""
    per_run = []
    for n in (1, 1 + steps):
        box = {}
        events = profiled_trace_events(lambda: box.update(r=eng.generate(prompt, max_new_tokens=n, stop_token_ids=[])))
        per_run.append((*kernel_time_by_group(events), box["r"]))
    (base, base_idle, base_gaps, _), (full, full_idle, full_gaps, result) = per_run
    def per_step(g: dict, b: dict) -> dict:  # the decode steps' share: the full run less the prefill's
        return {"calls_per_step": (g["calls"] - b["calls"]) / steps, "us_per_step": (g["us"] - b["us"]) / steps,
                "crit_us_per_step": (g["crit_us"] - b["crit_us"]) / steps}

    none = {"calls": 0, "us": 0.0, "crit_us": 0.0, "before": {}}
    rows = []
    for key, g in full.items():
        b = base.get(key, none)
        row = {"kernel": key[0][:100], "grid": list(key[1]), **per_step(g, b)}
        row["parts"] = {p: s for p, s in ((p, per_step(x, b["before"].get(p, none))) for p, x in g["before"].items())
                        if s["calls_per_step"] > 0}
        if row["calls_per_step"] > 0:
            rows.append(row)
    if not rows:
        return {"error": "the profiler recorded no kernels in the decode steps"}
    label_groups(rows, c, len(prompt) + steps // 2)
    rows = split_by_predecessor(rows, c)
    for x in rows:
        x["ideal_us_per_step"] = 1e6 * x["bytes_per_step"] / bw if x["bytes_per_step"] else 0.0
        x["excess_us_per_step"] = x["crit_us_per_step"] - x["ideal_us_per_step"]
    rows.sort(key=lambda x: -x["crit_us_per_step"])
    return {"steps": steps, "wall_us_per_step": 1e6 / result.decode_tokens_per_second,
            "kernel_us_per_step": sum(x["us_per_step"] for x in rows),
            "crit_us_per_step": sum(x["crit_us_per_step"] for x in rows),
            "idle_us_per_step": (full_idle - base_idle) / steps,
            "idle_gaps": sorted(({"after": a, "before": b, "us_per_step": (us - base_gaps.get((a, b), 0.0)) / steps}
                                 for (a, b), us in full_gaps.items()), key=lambda x: -x["us_per_step"]),
            "ideal_us_per_step": sum(x["ideal_us_per_step"] for x in rows),
            "kernels_per_step": sum(x["calls_per_step"] for x in rows), "groups": rows}


def breakdown_table(b: dict) -> str:
    rows = [{"work": x["work"] or "-", "kernel": x["kernel"][:60], "grid": "x".join(map(str, x["grid"])),
             "after": x.get("after", ""),
             "calls/step": f"{x['calls_per_step']:.0f}", "us/step": f"{x['us_per_step']:.1f}",
             "critical us/step": f"{x['crit_us_per_step']:.1f}",
             "MB/step": f"{x['bytes_per_step'] / 1e6:.1f}" if x["bytes_per_step"] else "-",
             "us at copy BW": f"{x['ideal_us_per_step']:.1f}" if x["bytes_per_step"] else "-",
             "% of copy BW": (f"{100 * x['ideal_us_per_step'] / x['crit_us_per_step']:.0f}"
                              if x["bytes_per_step"] and x["crit_us_per_step"] > 0 else "-"),
             "excess us": f"{x['excess_us_per_step']:.1f}"} for x in b["groups"]]
    idle = [("idle (no kernel running)", "", b["idle_us_per_step"])]
    # where it is: the largest gaps by the kernels on either side (before -> after in the columns)
    idle += [("  idle gap", f"{g['after']} -> {g['before']}", g["us_per_step"])
             for g in b.get("idle_gaps", [])[:4] if g["us_per_step"] >= 0.05]
    for work, where, us in idle:
        rows.append({"work": work, "kernel": where, "grid": "", "after": "", "calls/step": "", "us/step": "",
                     "critical us/step": f"{us:.1f}", "MB/step": "", "us at copy BW": "", "% of copy BW": "",
                     "excess us": f"{us:.1f}"})
    return markdown_table(rows, list(rows[0].keys()))


def bench_ours(model_dir: Path, prompt: list[int], new_tokens: int, reps: int, pdl: bool = True,
               breakdown_steps: int = 0, c: dict | None = None, bw: float = 0.0) -> dict:
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
            out["breakdown"] = decode_breakdown(eng, prompt, breakdown_steps, c, bw)
        except Exception as e:  # diagnostic: a profiler failure must not lose the timings
            out["breakdown"] = {"error": f"{type(e).__name__}: {e}"}
    del eng
    return out


def bench_eager_peer(model_dir: Path, prompt: list[int], new_tokens: int,
                     check_tokens: list[int] | None = None) -> tuple[dict, np.ndarray | None]:
    """transformers 5.x with flash-linear-attention kernels (when importable), BF16, greedy: the
    prompt is prefilled once, then `new_tokens` single-token forwards with the cache are timed.
    With check_tokens, also its logits [len, vocab] predicting each of them after the prompt and the
    ones before (one forward), else None."""
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
        del cache, out
        forced = None
        if check_tokens:
            seq = torch.tensor([prompt + check_tokens[:-1]], device="cuda")
            forced = model(seq, logits_to_keep=len(check_tokens)).logits[0].float().cpu().numpy()
    del model
    torch.cuda.empty_cache()
    return {"decode_tokens_per_s": new_tokens / decode, "prefill_s": prefill, "fla": fla_version, "tokens": new_tokens}, forced


def bench_graph_peer(peer, prompt: list[int], new_tokens: int, reps: int) -> dict:
    """The graph peer (bench/torch_peer.py, built once per shape): greedy from the prompt, the decode
    steps timed (new_tokens - 1 graph replays after the prefill's token, as ours counts them)."""
    rates = []
    for _ in range(reps):
        tokens, seconds = peer.generate(prompt, new_tokens)
        assert len(tokens) == new_tokens
        rates.append((new_tokens - 1) / seconds)
    return {"decode_tokens_per_s": statistics.median(rates), "tokens": new_tokens, "kernels": peer.kernels.name,
            "attention": peer.kernels.attention, "cuda_graph": peer.graph is not None}


def compare_greedy(ours: np.ndarray, theirs: np.ndarray, our_tokens: list[int], margin: float) -> dict:
    """Our greedy tokens against a peer's, step by step: ours [steps, vocab] are our logits at each
    step (predicting our_tokens), theirs the peer's after the same tokens (teacher-forced). A step
    where the argmaxes differ counts as a disagreement beyond BF16 noise only where our top-2 margin
    exceeds `margin` (logits); the logit differences themselves are reported too."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    top2 = np.partition(ours, -2, axis=-1)[:, -2:]
    our_margin = top2.max(-1) - top2.min(-1)
    differ = theirs.argmax(-1) != np.asarray(our_tokens)
    clear = our_margin > margin
    diff = np.abs(theirs - ours)
    rel = np.linalg.norm(theirs - ours, axis=-1) / np.linalg.norm(ours, axis=-1)
    return {"steps": int(len(our_tokens)), "margin": margin, "steps_above_margin": int(clear.sum()),
            "disagreements_above_margin": int((differ & clear).sum()), "disagreements": int(differ.sum()),
            "margins_where_they_differ": [round(float(m), 4) for m in our_margin[differ]],
            "median_margin": float(np.median(our_margin)), "max_abs_logit_diff": float(diff.max()),
            "median_step_max_abs_logit_diff": float(np.median(diff.max(-1))),
            "median_rel_logit_err": float(np.median(rel))}


def our_greedy_reference(model_dir: Path, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """Our greedy continuation (the decode path) and our logits along it [steps, vocab] (score)."""
    import ocria_rt

    eng = ocria_rt.Engine(model_dir, device="cuda", max_context=len(prompt) + steps + 8)
    tokens = eng.generate(prompt, max_new_tokens=steps, stop_token_ids=[]).token_ids
    logits = eng.score(prompt + tokens[:-1])[len(prompt) - 1:].copy()  # the rest of score's array goes
    del eng
    return tokens, logits


def token_check_cell(check: dict | None) -> str:
    if not check:
        return "-"
    return (f"{check['disagreements_above_margin']}/{check['steps_above_margin']} "
            f"({check['disagreements']}/{check['steps']})")


def logit_err_cell(checks: dict) -> str:
    """The median relative logit error against ours: graph peer / eager peer (BF16's own yardstick)."""
    if not checks:
        return "-"
    return " / ".join(f"{checks[k]['median_rel_logit_err']:.3f}" if k in checks else "-" for k in ("graph_peer", "eager_peer"))


def failure(what: str, e: Exception) -> dict:
    """An exception as a JSON entry, its traceback in the log."""
    import traceback

    traceback.print_exc()
    print(f"{what} failed: {type(e).__name__}: {e}", flush=True)
    return {"error": f"{type(e).__name__}: {e}"}


def quantized_dir(bf16_dir: Path, fmt: str) -> Path:
    """The checkpoint of format `fmt` made from the BF16 random weights at bf16_dir (written once,
    quantized on the GPU)."""
    return write_quantized_checkpoint(bf16_dir, bf16_dir.with_name(f"{bf16_dir.name}-{fmt}"), fmt, device="cuda")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="JSON output path")
    ap.add_argument("--shapes", default="ocria1-4b,qwen3.5-0.8b")
    ap.add_argument("--prompts", default="1024,8192")
    ap.add_argument("--quant", default="bf16", help=f"weight formats to decode, of {','.join(FORMATS)}")
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--peer-tokens", type=int, default=32, help="tokens the (slow) eager peer generates")
    ap.add_argument("--check-tokens", type=int, default=128,
                    help="greedy steps compared between ours and the graph peer (0: no check)")
    # BF16 noise on these random weights: a logit's error is ~0.1 (BF16 against fp32, qwen3.5-0.8b shape,
    # measured on the CPU), so two BF16 runs' top-2 differences differ by ~0.2 rms; 0.5 is 2.5 of those.
    ap.add_argument("--check-margin", type=float, default=0.5,
                    help="our top-2 logit margin above which a differing token counts as a disagreement")
    ap.add_argument("--no-peer", action="store_true", help="neither peer")
    ap.add_argument("--no-graph-peer", action="store_true")
    ap.add_argument("--no-eager-peer", action="store_true")
    ap.add_argument("--no-pdl-off", action="store_true", help="skip the decode run with OCRIA_RT_PDL=0")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ocria-bench"))
    ap.add_argument("--breakdown", type=int, default=0, metavar="STEPS",
                    help="also profile STEPS decode steps: GPU time per kernel name (0: off)")
    args = ap.parse_args()
    formats = args.quant.split(",")
    for fmt in formats:
        if fmt not in FORMATS:
            ap.error(f"--quant: unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    prompts = [int(x) for x in args.prompts.split(",")]

    import ocria_rt
    import torch
    from torch_peer import TorchPeer

    bw = measure_copy_bandwidth()
    mm = measure_matmul_rate()
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw, "bf16_matmul_flops": mm, "runs": []}
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        c = full_config(SHAPES[shape])
        bf16_dir = make_random_checkpoint(shape, args.workdir / shape)
        peer = peer_failure = None
        if not (args.no_peer or args.no_graph_peer):
            try:
                peer = TorchPeer(bf16_dir, device="cuda", max_new_tokens=max(args.new_tokens, args.check_tokens),
                                 max_context=max(prompts) + max(args.new_tokens, args.check_tokens) + 8)
            except Exception as e:  # a peer that cannot run must not lose our figures
                peer_failure = failure("graph peer", e)
        for n in prompts:
            prompt = [int(t) for t in rng.integers(0, c["vocab_size"], n)]
            mid_context = n + args.new_tokens // 2
            bf16_roof = bw / bytes_per_decode_step(c, mid_context)["total"]
            graph_peer, eager_peer = peer_failure, None
            checks, reference = {}, None
            eager = not (args.no_peer or args.no_eager_peer)
            if args.check_tokens and (peer is not None or eager):
                reference = our_greedy_reference(bf16_dir, prompt, args.check_tokens)
            if peer is not None:
                try:
                    graph_peer = bench_graph_peer(peer, prompt, args.new_tokens, args.reps)
                    if reference:
                        forced = peer.teacher_forced_logits(prompt, reference[0]).numpy()
                        checks["graph_peer"] = compare_greedy(reference[1], forced, reference[0], args.check_margin)
                except Exception as e:
                    graph_peer = failure("graph peer", e)
            if eager:
                eager_peer, forced = bench_eager_peer(bf16_dir, prompt, args.peer_tokens, reference and reference[0])
                if reference:
                    checks["eager_peer"] = compare_greedy(reference[1], forced, reference[0], args.check_margin)
            del reference
            for fmt in formats:
                model_dir = bf16_dir if fmt == "bf16" else quantized_dir(bf16_dir, fmt)
                need = bytes_per_decode_step(c, mid_context, quant=fmt)
                roof_tps = bw / need["total"]
                flops = prefill_flops(c, n)
                steps = args.breakdown if fmt == "bf16" else 0  # the breakdown's byte labels are BF16's
                run = {"shape": shape, "prompt": n, "weights": fmt, "new_tokens": args.new_tokens, "bytes_per_step": need,
                       "roofline_tokens_per_s": roof_tps, "bf16_roofline_tokens_per_s": bf16_roof, "prefill_flops": flops}
                try:
                    ours = bench_ours(model_dir, prompt, args.new_tokens, args.reps, breakdown_steps=steps, c=c, bw=bw)
                    if not args.no_pdl_off:
                        run["ours_pdl_off"] = bench_ours(model_dir, prompt, args.new_tokens, args.reps, pdl=False,
                                                         breakdown_steps=steps, c=c, bw=bw)
                except ocria_rt.OcriaError as e:  # e.g. a format the engine cannot load yet
                    ours = {"error": f"{type(e).__name__}: {e}"}
                    print(f"{shape} {fmt}: {ours['error']}", flush=True)
                run["ours"] = ours
                if graph_peer:
                    run["graph_peer"] = graph_peer
                if checks and fmt == formats[0]:  # on the BF16 weights, reported once per prompt
                    run["token_check"] = checks
                if eager_peer:
                    run["peer"] = eager_peer
                result["runs"].append(run)
                ok = "error" not in ours
                tps = ours["decode_tokens_per_s"] if ok else None
                gp = graph_peer if graph_peer and "error" not in graph_peer else None
                rows.append({
                    "model": shape, "prompt": n, "weights": fmt,
                    "ours tok/s": f"{tps:.1f}" if ok else "failed",
                    "ms/step": f"{1e3 / tps:.2f}" if ok else "-",
                    "ms/step PDL off": (f"{1e3 / run['ours_pdl_off']['decode_tokens_per_s']:.2f}"
                                        if "ours_pdl_off" in run else "-"),
                    "roofline tok/s": f"{roof_tps:.1f}",
                    "% roofline": f"{100 * tps / roof_tps:.1f}" if ok else "-",
                    "launches/step": ours["launches_per_step"] if ok else "-",
                    "kernels/step": ours["kernels_per_step"] if ok else "-",
                    "prefill tok/s": f"{n / ours['prefill_s']:.0f}" if ok else "-",
                    "prefill % matmul": f"{100 * flops / ours['prefill_s'] / mm:.1f}" if ok else "-",
                    "graph peer tok/s": f"{gp['decode_tokens_per_s']:.1f}" if gp else ("failed" if graph_peer else "-"),
                    "graph peer % BF16 roofline": f"{100 * gp['decode_tokens_per_s'] / bf16_roof:.1f}" if gp else "-",
                    "vs graph peer": f"{tps / gp['decode_tokens_per_s']:.2f}x" if gp and ok else "-",
                    "graph peer tokens differ (clear / all)": token_check_cell(run.get("token_check", {}).get("graph_peer")),
                    "logit rel err graph / eager": logit_err_cell(run.get("token_check", {})),
                    "eager peer tok/s": f"{eager_peer['decode_tokens_per_s']:.1f}" if eager_peer else "-",
                    "eager peer prefill tok/s": f"{n / eager_peer['prefill_s']:.0f}" if eager_peer else "-",
                    "vs eager peer": f"{tps / eager_peer['decode_tokens_per_s']:.1f}x" if eager_peer and ok else "-",
                })
                args.out.write_text(json.dumps(result, indent=1))
                print(rows[-1], flush=True)
        del peer
        torch.cuda.empty_cache()
    for run in result["runs"]:
        for which, label in (("ours", "PDL on"), ("ours_pdl_off", "PDL off")):
            b = run.get(which, {}).get("breakdown")
            if b is None:
                continue
            print(f"\nDecode step breakdown, {run['shape']}, prompt {run['prompt']}, {label}: "
                  + (b["error"] if "error" in b else
                     f"{b['kernels_per_step']:.0f} kernels in a {b['wall_us_per_step']:.0f} us step: "
                     f"{b['crit_us_per_step']:.0f} us on the critical path + {b['idle_us_per_step']:.0f} us idle; "
                     f"the bytes at copy bandwidth take {b['ideal_us_per_step']:.0f} us (profiled; {b['steps']} steps)"))
            if "groups" in b:
                print(breakdown_table(b))
    print()
    print(f"Device: {result['device']}; copy bandwidth {bw / 1e12:.2f} TB/s; BF16 matmul {mm / 1e12:.0f} TFLOP/s "
          f"(both measured in this run). Roofline = bytes per step (weights as stored: BF16, or FP8 / NVFP4 values + "
          f"block scales + fp32 row scales; KV at mid-generation context; DeltaNet state) / copy bandwidth. "
          f"Graph peer (BF16, {args.new_tokens} tokens): bench/torch_peer.py, the serving-engine recipe in one CUDA "
          f"graph; tokens differ: steps where its greedy token differs from ours, teacher-forced on our "
          f"{args.check_tokens} greedy tokens, among the steps where our top-2 logit margin exceeds "
          f"{args.check_margin} (clear) and among all; logit rel err: median over those steps of "
          f"|peer - ours| / |ours| (the eager peer's is BF16's own yardstick on these random weights). "
          f"Eager peer: transformers + flash-linear-attention, {args.peer_tokens} tokens.")
    print(markdown_table(rows, list(rows[0].keys())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
