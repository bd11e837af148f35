"""Quantized checkpoints end to end on CUDA against the CPU reference (run on the GPU machine).

Each quantized model (written with numpy from a dense fixture, tests/quant_checkpoints.py) comes with
its dense twin: the same model with the dequantized weights stored densely. BF16 alone moves these
random models' logits by ~0.2, so the bound on the quantized CUDA engine's error against the CPU is
the dense twin's own CUDA-vs-CPU error: what the quantized kernels add must stay small beside it."""

from __future__ import annotations

import numpy as np
import pytest

import ocria_rt
import quant_checkpoints as qc
from support import FIXTURES, load_reference, relerr

pytestmark = pytest.mark.gpu

CONTINUATION = 64


def plan_for(base, recipe):
    mods = qc.linear_modules(qc.read_safetensors(next(base.glob("*.safetensors"))))
    kept = ("in_proj_a", "in_proj_b")
    plan = {}
    for m in mods:
        k = m.rsplit(".", 1)[-1]
        if k in kept or (k == "lm_head" and recipe != "mixed"):
            continue
        if recipe == "mixed":
            plan[m] = "fp8" if k in ("lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "down_proj") else "nvfp4"
        else:
            plan[m] = recipe
    return plan


@pytest.fixture(scope="module", params=[("text_tied", "nvfp4"), ("text_tied", "fp8"), ("vlm_untied", "mixed")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def quantized(request, tmp_path_factory):
    name, recipe = request.param
    base = FIXTURES / name
    root = tmp_path_factory.mktemp(f"{name}-{recipe}")
    plan = plan_for(base, recipe)
    qc.quantize(base, root / "q", root / "twin", plan)
    algo = {"nvfp4": {"quant_algo": "NVFP4", "group_size": 16}, "fp8": {"quant_algo": "FP8"}}
    qc.set_quantization_config(root / "q", hf_quant_config=qc.modelopt_config(
        "MIXED_PRECISION", quantized_layers={m: algo[f] for m, f in plan.items()}))
    return name, root / "q", root / "twin"


def test_quantized_logits_match_cpu(quantized):
    name, qdir, twin = quantized
    prompt = list(load_reference(name)["greedy_prompt"])
    cpu_q = ocria_rt.Engine(qdir, device="cpu")
    cont = cpu_q.generate(prompt, max_new_tokens=CONTINUATION, stop_token_ids=[]).token_ids
    seq = prompt + cont[:-1]
    want_q = cpu_q.score(seq)
    want_twin = ocria_rt.Engine(twin, device="cpu").score(seq)
    gpu_q, gpu_twin = ocria_rt.Engine(qdir, device="cuda"), ocria_rt.Engine(twin, device="cuda")
    # the quantized formats are stored as the checkpoint has them on both backends; dense weights are
    # fp32 on the CPU and BF16 on CUDA
    by_format = {d: e.stats()["weight_bytes_by_format"] for d, e in (("cpu", cpu_q), ("cuda", gpu_q))}
    assert {f: by_format["cuda"][f] for f in ("fp8", "nvfp4")} == {f: by_format["cpu"][f] for f in ("fp8", "nvfp4")}
    assert 0 < by_format["cuda"]["dense"] < by_format["cpu"]["dense"]
    for chunk in (1, 0):  # decode path (the skinny GEMM), prefill path (dequantized rows + CUTLASS)
        err_q = np.array([relerr(g, w) for g, w in zip(gpu_q.score(seq, chunk=chunk), want_q)])
        err_twin = np.array([relerr(g, w) for g, w in zip(gpu_twin.score(seq, chunk=chunk), want_twin)])
        assert np.all(np.isfinite(err_q)), f"{name} chunk={chunk}: non-finite logits"
        assert err_q.mean() <= 1.5 * err_twin.mean() + 5e-3, (
            f"{name} chunk={chunk}: quantized CUDA error {err_q.mean():.3g} vs dense twin's {err_twin.mean():.3g}")


def test_quantized_greedy_matches_cpu_where_margin_allows(quantized):
    name, qdir, _ = quantized
    prompt = list(load_reference(name)["greedy_prompt"])
    cpu, gpu = ocria_rt.Engine(qdir, device="cpu"), ocria_rt.Engine(qdir, device="cuda")
    want = cpu.generate(prompt, max_new_tokens=CONTINUATION, stop_token_ids=[]).token_ids
    got = gpu.generate(prompt, max_new_tokens=CONTINUATION, stop_token_ids=[]).token_ids
    if got == want:
        return
    i = next(k for k in range(len(want)) if got[k] != want[k])
    lc, lg = cpu.score(prompt + want[:i])[-1], gpu.score(prompt + want[:i])[-1]
    top2 = np.sort(lc)[-2:]
    margin, err = float(top2[1] - top2[0]), float(np.abs(lc - lg).max())
    assert margin <= 2 * err, f"{name}: tokens diverge at step {i} although the CPU margin {margin:.3g} > 2 x error {err:.3g}"
