"""The ocria-rt command line."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import OcriaError


def _generate(args: argparse.Namespace) -> int:
    from . import Engine

    eng = Engine(args.model, device=args.device, max_context=args.max_context, num_threads=args.threads)
    stops = [] if args.ignore_eos else None
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
        }))
        return 0
    print(r.text if r.text is not None else " ".join(map(str, r.token_ids)))
    print(
        f"[{r.prompt_tokens} prompt tokens: prefill {r.prefill_seconds * 1e3:.1f} ms "
        f"({r.prefill_tokens_per_second:.1f} tokens/s); {len(r.token_ids)} new tokens: "
        f"decode {r.decode_tokens_per_second:.1f} tokens/s; finish: {r.finish_reason}; device {eng.device}]",
        file=sys.stderr,
    )
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
    g.set_defaults(func=_generate)

    i = sub.add_parser("info", help="print build information")
    i.set_defaults(func=_info)

    args = p.parse_args(argv)
    try:
        return int(args.func(args))
    except OcriaError as e:
        print(f"ocria-rt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
