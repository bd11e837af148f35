"""The command line and the C++ embedding example."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ocria_rt
from support import FIXTURES, load_reference

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ocria_rt.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_generate_default_model():
    r = cli("generate", "--prompt", "The table below lists", "--max-new-tokens", "12", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no text printed"
    assert "tokens/s" in r.stderr


def test_cli_json_matches_python_api():
    r = cli("generate", "--model", str(FIXTURES / "text_tied"), "--prompt", "3 1 4 1 5", "--max-new-tokens", "9", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    expected = ocria_rt.Engine(FIXTURES / "text_tied").generate([3, 1, 4, 1, 5], max_new_tokens=9)
    assert out["token_ids"] == expected.token_ids
    assert out["decode_tokens_per_second"] > 0


def test_cli_eval_scores_held_out_pages_like_the_python_api(tmp_path):
    from ocria_rt.synthdoc import evaluate, heldout_page_config

    out = tmp_path / "eval.json"
    r = cli("eval", "--pages", "2", "--max-new-tokens", "24", "--json", str(out), "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert "held-out pages" in r.stdout and "CER" in r.stdout
    got = json.loads(out.read_text())
    # its pages: the model's training distribution, text source and font families (training.json)
    model = ocria_rt.default_model_dir()
    config, sources = heldout_page_config(model)
    assert got["page_sources"]["fonts_used"] == sources["fonts_used"] and len(config.fonts) == len(sources["fonts_used"])
    assert got["page_config"]["fonts"] == sources["fonts_trained"] == list(config.fonts)
    assert "fonts found here" in r.stdout and "text: faker" in r.stdout
    expected = evaluate(ocria_rt.Engine(model), n_pages=2, seed=3, max_new_tokens=24, config=config)
    assert got["pages"] == 2 and [p["seed"] for p in got["per_page"]] == [p["seed"] for p in expected["per_page"]]
    assert got["cer"] == pytest.approx(expected["cer"]) and got["tables"] == expected["tables"]
    assert all(p["seed"] % 2 == 1 for p in got["per_page"]), "held-out pages have odd seeds"


def _vlm_with_training_json(tmp_path: Path, data, **record) -> Path:
    """The shipped model (ocria-mini) plus the training.json an exported training checkpoint carries."""
    d = tmp_path / "vlm"
    shutil.copytree(ocria_rt.default_model_dir(), d)
    (d / "training.json").write_text(json.dumps({"preset": "small", "step": 1, "data": data, **record}))
    return d


SMALL_PAGES = {"long_side": [320, 352], "aspect": [1.25, 1.45], "landscape": 0.0, "body_px": [40, 56],
               "chars": [20, 90], "noise": 0.5, "locales": None}


@pytest.mark.parametrize("text_source, match", [
    ({"generator": "faker", "version": "0.0.1"}, "faker 0.0.1.*pip install faker==0.0.1"),
    ({"generator": "synthdoc word lists", "sha256": "0" * 16}, "synthdoc word lists"),
])
def test_cli_eval_refuses_another_text_source(tmp_path, text_source, match):
    model = _vlm_with_training_json(tmp_path, SMALL_PAGES, text_source=text_source)
    r = cli("eval", "--model", str(model), "--pages", "1", "--max-new-tokens", "4")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert re.search(match, r.stderr) and "training.json" in r.stderr and "CER" in r.stderr, r.stderr


def test_cli_eval_refuses_a_machine_without_faker(tmp_path):
    # faker hidden: a package of that name earlier on the path that fails to import
    (tmp_path / "hide" / "faker").mkdir(parents=True)
    (tmp_path / "hide" / "faker" / "__init__.py").write_text("raise ImportError('hidden for the test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "hide"), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "ocria_rt.cli", "eval", "--pages", "1", "--max-new-tokens", "4"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "faker 40.63.0, which is not installed" in r.stderr and "pip install faker==40.63.0" in r.stderr, r.stderr


def test_cli_eval_draws_with_the_recorded_fonts_and_warns_about_the_others(tmp_path):
    from ocria_rt.synthdoc import family_records, fonts, text_source

    here = family_records("auto")
    absent = next(n for n in sorted(fonts.KNOWN_FAMILIES) if n not in {f["family"] for f in here})
    recorded = [here[0], {"family": absent, "sha256": "1" * 16}]
    model = _vlm_with_training_json(tmp_path, SMALL_PAGES, text_source=text_source(), fonts=recorded)
    out = tmp_path / "eval.json"
    r = cli("eval", "--model", str(model), "--pages", "1", "--max-new-tokens", "4", "--json", str(out))
    assert r.returncode == 0, r.stderr
    sub = fonts.substitute(absent).name
    assert "warning" in r.stderr and f"lacks {absent} (drawn with {sub} instead)" in r.stderr, r.stderr
    assert "fonts found here: " + ", ".join(f["family"] for f in here) in r.stdout, r.stdout
    got = json.loads(out.read_text())
    assert got["page_config"]["fonts"] == [here[0]["family"], absent]
    assert got["page_sources"]["fonts_used"] == [here[0]["family"], sub]


def test_cli_eval_uses_the_model_training_pages_and_the_flags(tmp_path):
    model = _vlm_with_training_json(tmp_path, SMALL_PAGES)
    out = tmp_path / "eval.json"
    r = cli("eval", "--model", str(model), "--pages", "3", "--max-new-tokens", "4", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "training.json" in r.stdout and "long side 320-352 px" in r.stdout
    got = json.loads(out.read_text())
    assert got["page_config"]["long_side"] == [320, 352] and got["page_config"]["max_chars"] == 90
    assert all(max(p["size"]) in (320, 352) for p in got["per_page"]), got["per_page"]
    # a flag replaces one field; the rest stays the model's
    r = cli("eval", "--model", str(model), "--pages", "2", "--max-new-tokens", "4", "--json", str(out),
            "--long-side", "512", "512")
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    assert [max(p["size"]) for p in got["per_page"]] == [512, 512] and got["page_config"]["body_px"] == [40, 56]


def test_cli_eval_names_a_malformed_training_json(tmp_path):
    model = _vlm_with_training_json(tmp_path, {"long_side": [320]})
    r = cli("eval", "--model", str(model), "--pages", "1", "--max-new-tokens", "4")
    assert r.returncode == 2 and "training.json" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("args, match", [
    (["--pages", "0"], "--pages must be at least 1"),
    (["--long-side", "512", "256"], "--long-side needs 32 <= LO <= HI"),
    (["--max-chars", "0"], "--max-chars must be at least 1"),
    (["--json", "/nonexistent/dir/eval.json"], "does not exist"),
    (["--model", str(FIXTURES / "text_tied")], "no vision encoder"),
])
def test_cli_eval_bad_arguments(args, match):
    r = cli("eval", "--pages", "1", "--max-new-tokens", "4", *args)
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_cli_reports_errors_without_traceback():
    r = cli("generate", "--model", "/nonexistent/model", "--prompt", "x")
    assert r.returncode == 2
    assert "error:" in r.stderr and "does not exist" in r.stderr
    assert "Traceback" not in r.stderr


def test_cpp_example_builds_and_generates(tmp_path):
    cmake_dir = Path(ocria_rt.build_info()["cmake_dir"])
    if not cmake_dir.exists():
        pytest.skip("the C++ SDK is installed with the package: run `pip install .` first")
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not on PATH")
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(ROOT / "examples" / "cpp"), "-B", str(build), f"-Docria_rt_DIR={cmake_dir}"],
                   check=True, capture_output=True, timeout=300)
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True, timeout=300)
    ref = load_reference("text_tied")
    prompt = [str(t) for t in ref["greedy_prompt"]]
    r = subprocess.run([str(build / "generate"), str(FIXTURES / "text_tied"), "--max-new-tokens", "64", *prompt],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal([int(t) for t in r.stdout.split()], ref["greedy_tokens"])
    bad = subprocess.run([str(build / "generate"), str(tmp_path / "missing"), "1"], capture_output=True, text=True)
    assert bad.returncode == 1 and "does not exist" in bad.stderr


def test_cli_eval_reports_speculative_decoding_beside_plain(tmp_path):
    model = Path(ocria_rt.__file__).parent / "models" / "tiny-vlm"
    drafter = FIXTURES / "drafters" / "trained_tiny_vlm"
    out = tmp_path / "eval.json"
    r = cli("eval", "--model", str(model), "--drafter", str(drafter), "--compare-plain", "--pages", "2",
            "--max-new-tokens", "24", "--threads", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())["decode"]
    assert d["identical_pages"] == 2, "greedy speculative decoding must give the plain tokens"
    # every decoded token came out of a verify step: the histogram's tokens are the decoded tokens
    assert sum(int(k) * v for k, v in d["acceptance_histogram"].items()) == d["tokens"] > 0
    assert sum(d["acceptance_histogram"].values()) == d["verify_steps"]
    assert d["mean_acceptance_length"] == pytest.approx(d["tokens"] / d["verify_steps"])
    assert d["tokens_per_s"] > 0 and d["plain_tokens_per_s"] > 0 and d["speedup"] > 0
    assert "tau" in r.stdout and "2/2 pages token-identical" in r.stdout
    r = cli("eval", "--model", str(model), "--compare-plain", "--pages", "1", "--max-new-tokens", "4")
    assert r.returncode != 0 and "--compare-plain needs a drafter" in r.stderr


def test_cli_parse_reports_acceptance_lengths_with_a_drafter(tmp_path):
    model = Path(ocria_rt.__file__).parent / "models" / "tiny-vlm"
    drafter = FIXTURES / "drafters" / "trained_tiny_vlm"
    out = tmp_path / "doc.json"
    r = cli("parse", "--sample", "--pages", "1-2", "--model", str(model), "--drafter", str(drafter),
            "--max-new-tokens", "16", "--threads", "1", "-o", str(tmp_path / "doc.md"), "--json", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    steps = [a for p in doc["pages"] for a in p["acceptance_lengths"]]
    for p in doc["pages"]:  # every token after a page's first came out of a verify step
        assert sum(p["acceptance_lengths"]) == p["new_tokens"] - 1
    assert doc["timings"]["mean_acceptance_length"] == pytest.approx(sum(steps) / len(steps))
    assert "tau" in r.stderr
    plain = ocria_rt.parse(ocria_rt.sample_document(), engine=ocria_rt.Engine(model, num_threads=1), pages="1-2",
                           max_new_tokens=16, progress=False)
    assert [p.markdown for p in plain.pages] == [p["markdown"] for p in doc["pages"]]
    assert "mean_acceptance_length" not in plain.timings and not plain.pages[0].acceptance_lengths
