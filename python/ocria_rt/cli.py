"""The ocria-rt command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import OcriaError

DRAFTER_HELP = ("speculative decoding with this DFlash / DFlash2 drafter directory (z-lab's format), trained for "
                "the model: the same output (on CUDA up to BF16 near ties), fewer target passes when its drafts are "
                "accepted; default: the model directory's own drafter/, if any, on the devices its config.json "
                "names in \"ocria_rt\": {\"default_devices\": [...]} (all without it)")


def _add_drafter_args(p: argparse.ArgumentParser) -> None:
    d = p.add_mutually_exclusive_group()
    d.add_argument("--drafter", default=None, metavar="DIR", help=DRAFTER_HELP)
    d.add_argument("--no-drafter", action="store_true", help="no speculative decoding, not even with the model's own drafter/")


def _drafter(args: argparse.Namespace) -> str | bool | None:
    """Engine's drafter argument: the directory asked for, False (--no-drafter) or None (the model's own)."""
    return False if args.no_drafter else args.drafter


def _generate(args: argparse.Namespace) -> int:
    from . import Engine

    eng = Engine(args.model, device=args.device, max_context=args.max_context, num_threads=args.threads,
                 drafter=_drafter(args))
    stops: list[int] | None = [] if args.ignore_eos else None
    prompt = args.prompt
    if eng.tokenizer is None:
        prompt = [int(t) for t in args.prompt.split()]  # no tokenizer: the prompt is token ids
    if args.stream and eng.tokenizer is not None:
        import time

        tokens: list[int] = []
        printed = ""
        t0 = time.perf_counter()
        for tok in eng.stream(prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, stops):
            tokens.append(tok)
            text = eng.decode(tokens)
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
        elapsed = time.perf_counter() - t0
        print(f"\n[{len(tokens)} tokens in {elapsed:.2f} s: {len(tokens) / elapsed:.1f} tokens/s]", file=sys.stderr)
        return 0
    r = eng.generate(prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, stops)
    if args.json:
        print(json.dumps({
            "text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
            "prompt_tokens": r.prompt_tokens, "prefill_seconds": r.prefill_seconds,
            "decode_seconds": r.decode_seconds, "decode_tokens_per_second": r.decode_tokens_per_second,
            "prefill_tokens_per_second": r.prefill_tokens_per_second, "stats": r.stats,
            "acceptance_lengths": r.acceptance_lengths, "mean_acceptance_length": r.mean_acceptance_length,
        }))
        return 0
    print(r.text if r.text is not None else " ".join(map(str, r.token_ids)))
    if r.acceptance_lengths:
        print(f"[speculative: {len(r.acceptance_lengths)} verify steps, {r.mean_acceptance_length:.2f} tokens per step]",
              file=sys.stderr)
    print(
        f"[{r.prompt_tokens} prompt tokens: prefill {r.prefill_seconds * 1e3:.1f} ms "
        f"({r.prefill_tokens_per_second:.1f} tokens/s); {len(r.token_ids)} new tokens: "
        f"decode {r.decode_tokens_per_second:.1f} tokens/s; finish: {r.finish_reason}; device {eng.device}]",
        file=sys.stderr,
    )
    return 0


def _write_atomic(path: str, text: str) -> str:
    """Writes `text` to a temporary file next to `path`; returns the temporary path (see _commit)."""
    import os
    import tempfile

    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _check_output_path(path: str) -> None:
    """Raises FileError unless `path` can be written: its directory exists and it is not a directory."""
    import os

    from .errors import FileError

    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise FileError(f"output directory '{d}' does not exist (for '{path}')")
    if os.path.isdir(path):
        raise FileError(f"output '{path}' is a directory")


def _parse(args: argparse.Namespace) -> int:
    import os

    from . import sample_document
    from .errors import FileError, InvalidArgumentError
    from .pipeline import parse, parse_page_spec

    for out in (args.output, args.json):  # fail before the model runs, not after
        if out not in (None, "-"):
            _check_output_path(out)
    if args.output and args.json and args.output != "-" and os.path.abspath(args.output) == os.path.abspath(args.json):
        raise InvalidArgumentError("-o and --json name the same file")
    parse_page_spec(args.pages)  # a bad --pages is a usage error before anything runs
    if args.sample == bool(args.inputs):
        raise InvalidArgumentError("give INPUT files or --sample (the PDF shipped with the package), not both"
                                   if args.sample else "no INPUT given (PDF or image files; --sample parses the shipped sample)")
    inputs = [str(sample_document())] if args.sample else args.inputs

    engine = args.model  # a directory (or None: the default VLM), loaded by parse() once the inputs check out
    if args.threads or args.drafter or args.no_drafter:
        from . import Engine, default_model_dir

        engine = Engine(args.model or default_model_dir(), device=args.device, num_threads=args.threads,
                        drafter=_drafter(args))
    doc = parse(
        inputs,
        engine=engine,
        prompt=args.prompt,
        pages=args.pages,
        dpi=args.dpi,
        target_long_side=args.target_long_side,
        max_new_tokens=args.max_new_tokens,
        progress="always" if args.progress else not args.no_progress,
        device=args.device,
    )

    texts = {}
    if args.output in (None, "-"):
        sys.stdout.write(doc.markdown)
        sys.stdout.flush()
    else:
        texts[args.output] = doc.markdown
    if args.json == "-":
        print(json.dumps(doc.to_dict(), indent=2, ensure_ascii=False))
    elif args.json:
        texts[args.json] = json.dumps(doc.to_dict(), indent=2, ensure_ascii=False) + "\n"
    temps: list[tuple[str, str]] = []
    try:
        for path, text in texts.items():
            temps.append((_write_atomic(path, text), path))
        for tmp, path in temps:
            os.replace(tmp, path)
    except OSError as e:
        for tmp, _ in temps:
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise FileError(f"cannot write the output: {e}") from e

    n, failed = len(doc.pages), doc.failed_pages
    for p in failed:
        print(f"ocria-rt: page {p.page_number} of '{p.source}' failed: {p.error}", file=sys.stderr)
    for bad in doc.input_errors:
        print(f"ocria-rt: input '{bad.source}' failed: {bad.error}", file=sys.stderr)
    t = doc.timings
    print(
        f"[{n - len(failed)}/{n} pages in {t['wall_s']:.2f} s ({t['pages_per_s']:.2f} pages/s), "
        f"{doc.new_tokens} new tokens ({t['tokens_per_s']:.1f} tokens/s)"
        + (f", speculative: tau {t['mean_acceptance_length']:.2f} tokens per verify step" if "mean_acceptance_length" in t
           else "") + "]",
        file=sys.stderr,
    )
    if args.sample:
        _score_sample(doc, sample_document().with_suffix(".json"))
    return 0 if doc.ok else 1


def _score_sample(doc, truth_path) -> None:
    """After `parse --sample`: each page's character error rate against the sample's true Markdown."""
    from .synthdoc.metrics import cer

    truth = json.loads(truth_path.read_text())["markdown"]
    rates = [cer(p.markdown, truth[p.page_index]) for p in doc.pages if p.ok]
    if rates:
        print(f"[sample: character error rate against the true Markdown, per page: "
              f"{' '.join(f'{100 * r:.1f}%' for r in rates)}; mean {100 * sum(rates) / len(rates):.1f}%]",
              file=sys.stderr)


def _describe_text(source: dict[str, str]) -> str:
    if source["generator"] == "faker":
        return f"faker {source.get('version', '?')}"
    return f"{source['generator']} ({', '.join(f'{k} {v}' for k, v in source.items() if k != 'generator')})"


def _check_page_sources(model_dir: Path, report: dict) -> None:
    """Refuses a machine that cannot draw the text of the model's held-out pages; warns (stderr) where its
    font families differ from the training machine's."""
    from .errors import DependencyError

    where = model_dir / "training.json"
    trained, here = report["text_trained"], report["text_here"]
    fix = (f"pip install faker=={trained['version']}" if trained and trained["generator"] == "faker" and "version" in trained
           else "install ocria-rt with its dependencies")
    if here is None:
        what = _describe_text(trained) if trained else "faker"
        raise DependencyError(f"{where}: the held-out pages take their text from {what}, which is not installed "
                              f"here ({fix}); other text would make the CER incomparable")
    if report["text_matches"] is False:
        raise DependencyError(f"{where}: the model was trained on pages with text from {_describe_text(trained)}; "
                              f"this machine has {_describe_text(here)}, whose pages of the same seeds are other "
                              f"text, so the CER would not be comparable ({fix})")
    if report["fonts_missing"] or report["fonts_other_files"]:
        lacks = []
        if report["fonts_missing"]:
            lacks.append("lacks " + ", ".join(f"{name} (drawn with {sub} instead)"
                                              for name, sub in report["fonts_missing"].items()))
        if report["fonts_other_files"]:
            lacks.append(f"has other files of {', '.join(report['fonts_other_files'])} (which may draw other glyphs)")
        print(f"ocria-rt eval: warning: the model was trained with the font families "
              f"{', '.join(report['fonts_trained'])}; this machine {' and '.join(lacks)}, so held-out pages "
              f"that fall to those families may differ from the training machine's (glyphs, line breaks) and "
              f"the CER from one measured there; found here: "
              f"{', '.join(f['family'] for f in report['fonts_found'])} (OCRIA_SYNTHDOC_FONT_DIRS adds font "
              f"folders)", file=sys.stderr)


def _eval(args: argparse.Namespace) -> int:
    import dataclasses
    import os

    from . import Engine, default_model_dir
    from .errors import InvalidArgumentError, ModelError
    from .synthdoc import evaluate, heldout_page_config, with_overrides

    if args.pages < 1:
        raise InvalidArgumentError(f"--pages must be at least 1, got {args.pages}")
    if args.json:
        _check_output_path(args.json)
    for name, pair, low in (("--long-side", args.long_side, 32), ("--body-px", args.body_px, 1)):
        if pair is not None and not low <= pair[0] <= pair[1]:
            raise InvalidArgumentError(f"{name} needs {low} <= LO <= HI, got {pair[0]} {pair[1]}")
    if args.max_chars is not None and args.max_chars < 1:
        raise InvalidArgumentError(f"--max-chars must be at least 1, got {args.max_chars}")
    model_dir = Path(args.model) if args.model else default_model_dir()
    # The pages: the model's own training distribution, text source and font families when its directory
    # says (training.json), else synthdoc's defaults; the flags replace single fields.
    try:
        cfg, sources = heldout_page_config(model_dir)
    except ValueError as e:
        raise ModelError(str(e)) from None
    _check_page_sources(model_dir, sources)
    trained = (model_dir / "training.json").is_file()
    source = "the model's training pages (training.json)" if trained else "synthdoc's defaults"
    overrides = {k: v for k, v in (("long_side", args.long_side), ("body_px", args.body_px),
                                   ("max_chars", args.max_chars)) if v is not None}
    if overrides:
        cfg = with_overrides(cfg, **{k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()})
        source += ", " + ", ".join(f"{k} {v}" for k, v in overrides.items())
    eng = Engine(model_dir, device=args.device, num_threads=args.threads, drafter=_drafter(args))
    if not eng.config.get("has_vision"):
        raise InvalidArgumentError(f"model '{eng.model_dir}' has no vision encoder: eval needs a VLM")
    if args.compare_plain and eng.drafter_dir is None:
        own = eng.model_dir / "drafter"
        if (own / "config.json").is_file() and not args.no_drafter:
            raise InvalidArgumentError(f"--compare-plain needs a drafter: the model's own is off by default on "
                                       f"{args.device} (its config.json's default_devices); name it: --drafter {own}")
        raise InvalidArgumentError("--compare-plain needs a drafter (--drafter DIR, or the model's own drafter/)")
    r = evaluate(eng, n_pages=args.pages, seed=args.seed, config=cfg, max_new_tokens=args.max_new_tokens,
                 progress=args.progress, compare_plain=args.compare_plain)
    r.update(model=str(eng.model_dir), device=str(eng.device), pages_from=source, page_sources=sources,
             page_config={k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()})
    if args.json:
        os.replace(_write_atomic(args.json, json.dumps(r, indent=1) + "\n"), args.json)
    rate = "n/a" if r["table_exact_rate"] is None else f"{100 * r['table_exact_rate']:.1f}%"
    lo, hi = r["cer_ci95"]
    print(f"{r['pages']} held-out pages (seed {args.seed}): CER {100 * r['cer']:.2f}% (95% interval over pages "
          f"{100 * lo:.2f}-{100 * hi:.2f}%, pooled {100 * r['cer_micro']:.2f}%, median {100 * r['cer_median']:.2f}%); tables exact "
          f"{r['tables_exact']}/{r['tables']} ({rate}); {r['pages_per_s']:.2f} pages/s on {eng.device}")
    d = r["decode"]
    line = f"decode: {d['tokens']} tokens, {d['tokens_per_s']:.1f} tokens/s"
    if "mean_acceptance_length" in d:
        line += f"; speculative: tau {d['mean_acceptance_length']:.2f} tokens per verify step ({d['verify_steps']} steps)"
    if "speedup" in d:
        line += (f"; without the drafter {d['plain_tokens_per_s']:.1f} tokens/s ({d['speedup']:.2f}x with it), "
                 f"{d['identical_pages']}/{r['pages']} pages token-identical")
    print(line)
    print("by layout: " + ", ".join(f"{name} {100 * v['cer']:.1f}% ({v['pages']})" for name, v in r["by_layout"].items()))
    print(f"pages: {source}: long side {cfg.long_side[0]}-{cfg.long_side[1]} px, body {cfg.body_px[0]}-{cfg.body_px[1]} px"
          + (f", at most {cfg.max_chars} characters" if cfg.max_chars else ""))
    text_note = "" if sources["text_trained"] else " (training.json records none: unchecked)"
    print(f"text: {_describe_text(sources['text_here'])}{text_note}")
    print(f"fonts found here: {', '.join(f['family'] for f in sources['fonts_found'])}; pages drawn with "
          f"{', '.join(sources['fonts_used'])}"
          + (f" (trained with {', '.join(sources['fonts_trained'])})" if sources["fonts_trained"]
             else " (training.json records no families)"))
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from .quantization import quantize

    res = quantize(
        args.model_dir,
        args.out_dir,
        recipe=args.recipe,
        calib=args.calib,
        calib_synthetic=args.calib_synthetic,
        budget=args.budget,
        max_kl=args.max_kl,
        method=args.method,
        device=args.device,
        force=args.force,
        heldout=args.heldout,
        seed=args.seed,
        num_threads=args.threads,
        max_new_tokens=args.max_new_tokens,
        progress="always" if args.progress else not args.no_progress,
    )
    print(res.table())
    print(f"[{res.report['quant_algo']} checkpoint written to {res.out_dir}; report {res.out_dir / 'quantization_report.json'}, "
          f"plot {res.out_dir / 'quantization_kl.png'}]", file=sys.stderr)
    return 0


def _info(args: argparse.Namespace) -> int:
    from . import build_info

    print(json.dumps(build_info(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ocria-rt", description="Run Qwen3.5-architecture models with ocria_rt.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text after a prompt")
    g.add_argument("--model", default=None, help="model directory (default: the small model shipped in the package)")
    g.add_argument("--prompt", default="The table below lists", help="prompt text (token ids if the model has no tokenizer)")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-context", type=int, default=0)
    g.add_argument("--threads", type=int, default=0, help="CPU threads (0: all cores)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    g.add_argument("--stream", action="store_true", help="print tokens as they come")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _add_drafter_args(g)
    g.set_defaults(func=_generate)

    pa = sub.add_parser(
        "parse",
        help="convert PDFs and images to Markdown, page by page",
        description="Convert PDFs and images (PNG, JPEG, TIFF incl. multi-page) to Markdown with a VLM. "
        "Exit status: 0 all pages converted, 1 some pages (or, with several inputs, some inputs) failed "
        "(outputs still written), 2 usage or input error (nothing written).",
    )
    pa.add_argument("inputs", nargs="*", metavar="INPUT", help="PDF or image files")
    pa.add_argument("--sample", action="store_true",
                    help="parse the sample PDF shipped with the package and score it against its true Markdown")
    pa.add_argument("-o", "--output", default=None, help="Markdown output file (default or '-': stdout)")
    pa.add_argument("--json", default=None, metavar="OUT.json", help="also write per-page text, errors, timings and token counts as JSON ('-': stdout)")
    pa.add_argument("--pages", default=None, help="pages of every document, 1-based: e.g. 1-3,7 or 5-")
    pa.add_argument("--prompt", default=None, help="the instruction sent with every page (default: Markdown, tables as HTML)")
    pa.add_argument("--model", default=None, help="VLM directory (default: the model shipped in the package, ocria-mini)")
    pa.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    pa.add_argument("--max-new-tokens", type=int, default=2048, help="per page")
    pa.add_argument("--dpi", type=float, default=None, help="render PDFs at this resolution (default: longer side = --target-long-side)")
    pa.add_argument("--target-long-side", type=int, default=1288, help="PDF pages: pixels of the longer side (default 1288)")
    pa.add_argument("--threads", type=int, default=0, help="CPU threads (0: all cores)")
    _add_drafter_args(pa)
    prog = pa.add_mutually_exclusive_group()
    prog.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    prog.add_argument("--progress", action="store_true", help="a progress line on stderr even when it is not a terminal")
    pa.set_defaults(func=_parse)

    e = sub.add_parser(
        "eval",
        help="character error rate and table exactness on generated held-out pages",
        description="Scores a VLM on N pages from ocria_rt.synthdoc's held-out split (odd page seeds, never "
        "used in training): each page goes through Engine.chat with parse's default prompt, greedy; CER = "
        "edit distance / reference characters (mean over pages, and pooled); a table is exact when its rows, "
        "cells per row and th/td kinds match. The pages follow the model's training distribution when its "
        "directory has the training.json that scripts/train_ocr/export.py writes, else synthdoc's defaults.",
    )
    e.add_argument("--model", default=None, help="VLM directory (default: the model shipped in the package, ocria-mini)")
    e.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    e.add_argument("--pages", type=int, default=200, help="held-out pages (default 200)")
    e.add_argument("--seed", type=int, default=0, help="held-out set (default 0)")
    e.add_argument("--max-new-tokens", type=int, default=2048, help="per page")
    e.add_argument("--long-side", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="page long side range in px (default: the model's training pages, else 768 1024)")
    e.add_argument("--body-px", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="body type size range at a long side of 1024 (default: as --long-side, else 13 19)")
    e.add_argument("--max-chars", type=int, default=None,
                   help="Markdown characters per page at most (default: as --long-side, else no limit)")
    e.add_argument("--threads", type=int, default=0, help="CPU threads (0: all cores)")
    _add_drafter_args(e)
    e.add_argument("--compare-plain", action="store_true",
                   help="with a drafter: generate each page again without it and report both decode speeds "
                        "and how many pages came out token-identical")
    e.add_argument("--json", default=None, metavar="OUT.json", help="also write the figures, per page, as JSON")
    e.add_argument("--progress", action="store_true", help="one line per page on stdout")
    e.set_defaults(func=_eval)

    q = sub.add_parser(
        "quantize",
        help="write an FP8 / NVFP4 / mixed-precision ModelOpt checkpoint of a model",
        description="Calibrates MODEL_DIR on pages (or text) run through the engine, quantizes its decoder "
        "projections (AWQ scales folded into the layers before them, clipped NVFP4 block scales) and writes a "
        "ModelOpt-format checkpoint (hf_quant_config.json; quant_algo FP8, NVFP4 or MIXED_PRECISION) with "
        "quantization_report.json and quantization_kl.png to OUT_DIR. Embeddings, norms, the DeltaNet conv, "
        "in_proj_a / in_proj_b and the vision encoder stay unquantized; the uniform recipes keep the LM head too. "
        "Exit status 2 on a usage or input error (nothing is written).",
    )
    q.add_argument("model_dir", metavar="MODEL_DIR", help="the dense (BF16 / F16 / F32) checkpoint to quantize")
    q.add_argument("out_dir", metavar="OUT_DIR", help="where the quantized checkpoint goes (must be empty or absent)")
    q.add_argument("--recipe", choices=["fp8", "nvfp4", "mixed"], default="mixed",
                   help="one format for every projection, or a format per projection group chosen by its KL "
                   "divergence per byte (default mixed)")
    q.add_argument("--method", choices=["awq", "gptq", "rtn"], default="awq",
                   help="awq: activation-aware scales and clipped block scales (default); gptq: AWQ's scales, "
                        "then rounding with error feedback (lower error, more host time); rtn: plain rounding")
    src = q.add_mutually_exclusive_group()
    src.add_argument("--calib", nargs="+", metavar="FILE", default=None,
                     help="calibration PDFs / images (rendered as parse renders them; continued by the model's own "
                     "output) or .txt / .md files")
    src.add_argument("--calib-synthetic", type=int, metavar="N", default=None,
                     help="N synthetic pages with their true Markdown (default 64, a quarter of them held out for the KL)")
    q.add_argument("--budget", default=None,
                   help="mixed: the bytes allowed for the quantized projections: average bits per weight (4.5), a share "
                   "of their BF16 bytes (40%%) or bytes (3MB); the plan with the lowest KL within it")
    q.add_argument("--max-kl", type=float, default=None,
                   help="mixed without --budget: the fewest bytes whose KL (nats per token, summed over the groups quantized alone) stays below this (default 0.005)")
    q.add_argument("--heldout", type=int, default=None, help="calibration samples kept for the KL (default a quarter)")
    q.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    q.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    q.add_argument("--seed", type=int, default=0, help="synthetic calibration pages (default 0)")
    q.add_argument("--max-new-tokens", type=int, default=512, help="--calib pages: the model's output continued this far")
    q.add_argument("--threads", type=int, default=0, help="CPU threads (0: all cores)")
    qprog = q.add_mutually_exclusive_group()
    qprog.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    qprog.add_argument("--progress", action="store_true", help="the progress bar even when stderr is not a terminal")
    q.set_defaults(func=_quantize)

    i = sub.add_parser("info", help="print build information")
    i.set_defaults(func=_info)

    args = p.parse_args(argv)
    try:
        return int(args.func(args))
    except OcriaError as e:
        print(f"ocria-rt: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ocria-rt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
