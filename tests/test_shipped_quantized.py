"""The mixed-precision ocria-mini shipped beside the dense one (`ocria-rt quantize --recipe mixed` of it):
it loads as a ModelOpt MIXED_PRECISION checkpoint and reads held-out pages about as well as the dense model."""
import json

import pytest

import ocria_rt
from ocria_rt.synthdoc import evaluate, heldout_page_config

MIXED = ocria_rt.default_model_dir().parent / "ocria-mini-mixed"


def test_the_mixed_model_loads_as_a_mixed_precision_checkpoint():
    quant = json.loads((MIXED / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "MIXED_PRECISION"
    algos = {v["quant_algo"] for v in quant["quantized_layers"].values()}
    assert algos == {"FP8", "NVFP4"}
    s = ocria_rt.Engine(MIXED, num_threads=1).stats()
    assert s["quantization"] == "modelopt"
    assert s["weight_bytes_by_format"]["fp8"] > 0 and s["weight_bytes_by_format"]["nvfp4"] > 0
    report = json.loads((MIXED / "quantization_report.json").read_text())
    assert report["total"]["fraction_of_bf16"] <= 0.40


def test_the_mixed_model_reads_held_out_pages_as_well_as_the_dense_one():
    config, _ = heldout_page_config(ocria_rt.default_model_dir())
    dense = evaluate(ocria_rt.Engine(ocria_rt.default_model_dir(), num_threads=1), n_pages=12, seed=5, config=config)
    mixed = evaluate(ocria_rt.Engine(MIXED, num_threads=1), n_pages=12, seed=5, config=config)
    # 200 pages: 3.09% against 3.10% (README); on 12 pages allow a page's worth of difference
    assert mixed["cer"] <= dense["cer"] + 0.02
    assert mixed["cer"] < 0.10
    same = sum(a["cer"] == pytest.approx(b["cer"]) for a, b in zip(mixed["per_page"], dense["per_page"]))
    assert same >= 8, "most pages read the same"
