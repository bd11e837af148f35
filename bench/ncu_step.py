"""Decode steps under Nsight Compute: per kernel, its time alone and the counters that say what bounds
it (DRAM, L2 and SM throughput as % of peak, achieved occupancy, registers, the warp stall reasons).

    ncu --clock-control none --profile-from-start off --graph-profiling node \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --csv --page raw \\
        --log-file OUT/ncu.csv python3 bench/ncu_step.py run --shape ocria1-4b --prompt 1024 --steps 2
    python3 bench/ncu_step.py summarize OUT/ncu.csv --out OUT/ncu.md

`run` builds the random checkpoint of the shape (bench/common.py), prefills the prompt, and turns the
profiler on (cudaProfilerStart) for `steps` decode steps only. ncu runs every kernel by itself, several
times over (one pass per counter group), so the times are those of each kernel alone, without the
overlap programmatic dependent launch gives in the real step; the counters are what to read. Under
a runtime that hides the hardware counters (gVisor, for one) ncu fails.
`summarize` groups the rows by kernel name and launch grid and prints a Markdown table, slowest
groups first.

Where the time goes inside a kernel: profile a few launches of it with the full set and the source
counters, then `source` reads ncu's per-instruction export (warp stall samples, instructions executed):

    ncu --clock-control none --profile-from-start off --graph-profiling node --set full \
        --import-source yes --warp-sampling-interval 0 -k regex:"gdn_decode" --launch-count 2 \
        -o OUT/k python3 bench/ncu_step.py run
    ncu -i OUT/k.ncu-rep --page source --csv --print-source sass > OUT/k-source.csv
    python3 bench/ncu_step.py source OUT/k-source.csv --out OUT/k-source.md

One decode GEMM instead of a step: `linear M N K OP` runs KernelBench's graph of back-to-back calls
of that op (bench/kernels.py's shapes; OP as KernelBench.linear takes it), e.g. OCRia-1's in_proj at 16
tokens, its 13th launch:

    ncu --clock-control none --graph-profiling node -k regex:skinny_gemm --launch-skip 12 --launch-count 1 \
        --set full --import-source yes --warp-sampling-interval 0 -o OUT/k \
        python3 bench/ncu_step.py linear 16 12352 2560 rms_norm_linear

(`--format fp8|nvfp4`: the same shape with quantized weights.)

It prints, per section of the export (ncu writes at least one per profiled launch), the warp
instructions executed, the stall reasons summed over the kernel and the instructions that hold the
most samples (each with its top two reasons): instructions executed say where the issue slots go,
samples where the warps wait.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import SHAPES, full_config, make_random_checkpoint, markdown_table  # noqa: E402
from decode import short_kernel_name  # noqa: E402

# ncu --page raw column names (metric name and unit row), as the sections above report them.
COLUMNS = {
    "us": "gpu__time_duration.sum",
    "DRAM BW %": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "L2 %": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "SM %": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "occupancy %": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "regs": "launch__registers_per_thread",
}
# WarpStateStats: warps stalled per issued instruction, by reason.
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def run(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    import ocria_rt

    c = full_config(SHAPES[args.shape])
    model_dir = make_random_checkpoint(args.shape, args.workdir / args.shape)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, c["vocab_size"], args.prompt)]
    eng = ocria_rt.Engine(model_dir, device="cuda", max_context=args.prompt + args.steps + 16)
    eng.generate(prompt[:64], max_new_tokens=4, stop_token_ids=[])  # graph capture, module load (not profiled)
    tokens = eng.stream(prompt, max_new_tokens=args.steps + 3, stop_token_ids=[])
    next(tokens)  # prefill and the first token
    next(tokens)  # a step queued ahead of the first read is done too
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(args.steps):
        next(tokens)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    for _ in tokens:
        pass


def linear(args: argparse.Namespace) -> None:
    from ocria_rt import _core

    us = _core.KernelBench("cuda").linear(args.M, args.N, args.K, args.op, iters=8, reps=2, fmt=args.format)
    print(f"{args.op} M={args.M} N={args.N} K={args.K} {args.format}: {min(us):.2f} us a call (unprofiled replays)")


def number(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def ncu_rows(text: str) -> tuple[list[str], list[dict]]:
    """The header and the kernel rows of ncu's --csv --page raw log (its own messages, ==PROF== ...,
    may come first; the row after the header holds the units)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"') and '"Kernel Name"' in line)
    reader = csv.reader(lines[start:])
    header = next(reader)
    rows = [dict(zip(header, r)) for r in reader if len(r) == len(header)]
    return header, [r for r in rows if r.get("Kernel Name")]  # (the units row names no kernel)


def summary_rows(header: list[str], rows: list[dict]) -> list[dict]:
    """One row per (kernel, grid): calls, medians of the COLUMNS, the three largest stall reasons."""
    stall_cols = [h for h in header if h.startswith(STALL_PREFIX) and h.endswith(STALL_SUFFIX)]
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(short_kernel_name(r["Kernel Name"]), r.get("Grid Size", "?"))].append(r)
    table = []
    for (name, grid), rs in groups.items():
        row = {"kernel": name[:60], "grid": grid, "calls": len(rs)}
        for label, col in COLUMNS.items():
            vals = [v for v in (number(r.get(col, "")) for r in rs) if v is not None]
            row[label] = round(statistics.median(vals), 1) if vals else "-"
        if isinstance(row["us"], float):
            row["us"] = round(row["us"] / 1000, 2)  # ncu reports ns
        stalls = []
        for col in stall_cols:
            vals = [v for v in (number(r.get(col, "")) for r in rs) if v is not None]
            if vals:
                stalls.append((statistics.median(vals), col[len(STALL_PREFIX):-len(STALL_SUFFIX)]))
        row["top stalls (per issue)"] = ", ".join(f"{n} {v:.1f}" for v, n in sorted(stalls, reverse=True)[:3])
        row["total us"] = round(row["us"] * len(rs), 1) if isinstance(row["us"], float) else "-"
        table.append(row)
    table.sort(key=lambda r: -(r["total us"] if isinstance(r["total us"], float) else 0))
    return table


def report(text: str, out: Path | None) -> None:
    """Prints a report and, with --out, writes it there too."""
    if out:
        out.write_text(text + "\n")
    print(text)


def summarize(args: argparse.Namespace) -> None:
    table = summary_rows(*ncu_rows(Path(args.csv).read_text()))
    cols = ["kernel", "grid", "calls", "us", "total us", "DRAM BW %", "L2 %", "SM %", "occupancy %", "regs",
            "top stalls (per issue)"]
    report(markdown_table(table, cols), args.out)


def source_sections(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(kernel name, header, instruction rows) per section of ncu's --page source --csv export."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith('"Kernel Name"')]
    sections = []
    for n, i in enumerate(starts):
        name = next(csv.reader([lines[i]]))[1]
        body = list(csv.reader(lines[i + 1:starts[n + 1] if n + 1 < len(starts) else len(lines)]))
        sections.append((name, body[0], [r for r in body[1:] if len(r) == len(body[0])]))
    return sections


def source_report(text: str, top: int = 12) -> str:
    out = []
    for name, header, rows in source_sections(text):
        samples, executed = header.index("Warp Stall Sampling (All Samples)"), header.index("Instructions Executed")
        reasons = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
        total = sum(int(r[samples]) for r in rows) or 1
        by_reason = sorted(((sum(int(r[i]) for r in rows), header[i][len("stall_"):]) for i in reasons), reverse=True)
        out.append(f"### {short_kernel_name(name)}\n")
        out.append(f"{len(rows)} SASS instructions, {sum(int(r[executed]) for r in rows)} warp instructions "
                   f"executed, {total} stall samples: "
                   + ", ".join(f"{reason} {100 * n / total:.0f}%" for n, reason in by_reason[:6]) + "\n")
        hot = sorted(range(len(rows)), key=lambda i: -int(rows[i][samples]))[:top]
        table = []
        for i in sorted(hot):
            r = rows[i]
            why = sorted(((int(r[j]), header[j][len("stall_"):]) for j in reasons), reverse=True)[:2]
            table.append({"#": i, "instruction": r[1].strip()[:60], "samples %": round(100 * int(r[samples]) / total, 1),
                          "executed": r[executed], "top stalls": ", ".join(f"{w} {n}" for n, w in why if n)})
        out.append(markdown_table(table, ["#", "instruction", "samples %", "executed", "top stalls"]) + "\n")
    return "\n".join(out)


def source(args: argparse.Namespace) -> None:
    report(source_report(Path(args.csv).read_text(), args.top), args.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the workload to start under ncu")
    r.add_argument("--shape", default="ocria1-4b", choices=sorted(SHAPES))
    r.add_argument("--prompt", type=int, default=1024)
    r.add_argument("--steps", type=int, default=2)
    r.add_argument("--workdir", type=Path, default=Path("/tmp/ocria-bench"))
    g = sub.add_parser("linear", help="one decode GEMM shape to start under ncu (KernelBench.linear)")
    g.add_argument("M", type=int)
    g.add_argument("N", type=int)
    g.add_argument("K", type=int)
    g.add_argument("op", help="as KernelBench.linear takes it (it names the ones it knows otherwise)")
    g.add_argument("--format", default="dense", choices=("dense", "fp8", "nvfp4"), help="the weight's format")
    s = sub.add_parser("summarize", help="a Markdown table from ncu's --csv --page raw log")
    s.add_argument("csv", type=Path)
    s.add_argument("--out", type=Path)
    c = sub.add_parser("source", help="the hottest instructions from ncu's --page source --csv export")
    c.add_argument("csv", type=Path)
    c.add_argument("--top", type=int, default=12, help="instructions shown per section")
    c.add_argument("--out", type=Path)
    args = ap.parse_args()
    {"run": run, "linear": linear, "summarize": summarize, "source": source}[args.cmd](args)


if __name__ == "__main__":
    main()
