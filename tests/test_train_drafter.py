"""scripts/train_drafter: a drafter the recipe trained (tests/fixtures/drafters/trained_tiny_vlm, written by
`smoke.py --fixture`) loads in ocria_rt, proposes what the torch model proposed, and speculative greedy
decoding with it gives plain greedy's tokens (no torch needed); with torch and transformers, the whole
smoke run (data, training with a resume, export, the same checks on its fresh output)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import numpy as np
import pytest

import ocria_rt
from support import FIXTURES, PACKAGE_MODELS

REPO = FIXTURES.parent.parent
TRAINED = FIXTURES / "drafters" / "trained_tiny_vlm"
CASES = json.loads((TRAINED / "proposals.json").read_text())["prompts"]


@pytest.fixture(scope="module")
def engine() -> ocria_rt.Engine:
    return ocria_rt.Engine(PACKAGE_MODELS / "tiny-vlm", drafter=TRAINED, num_threads=1)


def test_trained_drafter_is_a_dflash2_checkpoint() -> None:
    cfg = json.loads((TRAINED / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3"
    d = cfg["dflash_config"]
    assert d["block_size"] == 8 and d["target_layer_ids"] == [1, 4] and d["selector_top_k"] == 8


@pytest.mark.parametrize("case", CASES, ids=[f"prompt{i}" for i in range(len(CASES))])
def test_trained_drafter_proposals_match_torch(engine: ocria_rt.Engine, case: dict) -> None:
    assert engine.generate(case["prompt"], 1, stop_token_ids=[], speculative=False).token_ids == [case["anchor"]]
    assert engine.draft(case["prompt"]) == case["proposals"]


@pytest.mark.parametrize("case", CASES, ids=[f"prompt{i}" for i in range(len(CASES))])
def test_trained_drafter_speculative_greedy_is_plain_greedy(engine: ocria_rt.Engine, case: dict) -> None:
    plain = engine.generate(case["prompt"], 48, stop_token_ids=[], speculative=False)
    spec = engine.generate(case["prompt"], 48, stop_token_ids=[])
    assert spec.token_ids == plain.token_ids
    assert spec.acceptance_lengths and sum(spec.acceptance_lengths) == 47  # the first token comes from the prefill


@contextmanager
def recipe_module(name: str) -> Iterator[ModuleType]:
    """scripts/train_drafter/<name>.py imported; the recipe's modules have plain names (data, train,
    model) that other scripts' tests also import, so theirs are put back afterwards."""
    names = ("smoke", "data", "train", "model")
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    sys.path.insert(0, str(REPO / "scripts" / "train_drafter"))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "scripts" / "train_drafter"))
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


def test_pages_drawn_by_worker_processes_are_those_drawn_in_process() -> None:
    args = argparse.Namespace(images=None, target=PACKAGE_MODELS / "ocria-mini", split="heldout", seed=0, pages=5,
                              workers=0)
    with recipe_module("data") as data:
        here = list(data.page_sources(args, start=2))
        args.workers = 2
        pooled = list(data.page_sources(args, start=2))
    assert [key for key, _ in here] == [key for key, _ in pooled] and len(here) == 3
    assert all(a.size == b.size and a.tobytes() == b.tobytes() for (_, a), (_, b) in zip(here, pooled))


def test_cache_reading_skips_a_shard_being_written(tmp_path) -> None:
    page = {"0/ids": np.arange(4, dtype=np.int32), "0/prompt_len": np.int32(1), "0/taps": np.ones((4, 2), np.float16)}
    np.savez(tmp_path / "shard-00000.npz", **page)
    np.savez(tmp_path / "shard-00001.npz", **page)
    (tmp_path / "shard-00002.npz.tmp.npz").write_bytes(b"half a shard")  # data.py's name while it writes
    with recipe_module("data") as data:
        assert data.shard_files(tmp_path) == [tmp_path / "shard-00000.npz", tmp_path / "shard-00001.npz"]
        pages = list(data.read_cache(tmp_path, shards=slice(1, None)))
    assert len(pages) == 1 and pages[0]["prompt_len"] == 1 and pages[0]["taps"].shape == (4, 2)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
                    reason="the training recipe needs torch and transformers")
def test_smoke_recipe(tmp_path) -> None:
    with recipe_module("smoke") as smoke:
        r = smoke.run(tmp_path)  # raises on a proposal or greedy mismatch
    assert r["proposals_match"] and r["greedy_match"] == len(smoke.PROMPT_SEEDS)
    assert r["loop_steps_match"] > 0  # the engine's proposals = torch's at every step on the image pages
    assert r["steps"] == 40 and r["ce_last"] < r["ce_first"]
    assert (tmp_path / "run" / "drafter" / "model.safetensors").is_file()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the training recipe needs torch")
def test_training_batches() -> None:
    """make_batch: anchors inside each answer (distinct where it has as many positions, drawn with
    replacement where not), labels the tokens from each anchor on (-1 past the end), blocks the anchor then
    the mask id, taps each sequence's own, zero past its end."""
    import torch

    rng = np.random.default_rng(0)
    pages = []
    for n, prompt in ((40, 10), (30, 25), (60, 5)):  # 29, 4 and 54 anchor positions
        pages.append({"ids": torch.from_numpy(rng.integers(0, 100, n)), "prompt_len": prompt,
                      "taps": torch.from_numpy(rng.standard_normal((n, 6)).astype(np.float16))})
    pick = [2, 0, 1, 1, 2, 0, 0, 2, 1, 2, 0, 1]
    with recipe_module("train") as train:
        taps, blocks, anchors, labels = train.make_batch(pages, pick, torch.Generator().manual_seed(3), 8, 5, 99)
    assert taps.shape == (12, 60, 6) and labels.shape == blocks.shape == (12, 8, 5)
    for s, i in enumerate(pick):
        ids, start, n = pages[i]["ids"], pages[i]["prompt_len"], len(pages[i]["ids"])
        at = anchors[s].tolist()
        assert all(start <= a <= n - 2 for a in at) and (len(set(at)) == 8 or n - 1 - start < 8)
        for a, row in zip(at, labels[s].tolist()):
            assert row == [int(ids[a + k]) if a + k < n else -1 for k in range(5)]
        assert torch.equal(taps[s, :n], pages[i]["taps"]) and not taps[s, n:].any()
    assert torch.equal(blocks[..., 0], labels[..., 0]) and bool((blocks[..., 1:] == 99).all())


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the training recipe needs torch")
def test_batches_draw_the_least_drawn_pages_first() -> None:
    """Every page is drawn once before any is drawn twice, a page added later comes before the others
    are drawn again, and no draw passes max_reuse (None instead; the counts then stay as they were)."""
    import torch

    with recipe_module("train") as train:
        gen = torch.Generator().manual_seed(0)
        draws = torch.zeros(10)
        firsts = torch.cat([train.draw_pages(draws, gen, 4, 2) for _ in range(2)])
        assert len(set(firsts.tolist())) == 8 and sorted(draws.tolist()) == [0, 0] + [1] * 8
        draws = torch.cat([draws, torch.zeros(3)])  # three new pages
        undrawn = {i for i in range(13) if draws[i] == 0}  # the 2 pages not drawn yet and the 3 new ones
        assert set(train.draw_pages(draws, gen, 4, 2).tolist()) < undrawn and draws.max() == 1
        while train.draw_pages(draws, gen, 4, 2) is not None:
            assert draws.max() <= 2
        assert draws.sum() == 24 and draws.max() == 2  # 26 draws allowed; the last batch of 4 did not fit
        assert len(train.draw_pages(torch.zeros(3), gen, 5, 0)) == 5  # no limit: pages repeat in a batch


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the training recipe needs torch")
def test_training_waits_for_data_past_the_reuse_limit(tmp_path) -> None:
    """--max-reuse R: no cached page drawn more than R times; training then waits for new shards (here
    none come) until its time is spent, and still writes its drafter."""
    data = random_cache(tmp_path / "data")
    with recipe_module("train") as train:
        train.main(["--target", str(PACKAGE_MODELS / "tiny-vlm"), "--data", str(data), "--out", str(tmp_path / "run"),
                    "--block-size", "4", "--batch", "4", "--anchors", "2", "--max-reuse", "2", "--steps", "0",
                    "--minutes", "0.05", "--log-every", "1", "--threads", "1"])
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "ce" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))  # 2 x 16 pages / 4 per step
    assert steps[-1]["draws_max"] == 2 and steps[-1]["draws_mean"] == 2.0
    assert (tmp_path / "run" / "drafter" / "model.safetensors").is_file()


def random_cache(data: Path, seed: int = 0) -> Path:
    """A data.py cache of one shard: 16 pages of tiny-vlm, 6 prompt tokens, 14 answer tokens, 2 taps."""
    rng = np.random.default_rng(seed)
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"layers": [1, 4], "position_ids": "sequence index"}))
    pages = {}
    for j in range(16):
        pages[f"{j}/ids"] = rng.integers(0, 1000, 20).astype(np.int32)
        pages[f"{j}/prompt_len"] = np.int32(6)
        pages[f"{j}/taps"] = rng.standard_normal((20, 2 * 128)).astype(np.float16)
    np.savez(data / "shard-00000.npz", **pages)
    return data


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the training recipe needs torch")
def test_training_goes_on_from_a_drafter_over_several_caches(tmp_path) -> None:
    """--init DIR starts from DIR's weights (at learning rate 0 they stay DIR's); --data takes several
    caches (32 pages here); a checkpoint to resume and --init together are refused."""
    from safetensors.numpy import load_file

    caches = [str(random_cache(tmp_path / f"data-{i}", seed=i)) for i in range(2)]
    common = ["--target", str(PACKAGE_MODELS / "tiny-vlm"), "--block-size", "4", "--batch", "4", "--anchors", "2",
              "--steps", "4", "--log-every", "1", "--threads", "1"]
    with recipe_module("train") as train:
        train.main([*common, "--data", caches[0], "--out", str(tmp_path / "a")])
        train.main([*common, "--data", *caches, "--out", str(tmp_path / "b"), "--init", str(tmp_path / "a" / "drafter"),
                    "--lr", "0"])
        with pytest.raises(SystemExit, match="--init starts a run"):
            train.main([*common, "--data", caches[0], "--out", str(tmp_path / "b"), "--init", str(tmp_path / "a")])
    a, b = (load_file(str(tmp_path / r / "drafter" / "model.safetensors")) for r in "ab")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    start = json.loads((tmp_path / "b" / "log.jsonl").read_text().splitlines()[0])
    assert start["pages"] == 32 and start["start"]["init"] == str(tmp_path / "a" / "drafter")


def test_engine_uses_the_model_directorys_drafter_by_default(tmp_path) -> None:
    model = tmp_path / "tiny-vlm"
    shutil.copytree(PACKAGE_MODELS / "tiny-vlm", model)
    prompt = CASES[0]["prompt"]
    plain = ocria_rt.Engine(model, num_threads=1)
    assert plain.drafter_dir is None
    shutil.copytree(TRAINED, model / "drafter")
    eng = ocria_rt.Engine(model, num_threads=1)
    assert eng.drafter_dir == model / "drafter"
    spec = eng.generate(prompt, 24, stop_token_ids=[])
    assert spec.acceptance_lengths and spec.token_ids == plain.generate(prompt, 24, stop_token_ids=[]).token_ids
    assert eng.generate(prompt, 24, stop_token_ids=[], speculative=False).acceptance_lengths == []
    off = ocria_rt.Engine(model, num_threads=1, drafter=False)
    assert off.drafter_dir is None and off.generate(prompt, 24, stop_token_ids=[]).acceptance_lengths == []
    with pytest.raises(ocria_rt.OcriaError, match="drafter must be a directory"):
        ocria_rt.Engine(model, num_threads=1, drafter=True)
    # the CLI: the model's own drafter by default, none with --no-drafter (not with --drafter as well)
    from contextlib import redirect_stdout
    from io import StringIO

    from ocria_rt import cli

    for extra, speculative in (([], True), (["--no-drafter"], False)):
        out = StringIO()
        with redirect_stdout(out):
            assert cli.main(["generate", "--model", str(model), "--prompt", "Read the page.", "--max-new-tokens", "12",
                             "--ignore-eos", "--json", "--threads", "1", *extra]) == 0
        assert bool(json.loads(out.getvalue())["acceptance_lengths"]) == speculative
    with pytest.raises(SystemExit):
        cli.main(["generate", "--model", str(model), "--prompt", "x", "--drafter", str(model / "drafter"), "--no-drafter"])


def test_the_model_directorys_drafter_is_on_by_default_only_on_the_devices_its_config_names(tmp_path) -> None:
    model = tmp_path / "tiny-vlm"
    shutil.copytree(PACKAGE_MODELS / "tiny-vlm", model)
    shutil.copytree(TRAINED, model / "drafter")
    config = json.loads((model / "drafter" / "config.json").read_text())

    def default_on(section: object) -> bool:
        (model / "drafter" / "config.json").write_text(json.dumps({**config, "ocria_rt": section}))
        return ocria_rt.Engine(model, num_threads=1).drafter_dir == model / "drafter"

    assert not default_on({"default_devices": ["cuda"]})
    assert default_on({"default_devices": ["cuda", "cpu"]})
    assert default_on({})  # no list: every device
    # asked for by name, it loads wherever its config says it is on by default
    (model / "drafter" / "config.json").write_text(json.dumps({**config, "ocria_rt": {"default_devices": []}}))
    assert ocria_rt.Engine(model, num_threads=1, drafter=model / "drafter").drafter_dir == model / "drafter"
    for bad in ({"default_devices": "cuda"}, {"default_devices": [0]}, ["cuda"]):
        with pytest.raises(ocria_rt.OcriaError, match=r'drafter/config.json: "ocria_rt".* must be'):
            default_on(bad)
    (model / "drafter" / "config.json").write_text("{")
    with pytest.raises(ocria_rt.OcriaError, match=r"drafter/config.json' is not valid JSON"):
        ocria_rt.Engine(model, num_threads=1)
