#!/usr/bin/env python3
"""The CPU proof of the recipe (well under a minute): data -> training (with a resume) -> a drafter that
ocria_rt loads, whose proposals through the engine equal the torch model's, and with which speculative
greedy decoding gives plain greedy's tokens. Target: the package's tiny-vlm (random weights).
The proposals are compared on text prompts (the first block; the torch model on transformers' taps,
which cross-checks the engine's) and at every step of the engine's speculative loop on the cached image
pages (the torch model on the cached taps, data.py's from Engine.hidden_states, before each step's
anchor: the training data's context), so that training and the engine cannot disagree on which taps,
positions or tokens a block sees.

    python scripts/train_drafter/smoke.py [--keep DIR] [--fixture DIR]

--fixture DIR also writes the trained drafter there with proposals.json (the torch model's proposals
for a few prompts), the committed fixture tests/test_train_drafter.py loads without torch.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import data  # noqa: E402
import train  # noqa: E402
from model import DFlash2Drafter, propose  # noqa: E402

TARGET = HERE.parents[1] / "python" / "ocria_rt" / "models" / "tiny-vlm"
LAYERS = [1, 4]
PROMPT_SEEDS = range(4)


def text_prompt(seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (10 + seed,), generator=g).tolist()


def load_transformers_target(target: Path):
    """The target in transformers (fp32, CPU): its taps for the text prompts, and z-lab's reference."""
    from transformers import AutoConfig, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    vlm = getattr(AutoConfig.from_pretrained(target), "vision_config", None) is not None
    cls = Qwen3_5ForConditionalGeneration if vlm else Qwen3_5ForCausalLM
    return cls.from_pretrained(target, dtype=torch.float32).eval()


def transformers_taps(model, ids: list[int], layers: list[int]) -> torch.Tensor:
    """transformers' hidden_states[id + 1] of the layers, concatenated per position, for a text prompt (the
    cross-check of the engine's taps, which data.py caches)."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False, logits_to_keep=1)
    return torch.cat([out.hidden_states[i + 1][0] for i in layers], -1)


def zlab_proposals(drafter_dir: Path, target, prompt: list[int], anchor: int) -> list[int] | None:
    """z-lab's reference (PyPI `dflash`) loading the checkpoint and proposing the first block; None
    when the package is not installed."""
    try:
        import dflash.model as zl
    except ImportError:
        return None
    model = zl.DFlash2DraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True, use_cache=False)
        taps = zl.extract_context_feature(out.hidden_states, model.target_layer_ids)
        B = model.block_size
        block = torch.tensor([[anchor] + [model.mask_token_id] * (B - 1)])
        noise = zl._raw_input_embeddings(target, block, 1.0)
        hidden = model(target_hidden=taps, noise_embedding=noise, position_ids=torch.arange(len(prompt) + B)[None],
                       use_cache=False)[:, 1:, :]
        tokens, _, _ = model.propose(hidden, block[:, 0], zl._output_head(target), 0.0)
    return [int(t) for t in tokens[0]]


def loop_mismatches(eng, model, cache: Path, embed, head) -> tuple[int, list[str]]:
    """(steps checked, mismatches) of the engine's speculative greedy loop on data.py's cached image pages:
    at each step the engine's proposals (seen through its proposal hook) against the torch model's on
    the cached taps of the tokens before the step's anchor."""
    from ocria_rt.chat import build_multimodal_prompt
    from ocria_rt.pipeline import DEFAULT_PROMPT

    meta = json.loads((cache / "meta.json").read_text())
    pages = train.load_cache(cache)
    source = argparse.Namespace(images=None, target=TARGET, split=meta["split"], seed=meta["seed"],
                                pages=pages[-1]["index"] + 1, workers=0)
    images = [image for _, image in data.page_sources(source)]
    steps, bad = 0, []
    for page in pages:
        image = images[page["index"]]
        messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "text", "text": DEFAULT_PROMPT}]}]
        ids, pv, grid = build_multimodal_prompt(eng, messages)
        seen: list[tuple[int, list[int]]] = []
        eng._core.set_proposal_hook(lambda position, proposals: seen.append((position, list(proposals))))
        try:
            out = eng.generate(ids, len(page["ids"]) - len(ids), pixel_values=pv, image_grid_thw=grid)
        finally:
            eng._core.set_proposal_hook(None)
        seq = page["ids"].tolist()
        if list(ids) + list(out.token_ids) != seq:
            bad.append(f"page {page['index']}: speculative greedy differs from the cached answer")
            continue
        for position, engine_proposals in seen:
            mine = propose(model, page["taps"][:position], seq[position], embed, head)
            steps += 1
            if mine != engine_proposals:
                bad.append(f"page {page['index']}, block at {position}: torch {mine}, ocria_rt {engine_proposals}")
    return steps, bad


def run(work: Path, fixture: Path | None = None) -> dict:
    import ocria_rt

    t0 = time.perf_counter()
    cache, run_dir = work / "data", work / "run"
    data.main(["--target", str(TARGET), "--out", str(cache), "--layers", *map(str, LAYERS), "--pages", "3",
               "--max-new-tokens", "24", "--threads", "1"])
    common = ["--target", str(TARGET), "--data", str(cache), "--out", str(run_dir), "--block-size", "8",
              "--num-heads", "2", "--num-kv-heads", "1", "--head-dim", "32", "--intermediate-size", "64",
              "--selector-rank", "16", "--selector-top-k", "8", "--batch", "2", "--anchors", "4", "--warmup", "5",
              "--lr", "3e-3", "--ckpt-every", "10", "--log-every", "10", "--threads", "1"]
    train.main(common + ["--steps", "40", "--run-steps", "20"])
    train.main(common + ["--steps", "40"])  # resumes at step 20
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    losses = [r["ce"] for r in log if "ce" in r]
    drafter_dir = run_dir / "drafter"

    model = DFlash2Drafter.load(drafter_dir).eval()
    embed, head, _, text = train.target_tables(TARGET)
    target = load_transformers_target(TARGET)
    eng = ocria_rt.Engine(TARGET, drafter=drafter_dir, num_threads=1)
    proposals, same_greedy, accept, zlab_checked = [], 0, [], 0
    for seed in PROMPT_SEEDS:
        prompt = text_prompt(seed, int(text["vocab_size"]) - 4)
        taps = transformers_taps(target, prompt, LAYERS)
        anchor = eng.generate(prompt, 1, stop_token_ids=[], speculative=False).token_ids[0]
        mine = propose(model, taps, anchor, embed, head)
        if mine != eng.draft(prompt):
            raise SystemExit(f"prompt {seed}: the torch drafter proposes {mine}, ocria_rt {eng.draft(prompt)}")
        reference = zlab_proposals(drafter_dir, target, prompt, anchor)
        if reference is not None and reference != mine:
            raise SystemExit(f"prompt {seed}: the torch drafter proposes {mine}, z-lab's reference {reference}")
        zlab_checked += reference is not None
        proposals.append({"prompt": prompt, "anchor": anchor, "proposals": mine})
        plain = eng.generate(prompt, 40, stop_token_ids=[], speculative=False).token_ids
        spec = eng.generate(prompt, 40, stop_token_ids=[])
        same_greedy += spec.token_ids == plain
        accept += spec.acceptance_lengths
    if same_greedy != len(PROMPT_SEEDS):
        raise SystemExit("speculative greedy differs from plain greedy")
    loop_steps, loop_bad = loop_mismatches(eng, model, cache, embed, head)
    if loop_bad or loop_steps == 0:
        raise SystemExit(f"the engine's loop on the cached image pages ({loop_steps} steps): " + "; ".join(loop_bad))
    if fixture is not None:
        if fixture.exists():
            shutil.rmtree(fixture)
        shutil.copytree(drafter_dir, fixture)
        (fixture / "proposals.json").write_text(json.dumps(
            {"target": "python/ocria_rt/models/tiny-vlm", "prompts": proposals}, indent=1) + "\n")
    return {"seconds": round(time.perf_counter() - t0, 1), "pages": 3, "steps": log[-1]["step"],
            "ce_first": losses[0], "ce_last": losses[-1], "proposals_match": True, "zlab_checked": zlab_checked,
            "greedy_match": same_greedy, "loop_steps_match": loop_steps,
            "tau": sum(accept) / len(accept)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", type=Path, help="work directory to keep (default: a temporary one)")
    ap.add_argument("--fixture", type=Path, help="also write the drafter and proposals.json here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        print(json.dumps(run(args.keep, args.fixture)))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(run(Path(tmp), args.fixture)))


if __name__ == "__main__":
    main()
