"""bench/spec.py on the CPU with its small target shape: the whole script in seconds (random target and
DFlash2 drafter written, forced acceptance lengths, phase timing, plain decoding, JSON and table)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import spec  # noqa: E402
from common import bytes_per_decode_step  # noqa: E402


def test_spec_bench_smoke(tmp_path, capsys):
    out = tmp_path / "spec.json"
    taus = [1, 3, 16]
    assert spec.main([str(out), "--device", "cpu", "--shapes", "tiny", "--quant", "bf16", "--taus", "1,3,16",
                      "--prompt", "9", "--new-tokens", "20", "--reps", "1", "--workdir", str(tmp_path / "models")]) == 0
    result = json.loads(out.read_text())
    assert result["copy_bandwidth_Bps"] is None and result["block_size"] == 16
    (run,) = result["runs"]
    assert run["shape"] == "tiny" and run["weights"] == "bf16"
    assert run["plain"]["tokens_per_s"] > 0 and run["plain"]["ms_per_step"] > 0
    assert [r["tau"] for r in run["taus"]] == taus
    for r in run["taus"]:
        assert r["forced_ok"], r  # every step emitted tau tokens
        assert r["speculative"]["tokens_per_s"] > 0
        assert all(r["phases_ms"][p] > 0 for p in ("draft", "verify", "commit")), r
        assert "ceiling_tokens_per_s" not in r  # no bandwidth measured on the CPU
    # the table comes last: a header, a separator, the plain row and one row per tau
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-len(taus) - 3].startswith("| model | weights | tau | tok/s | ceiling tok/s")
    assert "plain decode" in lines[-len(taus) - 1]
    assert [line.split(" | ")[2] for line in lines[-len(taus):]] == [str(t) for t in taus]


def test_spec_step_bytes_4b():
    """The 4B's speculative step moves the decode step's bytes, plus the LM head again (1.27 GB in BF16)
    for the drafter's logits, the drafter's ~0.5 B weights, its context K/V and one more DeltaNet state
    read; per phase, the verify is the decode step but for half the state traffic."""
    c, d = spec.target_config("ocria1-4b"), spec.DRAFTERS["ocria1-4b"]
    need = spec.spec_step_bytes(c, d, 1024, "bf16")
    decode = bytes_per_decode_step(c, 1024, "bf16")
    lm_head = 2 * c["vocab_size"] * c["hidden_size"]
    assert need["verify"] == decode["weights"] + decode["kv_cache"] + decode["gdn_state"] / 2
    assert 0.9e9 < need["draft"] - lm_head < 1.3e9
    assert need["total"] == need["draft"] + need["verify"] + need["commit"]
    nvfp4 = spec.spec_step_bytes(c, d, 1024, "nvfp4")
    assert nvfp4["verify"] < need["verify"] / 2 and nvfp4["draft"] == need["draft"]  # the drafter stays BF16


def test_spec_bench_nvfp4_target(tmp_path):
    """--quant nvfp4: the target quantized (with torch, as bench/decode.py does) and run with the drafter."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    out = tmp_path / "spec.json"
    assert spec.main([str(out), "--device", "cpu", "--shapes", "tiny", "--quant", "nvfp4", "--taus", "4",
                      "--prompt", "5", "--new-tokens", "9", "--reps", "1", "--workdir", str(tmp_path / "models")]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["weights"] == "nvfp4" and run["taus"][0]["forced_ok"]
    assert (tmp_path / "models" / "tiny-cpu-nvfp4" / "hf_quant_config.json").is_file()
