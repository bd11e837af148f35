"""Quantizing a Qwen3.5 checkpoint into a ModelOpt-format FP8 / NVFP4 / mixed-precision checkpoint.

>>> res = ocria_rt.quantize("models/ocria-mini", "out/ocria-mini-mixed", recipe="mixed", budget="40%")
>>> res.plan["layers.0.mlp.gate|up"], res.report["total"]["measured_kl"]

1. Calibration: samples (calibration.py) run through the engine, which observes the inputs of every
   projection (Engine.observe_linear_inputs): per-channel max |x|, mean |x|, mean x^2 and X^T X.
2. Each projection group (per layer: attention q|k|v and o_proj, or DeltaNet in_proj_qkv|in_proj_z and
   out_proj; MLP gate|up and down_proj; the LM head) is quantized alone to each candidate format (awq.py;
   the codes by the engine's library on all cores), its dequantized weights set into the engine in memory
   (Engine.set_linear_weight), and the KL divergence of the next-token distributions from the unquantized
   model's measured on held-out samples, whose logits and image features the engine keeps on its device
   (Engine.keep_reference, reference_kl). On a GPU the next group is quantized on the host meanwhile.
3. The plan: one format for every group but the LM head (recipes fp8 / nvfp4, ModelOpt's defaults), or
   per group (mixed: plan.choose_mixed under a byte budget or a KL threshold). Embeddings, norms, the
   DeltaNet conv, in_proj_a / in_proj_b and the vision encoder stay in the checkpoint's dtype.
4. The checkpoint (writer.py) in ModelOpt's layout, with the AWQ scales folded into the layers before
   each group (a group whose weights no fold changed keeps its quantization from step 2); it is written
   to a temporary directory beside OUT_DIR, loaded and scored by a fresh engine (the measured KL), and
   renamed to OUT_DIR only when complete. The report records the seconds of each stage.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from ..errors import FileError, InvalidArgumentError, ModelError
from . import calibration, plan as planning, writer
from .awq import METHODS, GroupQuantization, format_bytes, quantize_group
from .report import format_table, write_kl_plot
from .safetensors_io import DTYPE_BYTES, Checkpoint

RECIPES = ("fp8", "nvfp4", "mixed")
DEFAULT_CALIBRATION_PAGES = 64  # a quarter held out: ~500 continuation tokens of ocria-mini pages for the KL
DEFAULT_MAX_KL = 0.005  # nats per continuation token, summed over the groups alone: mixed without a budget
REPORT_NAME, PLOT_NAME = "quantization_report.json", "quantization_kl.png"


@dataclass
class QuantizationResult:
    """What quantize() returns: the format of each projection group, the report written beside the
    checkpoint (quantization_report.json), and the checkpoint's directory."""

    plan: dict[str, str]
    report: dict[str, Any]
    out_dir: Path

    def table(self) -> str:
        return format_table(self.report)


class _Seconds:
    """Wall-clock seconds per stage of a run (the report's "seconds"): `with seconds("stage"):` adds the
    block's time to the stage; nested names ("sensitivity/kl") split a stage."""

    def __init__(self) -> None:
        self.by_stage: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.by_stage[stage] = self.by_stage.get(stage, 0.0) + time.perf_counter() - t0


class _Progress:
    """A bar on stderr per stage: "quantize: calibration 12/24 (3.1 s)", redrawn in place on a terminal;
    elsewhere (a log) a line when the stage ends and at most one every LOG_SECONDS before that."""

    LOG_SECONDS = 30.0

    def __init__(self, mode: bool | str, stream: IO[str] | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = mode == "always" or (mode is True and self.tty)
        self.stage, self.total, self.done, self.t0 = "", 0, 0, time.perf_counter()
        self.logged = self.t0

    def start(self, stage: str, total: int) -> None:
        self.stage, self.total, self.done = stage, total, 0
        self.t0 = self.logged = time.perf_counter()
        self._show()

    def tick(self) -> None:
        self.done += 1
        self._show()

    def _show(self) -> None:
        if not self.enabled:
            return
        width = 24
        filled = width * self.done // max(self.total, 1)
        now = time.perf_counter()
        line = (f"ocria-rt quantize: {self.stage:<22} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
                f" ({now - self.t0:.1f} s)")
        end = self.done >= self.total
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K" + ("\n" if end else ""))
        elif end or now - self.logged >= self.LOG_SECONDS:
            self.stream.write(line + "\n")
            self.logged = now
        self.stream.flush()


def _check_out_dir(model_dir: Path, out_dir: Path, force: bool) -> None:
    if out_dir.resolve() == model_dir.resolve():
        raise InvalidArgumentError(f"OUT_DIR '{out_dir}' is the model directory itself")
    if out_dir.exists():
        if not out_dir.is_dir():
            raise FileError(f"OUT_DIR '{out_dir}' exists and is not a directory")
        if any(out_dir.iterdir()) and not force:
            raise FileError(f"OUT_DIR '{out_dir}' exists and is not empty (force=True / --force replaces it)")


def quantize(
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    recipe: str = "mixed",
    *,
    calib: list[str | os.PathLike[str]] | None = None,
    calib_synthetic: int | None = None,
    budget: str | float | None = None,
    max_kl: float | None = None,
    method: str = "awq",
    device: str = "cpu",
    force: bool = False,
    heldout: int | None = None,
    seed: int = 0,
    num_threads: int = 0,
    max_new_tokens: int = 512,
    page_config: Any = None,
    progress: bool | str = True,
    progress_stream: IO[str] | None = None,
) -> QuantizationResult:
    """Quantizes the dense checkpoint in model_dir and writes a ModelOpt-format checkpoint to out_dir.

    recipe: "fp8" or "nvfp4" (every projection but the LM head, ModelOpt's defaults) or "mixed" (a format
    per projection group, the LM head included). method: "awq" (activation-aware scales and clipped block
    scales), "gptq" (AWQ's scales, then rounding with error feedback where the second moments were kept:
    lower output error, more host time) or "rtn" (ModelOpt's plain rounding). calib: PDF / image files (rendered and preprocessed as
    parse() does; the model's greedy output is the continuation) or text files; calib_synthetic: that many
    synthdoc pages with their true Markdown (the default, 64 pages). heldout: samples kept out of the
    statistics for the KL (default a quarter). budget (mixed): "4.5" bits per weight, "40%" of the BF16
    bytes, or bytes ("3MB"); else max_kl (mixed): the summed KL allowed (default 0.005 nats per token).
    force: replace a non-empty out_dir. page_config: the synthdoc.PageConfig of synthetic pages (default:
    the model's training pages, else synthdoc's defaults). Raises an OcriaError naming the file or argument
    at fault; nothing is left at out_dir unless the whole checkpoint was written.
    """
    from .. import _core
    from ..engine import Engine

    t_start = time.perf_counter()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if recipe not in RECIPES:
        raise InvalidArgumentError(f"recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    if method not in METHODS:
        raise InvalidArgumentError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if calib is not None and calib_synthetic is not None:
        raise InvalidArgumentError("give calibration files or a number of synthetic pages, not both")
    if calib_synthetic is not None and (isinstance(calib_synthetic, bool) or int(calib_synthetic) < 1):
        raise InvalidArgumentError(f"calib_synthetic must be a positive number of pages, got {calib_synthetic!r}")
    if recipe != "mixed" and (budget is not None or max_kl is not None):
        raise InvalidArgumentError(f"budget and max_kl choose a mixed plan; recipe {recipe!r} has one format")
    if budget is not None and max_kl is not None:
        raise InvalidArgumentError("give a budget or max_kl, not both")
    if max_kl is not None and not max_kl >= 0:
        raise InvalidArgumentError(f"max_kl must be >= 0, got {max_kl!r}")
    if heldout is not None and int(heldout) < 1:
        raise InvalidArgumentError(f"heldout must be at least 1, got {heldout!r}")
    if not (model_dir / "config.json").is_file():
        raise FileError(f"model directory '{model_dir}' does not exist or has no config.json")
    _check_out_dir(model_dir, out_dir, force)
    config = _core.load_config(str(model_dir))
    if calib is not None:
        calibration.check_files(calib, bool(config["has_vision"]))

    bar = _Progress(progress, progress_stream)
    seconds = _Seconds()
    with seconds("load"):
        eng = Engine(model_dir, device=device, num_threads=num_threads, linear_observer=True)
    groups = writer.projection_groups(eng.linear_groups())
    quantized = [g for g in groups if g.slot_format != "dense"]
    if quantized:
        raise ModelError(f"model '{model_dir}' is already quantized ({quantized[0].modules[0]} is "
                         f"{quantized[0].slot_format}); quantize a dense checkpoint")
    ck = Checkpoint(model_dir)
    candidates = groups if recipe == "mixed" else [g for g in groups if g.kind != "lm_head"]
    nbytes = {g.name: _bytes_by_format(g, ck) for g in candidates}
    # the formats each group is tried in: mixed, all it can take; else the recipe's (FP8 where NVFP4's
    # blocks do not fit the inputs)
    trial_formats = {g.name: [f for f in ("fp8", "nvfp4") if f in nbytes[g.name]] if recipe == "mixed" else
                     [recipe if recipe in nbytes[g.name] else "fp8"] for g in candidates}
    weights = sum(g.weights for g in candidates)
    budget_bytes = None
    if budget is not None:
        budget_bytes = planning.parse_budget(budget, weights)
        least = planning.smallest_bytes(nbytes)
        if budget_bytes < least:
            raise InvalidArgumentError(f"budget {budget!r} = {budget_bytes:,} bytes is below the smallest possible "
                                       f"checkpoint of these projections ({least:,} bytes, "
                                       f"{8 * least / weights:.2f} bits per weight)")

    # 1. calibration samples, statistics and the reference next-token distributions
    n = DEFAULT_CALIBRATION_PAGES if calib is None and calib_synthetic is None else (calib_synthetic or 0)
    with seconds("calibration samples"):
        if calib is not None:
            bar.start("calibration inputs", len(calib))
            samples = calibration.file_samples(eng, calib, max_new_tokens, tick=bar.tick)
        else:
            bar.start("calibration pages", n)
            samples = calibration.synthetic_samples(eng, n, seed, page_config, tick=bar.tick)
    if heldout is not None and len(samples) < int(heldout) + 1:
        raise InvalidArgumentError(f"heldout={heldout} leaves no calibration sample of {len(samples)}")
    n_held = int(heldout) if heldout is not None else (max(1, len(samples) // 4) if len(samples) > 1 else 0)
    calib_set = samples[: len(samples) - n_held]
    held = samples[len(samples) - n_held :] or samples  # a single sample serves both
    bar.start("input statistics", len(calib_set))
    with seconds("input statistics"):
        stats = calibration.collect_stats(eng, calib_set, tick=bar.tick)
    bar.start("reference outputs", len(held))
    references = []
    with seconds("reference outputs"):
        for s in held:
            references.append(calibration.keep_reference(eng, s))
            bar.tick()

    # 2. each group alone in each candidate format; the quantizations are kept for the checkpoint
    shapes = writer.Shapes.of(config)
    source = writer.SourceWeights(ck, groups)
    trials: dict[str, dict[str, Any]] = {g.name: {} for g in candidates}
    quantized_groups: dict[tuple[str, str], GroupQuantization] = {}
    work = [(g, f) for g in candidates for f in trial_formats[g.name]]

    bar.start("sensitivity", len(work))
    # Where the forward passes run on a GPU, the next group is quantized on the host's cores meanwhile,
    # one core left to the thread that drives the GPU.
    overlap = _overlap_quantization(device)
    trial_threads = num_threads if num_threads > 0 or not overlap else max(1, (os.cpu_count() or 2) - 1)

    def trial(g: writer.Group, fmt: str) -> tuple[GroupQuantization, list]:
        with seconds("sensitivity/quantize" + (" (beside the KL passes)" if overlap else "")):
            parts = [source.get(m) for m in g.modules]
            gq = quantize_group(parts, fmt, stats[g.slot], method, writer.tie_classes(g, shapes), trial_threads)
            return gq, gq.effective(trial_threads)

    with seconds("sensitivity"), ThreadPoolExecutor(1) as pool:
        pending = pool.submit(trial, *work[0]) if overlap and work else None
        for i, (g, fmt) in enumerate(work):
            if overlap:
                with seconds("sensitivity/wait for the quantization"):
                    gq, effective = pending.result()
            else:
                gq, effective = trial(g, fmt)
            if overlap and i + 1 < len(work):
                pending = pool.submit(trial, *work[i + 1])
            try:
                with seconds("sensitivity/set weights"):
                    for m, w in zip(g.modules, effective):
                        eng.set_linear_weight(m, w)
                with seconds("sensitivity/kl"):
                    kl = calibration.kl_divergence(eng, references)
            finally:
                with seconds("sensitivity/restore"):
                    eng.restore_linear_weights()
            del effective
            quantized_groups[(g.name, fmt)] = gq
            trials[g.name][fmt] = {"kl": kl, "alpha": gq.alpha, "output_error": gq.error,
                                   "rtn_output_error": gq.rtn_error, "searched_blocks": gq.searched_blocks}
            bar.tick()

    # 3. the plan
    if recipe == "mixed":
        kl_table = {g: {"dense": 0.0, **{f: t["kl"] for f, t in trials[g].items()}} for g in trials}
        plan = planning.choose_mixed(kl_table, nbytes, budget=budget_bytes,
                                     max_kl=None if budget_bytes is not None else (DEFAULT_MAX_KL if max_kl is None else max_kl))
    else:
        plan = {g.name: trial_formats[g.name][0] for g in candidates}
    full_plan = {g.name: plan.get(g.name, "dense") for g in groups}
    chosen = {name: quantized_groups[(name, fmt)] for name, fmt in full_plan.items() if (name, fmt) in quantized_groups}
    del quantized_groups

    # 4. the checkpoint, in a temporary directory beside out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's directory is private
    try:
        bar.start("writing", 1)
        with seconds("writing"):
            built = writer.write_checkpoint(tmp, model_dir, ck, groups, full_plan, stats, method, shapes, num_threads,
                                            chosen)
        bar.tick()
        del chosen
        reference_logits = [eng.reference_logits(i) for i in references]
        del eng
        bar.start("checking", len(held))
        with seconds("checking/load"):
            check = Engine(tmp, device=device, num_threads=num_threads)
        total_kl, rows = 0.0, 0
        with seconds("checking/kl"):
            for s, logits in zip(held, reference_logits):
                kl = check.reference_kl(calibration.keep_reference(check, s, logits))
                total_kl, rows = total_kl + float(np.sum(kl)), rows + len(kl)
                bar.tick()
        del reference_logits
        measured_kl = total_kl / max(rows, 1)
        report = _report(model_dir, recipe, method, built, groups, full_plan, trials, nbytes, ck, samples, calib_set,
                         held, n_held, measured_kl, budget, budget_bytes, max_kl, check.stats(), tmp)
        del check
        with seconds("report"):
            write_kl_plot(tmp / PLOT_NAME, report)
        report["seconds"] = {k: round(v, 3) for k, v in seconds.by_stage.items()}
        report["seconds"]["total"] = round(time.perf_counter() - t_start, 3)
        (tmp / REPORT_NAME).write_text(json.dumps(report, indent=1) + "\n")
        _replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return QuantizationResult(plan=full_plan, report=report, out_dir=out_dir)


def _overlap_quantization(device: str) -> bool:
    """Whether the sensitivity stage quantizes the next group in a thread while the engine runs the KL
    passes of the current one: on a GPU (the host's cores are free meanwhile), not on the CPU (where the
    engine uses them)."""
    return device != "cpu"


def _bytes_by_format(g: writer.Group, ck: Checkpoint) -> dict[str, int]:
    """Checkpoint bytes of the group in "dense" (its dtype) and in each format its inputs allow."""
    dense_bytes = DTYPE_BYTES[ck.dtype(writer.weight_name(g, g.modules[0], ck))]
    out = {"dense": sum(format_bytes("dense", r, g.in_features, dense_bytes) for r in g.rows)}
    for f in ("fp8", "nvfp4"):
        if f == "nvfp4" and g.in_features % 16:
            continue  # NVFP4 blocks need K to be a multiple of 16
        out[f] = sum(format_bytes(f, r, g.in_features, dense_bytes) for r in g.rows)
    return out


def _report(model_dir: Path, recipe: str, method: str, built: writer.Built, groups: list[writer.Group],
            plan: dict[str, str], trials: dict, nbytes: dict, ck: Checkpoint, samples: list, calib_set: list,
            held: list, n_held: int, measured_kl: float, budget: Any, budget_bytes: int | None, max_kl: float | None,
            stats: dict, out: Path) -> dict[str, Any]:
    rows = []
    for g in groups:
        fmt = plan[g.name]
        b = nbytes.get(g.name) or _bytes_by_format(g, ck)
        t = trials.get(g.name, {})
        rows.append({
            "name": g.name, "short": g.short, "kind": g.kind, "layer": g.layer, "modules": g.modules, "format": fmt,
            "weights": g.weights, "bytes": b[fmt], "bf16_bytes": 2 * g.weights, "bytes_by_format": b,
            "kl": {f: v["kl"] for f, v in t.items()},
            "awq": {f: {k: v[k] for k in ("alpha", "output_error", "rtn_output_error", "searched_blocks")}
                    for f, v in t.items()},
        })
    considered = [r for r in rows if r["name"] in nbytes]
    total_bytes = sum(r["bytes"] for r in considered)
    weights = sum(r["weights"] for r in considered)
    summed = sum(r["kl"].get(r["format"], 0.0) for r in considered)
    quant_algo = built.quant_algo
    return {
        "model": str(model_dir), "model_name": model_dir.name, "recipe": recipe, "method": method,
        "quant_algo": quant_algo, "plan": plan,
        "calibration": {
            "samples": len(calib_set), "heldout_samples": n_held, "tokens": sum(len(s.ids) for s in calib_set),
            "heldout_continuation_tokens": sum(s.answer_tokens for s in held),
            "sources": [s.source for s in samples[:8]] + (["..."] if len(samples) > 8 else []),
        },
        "budget": None if budget is None else {"given": str(budget), "bytes": budget_bytes},
        "max_kl": None if recipe != "mixed" or budget is not None else (DEFAULT_MAX_KL if max_kl is None else max_kl),
        "groups": rows,
        "total": {
            "groups": [r["name"] for r in considered], "weights": weights, "bytes": total_bytes,
            "bf16_bytes": 2 * weights, "fraction_of_bf16": total_bytes / max(2 * weights, 1),
            "bits_per_weight": 8 * total_bytes / max(weights, 1), "summed_kl": summed, "measured_kl": measured_kl,
            "checkpoint_bytes": sum(f.stat().st_size for f in out.iterdir() if f.suffix == ".safetensors"),
            "engine_weight_bytes_by_format": stats["weight_bytes_by_format"],
        },
    }


def _replace(tmp: Path, out_dir: Path) -> None:
    """Moves the finished checkpoint to out_dir (an existing one, with force, only once this is done)."""
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
        os.replace(out_dir, old / "previous")
    try:
        os.replace(tmp, out_dir)
    except OSError as e:
        if old is not None:
            os.replace(old / "previous", out_dir)
            shutil.rmtree(old, ignore_errors=True)
        raise FileError(f"cannot move the checkpoint to '{out_dir}': {e}") from e
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


__all__ = ["QuantizationResult", "quantize", "format_table", "RECIPES", "METHODS"]
