"""Kernel benchmarks of the CUDA backend on OCRia-1 (Qwen3.5-4B text) shapes, each beside its ceiling.

    python bench/kernels.py OUT.json [--reps 10] [--skip-prefill] [--ksplit-sweep 2,3,4,6,8] [--cluster-sweep 2,4]
                                     [--persistent-sweep 0,1] [--rows-sweep 16,32] [--sweep-shapes o_proj,down]
                                     [--sweep-formats dense,fp8,nvfp4]

- linear, decode / verify (M = 1..16 tokens): achieved bandwidth (weight bytes + activations) against
  the measured device-to-device copy bandwidth (bytes read + written per second); --ksplit-sweep adds
  M = 1 / 16 with the skinny GEMM's split-K forced to each listed count (OCRIA_RT_SKINNY_KSPLIT), and
  --cluster-sweep with its K split over each listed number of blocks of a cluster (OCRIA_RT_SKINNY_CLUSTER),
  --persistent-sweep with persistent blocks always (1) or never (0) (OCRIA_RT_SKINNY_PERSISTENT; auto
  uses them for the shapes of many row tiles), --rows-sweep with block tiles of each listed height
  (OCRIA_RT_SKINNY_ROWS); --sweep-shapes limits the sweeps to the shapes whose names hold one of the
  listed pieces, --sweep-formats to the weight formats listed (default dense);
- linear, prefill (M = 8192): TFLOP/s against torch.matmul (cuBLAS) on the same shapes, same run;
- quantized linears (FP8, NVFP4 weights; --skip-quant leaves them out): decode at M = 1..16 against
  the copy bandwidth on the bytes they must move (the quantized weight with its scales, x, out), and
  prefill at M = 8192 in TFLOP/s beside the BF16 GEMM of the same run;
- Gated DeltaNet recurrence per layer at T = 1 and 16, against the time to read and write the fp32
  state once, and a speculative block's gdn_verify + gdn_commit (T = 16, all kept) against 8 us and
  flash-linear-attention's fused_recurrent_gated_delta_rule over the same 16 tokens (a state to the
  next, no rollback; with the prefill rows); GDN prefill (the chunked kernels) at T = 1k / 4k / 8k beside the token-serial
  recurrence and flash-linear-attention's chunk_gated_delta_rule (when fla and torch import);
- attention decode (T = 1) and a speculative verify block (T = 16) at 1k / 8k / 32k context, against
  reading the KV cache once, and the whole step (attention_decode: q / k norms, RoPE, cache write,
  attention; for T = 1 one kernel) beside attention_prepare + attention; for T = 16 also the
  flash-decoding kernels the verify kernel replaces (OCRIA_RT_ATTN_VERIFY=0);
- attention prefill (causal, T = 1k / 4k / 8k tokens from an empty cache): TFLOP/s against torch's
  scaled_dot_product_attention (flash backend, K / V repeated over the GQA group) on the same shapes;
- sampling over the 248320-entry vocabulary.

Times come from ocria_rt._core.KernelBench: `iters` back-to-back calls captured in one CUDA graph,
replayed `reps` times, median time per call; weights / caches / states are replicated so that every
timed sequence streams >= 256 MiB (no L2 reuse between calls), and all data is random (never zeros).
A Markdown table is printed last; everything goes to OUT.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, cuda_times, markdown_table  # noqa: E402

C = SHAPES["ocria1-4b"]
H, I, V = C["hidden_size"], C["intermediate_size"], C["vocab_size"]
HQ, HKV, HD = C["num_attention_heads"], C["num_key_value_heads"], C["head_dim"]
HK, HV, DK, DV = (C["linear_num_key_heads"], C["linear_num_value_heads"], C["linear_key_head_dim"],
                  C["linear_value_head_dim"])

LINEAR_SHAPES = [  # name, N (out), K (in), the op as a decode step runs it (KernelBench.linear)
    ("gdn qkvzba (fused in_proj)", 2 * HK * DK + HV * DV * 2 + 2 * HV, H, "rms_norm_linear"),  # 12352
    ("attn qkv (fused q|gate, k, v)", HQ * HD * 2 + 2 * HKV * HD, H, "rms_norm_linear"),  # 10240
    ("attn o_proj", H, HQ * HD, "linear_add"),  # 2560 x 4096
    ("gdn out_proj", H, HV * DV, "linear_add"),  # 2560 x 4096
    ("mlp gate_up", 2 * I, H, "rms_norm_linear_glu"),  # 18432 x 2560, out [M, N / 2] = silu(gate) * up
    ("mlp down", H, I, "linear_add"),  # 2560 x 9216
    ("lm_head", V, H, "linear"),  # 248320 x 2560
]
DECODE_M = [1, 2, 4, 8, 16]
PREFILL_M = 8192
ATTN_CONTEXTS = [1024, 8192, 32768]
ATTN_PREFILL_T = [1024, 4096, 8192]
GDN_PREFILL_T = [1024, 4096, 8192]


def kernel_bench_with_env(core, var: str, value: str):
    """A KernelBench whose CUDA backend reads var = value (e.g. OCRIA_RT_SKINNY_KSPLIT) when it is constructed."""
    saved = os.environ.get(var)
    os.environ[var] = value
    try:
        return core.KernelBench("cuda")
    finally:
        if saved is None:
            del os.environ[var]
        else:
            os.environ[var] = saved


def linear_bytes(M: int, N: int, K: int, op: str, fmt: str = "dense") -> int:
    """Bytes a decode linear op must move: the weight (BF16; FP8 one byte a weight and a row scale;
    NVFP4 half a byte, a byte per 16 for the block scales and a row scale), BF16 x, and BF16 out (N / 2
    columns with the GLU activation; read and written again for a residual add)."""
    out = M * (N // 2 if op.endswith("_glu") else N)
    weight = {"dense": 2 * N * K, "fp8": N * K + 4 * N, "nvfp4": N * K // 2 + N * K // 16 + 4 * N}[fmt]
    return weight + 2 * (M * K + out * (2 if op == "linear_add" else 1))


def med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def iters_for(seconds_per_call: float, target: float = 3e-3, lo: int = 3, hi: int = 200) -> int:
    """Calls per graph so that one replay lasts about `target` seconds."""
    return int(max(lo, min(hi, target / max(seconds_per_call, 1e-7))))


def copy_bandwidth(kb, reps: int) -> tuple[float, str]:
    """Bytes read + written per second of a device-to-device copy: torch when available, else the
    backend's own row gather (embedding over ids 0..n-1, a plain copy)."""
    try:
        from common import measure_copy_bandwidth

        return measure_copy_bandwidth(), "torch copy_"
    except Exception:  # noqa: BLE001 - no torch on this machine
        rows, cols = 1 << 16, 8192  # 1 GiB of BF16
        us = med(kb.copy(rows, cols, iters=5, reps=reps))
        return 2 * rows * cols * 2 / (us * 1e-6), "ocria_rt embedding gather"


def torch_matmul_tflops(M: int, N: int, K: int, reps: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    times = cuda_times(lambda: torch.matmul(x, w.t()), reps)
    del x, w
    torch.cuda.empty_cache()
    return 2 * M * N * K / med(times) / 1e12


def causal_attention_flops(T: int) -> float:
    """Q K^T and P V over the causal triangle: 2 * 2 * T (T + 1) / 2 * head_dim per q head."""
    return 2 * 2 * T * (T + 1) / 2 * HD * HQ


def torch_sdpa_tflops(T: int, reps: int) -> float | None:
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    q = torch.randn(1, HQ, T, HD, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, HKV, T, HD, device="cuda", dtype=torch.bfloat16).repeat_interleave(HQ // HKV, dim=1)
    v = torch.randn(1, HKV, T, HD, device="cuda", dtype=torch.bfloat16).repeat_interleave(HQ // HKV, dim=1)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            times = cuda_times(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps)
    except RuntimeError:  # no flash backend for this device / build
        return None
    finally:
        del q, k, v
        torch.cuda.empty_cache()
    return causal_attention_flops(T) / med(times) / 1e12


def fla_gdn_us(T: int, reps: int, form: str = "chunk") -> float | None:
    """flash-linear-attention's chunk_gated_delta_rule (form "chunk") or fused_recurrent_gated_delta_rule
    ("fused_recurrent") on one 4B GDN layer of T tokens (q, k given at the value heads, the gates
    precomputed, q / k L2-normalised inside, from an initial state to a final one): median
    microseconds per call, CUDA events around the Python call. None without torch / fla."""
    try:
        import torch
        from fla.ops import gated_delta_rule as fla_gdr
    except Exception:  # noqa: BLE001 - not installed
        return None
    kernel = getattr(fla_gdr, f"{form}_gated_delta_rule")
    dev, bf = "cuda", torch.bfloat16
    q = torch.randn(1, T, HV, DK, device=dev, dtype=bf)
    k = torch.randn(1, T, HV, DK, device=dev, dtype=bf)
    v = torch.randn(1, T, HV, DV, device=dev, dtype=bf)
    g = -torch.rand(1, T, HV, device=dev, dtype=torch.float32)
    beta = torch.rand(1, T, HV, device=dev, dtype=bf)
    h0 = torch.randn(1, HV, DK, DV, device=dev, dtype=torch.float32) * 0.05
    try:
        times = cuda_times(lambda: kernel(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True), reps)
    except Exception as e:  # noqa: BLE001 - an fla version with another signature
        print(f"fla {form}_gated_delta_rule failed: {e}", flush=True)
        return None
    return med(times) * 1e6


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001
        return "unknown"


def comma_items(text: str) -> list[str]:
    """The non-empty, stripped items of a comma-separated argument."""
    return [item.strip() for item in text.split(",") if item.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="JSON output path")
    ap.add_argument("--reps", type=int, default=10, help="graph replays per figure (median)")
    ap.add_argument("--skip-prefill", action="store_true",
                    help="skip the M = 8192 GEMMs, the attention and DeltaNet prefill (and torch, fla)")
    ap.add_argument("--skip-linear", action="store_true", help="skip the linear layers (decode and prefill)")
    ap.add_argument("--skip-quant", action="store_true", help="skip the quantized (FP8, NVFP4) linear layers")
    ap.add_argument("--quant-input-scale", action="store_true",
                    help="give the quantized weights an input_scale (x scaled per column before the product)")
    ap.add_argument("--ksplit-sweep", default="",
                    help="comma-separated skinny-GEMM split counts to time at M = 1 / 16 (e.g. 2,3,4,6,8)")
    ap.add_argument("--persistent-sweep", default="",
                    help="comma-separated OCRIA_RT_SKINNY_PERSISTENT values to time at M = 1 / 16 (1: persistent "
                         "skinny-GEMM blocks always, 0: never)")
    ap.add_argument("--rows-sweep", default="",
                    help="comma-separated skinny-GEMM block tile heights to time at M = 1 / 16 (16,32: "
                         "OCRIA_RT_SKINNY_ROWS, two row tiles per block sharing their x loads)")
    ap.add_argument("--cluster-sweep", default="",
                    help="comma-separated blocks per cluster of the skinny GEMM's cluster split-K to time at M = 1 / 16 "
                         "(2,4; it applies to the shapes of few row tiles, N = 2560)")
    ap.add_argument("--sweep-shapes", default="",
                    help="comma-separated pieces of shape names (e.g. 'o_proj,down'): the sweeps time only the "
                         "linear shapes whose name holds one of them (default: all)")
    ap.add_argument("--sweep-formats", default="dense",
                    help="comma-separated weight formats the sweeps time, of dense,fp8,nvfp4 (default %(default)s)")
    ap.add_argument("--attention-contexts", default=",".join(map(str, ATTN_CONTEXTS)),
                    help="comma-separated context lengths of the attention table, T = 1 and 16 (default %(default)s)")
    args = ap.parse_args()
    sweep_formats = comma_items(args.sweep_formats)
    if any(f not in ("dense", "fp8", "nvfp4") for f in sweep_formats):
        ap.error(f"--sweep-formats takes dense, fp8 and nvfp4, got {args.sweep_formats!r}")
    attn_contexts = [int(c) for c in args.attention_contexts.split(",") if c]

    from ocria_rt import _core

    kb = _core.KernelBench("cuda")
    ksplit_mode = os.environ.get("OCRIA_RT_SKINNY_KSPLIT", "1")
    bw, bw_source = copy_bandwidth(kb, args.reps)
    print(f"device: {device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s ({bw_source})", flush=True)
    results: dict = {"device": device_name(), "copy_bandwidth_Bps": bw, "copy_bandwidth_source": bw_source,
                     "linear_decode": [], "linear_prefill": [], "gdn": [], "gdn_prefill": [], "attention": [],
                     "attention_prefill": [], "linear_decode_ksplit_sweep": [], "linear_decode_cluster_sweep": [],
                     "linear_decode_persistent_sweep": [], "linear_decode_rows_sweep": [],
                     "linear_decode_quant": [], "linear_prefill_quant": [],
                     "sample": [], "skinny_ksplit": ksplit_mode}
    summary: list[dict] = []

    # ---- linear, M <= 16: weight streaming ----
    rows = []
    for shape, N, K, op in ([] if args.skip_linear else LINEAR_SHAPES):
        name = f"{shape} ({op})"
        for M in DECODE_M:
            nbytes = linear_bytes(M, N, K, op)
            us = med(kb.linear(M, N, K, op, iters=iters_for(nbytes / bw), reps=args.reps))
            got = nbytes / (us * 1e-6)
            r = {"shape": name, "M": M, "N": N, "K": K, "us": round(us, 2), "TB/s": round(got / 1e12, 3),
                 "of copy BW": f"{got / bw:.0%}"}
            rows.append(r)
            results["linear_decode"].append({**r, "bytes": nbytes, "fraction_of_copy_bw": got / bw})
            if M in (1, 16):
                summary.append({"kernel": f"linear {name}", "case": f"M={M} N={N} K={K}", "time": f"{us:.1f} us",
                                "achieved": f"{got / 1e12:.2f} TB/s", "reference": f"copy {bw / 1e12:.2f} TB/s",
                                "ratio": f"{got / bw:.0%}"})
        print(f"linear {name}: " + ", ".join(f"M={r['M']} {r['us']} us {r['of copy BW']}" for r in rows[-5:]),
              flush=True)
    print(f"\n## Linear, decode / verify (weight streaming; OCRIA_RT_SKINNY_KSPLIT={ksplit_mode})\n")
    print(markdown_table(rows, ["shape", "M", "N", "K", "us", "TB/s", "of copy BW"]))

    # ---- linear, M = 1 / 16 with the skinny GEMM's experimental switches (--ksplit-sweep, --cluster-sweep, --persistent) ----
    pieces = comma_items(args.sweep_shapes)
    sweep_shapes = [shape for shape in LINEAR_SHAPES if not pieces or any(p in shape[0] for p in pieces)]
    for flag, var, key, title in (
            (args.ksplit_sweep, "OCRIA_RT_SKINNY_KSPLIT", "ksplit", "split-K over the grid forced (capped by K and the scratch)"),
            (args.cluster_sweep, "OCRIA_RT_SKINNY_CLUSTER", "cluster", "split-K over the blocks of a cluster"),
            (args.persistent_sweep, "OCRIA_RT_SKINNY_PERSISTENT", "persistent", "persistent blocks (1 always, 0 never)"),
            (args.rows_sweep, "OCRIA_RT_SKINNY_ROWS", "rows", "block tiles of this many rows")):
        sweep = comma_items(flag)
        if not sweep or args.skip_linear:
            continue
        rows = []
        for k in sweep:
            kb_k = kernel_bench_with_env(_core, var, k)
            for fmt, (name, N, K, op), M in itertools.product(sweep_formats, sweep_shapes, (1, 16)):
                nbytes = linear_bytes(M, N, K, op, fmt)
                us = med(kb_k.linear(M, N, K, op, iters=iters_for(nbytes / bw), reps=args.reps, fmt=fmt))
                got = nbytes / (us * 1e-6)
                r = {key: k, "format": fmt, "shape": name, "M": M, "N": N, "K": K, "us": round(us, 2),
                     "of copy BW": f"{got / bw:.0%}"}
                rows.append(r)
                results[f"linear_decode_{key}_sweep"].append({**r, "fraction_of_copy_bw": got / bw})
            del kb_k
            print(f"{key} sweep: {k} done", flush=True)
        print(f"\n## Linear, decode with {title} ({var})\n")
        print(markdown_table(rows, [key, "format", "shape", "M", "N", "K", "us", "of copy BW"]))

    # ---- linear, M = 8192: CUTLASS vs cuBLAS ----
    if not args.skip_prefill and not args.skip_linear:
        rows = []
        for name, N, K, _ in LINEAR_SHAPES:  # the GEMM alone (linear_glu adds silu_mul above 16 tokens)
            flops = 2 * PREFILL_M * N * K
            us = med(kb.linear(PREFILL_M, N, K, iters=iters_for(flops / 600e12, lo=2, hi=20), reps=max(3, args.reps // 2)))
            ours = flops / (us * 1e-6) / 1e12
            peer = torch_matmul_tflops(PREFILL_M, N, K, reps=max(3, args.reps // 2))
            r = {"shape": name, "M": PREFILL_M, "N": N, "K": K, "us": round(us, 1), "TFLOP/s": round(ours, 1),
                 "torch TFLOP/s": round(peer, 1) if peer else "n/a", "vs torch": f"{ours / peer:.0%}" if peer else "n/a"}
            rows.append(r)
            results["linear_prefill"].append({**r, "tflops": ours, "torch_tflops": peer})
            summary.append({"kernel": f"gemm {name}", "case": f"M={PREFILL_M} N={N} K={K}", "time": f"{us:.0f} us",
                            "achieved": f"{ours:.0f} TFLOP/s", "reference": f"torch {peer:.0f} TFLOP/s" if peer else "n/a",
                            "ratio": f"{ours / peer:.0%}" if peer else "n/a"})
            print(f"gemm {name}: {ours:.0f} TFLOP/s (torch {peer and round(peer)})", flush=True)
        print("\n## Linear, prefill (CUTLASS sm90 vs torch.matmul)\n")
        print(markdown_table(rows, ["shape", "M", "N", "K", "us", "TFLOP/s", "torch TFLOP/s", "vs torch"]))

    # ---- quantized linears: decode (quantized bytes against the copy bandwidth), prefill beside BF16 ----
    if not args.skip_linear and not args.skip_quant:
        rows = []
        for fmt in ("fp8", "nvfp4"):
            for shape, N, K, op in LINEAR_SHAPES:
                name = f"{shape} ({op})"
                for M in DECODE_M:
                    nbytes = linear_bytes(M, N, K, op, fmt)
                    us = med(kb.linear(M, N, K, op, iters=iters_for(nbytes / bw), reps=args.reps, fmt=fmt,
                                       input_scale=args.quant_input_scale))
                    got = nbytes / (us * 1e-6)
                    r = {"format": fmt, "shape": name, "M": M, "N": N, "K": K, "us": round(us, 2),
                         "TB/s": round(got / 1e12, 3), "of copy BW": f"{got / bw:.0%}"}
                    rows.append(r)
                    results["linear_decode_quant"].append({**r, "bytes": nbytes, "fraction_of_copy_bw": got / bw})
                    if M in (1, 16):
                        summary.append({"kernel": f"linear {fmt} {name}", "case": f"M={M} N={N} K={K}",
                                        "time": f"{us:.1f} us", "achieved": f"{got / 1e12:.2f} TB/s",
                                        "reference": f"copy {bw / 1e12:.2f} TB/s", "ratio": f"{got / bw:.0%}"})
                print(f"linear {fmt} {name}: " +
                      ", ".join(f"M={r['M']} {r['us']} us {r['of copy BW']}" for r in rows[-len(DECODE_M):]), flush=True)
        print(f"\n## Linear with quantized weights, decode / verify (input_scale: {args.quant_input_scale})\n")
        print(markdown_table(rows, ["format", "shape", "M", "N", "K", "us", "TB/s", "of copy BW"]))
        if not args.skip_prefill:
            rows = []
            for name, N, K, _ in LINEAR_SHAPES:
                flops = 2 * PREFILL_M * N * K
                reps = max(3, args.reps // 2)
                iters = iters_for(flops / 600e12, lo=2, hi=20)
                dense = flops / (med(kb.linear(PREFILL_M, N, K, iters=iters, reps=reps)) * 1e-6) / 1e12
                r = {"shape": name, "M": PREFILL_M, "N": N, "K": K, "bf16 TFLOP/s": round(dense, 1)}
                for fmt in ("fp8", "nvfp4"):
                    us = med(kb.linear(PREFILL_M, N, K, iters=iters, reps=reps, fmt=fmt,
                                       input_scale=args.quant_input_scale))
                    tf = flops / (us * 1e-6) / 1e12
                    r[f"{fmt} TFLOP/s"], r[f"{fmt} vs bf16"] = round(tf, 1), f"{tf / dense:.0%}"
                    summary.append({"kernel": f"gemm {fmt} {name}", "case": f"M={PREFILL_M} N={N} K={K}",
                                    "time": f"{us:.0f} us", "achieved": f"{tf:.0f} TFLOP/s",
                                    "reference": f"bf16 {dense:.0f} TFLOP/s", "ratio": f"{tf / dense:.0%}"})
                rows.append(r)
                results["linear_prefill_quant"].append(r)
                print(f"gemm quantized {name}: bf16 {dense:.0f}, fp8 {r['fp8 TFLOP/s']}, nvfp4 {r['nvfp4 TFLOP/s']} "
                      "TFLOP/s", flush=True)
            print("\n## Linear with quantized weights, prefill (dequantized rows + CUTLASS) beside BF16\n")
            print(markdown_table(rows, ["shape", "M", "N", "K", "bf16 TFLOP/s", "fp8 TFLOP/s", "fp8 vs bf16",
                                        "nvfp4 TFLOP/s", "nvfp4 vs bf16"]))

    # ---- Gated DeltaNet recurrence ----
    rows = []
    floor_us = 2 * HV * DK * DV * 4 / bw * 1e6  # the state's read + write
    for T in (1, 16):
        us = med(kb.gdn(T, HK, HV, DK, DV, chunked=False, iters=50, reps=args.reps))
        r = {"op": "gdn_recurrent", "T": T, "us per layer": round(us, 2), "us per token": round(us / T, 3),
             "state r+w floor us": round(floor_us, 2)}
        rows.append(r)
        results["gdn"].append(r)
        summary.append({"kernel": "gdn_recurrent", "case": f"T={T} HV={HV} dk=dv={DK}", "time": f"{us:.1f} us",
                        "achieved": f"{us / T:.2f} us/token", "reference": f"state r+w {floor_us:.1f} us",
                        "ratio": f"{floor_us / us:.0%}"})
    # the decode step's conv + recurrence + gated norm: one fused kernel vs the three ops
    for T in (1, 16):
        fused = med(kb.gdn_decode(T, HK, HV, DK, DV, fused=True, iters=50, reps=args.reps))
        split = med(kb.gdn_decode(T, HK, HV, DK, DV, fused=False, iters=50, reps=args.reps))
        r = {"op": "gdn_decode", "T": T, "us per layer": round(fused, 2), "us per token": round(fused / T, 3),
             "state r+w floor us": round(floor_us, 2), "three ops us": round(split, 2)}
        rows.append(r)
        results["gdn"].append(r)
        summary.append({"kernel": "gdn_decode (conv + recurrence + gated norm)", "case": f"T={T} HV={HV} dk=dv={DK}",
                        "time": f"{fused:.1f} us", "achieved": f"three ops {split:.1f} us",
                        "reference": f"state r+w {floor_us:.1f} us", "ratio": f"{floor_us / fused:.0%}"})
    # a speculative block of 16 (ReplaySSM): verify reads the state once, commit reads and writes it
    parts = {part: med(kb.gdn_verify_commit(16, HK, HV, DK, DV, 16, part=part, iters=50, reps=args.reps))
             for part in ("verify", "commit", "both")}
    spec_floor_us = 1.5 * floor_us
    # the peer: fla's fused recurrent kernel over the same 16 tokens, from a state to the next (what a
    # verify that writes every token's state would cost; no rollback)
    fla16 = None if args.skip_prefill else fla_gdn_us(16, args.reps, "fused_recurrent")
    r = {"op": "gdn_verify + gdn_commit", "T": 16, "us per layer": round(parts["both"], 2),
         "us per token": round(parts["both"] / 16, 3), "state r+w floor us": round(spec_floor_us, 2),
         "verify us": round(parts["verify"], 2), "commit us (keep 16)": round(parts["commit"], 2),
         "fla fused recurrent us": round(fla16, 2) if fla16 else "n/a"}
    rows.append(r)
    results["gdn"].append({**r, "fla_fused_recurrent_us": fla16})
    summary.append({"kernel": "gdn_verify + gdn_commit (speculative block)", "case": f"T=16 HV={HV} dk=dv={DK}",
                    "time": f"{parts['both']:.1f} us", "achieved": f"verify {parts['verify']:.1f} + commit "
                    f"{parts['commit']:.1f} us" + (f"; fla fused recurrent {fla16:.1f} us" if fla16 else ""),
                    "reference": "8 us (the published target)", "ratio": f"{8.0 / parts['both']:.0%}"})
    print("\n## Gated DeltaNet recurrence (one layer)\n")
    print(markdown_table(rows, ["op", "T", "us per layer", "us per token", "state r+w floor us", "three ops us",
                                "verify us", "commit us (keep 16)", "fla fused recurrent us"]))

    # ---- Gated DeltaNet prefill: chunked kernels vs the token-serial recurrence and fla ----
    if not args.skip_prefill:
        rows = []
        for T in GDN_PREFILL_T:
            us = med(kb.gdn(T, HK, HV, DK, DV, chunked=True, iters=5, reps=args.reps))
            rec = med(kb.gdn(T, HK, HV, DK, DV, chunked=False, iters=2, reps=max(3, args.reps // 2)))
            fla = fla_gdn_us(T, args.reps)
            r = {"T": T, "chunked us": round(us, 1), "Mtok/s": round(T / us, 2), "recurrent us": round(rec, 1),
                 "vs recurrent": f"{rec / us:.1f}x", "fla us": round(fla, 1) if fla else "n/a",
                 "vs fla": f"{fla / us:.2f}x" if fla else "n/a"}
            rows.append(r)
            results["gdn_prefill"].append({**r, "fla_us": fla})
            summary.append({"kernel": "gdn_chunked", "case": f"T={T} HV={HV} dk=dv={DK}", "time": f"{us:.0f} us",
                            "achieved": f"{T / us:.2f} Mtok/s", "reference": f"fla {fla:.0f} us" if fla else "n/a",
                            "ratio": f"{fla / us:.0%}" if fla else "n/a"})
            print(f"gdn prefill T={T}: chunked {us:.0f} us, recurrent {rec:.0f} us, fla {fla and round(fla)} us",
                  flush=True)
        print("\n## Gated DeltaNet prefill (one layer; fla timed with CUDA events around its Python call)\n")
        print(markdown_table(rows, ["T", "chunked us", "Mtok/s", "recurrent us", "vs recurrent", "fla us", "vs fla"]))

    # ---- attention over the KV cache ----
    rows = []
    kb_split = kernel_bench_with_env(_core, "OCRIA_RT_ATTN_VERIFY", "0")  # T = 2..16 through flash-decoding
    for T, ctx in [(T, c) for T in (1, 16) for c in attn_contexts]:
        kv_bytes = 2 * ctx * HKV * HD * 2
        iters = iters_for(kv_bytes / bw, lo=10)
        us = med(kb.attention(T, ctx, HQ, HKV, HD, iters=iters, reps=args.reps))
        got = kv_bytes / (us * 1e-6)
        r = {"T": T, "context": ctx, "us": round(us, 2), "KV TB/s": round(got / 1e12, 3), "of copy BW": f"{got / bw:.0%}"}
        # the whole step (norms, RoPE, cache write, attention): for T = 1 one kernel, against the two ops
        r["step us"] = round(med(kb.attention_decode(T, ctx, HQ, HKV, HD, fused=True, iters=iters, reps=args.reps)), 2)
        r["prepare + attention us"] = round(
            med(kb.attention_decode(T, ctx, HQ, HKV, HD, fused=False, iters=iters, reps=args.reps)), 2)
        r["flash-decoding us"] = (round(med(kb_split.attention(T, ctx, HQ, HKV, HD, iters=iters, reps=args.reps)), 2)
                                  if T > 1 else "")
        rows.append(r)
        results["attention"].append({**r, "kv_bytes": kv_bytes})
        summary.append({"kernel": "attention", "case": f"T={T} ctx={ctx} Hq={HQ} Hkv={HKV} hd={HD}",
                        "time": f"{us:.1f} us", "achieved": f"{got / 1e12:.2f} TB/s", "reference": "KV read once",
                        "ratio": f"{got / bw:.0%}"})
    del kb_split
    # The shortest a dependent kernel can be in these chains: a one-row copy (an embedding gather of one
    # hidden row), launched back to back with PDL like every op above.
    floor_us = med(kb.copy(1, H, iters=200, reps=args.reps))
    results["kernel_floor_us"] = round(floor_us, 2)
    print("\n## Attention (one layer)\n")
    print(markdown_table(rows, ["T", "context", "us", "KV TB/s", "of copy BW", "step us", "prepare + attention us",
                                "flash-decoding us"]))
    print(f"\nA one-row copy in the same kind of chain (the floor of a dependent kernel): {floor_us:.2f} us")

    # ---- attention prefill: T tokens from an empty cache (causal), flash kernel vs torch SDPA ----
    if not args.skip_prefill:
        rows = []
        for T in ATTN_PREFILL_T:
            flops = causal_attention_flops(T)
            us = med(kb.attention(T, T, HQ, HKV, HD, iters=iters_for(flops / 300e12, lo=2, hi=20),
                                  reps=max(3, args.reps // 2)))
            ours = flops / (us * 1e-6) / 1e12
            peer = torch_sdpa_tflops(T, reps=max(3, args.reps // 2))
            r = {"T": T, "us": round(us, 1), "TFLOP/s": round(ours, 1),
                 "torch TFLOP/s": round(peer, 1) if peer else "n/a", "vs torch": f"{ours / peer:.0%}" if peer else "n/a"}
            rows.append(r)
            results["attention_prefill"].append({**r, "flops": flops, "tflops": ours, "torch_tflops": peer})
            summary.append({"kernel": "attention prefill", "case": f"T={T} Hq={HQ} Hkv={HKV} hd={HD} causal",
                            "time": f"{us:.0f} us", "achieved": f"{ours:.0f} TFLOP/s",
                            "reference": f"torch sdpa {peer:.0f} TFLOP/s" if peer else "n/a",
                            "ratio": f"{ours / peer:.0%}" if peer else "n/a"})
            print(f"attention prefill T={T}: {ours:.0f} TFLOP/s (torch {peer and round(peer)})", flush=True)
        print("\n## Attention prefill (one layer, causal)\n")
        print(markdown_table(rows, ["T", "us", "TFLOP/s", "torch TFLOP/s", "vs torch"]))

    # ---- sampling ----
    rows = []
    for label, temp, k, p in [("greedy", 0.0, 0, 1.0), ("T=0.7 top_k=50 top_p=0.95", 0.7, 50, 0.95),
                              ("T=1 (no cut)", 1.0, 0, 1.0), ("T=0.3 (no cut)", 0.3, 0, 1.0),
                              ("T=1 top_p=0.9", 1.0, 0, 0.9)]:
        us = med(kb.sample(1, V, temp, k, p, iters=20, reps=args.reps))
        r = {"sampler": label, "V": V, "us": round(us, 1)}
        rows.append(r)
        results["sample"].append(r)
        summary.append({"kernel": "sample", "case": f"{label}, V={V}", "time": f"{us:.1f} us", "achieved": "",
                        "reference": "", "ratio": ""})
    print("\n## Sampling (one row)\n")
    print(markdown_table(rows, ["sampler", "V", "us"]))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\n## Summary ({device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s)\n")
    print(markdown_table(summary, ["kernel", "case", "time", "achieved", "reference", "ratio"]))


if __name__ == "__main__":
    main()
