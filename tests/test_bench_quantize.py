"""bench/quantize_time.py on the CPU with its tiny shape: the random VLM written with numpy, quantize
timed stage by stage, the JSON and the Markdown table last; bench/quantize_quality.py on the shipped
model and its mixed-precision checkpoint; bench/compare_evals.py's paired bootstrap."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import compare_evals  # noqa: E402
import quantize_quality  # noqa: E402
import quantize_time  # noqa: E402
from common import OCRIA1_VISION, SHAPES  # noqa: E402


def test_quantize_time_tiny(tmp_path, capsys):
    out = tmp_path / "quantize.json"
    assert quantize_time.main([str(out), "--shape", "tiny", "--pages", "4", "--device", "cpu", "--threads", "1",
                               "--workdir", str(tmp_path / "work")]) == 0
    r = json.loads(out.read_text())
    assert r["shape"] == "tiny" and r["device"] == "cpu" and r["recipe"] == "mixed" and r["pages"] == 4
    assert r["calibration"]["samples"] == 3 and r["calibration"]["heldout_samples"] == 1
    assert r["groups"] == 4 * 4 + 1 and r["trials"] == 2 * r["groups"]  # every group in FP8 and NVFP4
    s = r["seconds"]
    for stage in ("load", "calibration samples", "input statistics", "reference outputs", "sensitivity",
                  "sensitivity/kl", "sensitivity/quantize", "writing", "checking/kl", "total"):
        assert s[stage] > 0, stage
    assert s["sensitivity"] < s["total"]
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("| total |") and lines[0].startswith("tiny (4 layers")
    table = lines[[i for i, line in enumerate(lines) if line.startswith("| stage |")][0]:]
    assert table[1] == "|---|---|---|" and any(line.startswith("|   kl |") for line in table)


def test_quantize_time_host_groups(tmp_path, capsys):
    """--host-groups: one group of each kind of the tiny shape in both formats, counted over its layers."""
    out = tmp_path / "groups.json"
    assert quantize_time.main([str(out), "--shape", "tiny", "--host-groups", "--threads", "1"]) == 0
    r = json.loads(out.read_text())
    kinds = {g["group"]: g for g in r["groups"]}
    assert len(kinds) == 7 and kinds["MLP gate, up"]["shape"] == "512 x 128"  # TINY: intermediate 256
    assert kinds["DeltaNet in_proj (qkv, z)"]["groups in the model"] == 3 and kinds["attention o_proj"]["groups in the model"] == 1
    assert all(g["fp8 s"] > 0 and g["nvfp4 s"] > 0 for g in r["groups"])
    assert r["model_seconds"] == pytest.approx(sum(g["model s"] for g in r["groups"]), abs=0.5)
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| LM head |")


def test_random_checkpoint_layout(monkeypatch):
    """The 4B shape cut to 2 layers keeps a DeltaNet and an attention layer of the real shapes, and the
    OCRia-1 vision tower; weights are drawn as bench/common.py draws them (norms zero, matrices 1/sqrt(fan_in))."""
    text = dict(SHAPES["ocria1-4b"], num_hidden_layers=2)
    types = quantize_time.layer_types(2)
    assert types == ["linear_attention", "full_attention"]
    assert quantize_time.layer_types(8) == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    shapes = quantize_time.tensor_shapes(text, types, dict(OCRIA1_VISION, out_hidden_size=2560))
    p = "model.language_model.layers."
    assert shapes[p + "0.linear_attn.in_proj_qkv.weight"] == (8192, 2560)
    assert shapes[p + "1.self_attn.q_proj.weight"] == (8192, 2560)
    assert shapes[p + "1.mlp.down_proj.weight"] == (2560, 9216)
    assert shapes["model.language_model.embed_tokens.weight"] == (248320, 2560)
    assert shapes["model.visual.blocks.23.attn.qkv.weight"] == (3072, 1024)
    assert not any(".layers.2." in n for n in shapes)
    monkeypatch.setattr(quantize_time, "PIECE", 40_000)
    shape = (8, 9216)  # two pieces
    w = [quantize_time.random_piece(p + "1.mlp.down_proj.weight", shape, i, seed=0) for i in (0, 1)]
    assert w[0].dtype == np.uint16 and w[0].size == 40_000 and w[1].size == 8 * 9216 - 40_000
    f = (np.concatenate(w).astype(np.uint32) << 16).view(np.float32)
    assert abs(float(f.std()) * 9216**0.5 - 1.0) < 0.02
    assert not np.array_equal(w[0][:1000], w[1][:1000])  # each piece has its own seed
    assert not np.any(quantize_time.random_piece(p + "0.input_layernorm.weight", (2560,), 0, seed=0))


def test_quantize_quality(tmp_path, capsys):
    """The shipped model against itself (KL 0, every top-1 agreeing) and against its mixed-precision
    checkpoint (a small KL, most tokens agreeing), on 2 held-out pages; then compare() by hand."""
    import ocria_rt

    models = Path(ocria_rt.__file__).parent / "models"
    out = tmp_path / "quality.json"
    assert quantize_quality.main([str(out), "--reference", str(models / "ocria-mini"), "--models",
                                  str(models / "ocria-mini"), str(models / "ocria-mini-mixed"), "--pages", "2",
                                  "--threads", "1"]) == 0
    same, mixed = json.loads(out.read_text())["rows"]
    assert same["kl"] == 0 and same["top1_agreement"] == 1 and same["tokens"] == mixed["tokens"] > 20
    assert 0 < mixed["kl"] < 0.05 and mixed["top1_agreement"] > 0.9
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| ocria-mini-mixed |")
    p, q = np.log([[0.5, 0.5], [0.9, 0.1]]), np.log([[0.25, 0.75], [0.9, 0.1]])
    r = quantize_quality.compare([p], [q])
    assert r["kl"] == pytest.approx((0.5 * np.log(2) + 0.5 * np.log(0.5 / 0.75)) / 2) and r["top1_agreement"] == 0.5


def test_compare_evals(tmp_path, capsys):
    """A run that is worse on every page by 0.1 is told apart (a tight interval around +10 points); one whose
    differences cancel holds 0; runs over different pages are refused."""
    def write(name, cers, seeds=None):
        pages = [{"cer": c, "seed": s} for c, s in zip(cers, seeds or range(len(cers)))]
        (tmp_path / name).write_text(json.dumps({"per_page": pages}))
        return str(tmp_path / name)

    rng = np.random.default_rng(0)
    base = rng.uniform(0, 0.2, 300)
    assert compare_evals.main([write("worse.json", base + 0.1), write("base.json", base)]) == 0
    assert "(300 differ): +10.00 points, 95% interval [+10.00, +10.00]" in capsys.readouterr().out
    swing = base + np.where(np.arange(300) % 2 == 0, 0.05, -0.05)
    r = compare_evals.paired_bootstrap(swing, base)
    assert abs(r["mean_difference"]) < 1e-12 and r["ci95"][0] < 0 < r["ci95"][1] and r["pages_differing"] == 300
    assert compare_evals.main([write("other.json", base, list(range(1, 301))), str(tmp_path / "base.json")]) == 2
    assert "scored different pages" in capsys.readouterr().err
