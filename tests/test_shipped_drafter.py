"""The DFlash2 drafter trained for ocria-mini (scripts/train_drafter on an H100; shipped as the model's
drafter/, on by default on CUDA only, where it pays): speculative decoding with it is lossless on
held-out pages, and its acceptance length does not fall below what it was measured at."""
import json

import ocria_rt
from ocria_rt import cli
from ocria_rt.synthdoc import evaluate, heldout_page_config

DRAFTER = ocria_rt.default_model_dir() / "drafter"
# Measured on these 12 pages (seed 5) on the CPU: TAU_MEASURED tokens per verify step at the
# shipped block size; a drafting regression (a wrong tap, position or mask) falls far below the floor.
TAU_MEASURED = 3.34
TAU_FLOOR = TAU_MEASURED - 0.25


def test_the_drafter_is_on_by_default_on_cuda_only_and_reads_the_models_taps(capsys):
    cfg = json.loads((DRAFTER / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [2, 6, 7]
    # on the CPU a verify step costs more than it saves (README, Limitations): asked for by name only
    assert cfg["ocria_rt"]["default_devices"] == ["cuda"]
    assert ocria_rt.Engine(num_threads=1).drafter_dir is None
    assert ocria_rt.Engine(num_threads=1, drafter=DRAFTER).drafter_dir == DRAFTER
    assert cli.main(["eval", "--pages", "1", "--compare-plain", "--threads", "1"]) == 2
    assert f"off by default on cpu (its config.json's default_devices); name it: --drafter {DRAFTER}" in capsys.readouterr().err


def test_the_shipped_drafter_is_lossless_and_keeps_its_acceptance_length():
    config, _ = heldout_page_config(ocria_rt.default_model_dir())
    eng = ocria_rt.Engine(num_threads=2, drafter=DRAFTER)
    d = evaluate(eng, n_pages=12, seed=5, config=config, compare_plain=True)["decode"]
    assert d["identical_pages"] == 12
    assert d["mean_acceptance_length"] >= TAU_FLOOR, d["acceptance_histogram"]
