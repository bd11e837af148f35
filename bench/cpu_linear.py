"""The CPU backend's linear op on ocria-mini's projection shapes, beside numpy's matrix product (OpenBLAS)
in the same process and the matrix rate numpy reaches on a large square product (the ceiling).

    python bench/cpu_linear.py OUT.json [--tokens 1,4,16,64,300] [--reps 7]

Both use every core of the machine (the backend's threads, OpenBLAS's) and cycle through copies of
the weights passing 256 MB, so that weights come from memory. Each figure is the median of --reps timings; the JSON goes to OUT.json, the Markdown table comes last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table  # noqa: E402

from ocria_rt import _core  # noqa: E402

# ocria-mini's projections (N outputs, K inputs): DeltaNet in_proj_qkv | in_proj_z, MLP gate | up,
# MLP down, attention o_proj / DeltaNet out_proj, the (tied) LM head
SHAPES = {"in_proj_qkvz": (768, 256), "mlp_gate_up": (1024, 256), "mlp_down": (256, 512), "out_proj": (256, 256),
          "lm_head": (4096, 256)}
STREAM_BYTES = 256 << 20  # KernelBench's weight copies (csrc/bindings/kernel_bench.cpp kStreamBytes)


def numpy_us(M: int, N: int, K: int, reps: int) -> float:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, K), np.float32)
    # copies of W passing STREAM_BYTES, cycled as KernelBench cycles its own: weights come from memory, as
    # in a decode step whose weights are larger than the caches
    ws = [rng.standard_normal((N, K), np.float32) for _ in range(max(1, STREAM_BYTES // (N * K * 4)))]
    out = np.empty((M, N), np.float32)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(20):
            np.matmul(x, ws[i % len(ws)].T, out=out)
        times.append((time.perf_counter() - t) / 20 * 1e6)
    return float(np.median(times))


def matrix_rate(n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of numpy's n x n x n float32 product (median)."""
    a = np.random.default_rng(1).standard_normal((n, n), np.float32)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - t)
    return 2 * n**3 / float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokens", default="1,4,16,64,300")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    bench = _core.KernelBench("cpu")
    rate = matrix_rate()
    rows = []
    for name, (N, K) in SHAPES.items():
        for M in map(int, args.tokens.split(",")):
            ours = float(np.median(bench.linear(M, N, K, iters=20, reps=args.reps)))
            peer = numpy_us(M, N, K, args.reps)
            flops = 2 * M * N * K
            rows.append({"projection": name, "N": N, "K": K, "tokens": M, "ours_us": round(ours, 2),
                         "ours_gflops": round(flops / ours / 1e3, 1), "of_matrix_rate": round(flops / ours / 1e-6 / rate, 3),
                         "numpy_us": round(peer, 2), "ours_vs_numpy": round(peer / ours, 2)})
    run = {"cores": os.cpu_count(), "numpy_matrix_gflops": round(rate / 1e9, 1), "rows": rows}
    args.out.write_text(json.dumps(run, indent=1) + "\n")
    print(f"{os.cpu_count()} cores; numpy's 1024^3 float32 product: {rate / 1e9:.1f} GFLOP/s (the ceiling)\n")
    table = [{"projection": r["projection"], "N x K": f"{r['N']} x {r['K']}", "tokens": r["tokens"],
              "ours us": f"{r['ours_us']:.1f}", "ours GFLOP/s": f"{r['ours_gflops']:.1f}",
              "of matrix rate": f"{100 * r['of_matrix_rate']:.0f}%", "numpy us": f"{r['numpy_us']:.1f}",
              "numpy / ours": f"{r['ours_vs_numpy']:.2f}x"} for r in rows]
    print(markdown_table(table, list(table[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
