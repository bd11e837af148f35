"""ocria_rt.quantize and the engine's calibration hooks, on small random models: the observer's input
statistics against numpy, in-memory weight replacement, the codes against ModelOpt's, the checkpoints it
writes against ModelOpt's own exports (tests/fixtures/quant), the engine's scores of them against their
dequantized twins and against the source model with the effective weights (the AWQ folds), AWQ against
plain rounding, budgets, and bad input."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import ocria_rt
import quant_checkpoints as qc
import quant_numpy as qn
from ocria_rt.quantization import formats as F, writer
from ocria_rt.quantization.safetensors_io import Checkpoint
from ocria_rt.synthdoc import PageConfig
from support import FIXTURES, TINY_VLM, relerr

TEXT = FIXTURES / "text_tied"  # F32, tied embeddings, model.* keys, no tokenizer: random-token calibration
QUANT = FIXTURES / "quant"
TINY_PAGES = PageConfig(long_side=(160, 192), body_px=(14, 16), max_chars=40, fonts="pillow", use_faker=False)
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")


def engine(model_dir, **kw):
    return ocria_rt.Engine(model_dir, num_threads=1, **kw)  # tiny models: one thread is the fastest


def ids(n=40, seed=3):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 512, n)]


def run(tmp, src=TEXT, name="q", **kw):
    kw.setdefault("calib_synthetic", 4)
    kw.setdefault("heldout", 1)
    return ocria_rt.quantize(src, tmp / name, num_threads=1, progress=False, **kw)


# ---- codes ----

def e2m1_codes(q: np.ndarray) -> np.ndarray:
    """The library's E2M1 codes of values already divided by their scales: blocks whose largest value is 6
    with global scale 1 get block scale 1."""
    w = np.concatenate([np.full((len(q), 1), 6.0, np.float32), q[:, None], np.zeros((len(q), 14), np.float32)], 1)
    bs, packed, _ = F.nvfp4_quantize(w, np.float32(1.0))
    assert (bs == 0x38).all()
    return packed[:, 0] >> 4


def test_e4m3_and_e2m1_rounding():
    finite = np.array([c for c in range(1, 0x7F)], np.uint8)
    values = F.e4m3_decode(finite)
    np.testing.assert_array_equal(F.fp8_quantize(values, 1.0), finite)
    np.testing.assert_array_equal(F.fp8_quantize(-values, 1.0), finite | 0x80)
    mid = (values[:-1] + values[1:]) / 2  # ties go to the even code
    want = np.where(finite[:-1] % 2 == 0, finite[:-1], finite[1:])
    np.testing.assert_array_equal(F.fp8_quantize(mid, 1.0), want)
    np.testing.assert_array_equal(F.fp8_quantize(np.array([1e6, -0.0, 0.0], np.float32), 1.0), [0x7E, 0x80, 0])
    # E2M1 ties (shared QUANT.md): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    q = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.1, -5.5], np.float32)
    codes = e2m1_codes(q)
    np.testing.assert_array_equal(qn.E2M1_TABLE[codes], [0, 1, 1, 2, 2, 4, 4, 6, -0.0, -6])
    assert codes[8] == 8  # -0 keeps its sign bit, as both tools write it
    w = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    bs, packed, _ = F.nvfp4_quantize(w, F.nvfp4_global_scale(float(np.abs(w).max())))
    np.testing.assert_array_equal(qn.pack_e2m1(qn.nvfp4_codes(w, bs, F.nvfp4_global_scale(float(np.abs(w).max())))),
                                  packed)  # element 2j in the low nibble


def awkward_weights(rng, n, k):
    """Weights that reach every corner of the formats: zeros, all-zero blocks, values across 30 octaves
    (E4M3 subnormals and saturation after scaling), exact ties of both grids, negative zeros."""
    w = (rng.standard_normal((n, k)) * np.exp2(rng.integers(-20, 10, (n, 1)))).astype(np.float32)
    w[rng.random((n, k)) < 0.05] = 0.0
    w[rng.random((n, k)) < 0.02] = -0.0
    w[:, :16] = 0.0  # an all-zero block per row
    w[0, 16:32] = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0]
    return w


@pytest.mark.parametrize("threads", [1, 3])
def test_codes_match_numpy_reference(threads):
    """The library's FP8 and NVFP4 codes (csrc/engine/weight_codes.cpp) are tests/quant_numpy.py's bit for
    bit, dequantized values too, on any number of threads."""
    rng = np.random.default_rng(1)
    w = awkward_weights(rng, 203, 96)
    for scale in (np.float32(np.abs(w).max() / 448), np.float32(1e-3), np.float32(7.5)):
        codes = F.fp8_quantize(w, scale, threads=threads)
        np.testing.assert_array_equal(codes, qn.encode_e4m3(w / scale))
        np.testing.assert_array_equal(F.fp8_dequantize(codes, scale, threads=threads), qn.E4M3_TABLE[codes] * scale)
    x = np.frombuffer(rng.integers(0, 2**32, 200_000, dtype=np.uint32).tobytes(), np.float32)
    x = x[np.isfinite(x)]  # every finite float pattern: the encoder's bit arithmetic against the table search
    np.testing.assert_array_equal(F.fp8_quantize(x, 1.0, threads=threads), qn.encode_e4m3(x))
    for gs in (F.nvfp4_global_scale(float(np.abs(w).max())), np.float32(1e-9), np.float32(0.01)):
        bs, packed, changed = F.nvfp4_quantize(w, gs, threads=threads)
        want_bs = qn.nvfp4_block_scales(qn.block_amax(w), gs)
        np.testing.assert_array_equal(bs, want_bs)
        np.testing.assert_array_equal(packed, qn.pack_e2m1(qn.nvfp4_codes(w, want_bs, gs)))
        np.testing.assert_array_equal(F.nvfp4_dequantize(packed, bs, gs, threads=threads),
                                      qn.dequant_nvfp4(packed, qn.E4M3_TABLE[bs], float(gs)))
        assert changed == 0
    # with AWQ's column scale s: the codes of w * s, and the error minuend - dequant / s, each step in fp32
    s = np.exp(rng.uniform(-3, 3, w.shape[1])).astype(np.float32)
    scaled = w * s
    scale, gs = np.float32(np.abs(scaled).max() / 448), F.nvfp4_global_scale(float(np.abs(scaled).max()))
    codes = F.fp8_quantize(w, scale, s, threads)
    np.testing.assert_array_equal(codes, qn.encode_e4m3(scaled / scale))
    np.testing.assert_array_equal(F.fp8_dequantize(codes, scale, s, w, threads), w - (qn.E4M3_TABLE[codes] * scale) / s)
    bs, packed, _ = F.nvfp4_quantize(w, gs, col_scale=s, threads=threads)
    np.testing.assert_array_equal(bs, qn.nvfp4_block_scales(qn.block_amax(scaled), gs))
    np.testing.assert_array_equal(packed, qn.pack_e2m1(qn.nvfp4_codes(scaled, bs, gs)))
    np.testing.assert_array_equal(F.nvfp4_dequantize(packed, bs, gs, s, w, threads),
                                  w - qn.dequant_nvfp4(packed, qn.E4M3_TABLE[bs], float(gs)) / s)
    with pytest.raises(ocria_rt.InvalidArgumentError, match=r"col_scale must be \[K\] = \[96\]"):
        F.fp8_quantize(w, scale, s[:5])
    with pytest.raises(ocria_rt.InvalidArgumentError, match=r"minuend must be \[203, 96\]"):
        F.nvfp4_dequantize(packed, bs, gs, s, w[:3])
    with pytest.raises(ocria_rt.InvalidArgumentError, match="not a multiple of 16"):
        F.nvfp4_quantize(w[:, :40], gs)


def test_clip_search_matches_numpy_reference():
    """The clip search of the NVFP4 block scales: each block takes the factor whose d^T C_b d is least
    (evaluated in double; the first of equal ones), as tests/quant_numpy.py's float64 search does. The
    float32 evaluation the search had before differs from it only between factors whose errors agree to
    1e-5 (near ties), where either is as good."""
    from ocria_rt.quantization.awq import CLIP_GRID

    rng = np.random.default_rng(2)
    n, k = 150, 64
    w = (rng.standard_normal((n, k)) * np.where(rng.random(k) < 0.1, 8.0, 1.0)).astype(np.float32)
    x = rng.standard_normal((512, k)) * np.where(rng.random(k) < 0.1, 10.0, 1.0)
    C = (x.T @ x / len(x)).astype(np.float32)
    blocks = np.stack([C[i:i + 16, i:i + 16] for i in range(0, k, 16)])
    gs = F.nvfp4_global_scale(float(np.abs(w).max()))
    bs, packed, changed = F.nvfp4_quantize(w, gs, CLIP_GRID, blocks)
    want, errs = qn.nvfp4_searched_block_scales(w, gs, blocks, CLIP_GRID)
    np.testing.assert_array_equal(bs, want)
    np.testing.assert_array_equal(packed, qn.pack_e2m1(qn.nvfp4_codes(w, bs, gs)))
    plain = qn.nvfp4_block_scales(qn.block_amax(w), gs)
    assert changed == np.count_nonzero(bs != plain) > n * k // 16 // 10  # the search moves many blocks
    f32, _ = qn.nvfp4_searched_block_scales(w, gs, blocks, CLIP_GRID, dtype=np.float32)
    codes = np.stack([qn.nvfp4_block_scales(qn.block_amax(w), gs, c) for c in CLIP_GRID])  # [factor, N, K/16]
    for r, b in zip(*np.nonzero(f32 != bs)):
        chose = int(np.argmax(codes[:, r, b] == f32[r, b]))  # the factor the float32 search took
        assert errs[chose, r, b] - errs[:, r, b].min() <= 1e-5 * errs[:, r, b].min(), (r, b)


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("in_proj_qkv", "in_proj_z"))


@pytest.mark.parametrize("fixture,fmt", [("modelopt_nvfp4", "nvfp4"), ("modelopt_fp8", "fp8")])
def test_codes_reproduce_modelopt(fixture, fmt):
    """ModelOpt's dequantized weights quantized again: block scales and codes are ModelOpt's bit for bit (its
    largest codes are 6 and so the block scales come back exactly), and so are the NVFP4 global scales, from
    the amax over each fused projection (q|k|v, gate|up, in_proj_qkv|in_proj_z share one)."""
    t = qn.read_checkpoint(QUANT / fixture)
    deq = {m: qn.dequant_linear(t, m, f) for m, f in qn.quantized_linears(t).items()}
    for module, w in deq.items():
        if fmt == "nvfp4":
            gs = np.float32(t[module + ".weight_scale_2"].f32())
            parent, name = module.rsplit(".", 1)
            fused = next((f for f in FUSED if name in f), (name,))
            amax = max(float(np.abs(deq[f"{parent}.{p}"]).max()) for p in fused)
            assert F.nvfp4_global_scale(amax) == pytest.approx(float(gs), rel=1e-6), module
            bs, packed, _ = F.nvfp4_quantize(w, gs)
            np.testing.assert_array_equal(bs, t[module + ".weight_scale"].raw, err_msg=module)
            np.testing.assert_array_equal(packed, t[module + ".weight"].raw, err_msg=module)
        else:
            scale = F.fp8_scale(float(np.abs(w).max()))
            assert scale == pytest.approx(float(t[module + ".weight_scale"].f32()), rel=1e-6)
            np.testing.assert_array_equal(F.fp8_quantize(w, scale), t[module + ".weight"].raw, err_msg=module)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("full", [True, False])
def test_awq_protects_large_channels(fmt, full):
    """Inputs with a few channels 30 times larger than the rest: AWQ's scales cut the output error on them
    well below plain rounding's (with the second moment, or its diagonal alone for wide inputs)."""
    from ocria_rt.quantization.awq import quantize_group

    rng = np.random.default_rng(0)
    k = 128
    x = rng.standard_normal((2048, k)) * np.where(np.arange(k) % 37 == 0, 30.0, 1.0)
    parts = [rng.standard_normal((96, k)).astype(np.float32), rng.standard_normal((32, k)).astype(np.float32)]
    stats = {"abs_max": np.abs(x).max(0), "abs_mean": np.abs(x).mean(0), "square_mean": (x**2).mean(0),
             "second_moment": x.T @ x / len(x) if full else None}
    rtn, awq = (quantize_group(parts, fmt, stats, m) for m in ("rtn", "awq"))
    assert rtn.pre_quant_scale is None and awq.pre_quant_scale is not None and awq.alpha > 0
    assert awq.error < (0.7 if fmt == "nvfp4" else 0.9) * awq.rtn_error and awq.rtn_error == rtn.error
    y = x[:256].astype(np.float32)  # the error it reports is the error of the outputs
    out_err = sum(float(np.sum((y @ (w - e).T) ** 2)) for w, e in zip(parts, awq.effective())) / len(y)
    assert out_err == pytest.approx(awq.error, rel=0.25)
    if fmt == "nvfp4":  # one global scale for the parts
        assert awq.weights[0].scale == awq.weights[1].scale and awq.weights[0].input_scale == awq.weights[1].input_scale


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_feedback_rounding_beats_awq(fmt):
    """Correlated inputs (a mixing matrix over channels of unequal scale): rounding with error feedback
    (method "gptq") cuts the output error well below AWQ's; the error it reports is that of its codes,
    which decode as the checkpoint stores them (NVFP4: packed [N, K/2] with E4M3 block scales [N, K/16])."""
    from ocria_rt.quantization.awq import quantize_group

    rng = np.random.default_rng(1)
    k = 128
    x = rng.standard_normal((4096, k)) * np.exp(rng.standard_normal(k))
    x = x @ (np.eye(k) + 0.5 * rng.standard_normal((k, k)) / np.sqrt(k))
    parts = [rng.standard_normal((80, k)).astype(np.float32), rng.standard_normal((48, k)).astype(np.float32)]
    stats = {"abs_max": np.abs(x).max(0), "abs_mean": np.abs(x).mean(0), "square_mean": (x**2).mean(0),
             "second_moment": x.T @ x / len(x)}
    awq, gptq = (quantize_group(parts, fmt, stats, m) for m in ("awq", "gptq"))
    assert gptq.error < 0.5 * awq.error and gptq.rtn_error == awq.rtn_error
    y = x.astype(np.float32)
    out_err = sum(float(np.sum((y @ (w - e).T) ** 2)) for w, e in zip(parts, gptq.effective())) / len(y)
    assert out_err == pytest.approx(gptq.error, rel=1e-3)
    for w, part in zip(gptq.weights, parts):
        n = part.shape[0]
        assert w.codes.dtype == np.uint8 and w.codes.shape == ((n, k // 2) if fmt == "nvfp4" else (n, k))
        if fmt == "nvfp4":
            assert w.block_scale.shape == (n, k // 16) and not np.isnan(F.e4m3_decode(w.block_scale)).any()
    if fmt == "fp8":  # K not a multiple of the 16-column blocks
        odd = {key: v[:100] if v.ndim == 1 else v[:100, :100] for key, v in stats.items()}
        fed = quantize_group([p[:, :100] for p in parts], fmt, odd, "gptq")
        assert fed.weights[0].codes.shape == (80, 100) and fed.error < quantize_group(
            [p[:, :100] for p in parts], fmt, odd, "awq").error
    diagonal = dict(stats, second_moment=None)  # nothing to feed back without the off-diagonal moments
    assert quantize_group(parts, fmt, diagonal, "gptq").error == quantize_group(parts, fmt, diagonal, "awq").error


@pytest.mark.parametrize("method", ["awq", "gptq", "rtn"])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_errors_measured_on_sampled_rows(monkeypatch, fmt, method):
    """Groups of more than SEARCH_ROWS rows measure the errors on that many rows: the weights kept are
    those that measuring every row keeps where both choose the same candidate (as here; where two candidates'
    errors lie within the sampling's spread, either may be kept), bit for bit, and the error reported is
    the exact one within that spread."""
    from ocria_rt.quantization import awq as A

    rng = np.random.default_rng(3)
    k = 64
    x = rng.standard_normal((1024, k)) * np.where(np.arange(k) % 7 == 0, 30.0, 1.0)
    parts = [rng.standard_normal((700, k)).astype(np.float32), rng.standard_normal((300, k)).astype(np.float32)]
    stats = {"abs_max": np.abs(x).max(0), "abs_mean": np.abs(x).mean(0), "square_mean": (x**2).mean(0),
             "second_moment": x.T @ x / len(x)}
    monkeypatch.setattr(A, "SEARCH_ROWS", 400)
    sampled = A.quantize_group(parts, fmt, stats, method)
    monkeypatch.setattr(A, "SEARCH_ROWS", 4096)
    exact = A.quantize_group(parts, fmt, stats, method)
    assert (sampled.alpha, sampled.pre_quant_scale is None) == (exact.alpha, exact.pre_quant_scale is None)
    assert sampled.searched_blocks == exact.searched_blocks
    for a, b in zip(sampled.weights, exact.weights):
        assert a.codes.shape == b.codes.shape and a.scale == b.scale and a.input_scale == b.input_scale
        np.testing.assert_array_equal(a.codes, b.codes)
        if fmt == "nvfp4":
            np.testing.assert_array_equal(a.block_scale, b.block_scale)
    assert sampled.error == pytest.approx(exact.error, rel=0.1)
    assert sampled.rtn_error == pytest.approx(exact.rtn_error, rel=0.1)


# ---- the engine's calibration hooks ----

def test_observer_statistics_match_numpy():
    """The first projection's input is rms_norm(embeddings) * (1 + w): its statistics from the observer are
    those of numpy's, though the engine folded (1 + w) into the weights."""
    t = qn.read_checkpoint(TEXT)
    eng = engine(TEXT, linear_observer=True)
    tokens = ids(37)
    plain = engine(TEXT).score(tokens)
    eng.observe_linear_inputs(True, second_moment=True)
    np.testing.assert_array_equal(eng.score(tokens), plain)  # observing changes nothing
    eng.observe_linear_inputs(False)
    eng.score(ids(5))  # not observed
    st = eng.linear_input_stats()
    groups = eng.linear_groups()
    assert groups[0]["modules"][:2] == ["model.layers.0.linear_attn.in_proj_qkv", "model.layers.0.linear_attn.in_proj_z"]
    assert groups[-1] == {"modules": ["lm_head"], "rows": [512], "in_features": 64, "format": "dense"}
    assert len(st) == len(groups) and st[0]["tokens"] == 37
    x = t["model.embed_tokens.weight"].f32()[tokens].astype(np.float64)
    u = x / np.sqrt((x**2).mean(1, keepdims=True) + 1e-6) * (1 + t["model.layers.0.input_layernorm.weight"].f32())
    np.testing.assert_allclose(st[0]["abs_max"], np.abs(u).max(0), rtol=1e-5)
    np.testing.assert_allclose(st[0]["abs_mean"], np.abs(u).mean(0), rtol=1e-5)
    np.testing.assert_allclose(st[0]["square_mean"], (u**2).mean(0), rtol=1e-5)
    np.testing.assert_allclose(st[0]["second_moment"], u.T @ u / len(tokens), rtol=1e-4, atol=1e-6)
    with pytest.raises(ocria_rt.InvalidArgumentError, match="without linear_observer"):
        engine(TEXT).observe_linear_inputs(True)


def test_set_linear_weight_and_restore():
    t = qn.read_checkpoint(TEXT)
    eng = engine(TEXT)
    tokens = ids()
    base = eng.score(tokens)
    up = t["model.layers.2.mlp.up_proj.weight"].f32()
    eng.set_linear_weight("model.layers.2.mlp.up_proj", up)  # the same weight: the same scores
    np.testing.assert_array_equal(eng.score(tokens), base)
    eng.set_linear_weight("model.language_model.layers.2.mlp.up_proj", up * 0.5)  # either key layout
    assert relerr(eng.score(tokens), base) > 1e-3
    eng.restore_linear_weights()
    np.testing.assert_array_equal(eng.score(tokens), base)
    emb = t["model.embed_tokens.weight"].f32()  # the tied LM head gets its own weight; the embeddings stay
    eng.set_linear_weight("lm_head", 0.5 * emb)
    np.testing.assert_allclose(eng.score(tokens), 0.5 * base, rtol=1e-6, atol=1e-6)
    eng.restore_linear_weights()
    np.testing.assert_array_equal(eng.score(tokens), base)
    with pytest.raises(ocria_rt.InvalidArgumentError, match="no projection module 'model.layers.2.mlp.up_prj'"):
        eng.set_linear_weight("model.layers.2.mlp.up_prj", up)
    with pytest.raises(ocria_rt.InvalidArgumentError, match=r"up_proj' is \[128, 64\], got 192 values"):
        eng.set_linear_weight("model.layers.2.mlp.up_proj", up[:3])
    with pytest.raises(ocria_rt.InvalidArgumentError, match="is stored quantized"):
        engine(QUANT / "modelopt_nvfp4").set_linear_weight("model.language_model.layers.0.mlp.up_proj", up)


def with_weights(src: Path, dst: Path, changed: dict[str, np.ndarray]) -> Path:
    """A copy of the model directory `src` whose checkpoint holds `changed` (F32) in place of those tensors."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    t = qc.read_safetensors(src / "model.safetensors")
    for name, value in changed.items():
        t[name] = ("F32", np.asarray(value, np.float32))
    qc.write_safetensors(dst / "model.safetensors", t)
    return dst


def test_set_linear_weight_reads_any_array(tmp_path):
    """The binding reads a float32 C-contiguous array where it is and converts any other (strided, Fortran
    order, float64) once: each gives the scores of a checkpoint holding those weights, the GLU projection's
    parts (interleaved in the engine) included; the engine keeps no reference to the array."""
    t = qn.read_checkpoint(TEXT)
    rng = np.random.default_rng(5)
    gate, up, o = (t[f"model.layers.{i}.{m}.weight"].f32() for i, m in ((1, "mlp.gate_proj"), (1, "mlp.up_proj"),
                                                                         (3, "self_attn.o_proj")))
    new_gate = gate + 0.05 * rng.standard_normal(gate.shape).astype(np.float32)
    new_up = (up * 0.7).astype(np.float32)
    new_o = o[:, ::-1].copy()
    want = engine(with_weights(TEXT, tmp_path / "edited", {"model.layers.1.mlp.gate_proj.weight": new_gate,
                                                            "model.layers.1.mlp.up_proj.weight": new_up,
                                                            "model.layers.3.self_attn.o_proj.weight": new_o}))
    eng = engine(TEXT)
    wide = np.zeros((new_gate.shape[0], 2 * new_gate.shape[1]), np.float32)
    wide[:, ::2] = new_gate
    eng.set_linear_weight("model.layers.1.mlp.gate_proj", wide[:, ::2])  # strided view
    up_copy = np.asfortranarray(new_up)
    eng.set_linear_weight("model.layers.1.mlp.up_proj", up_copy)  # Fortran order
    eng.set_linear_weight("model.layers.3.self_attn.o_proj", o[:, ::-1].astype(np.float64))  # float64, reversed
    up_copy[:] = 0.0  # read during the call only
    wide[:] = 0.0
    np.testing.assert_array_equal(eng.score(ids()), want.score(ids()))
    contiguous = engine(TEXT)
    for m, w in (("model.layers.1.mlp.gate_proj", new_gate), ("model.layers.1.mlp.up_proj", new_up),
                 ("model.layers.3.self_attn.o_proj", new_o)):
        assert w.flags.c_contiguous and w.dtype == np.float32
        contiguous.set_linear_weight(m, w)
    np.testing.assert_array_equal(contiguous.score(ids()), want.score(ids()))
    eng.restore_linear_weights()
    np.testing.assert_array_equal(eng.score(ids()), engine(TEXT).score(ids()))
    with pytest.raises(ocria_rt.InvalidArgumentError, match="weight must be 2-D"):
        eng.set_linear_weight("model.layers.1.mlp.up_proj", new_up.ravel())


def kl_numpy(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """Per row KL(softmax(ref) || softmax(logits)) in float64."""
    def log_softmax(z):
        z = z.astype(np.float64)
        z = z - z.max(axis=1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=1, keepdims=True))

    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    return (np.exp(lp) * (lp - lq)).sum(axis=1)


def test_reference_kl():
    """Reference logits kept on the device: the rows score() gives; the KL per row of the current weights
    from them is numpy's float64 KL of score()'s logits (0 for the same weights), also for logits handed
    from another engine and for a VLM page, whose image features are kept with the reference."""
    t = qn.read_checkpoint(TEXT)
    eng = engine(TEXT)
    tokens = ids(45)
    base = eng.score(tokens)
    i = eng.keep_reference(tokens, 10, 44)
    np.testing.assert_array_equal(eng.reference_logits(i), base[10:44])
    np.testing.assert_array_equal(eng.reference_kl(i), np.zeros(34))
    eng.set_linear_weight("model.layers.2.mlp.down_proj", t["model.layers.2.mlp.down_proj.weight"].f32() * 0.9)
    kl = eng.reference_kl(i)
    want = kl_numpy(base[10:44], eng.score(tokens)[10:44])
    assert kl.dtype == np.float64 and kl.shape == (34,) and want.min() > 1e-9
    np.testing.assert_allclose(kl, want, rtol=1e-5)
    other = engine(TEXT)
    j = other.keep_reference(tokens, 10, 44, logits=eng.reference_logits(i))
    np.testing.assert_array_equal(other.reference_kl(j), np.zeros(34))
    with pytest.raises(ocria_rt.InvalidArgumentError, match="reference 5 was not kept"):
        eng.reference_kl(5)
    with pytest.raises(ocria_rt.InvalidArgumentError, match=r"rows \[30, 20\) are not"):
        eng.keep_reference(tokens, 30, 20)
    with pytest.raises(ocria_rt.InvalidArgumentError, match="logits must be"):
        eng.keep_reference(tokens, 10, 44, logits=np.zeros((3, 4), np.float32))
    eng.clear_references()
    with pytest.raises(ocria_rt.InvalidArgumentError, match="reference 0 was not kept"):
        eng.reference_kl(0)

    from ocria_rt.quantization import calibration

    vlm = engine(TINY_VLM)
    (page,) = calibration.synthetic_samples(vlm, 1, 0, TINY_PAGES)
    logits = vlm.score(page.ids, pixel_values=page.pixel_values, image_grid_thw=page.image_grid_thw)
    r = calibration.keep_reference(vlm, page)
    rows = slice(page.answer_start - 1, len(page.ids) - 1)
    np.testing.assert_array_equal(vlm.reference_logits(r), logits[rows])
    up = qn.read_checkpoint(TINY_VLM)["model.language_model.layers.0.mlp.up_proj.weight"].f32()
    vlm.set_linear_weight("model.language_model.layers.0.mlp.up_proj", up * 1.2)
    changed = vlm.score(page.ids, pixel_values=page.pixel_values, image_grid_thw=page.image_grid_thw)
    np.testing.assert_allclose(vlm.reference_kl(r), kl_numpy(logits[rows], changed[rows]), rtol=1e-5, atol=1e-12)


# ---- checkpoints ----

@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """text_tied quantized with each uniform recipe and method."""
    tmp = tmp_path_factory.mktemp("quantized")
    return {(r, m): run(tmp, name=f"{r}-{m}", recipe=r, method=m) for r in ("nvfp4", "fp8")
            for m in ("rtn", "awq", "gptq")}


def tensor_kinds(tensors, module):
    """suffix -> (dtype, number of dimensions) of a quantized module's tensors."""
    return {n[len(module):]: (t.dtype, len(t.shape)) for n, t in tensors.items() if n.rsplit(".", 1)[0] == module}


def modelopt_exclude(base, layer_types, keep_lm_head=True):
    """ModelOpt's exclude_modules for a Qwen3.5 text model quantized uniformly."""
    out = (["lm_head"] if keep_lm_head else []) + [base + "embed_tokens"]
    for i, kind in enumerate(layer_types):
        if kind == "linear_attention":
            out += [f"{base}layers.{i}.linear_attn.{m}" for m in ("conv1d", "in_proj_a", "in_proj_b")]
    return out


@pytest.mark.parametrize("recipe,fixture", [("nvfp4", "modelopt_nvfp4"), ("fp8", "modelopt_fp8")])
def test_matches_modelopt_format(written, recipe, fixture):
    """Tensor names, dtypes and shapes, hf_quant_config.json and config.json's quantization_config as ModelOpt
    writes them (its fixture of the same architecture); the fused parts share their scales."""
    out = written[(recipe, "awq")].out_dir
    ref = QUANT / fixture
    ours, theirs = qn.read_checkpoint(out), qn.read_checkpoint(ref)
    src = qn.read_checkpoint(TEXT)
    ours_q, theirs_q = qn.quantized_linears(ours), qn.quantized_linears(theirs)
    assert set(ours_q.values()) == set(theirs_q.values()) == {recipe}
    strip = lambda m: re.sub(r"^model\.(language_model\.)?layers\.\d+\.", "", m)  # noqa: E731
    assert {strip(m) for m in ours_q} == {strip(m) for m in theirs_q}  # the same projections quantized
    want = {strip(m): tensor_kinds(theirs, m) for m in theirs_q}
    for m in ours_q:
        assert tensor_kinds(ours, m) == want[strip(m)], m
        n, k = src[m + ".weight"].shape
        assert ours[m + ".weight"].shape == ((n, k // 2) if recipe == "nvfp4" else (n, k))
        if recipe == "nvfp4":
            assert ours[m + ".weight_scale"].shape == (n, k // 16)
    for fused in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
                  ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z")):
        for layer in range(8):
            parts = [f"model.layers.{layer}.{p}" for p in fused]
            if parts[0] in ours_q:
                for suffix in (".weight_scale_2" if recipe == "nvfp4" else ".weight_scale", ".input_scale"):
                    assert len({float(ours[p + suffix].f32()) for p in parts}) == 1, parts[0] + suffix
    hf, hf_ref = (json.loads((d / "hf_quant_config.json").read_text()) for d in (out, ref))
    assert list(hf) == list(hf_ref) and list(hf["quantization"]) == list(hf_ref["quantization"])
    assert {k: v for k, v in hf["quantization"].items() if k != "exclude_modules"} == \
        {k: v for k, v in hf_ref["quantization"].items() if k != "exclude_modules"}
    cfg, cfg_ref = (json.loads((d / "config.json").read_text()) for d in (out, ref))
    assert hf_ref["quantization"]["exclude_modules"] == modelopt_exclude("model.language_model.", cfg_ref["layer_types"])
    assert hf["quantization"]["exclude_modules"] == modelopt_exclude("model.", cfg["layer_types"])
    q, q_ref = cfg["quantization_config"], cfg_ref["quantization_config"]
    assert list(q) == list(q_ref) and q["config_groups"] == q_ref["config_groups"] and q["quant_method"] == "modelopt"
    assert q["ignore"] == hf["quantization"]["exclude_modules"] and q["quant_algo"] == q_ref["quant_algo"]
    assert cfg["tie_word_embeddings"] is True  # the LM head stays unquantized, so tied


def dense_twin(qdir: Path, twin: Path) -> None:
    """The checkpoint with every quantized weight dequantized (numpy, tests/quant_numpy.py), in F32."""
    t = qn.read_checkpoint(qdir)
    formats = qn.quantized_linears(t)
    out = {}
    for name, tensor in t.items():
        module = name.rsplit(".", 1)[0]
        if module in formats:
            if name.endswith(".weight"):
                out[name] = ("F32", qn.dequant_linear(t, module, formats[module]))
        elif tensor.dtype in ("F32", "BF16", "F16"):
            out[name] = ("F32", tensor.f32())
    twin.mkdir()
    qc.write_safetensors(twin / "model.safetensors", out)
    cfg = json.loads((qdir / "config.json").read_text())
    del cfg["quantization_config"]
    (twin / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("key", [("nvfp4", "rtn"), ("nvfp4", "awq"), ("fp8", "awq"), ("nvfp4", "gptq"),
                                 ("fp8", "gptq")])
def test_scores_match_dequantized_twin(written, tmp_path, key):
    out = written[key].out_dir
    dense_twin(out, tmp_path / "twin")
    got, want = engine(out).score(ids()), engine(tmp_path / "twin").score(ids())
    assert relerr(got, want) <= 1e-4
    assert relerr(got, engine(TEXT).score(ids())) > 1e-3  # and it is quantized


def test_vlm_scores_match_dequantized_twin(vlm_mixed, tmp_path):
    dense_twin(vlm_mixed.out_dir, tmp_path / "twin")
    got, want = engine(vlm_mixed.out_dir).score(ids()), engine(tmp_path / "twin").score(ids())
    assert relerr(got, want) <= 1e-4


def test_awq_folds_are_exact(tmp_path):
    """Every group NVFP4 with AWQ, the (tied) LM head included: the checkpoint, whose scales are folded into
    the norms (input, post-attention, final, DeltaNet gated), v_proj's and up_proj's rows and in_proj_a /
    in_proj_b's columns, scores as the source model does with each projection's effective weight set in
    memory. The source is F32, so the folds are exact up to fp32 rounding."""
    eng = engine(TEXT, linear_observer=True)
    groups = writer.projection_groups(eng.linear_groups())
    eng.observe_linear_inputs(True, second_moment=True)
    for seed in range(4):
        eng.score(ids(48, seed))
    stats = eng.linear_input_stats()
    out = tmp_path / "q"
    out.mkdir()
    plan = dict.fromkeys((g.name for g in groups), "nvfp4")
    built = writer.write_checkpoint(out, TEXT, Checkpoint(TEXT), groups, plan, stats, "awq",
                                    writer.Shapes.of(eng.config))
    assert built.quant_algo == "NVFP4" and len(built.input_scales) == len(built.modules)
    assert {m.rsplit(".", 1)[-1] for m in built.row_scales} == {"v_proj", "up_proj"}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and "lm_head" not in cfg["quantization_config"]["ignore"]
    t = qn.read_checkpoint(out)
    source = engine(TEXT)
    for m, fmt in qn.quantized_linears(t).items():
        w = qn.dequant_linear(t, m, fmt) * built.input_scales[m][None, :]
        if m in built.row_scales:
            w = w / built.row_scales[m][:, None]
        source.set_linear_weight(m, w)
    for seed in (7, 8):
        got, want = engine(out).score(ids(40, seed)), source.score(ids(40, seed))
        assert relerr(got, want) <= 1e-4
    assert relerr(got, engine(TEXT).score(ids(40, 8))) > 1e-3


def test_awq_beats_rounding(written):
    """With AWQ the projections' output error on the calibration activations, tr(D C D^T) summed over the
    groups, is lower than with plain rounding in each format (no group's is higher); for NVFP4 so is the
    error of the whole model's logits on the calibration tokens. (These random models amplify weight noise
    chaotically, about 50-fold: a 2.5% FP8 weight error moves their logits by ~100%, too much for a
    model-level comparison at FP8.)"""
    for recipe, most in (("nvfp4", 0.9), ("fp8", 0.99)):
        groups = [g for g in written[(recipe, "awq")].report["groups"] if recipe in g["awq"]]
        awq = sum(g["awq"][recipe]["output_error"] for g in groups)
        rtn = sum(g["awq"][recipe]["rtn_output_error"] for g in groups)
        assert awq < most * rtn, (recipe, awq, rtn)
        for g in groups:
            assert g["awq"][recipe]["output_error"] <= g["awq"][recipe]["rtn_output_error"], g["name"]
        # error feedback (gptq) picks from AWQ's candidates and its own: never worse, and lower in sum
        fed = {g["name"]: g["awq"][recipe]["output_error"] for g in written[(recipe, "gptq")].report["groups"]
               if recipe in g["awq"]}
        assert sum(fed.values()) < 0.97 * awq, (recipe, sum(fed.values()), awq)  # 0.93 (NVFP4), 0.74 (FP8) measured
        for g in groups:
            assert fed[g["name"]] <= g["awq"][recipe]["output_error"] * (1 + 1e-6), g["name"]
    source = engine(TEXT)
    rng = np.random.default_rng(0)  # the calibration samples of seed 0 (random tokens: no tokenizer)
    calib = [[int(t) for t in rng.integers(0, 512, 64)] for _ in range(3)]
    err = {m: sum(relerr(engine(written[("nvfp4", m)].out_dir).score(c), source.score(c)) for c in calib)
           for m in ("rtn", "awq")}
    assert err["awq"] < err["rtn"], err


def test_report_and_plot(written):
    res = written[("nvfp4", "awq")]
    r = json.loads((res.out_dir / "quantization_report.json").read_text())
    assert r["quant_algo"] == "NVFP4" and r["plan"] == res.plan and r["plan"]["lm_head"] == "dense"
    assert r["total"]["bits_per_weight"] == pytest.approx(4.5, abs=0.02)
    assert r["total"]["bytes"] == sum(g["bytes"] for g in r["groups"] if g["name"] != "lm_head")
    from PIL import Image

    with Image.open(res.out_dir / "quantization_kl.png") as im:
        assert im.format == "PNG" and im.width > 400
    table = res.table()
    assert "layers.3.self_attn.q|k|v" in table and "28.2%" in table


@pytest.fixture(scope="module")
def vlm_mixed(tmp_path_factory):
    """tiny-vlm, mixed within a budget, calibrated on small synthetic pages."""
    tmp = tmp_path_factory.mktemp("vlm")
    return run(tmp, src=TINY_VLM, recipe="mixed", budget="40%", calib_synthetic=4, page_config=TINY_PAGES)


def test_mixed_budget_is_kept(vlm_mixed):
    """The bytes of the quantized projections as written stay within the budget; the plan mixes formats; the
    config is ModelOpt's MIXED_PRECISION (as its fixture); the vision tower is untouched."""
    out, r = vlm_mixed.out_dir, vlm_mixed.report
    budget = r["budget"]["bytes"]
    weights = r["total"]["weights"]
    assert budget == int(0.4 * 2 * weights) and r["total"]["bytes"] <= budget
    t = qn.read_checkpoint(out)
    src = qn.read_checkpoint(TINY_VLM)
    written_bytes = 0
    for g in r["groups"]:
        for m in g["modules"]:
            names = [n for n in t if n.rsplit(".", 1)[0] == m]
            if g["format"] == "dense":
                names = [n for n in names if n.endswith(".weight")] or ["model.language_model.embed_tokens.weight"]
            written_bytes += sum(t[n].raw.nbytes for n in names)
    assert written_bytes == r["total"]["bytes"] <= budget
    assert "nvfp4" in vlm_mixed.plan.values() and len(set(vlm_mixed.plan.values())) >= 2
    for name in t:
        if name.startswith("model.visual."):
            assert t[name].dtype == src[name].dtype and np.array_equal(t[name].raw, src[name].raw), name
    hf, hf_ref = (json.loads((d / "hf_quant_config.json").read_text()) for d in (out, QUANT / "modelopt_mixed"))
    assert list(hf["quantization"]) == list(hf_ref["quantization"]) == ["quant_algo", "kv_cache_quant_algo",
                                                                       "quantized_layers"]
    assert {json.dumps(v, sort_keys=True) for v in hf["quantization"]["quantized_layers"].values()} <= \
        {json.dumps(v, sort_keys=True) for v in hf_ref["quantization"]["quantized_layers"].values()}
    q, q_ref = (json.loads((d / "config.json").read_text())["quantization_config"] for d in (out, QUANT / "modelopt_mixed"))
    assert list(q) == list(q_ref) and q["ignore"] == [] and q["quantized_layers"] == hf["quantization"]["quantized_layers"]
    formats = sorted({v["quant_algo"] for v in q["quantized_layers"].values()}, key=["NVFP4", "FP8"].index)
    for i, f in enumerate(formats):
        ref_group = next(g for g in q_ref["config_groups"].values() if g["weights"]["num_bits"] == (4 if f == "NVFP4" else 8))
        assert {k: v for k, v in q["config_groups"][f"group_{i}"].items() if k != "targets"} == \
            {k: v for k, v in ref_group.items() if k != "targets"}
        assert q["config_groups"][f"group_{i}"]["targets"] == sorted(m for m, v in q["quantized_layers"].items()
                                                                     if v["quant_algo"] == f)


def test_quantized_vlm_parses(vlm_mixed, tmp_path):
    """The tokenizer, processor and chat template come along: Engine(OUT_DIR) and `ocria-rt parse --model`."""
    from ocria_rt import cli

    out = vlm_mixed.out_dir
    for f in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (TINY_VLM / f).read_bytes()
    stats = ocria_rt.Engine(out).stats()
    assert stats["quantization"] == "modelopt" and stats["weight_bytes_by_format"]["nvfp4"] > 0
    md = tmp_path / "page.md"
    assert cli.main(["parse", str(FIXTURES / "images" / "vis_a.png"), "--model", str(out), "--max-new-tokens", "3",
                     "-o", str(md), "--no-progress", "--threads", "1"]) == 0
    assert md.read_text().startswith("<!-- page 1 -->")


def test_choose_mixed_greedy():
    from ocria_rt.quantization.plan import choose_mixed, parse_budget

    nbytes = {"a": {"dense": 200, "fp8": 100, "nvfp4": 56}, "b": {"dense": 200, "fp8": 100, "nvfp4": 56},
              "c": {"dense": 400, "fp8": 200, "nvfp4": 112}}
    kl = {"a": {"dense": 0, "fp8": 0.001, "nvfp4": 0.01}, "b": {"dense": 0, "fp8": 0.002, "nvfp4": 0.5},
          "c": {"dense": 0, "fp8": 0.001, "nvfp4": 0.004}}
    assert choose_mixed(kl, nbytes, budget=800) == dict.fromkeys("abc", "dense")
    assert choose_mixed(kl, nbytes, budget=268) == {"a": "nvfp4", "b": "fp8", "c": "nvfp4"}
    assert choose_mixed(kl, nbytes, budget=311) == {"a": "nvfp4", "b": "fp8", "c": "nvfp4"}
    # x straight to NVFP4 (the best KL per byte saved) overshoots the budget: x gives bytes back, to FP8
    nbytes2 = {"x": {"dense": 1000, "fp8": 500, "nvfp4": 281}, "y": {"dense": 100, "fp8": 50, "nvfp4": 28}}
    kl2 = {"x": {"dense": 0, "fp8": 0.002, "nvfp4": 0.0025}, "y": {"dense": 0, "fp8": 0.01, "nvfp4": 0.05}}
    assert choose_mixed(kl2, nbytes2, budget=900) == {"x": "fp8", "y": "dense"}
    assert choose_mixed(kl, nbytes, max_kl=0.007) == {"a": "fp8", "b": "fp8", "c": "nvfp4"}
    assert choose_mixed(kl, nbytes, max_kl=0.006) == dict.fromkeys("abc", "fp8")  # c to NVFP4 would pass it
    assert choose_mixed(kl, nbytes, max_kl=0.0) == dict.fromkeys("abc", "dense")
    with pytest.raises(ocria_rt.InvalidArgumentError, match="below the smallest plan"):
        choose_mixed(kl, nbytes, budget=200)
    assert parse_budget("4.5", 1000) == parse_budget("4.5bits", 1000) == 562
    assert parse_budget("40%", 1000) == 800 and parse_budget("3kB", 1) == 3000 and parse_budget("1MiB", 1) == 2**20
    for bad in ("abc", "-3", "4 apples"):
        with pytest.raises(ocria_rt.InvalidArgumentError, match="budget"):
            parse_budget(bad, 1000)


def test_overlapped_quantization_writes_the_same(tmp_path, monkeypatch):
    """With the next group quantized in a thread while the engine runs the KL passes (as on a GPU), a run
    writes what the sequential one writes."""
    import ocria_rt.quantization as quantization

    kw = dict(recipe="mixed", budget="45%", calib_synthetic=3)
    sequential = run(tmp_path, name="sequential", **kw)
    monkeypatch.setattr(quantization, "_overlap_quantization", lambda device: True)
    overlapped = run(tmp_path, name="overlapped", **kw)
    assert overlapped.plan == sequential.plan and len(set(overlapped.plan.values())) >= 2
    assert (overlapped.out_dir / "model.safetensors").read_bytes() == (sequential.out_dir / "model.safetensors").read_bytes()
    assert [g["kl"] for g in overlapped.report["groups"]] == [g["kl"] for g in sequential.report["groups"]]
    assert "sensitivity/wait for the quantization" in overlapped.report["seconds"]
    assert "sensitivity/wait for the quantization" not in sequential.report["seconds"]


sys.path.insert(0, str(FIXTURES))
import make_quantize_outputs  # noqa: E402

RECORDED = json.loads((FIXTURES / "quantize_outputs.json").read_text())


@pytest.mark.parametrize("name", sorted(make_quantize_outputs.RUNS))
def test_outputs_as_recorded(tmp_path, name):
    """The checkpoints of four small runs hold the tensors, bit for bit, and the plans that the numpy
    implementation before the library kernels and the device-side KL wrote (tests/fixtures/
    make_quantize_outputs.py); the KL and AWQ figures agree to 1e-5 (the KL now sums in double on the
    device, the output errors in other orders)."""
    src, kw = make_quantize_outputs.RUNS[name]
    res = ocria_rt.quantize(src, tmp_path / "q", num_threads=1, progress=False, heldout=1, **kw)
    got, want = make_quantize_outputs.summary(res.out_dir, res.report), RECORDED[name]
    assert got["plan"] == want["plan"]
    assert got["tensors"] == want["tensors"]
    assert got["groups"].keys() == want["groups"].keys()
    for g, w in want["groups"].items():
        for fmt, kl in w["kl"].items():
            assert got["groups"][g]["kl"][fmt] == pytest.approx(kl, rel=1e-5, abs=1e-12), (g, fmt)
            a, b = got["groups"][g]["awq"][fmt], w["awq"][fmt]
            assert a["alpha"] == b["alpha"] and a["searched_blocks"] == b["searched_blocks"], (g, fmt)
            for key in ("output_error", "rtn_output_error"):
                assert a[key] == pytest.approx(b[key], rel=1e-5), (g, fmt, key)
    assert got["measured_kl"] == pytest.approx(want["measured_kl"], rel=1e-5, abs=1e-12)


# ---- bad input: a clear error, and nothing at OUT_DIR ----

def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("case,error,match", [
    ("missing_model", ocria_rt.FileError, "model directory '.*nowhere' does not exist"),
    ("unreadable_calibration", ocria_rt.FileError, "input '.*missing.pdf' does not exist"),
    ("not_an_image", ocria_rt.FileError, "'.*notes.bin' is neither a PDF nor an image"),
    ("impossible_budget", ocria_rt.InvalidArgumentError, "budget '1' = .* bytes is below the smallest possible"),
    ("out_dir_not_empty", ocria_rt.FileError, "OUT_DIR '.*busy' exists and is not empty"),
    ("quantized_model", ocria_rt.ModelError, "is already quantized"),
    ("budget_without_mixed", ocria_rt.InvalidArgumentError, "budget and max_kl choose a mixed plan"),
])
def test_bad_input(tmp_path, case, error, match):
    src, kw, out = TINY_VLM, {}, tmp_path / "out"
    if case == "missing_model":
        src = tmp_path / "nowhere"
    elif case == "unreadable_calibration":
        kw = {"calib": [str(FIXTURES / "images" / "vis_a.png"), str(tmp_path / "missing.pdf")]}
    elif case == "not_an_image":
        (tmp_path / "notes.bin").write_bytes(b"\x00\x01 not an image")
        kw = {"calib": [str(tmp_path / "notes.bin")]}
    elif case == "impossible_budget":
        kw = {"budget": "1"}
    elif case == "out_dir_not_empty":
        out = tmp_path / "busy"
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif case == "quantized_model":
        src = QUANT / "modelopt_fp8"
    elif case == "budget_without_mixed":
        kw = {"recipe": "nvfp4", "budget": "40%"}
    kw.setdefault("recipe", "mixed")
    with pytest.raises(error, match=match):
        ocria_rt.quantize(src, out, num_threads=1, progress=False, calib_synthetic=None if "calib" in kw else 2,
                          page_config=TINY_PAGES, **kw)
    if case == "out_dir_not_empty":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists()
    assert leftovers(tmp_path) == []


def test_calibration_files(tmp_path):
    """Images calibrate through parse's rendering and preprocessing, continued by the model's own output;
    a text file adds its tokens."""
    (tmp_path / "notes.txt").write_text("Invoice 12: total 40.00 EUR, due on delivery.")
    files = [FIXTURES / "images" / "vis_a.png", FIXTURES / "images" / "vis_b.png", tmp_path / "notes.txt"]
    res = run(tmp_path, src=TINY_VLM, recipe="fp8", method="rtn", calib_synthetic=None, calib=files,
              max_new_tokens=4)
    cal = res.report["calibration"]
    assert cal["samples"] == 2 and cal["heldout_samples"] == 1
    assert cal["sources"] == [f"{files[0]} page 1", f"{files[1]} page 1", str(files[2])]
    assert engine(res.out_dir).stats()["weight_bytes_by_format"]["fp8"] > 0


def test_nvfp4_falls_back_to_fp8(tmp_path):
    """intermediate_size 24: down_proj's inputs cannot fill NVFP4 blocks of 16, so the nvfp4 recipe stores
    it in FP8, and the checkpoint is MIXED_PRECISION."""
    src = tmp_path / "narrow"
    src.mkdir()
    cfg = json.loads((TEXT / "config.json").read_text())
    cfg["intermediate_size"] = 24
    (src / "config.json").write_text(json.dumps(cfg))
    t = qc.read_safetensors(TEXT / "model.safetensors")
    for name, (dtype, a) in list(t.items()):
        if "gate_proj" in name or "up_proj" in name:
            t[name] = (dtype, a[:24])
        elif "down_proj" in name:
            t[name] = (dtype, np.ascontiguousarray(a[:, :24]))
    qc.write_safetensors(src / "model.safetensors", t)
    res = run(tmp_path, src=src, recipe="nvfp4", method="rtn", calib_synthetic=2)
    assert {f for g, f in res.plan.items() if g.endswith("down_proj")} == {"fp8"}
    assert {f for g, f in res.plan.items() if g.endswith("gate|up")} == {"nvfp4"}
    assert res.report["quant_algo"] == "MIXED_PRECISION"
    assert engine(res.out_dir).stats()["weight_bytes_by_format"]["fp8"] > 0


def test_force_replaces(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    res = run(tmp_path, name="out", recipe="fp8", method="rtn", force=True)
    assert not (out / "old.txt").exists() and (out / "model.safetensors").exists() and res.out_dir == out
    assert leftovers(tmp_path) == []


def test_cli_quantize(tmp_path, capsys):
    from ocria_rt import cli

    assert cli.main(["quantize", str(TEXT), str(tmp_path / "q"), "--recipe", "fp8", "--method", "rtn",
                     "--calib-synthetic", "2", "--threads", "1", "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "layers.0.mlp.gate|up" in out.out and "total" in out.out and "FP8 checkpoint written" in out.err
    assert cli.main(["quantize", str(TEXT), str(tmp_path / "q"), "--recipe", "fp8"]) == 2  # not empty
    assert "exists and is not empty" in capsys.readouterr().err


def test_progress_in_a_log(monkeypatch):
    """Writing to a log (not a terminal), the progress gives a line when a stage ends and, in a long
    stage, one at most every LOG_SECONDS before that, so that a run's log shows where it is."""
    import io

    from ocria_rt.quantization import _Progress

    clock = iter([0.0, 0.0, 0.0, 10.0, 31.0, 40.0, 70.0])  # construction, start, its bar, 4 ticks
    monkeypatch.setattr("ocria_rt.quantization.time.perf_counter", lambda: next(clock))
    out = io.StringIO()
    bar = _Progress("always", out)
    bar.start("sensitivity", 4)
    for _ in range(4):
        bar.tick()
    lines = out.getvalue().splitlines()
    assert [ln.split("] ")[1].split(" (")[0] for ln in lines] == ["2/4", "4/4"], lines
    assert all(ln.startswith("ocria-rt quantize: sensitivity") for ln in lines)
