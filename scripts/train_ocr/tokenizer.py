#!/usr/bin/env python3
"""Train the OCR model's tokenizer: byte-level BPE on generated page Markdown.

    python scripts/train_ocr/tokenizer.py [--out scripts/train_ocr/tokenizer] [--vocab 4096] [--pages 4000]

The tokenizer is a Qwen3.5-style byte-level BPE (NFC normaliser, Qwen3.5's pre-tokenizer split, byte
level alphabet so that any text encodes) trained with the `tokenizers` package on the Markdown of
generated training pages (a base seed of their own, never the held-out split) plus the page prompt.
Added after the BPE vocabulary, in this order: the HTML table tags (ordinary added tokens, one token
each) and Qwen3.5's special tokens ``<|endoftext|> <|im_start|> <|im_end|> <|vision_start|>
<|vision_end|> <|image_pad|> <|video_pad|>``; the total is exactly --vocab.

Writes tokenizer.json and tokenizer_config.json (Qwen2Tokenizer class, eos <|im_end|>, pad
<|endoftext|>, the multimodal chat template of the package's tiny VLM) to --out. Deterministic for
its arguments (and the machine's fonts, which decide some line breaks, not the text).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (sets up the ocria_rt imports)
from common import DEFAULT_PROMPT, HTML_TOKENS, SPECIAL_TOKENS, TINY_VLM_DIR, synthdoc  # noqa: E402

# Qwen3.5's pre-tokenizer split (tokenizer.json of Qwen3.5 checkpoints; transformers' Qwen3.5
# tokenizer uses the same expression), so transformers and ocria_rt split text identically.
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS_SEED = 1000  # base seed of the tokenizer's pages (training pages use other base seeds)


def _markdown(i: int) -> str:
    cfg = synthdoc.PageConfig(render=False)
    return synthdoc.generate_page(synthdoc.page_seed("train", i, CORPUS_SEED), cfg)[1]


def corpus(n_pages: int, workers: int) -> list[str]:
    if workers > 1:
        with Pool(workers) as pool:
            texts = pool.map(_markdown, range(n_pages), chunksize=32)
    else:
        texts = [_markdown(i) for i in range(n_pages)]
    return texts + [DEFAULT_PROMPT] * 50 + ["user\n", "assistant\n", "system\n"] * 50


def train(texts: list[str], vocab: int):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    n_bpe = vocab - len(HTML_TOKENS) - len(SPECIAL_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, min_frequency=2, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.get_vocab_size() != n_bpe:
        raise SystemExit(f"BPE learned {tok.get_vocab_size()} tokens, wanted {n_bpe}: use more --pages or a smaller --vocab")
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in HTML_TOKENS])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.get_vocab_size() == vocab, tok.get_vocab_size()
    return tok


def write(tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {}
    for t in HTML_TOKENS + SPECIAL_TOKENS:
        added[str(tok.token_to_id(t))] = {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                         "single_word": False, "special": t in SPECIAL_TOKENS}
    template = json.loads((TINY_VLM_DIR / "tokenizer_config.json").read_text())["chat_template"]
    cfg = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "split_special_tokens": False,
        "chat_template": template,
    }
    common.write_json(out / "tokenizer_config.json", cfg)


def check_with_transformers(out: Path, texts: list[str]) -> str:
    """transformers' AutoTokenizer on the directory must give the same ids as the tokenizers file."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return "transformers not installed: not checked"
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(out))
    prompt = common.apply_chat_template(out, common.page_messages(), add_generation_prompt=True)
    for t in texts[:50] + [prompt, prompt + texts[0] + "<|im_end|>"]:
        a = raw.encode(t, add_special_tokens=False).ids
        b = hf(t, add_special_tokens=False)["input_ids"]
        if a != b:
            raise SystemExit(f"transformers' tokenizer disagrees on {t[:80]!r}: {a[:20]} vs {b[:20]}")
        if raw.decode(a, skip_special_tokens=False) != t:
            raise SystemExit(f"round trip failed on {t[:80]!r}")
    return f"transformers {type(hf).__name__}: identical ids on 52 texts"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--out", type=Path, default=common.DEFAULT_TOKENIZER_DIR)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--pages", type=int, default=4000)
    ap.add_argument("--workers", type=int, default=0, help="processes for page generation (0: CPU count)")
    args = ap.parse_args()
    import os

    workers = args.workers or os.cpu_count() or 1
    t0 = time.time()
    texts = corpus(args.pages, workers)
    t1 = time.time()
    tok = train(texts, args.vocab)
    write(tok, args.out)
    t2 = time.time()
    pages = texts[:args.pages]
    n_tok = sum(len(tok.encode(t, add_special_tokens=False).ids) for t in pages[:500])
    n_chr = sum(len(t) for t in pages[:500])
    print(f"corpus: {args.pages} pages, {sum(len(t) for t in pages) / 1e6:.1f} M chars ({t1 - t0:.0f} s); "
          f"BPE {args.vocab} tokens ({t2 - t1:.0f} s); {n_chr / n_tok:.2f} chars/token, "
          f"{n_tok / 500:.0f} tokens/page on average")
    print(check_with_transformers(args.out, pages))
    print(f"wrote {args.out}/tokenizer.json, tokenizer_config.json")


if __name__ == "__main__":
    main()
