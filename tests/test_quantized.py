"""Quantized checkpoints (FP8, NVFP4; ModelOpt and compressed-tensors layouts) written with numpy from the
dense fixtures: the engine scores each exactly as it scores the same model with the dequantized weights
stored densely (its dense twin), and rejects malformed ones with a ModelError naming the tensor or key."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import ocria_rt
import quant_checkpoints as qc
from support import FIXTURES, load_reference, relerr

TOL = 3e-5  # fp32 rounding: the norm's (1 + w) scales x for a quantized weight, W for a dense one (measured up to 2.2e-5)
TEXT, VLM = FIXTURES / "text_tied", FIXTURES / "vlm_untied"  # model.* and model.language_model.* keys


def engine(model_dir):
    return ocria_rt.Engine(model_dir, num_threads=1)  # tiny models: one thread is the fastest


def ids(base):
    return load_reference(base.name)["input_ids"][:24].tolist()


def modules(base):
    return qc.linear_modules(qc.read_safetensors(base / "model.safetensors"))


def kind(module):
    return module.rsplit(".", 1)[-1]


def check_twin(qdir, twin, base, tol=TOL):
    """The engine scores qdir as it scores the dense twin; returns qdir's stats."""
    eng = engine(qdir)
    got, want = eng.score(ids(base)), engine(twin).score(ids(base))
    assert relerr(got, want) <= tol
    # and the model really changed: quantization error is far above TOL
    assert relerr(got, load_reference(base.name)["logits"][:24]) > 100 * TOL
    return eng.stats()


def aligned(nbytes):
    return -(-nbytes // 256) * 256  # the weight arena's alignment


def test_modelopt_nvfp4(tmp_path):
    """NVFP4 everywhere but in_proj_b / in_proj_a (excluded with wildcards): the DeltaNet in_proj is then
    two linears into one output. Weight bytes by format: packed pairs, block scales, row scales and, for
    the projections after a norm, the input scale."""
    mods = [m for m in modules(TEXT) if kind(m) not in ("in_proj_a", "in_proj_b")]
    qc.quantize(TEXT, tmp_path / "q", tmp_path / "twin", dict.fromkeys(mods, "nvfp4"))
    qc.set_quantization_config(tmp_path / "q", hf_quant_config=qc.modelopt_config(
        "NVFP4", ["*linear_attn.in_proj_a", "model.layers.?.linear_attn.in_proj_b", "model.embed_tokens"]))
    stats = check_twin(tmp_path / "q", tmp_path / "twin", TEXT)
    assert stats["quantization"] == "modelopt" and stats["weight_bytes_by_format"]["fp8"] == 0

    cfg = json.loads((TEXT / "config.json").read_text())
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    hd, hq, hkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    vdim = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    conv = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] + vdim

    def nvfp4(N, K, norm):
        return aligned(N * K // 2) + aligned(N * K // 16) + aligned(4 * N) + (aligned(4 * K) if norm else 0)

    want = 0
    for t in cfg["layer_types"]:
        if t == "full_attention":
            want += nvfp4((2 * hq + 2 * hkv) * hd, H, True) + nvfp4(H, hq * hd, False)
        else:
            want += nvfp4(conv + vdim, H, True) + nvfp4(H, vdim, False)
        want += nvfp4(2 * I, H, True) + nvfp4(H, I, False)
    assert stats["weight_bytes_by_format"]["nvfp4"] == want
    assert sum(stats["weight_bytes_by_format"].values()) == stats["weight_bytes"]


@pytest.mark.parametrize("algo", ["FP8", "FP8_PER_CHANNEL_PER_TOKEN"])
def test_modelopt_fp8(tmp_path, algo):
    """FP8 with a scale per tensor or per output channel; the VLM key layout; the exclusions as ModelOpt
    writes them (exact names) in config.json's quantization_config alone."""
    fmt = "fp8" if algo == "FP8" else "fp8_channel"
    mods = modules(VLM)
    kept = [m for m in mods if kind(m) in ("in_proj_a", "in_proj_b", "lm_head")]
    qc.quantize(VLM, tmp_path / "q", tmp_path / "twin", {m: fmt for m in mods if m not in kept})
    cfg = qc.modelopt_config(algo, kept)["quantization"]
    cfg = {"quant_algo": cfg["quant_algo"], "ignore": kept, "quant_method": "modelopt"}
    qc.set_quantization_config(tmp_path / "q", quantization_config=cfg)
    stats = check_twin(tmp_path / "q", tmp_path / "twin", VLM)
    assert stats["weight_bytes_by_format"]["fp8"] > 0 and stats["weight_bytes_by_format"]["nvfp4"] == 0


def mixed_plan(mods):
    """Formats by module for a MIXED_PRECISION checkpoint: the LM head and the MLPs of even layers NVFP4,
    attention FP8, down projections FP8 per channel, odd layers' MLPs unquantized; the first DeltaNet
    layer with qkv | z NVFP4 and b | a FP8 (two quantized linears), the others all NVFP4 (one)."""
    plan, first_gdn = {}, None
    for m in mods:
        k, layer = kind(m), (int(m.split("layers.")[1].split(".")[0]) if "layers." in m else -1)
        if k == "lm_head" or (k in ("gate_proj", "up_proj") and layer % 2 == 0):
            plan[m] = "nvfp4"
        elif k in ("q_proj", "k_proj", "v_proj", "o_proj"):
            plan[m] = "fp8"
        elif k == "down_proj":
            plan[m] = "fp8_channel"
        elif k.startswith("in_proj") or k == "out_proj":
            first_gdn = layer if first_gdn is None else first_gdn
            plan[m] = "fp8" if layer == first_gdn and k in ("in_proj_a", "in_proj_b") else "nvfp4"
    return plan


def test_modelopt_mixed_precision(tmp_path):
    """MIXED_PRECISION, with quantized_layers named in the other key layout (model.layers.* for a
    checkpoint that has model.language_model.*)."""
    plan = mixed_plan(modules(VLM))
    qc.quantize(VLM, tmp_path / "q", tmp_path / "twin", plan)
    algo = {"nvfp4": {"quant_algo": "NVFP4", "group_size": 16}, "fp8": {"quant_algo": "FP8"},
            "fp8_channel": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}}
    layers = {m.replace("model.language_model.", "model."): algo[f] for m, f in plan.items()}
    qc.set_quantization_config(tmp_path / "q", hf_quant_config=qc.modelopt_config("MIXED_PRECISION",
                                                                                 quantized_layers=layers))
    stats = check_twin(tmp_path / "q", tmp_path / "twin", VLM)
    by_format = stats["weight_bytes_by_format"]
    assert by_format["fp8"] > 0 and by_format["nvfp4"] > 0 and by_format["dense"] > 0


def test_modelopt_awq(tmp_path):
    """NVFP4_AWQ: pre_quant_scale multiplies x (times the norm's (1 + w) after a norm), one shared by the
    parts of each fused projection."""
    rng = np.random.default_rng(0)
    mods = [m for m in modules(TEXT) if kind(m) not in ("in_proj_a", "in_proj_b")]
    shapes = {n[: -len(".weight")]: a.shape for n, (_, a) in qc.read_safetensors(TEXT / "model.safetensors").items()}
    shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "mlp", "up_proj": "mlp",
              "in_proj_qkv": "gdn", "in_proj_z": "gdn"}
    awq, by_group = {}, {}
    for m in mods:
        key = (m.rsplit(".", 2)[0], shared.get(kind(m), kind(m)))
        if key not in by_group:
            by_group[key] = rng.uniform(0.5, 2.0, shapes[m][1])
        awq[m] = by_group[key]
    qc.quantize(TEXT, tmp_path / "q", tmp_path / "twin", dict.fromkeys(mods, "nvfp4"), awq=awq)
    qc.set_quantization_config(tmp_path / "q", hf_quant_config=qc.modelopt_config(
        "NVFP4_AWQ", ["*in_proj_a", "*in_proj_b"]))
    # The AWQ-scaled model amplifies fp32 rounding more: noise of one ulp on the twin's weights alone
    # moves its logits by up to 4e-5.
    check_twin(tmp_path / "q", tmp_path / "twin", TEXT, tol=1e-4)


def test_compressed_tensors_nvfp4(tmp_path):
    """nvfp4-pack-quantized: weight_packed and weight_global_scale (1 / the global scale), each part of a
    fused projection with its own; the ignore list with a regex."""
    mods = [m for m in modules(TEXT) if kind(m) not in ("in_proj_a", "in_proj_b")]
    qc.quantize(TEXT, tmp_path / "q", tmp_path / "twin", dict.fromkeys(mods, "nvfp4"), producer="compressed-tensors")
    qc.set_quantization_config(tmp_path / "q", quantization_config=qc.ct_config(
        [qc.ct_scheme("nvfp4", ["Linear"])], ["re:.*in_proj_[ab]$", "lm_head"], "nvfp4-pack-quantized"))
    stats = check_twin(tmp_path / "q", tmp_path / "twin", TEXT)
    assert stats["quantization"] == "compressed-tensors" and stats["weight_bytes_by_format"]["nvfp4"] > 0


def test_compressed_tensors_fp8(tmp_path):
    """float-quantized FP8 per channel with dynamic activations, scales [N, 1] in BF16 (the model dtype);
    the VLM key layout; the vision tower and lm_head ignored."""
    mods = [m for m in modules(VLM) if kind(m) not in ("in_proj_a", "in_proj_b", "lm_head")]
    qc.quantize(VLM, tmp_path / "q", tmp_path / "twin", dict.fromkeys(mods, "fp8_channel"),
                producer="compressed-tensors", scale_dtype="BF16")
    qc.set_quantization_config(tmp_path / "q", quantization_config=qc.ct_config(
        [qc.ct_scheme("fp8", ["Linear"])], ["lm_head", "re:model[.]visual[.].*", "re:.*in_proj_b", "re:.*in_proj_a"],
        "float-quantized"))
    stats = check_twin(tmp_path / "q", tmp_path / "twin", VLM)
    assert stats["weight_bytes_by_format"]["fp8"] > 0


def test_compressed_tensors_mixed(tmp_path):
    """format mixed-precision: two groups, NVFP4 MLP gate / up and FP8 elsewhere (targets as regexes and
    module names); the rest dense because no group targets it."""
    mods = modules(TEXT)
    plan = {m: "nvfp4" if kind(m) in ("gate_proj", "up_proj") else "fp8_channel" for m in mods
            if kind(m) not in ("in_proj_a", "in_proj_b", "out_proj")}
    out_proj = [m for m in mods if kind(m) == "out_proj"]
    plan.update(dict.fromkeys(out_proj[:1], "fp8_channel"))
    qc.quantize(TEXT, tmp_path / "q", tmp_path / "twin", plan, producer="compressed-tensors")
    groups = [qc.ct_scheme("nvfp4", [r"re:.*mlp\.(gate|up)_proj$"]),
              qc.ct_scheme("fp8", ["re:.*self_attn", r"re:.*in_proj_(qkv|z)$", "re:.*down_proj", out_proj[0]])]
    qc.set_quantization_config(tmp_path / "q", quantization_config=qc.ct_config(groups, [], "mixed-precision"))
    check_twin(tmp_path / "q", tmp_path / "twin", TEXT)


def test_nvfp4_nibble_order(tmp_path):
    """The packed bytes with their nibbles swapped are a different model: element 2j is the low nibble."""
    mods = [m for m in modules(TEXT) if kind(m) in ("gate_proj", "up_proj", "down_proj")]
    qc.quantize(TEXT, tmp_path / "q", tmp_path / "twin", dict.fromkeys(mods, "nvfp4"))
    qc.set_quantization_config(tmp_path / "q", hf_quant_config=qc.modelopt_config(
        "MIXED_PRECISION", quantized_layers={m: {"quant_algo": "NVFP4", "group_size": 16} for m in mods}))
    path = tmp_path / "q" / "model.safetensors"
    tensors = qc.read_safetensors(path)
    want = engine(tmp_path / "twin").score(ids(TEXT))
    assert relerr(engine(tmp_path / "q").score(ids(TEXT)), want) <= TOL
    for m in mods:
        dtype, packed = tensors[m + ".weight"]
        tensors[m + ".weight"] = (dtype, (packed >> 4) | (packed << 4))
    qc.write_safetensors(path, tensors)
    assert relerr(engine(tmp_path / "q").score(ids(TEXT)), want) > 0.05


# ---- the real tools' exports (tests/fixtures/quant, make_quant_fixtures.py) against transformers ----

QUANT = FIXTURES / "quant"
REAL = sorted(p.name for p in QUANT.iterdir() if p.is_dir())


@pytest.mark.parametrize("name", REAL)
def test_real_tool_fixture(name):
    """Logits within 1e-4 of transformers' fp32 run of the dequantized model, at every position, and its
    greedy tokens; the weight bytes by format as the checkpoint stores them."""
    ref = np.load(QUANT / name / "reference.npz")
    eng = engine(QUANT / name)
    logits = eng.score(ref["input_ids"].tolist())
    assert relerr(logits, ref["logits"]) <= 1e-4
    for t in range(len(logits)):
        assert relerr(logits[t], ref["logits"][t]) <= 1e-4, f"position {t}"
    res = eng.generate(ref["greedy_prompt"].tolist(), max_new_tokens=len(ref["greedy_tokens"]), stop_token_ids=[])
    np.testing.assert_array_equal(np.array(res.token_ids), ref["greedy_tokens"])
    stats = eng.stats()
    assert stats["quantization"] == ("modelopt" if name.startswith("modelopt") else "compressed-tensors")
    by_format = stats["weight_bytes_by_format"]
    assert (by_format["nvfp4"] > 0) == ("nvfp4" in name or "mixed" in name)
    assert (by_format["fp8"] > 0) == ("fp8" in name or "mixed" in name)


def test_real_nvfp4_nibbles_swapped(tmp_path):
    """ModelOpt's NVFP4 export read with each byte's nibbles swapped: far from the reference."""
    d = shutil.copytree(QUANT / "modelopt_nvfp4", tmp_path / "swapped")
    tensors = qc.read_safetensors(d / "model.safetensors")
    for name, (dtype, a) in tensors.items():
        if dtype == "U8":
            tensors[name] = (dtype, (a >> 4) | (a << 4))
    qc.write_safetensors(d / "model.safetensors", tensors)
    ref = np.load(d / "reference.npz")
    assert relerr(engine(d).score(ref["input_ids"].tolist()), ref["logits"]) > 0.1


# ---- bad input: a ModelError naming the tensor or key ----

@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory):
    """A ModelOpt NVFP4 checkpoint of the text fixture (in_proj_b / in_proj_a dense)."""
    d = tmp_path_factory.mktemp("nvfp4")
    mods = [m for m in modules(TEXT) if kind(m) not in ("in_proj_a", "in_proj_b")]
    qc.quantize(TEXT, d / "q", d / "twin", dict.fromkeys(mods, "nvfp4"))
    qc.set_quantization_config(d / "q", hf_quant_config=qc.modelopt_config("NVFP4", ["*in_proj_a", "*in_proj_b"]))
    return d / "q"


def edited(src, dst, tensors=None, hf_quant=None, config=None):
    """A copy of checkpoint src with tensors(dict) / hf_quant(dict) / config(dict) edited in place."""
    shutil.copytree(src, dst)
    if tensors:
        t = qc.read_safetensors(dst / "model.safetensors")
        tensors(t)
        qc.write_safetensors(dst / "model.safetensors", t)
    for name, edit in (("hf_quant_config.json", hf_quant), ("config.json", config)):
        if edit:
            c = json.loads((dst / name).read_text())
            edit(c)
            (dst / name).write_text(json.dumps(c))
    return dst


GATE0 = "model.layers.0.mlp.gate_proj"


def set_algo(algo):
    def edit(c):
        c["quantization"]["quant_algo"] = algo
    return edit


def bad_cases():
    def scale_shape(t):
        t[GATE0 + ".weight_scale_2"] = ("F32", np.ones(2, np.float32))

    def missing_global(t):
        del t[GATE0 + ".weight_scale_2"]

    def block_scale_shape(t):
        t[GATE0 + ".weight_scale"] = ("F8_E4M3", t[GATE0 + ".weight_scale"][1][:, :2])

    def dense_in_proj_ba(c):  # NVFP4 for in_proj_b / in_proj_a too, which the checkpoint keeps dense
        c["quantization"]["exclude_modules"] = []

    nv = {"quant_algo": "NVFP4", "group_size": 16}

    def mixed(changes):  # MIXED_PRECISION listing every NVFP4 layer of the checkpoint, with changes
        def edit(c):
            layers = {m: nv for m in modules(TEXT) if kind(m) not in ("in_proj_a", "in_proj_b")}
            c["quantization"] = {"quant_algo": "MIXED_PRECISION", "quantized_layers": {**layers, **changes}}
        return edit

    return [
        ("scale_shape", dict(tensors=scale_shape), GATE0 + r".weight_scale_2' .*has shape \[2\]; expected \[\] or \[1\]"),
        ("missing_scale", dict(tensors=missing_global), "lacks tensor '" + GATE0 + r".weight_scale_2' \(the NVFP4 global"),
        ("block_scale_shape", dict(tensors=block_scale_shape), GATE0 + r".weight_scale' .*has shape \[128, 2\]; expected \[128, 4\]"),
        ("unknown_algo", dict(hf_quant=set_algo("W4A8_AWQ")), r"key 'quantization.quant_algo' is 'W4A8_AWQ'"),
        ("dense_but_configured", dict(hf_quant=dense_in_proj_ba),
         r"in_proj_b.weight' .*has dtype F32; expected U8 \(the quantization config stores layer .*in_proj_b' as NVFP4\)"),
        ("layer_names_nothing", dict(hf_quant=mixed({"model.layers.0.mlp.gate_prj": nv})),
         r"names layer 'model.layers.0.mlp.gate_prj', but checkpoint .* has no tensor"),
        ("fused_formats_differ", dict(hf_quant=mixed({"model.layers.0.mlp.up_proj": {"quant_algo": "FP8"}})),
         r"'model.layers.0.mlp.gate_proj.weight' \(NVFP4\) and 'model.layers.0.mlp.up_proj.weight' \(FP8\) .*share a storage format"),
        ("group_size", dict(hf_quant=mixed({GATE0: {"quant_algo": "NVFP4", "group_size": 32}})),
         r"quantized_layers.model.layers.0.mlp.gate_proj.group_size' is 32; NVFP4 needs 16"),
    ]


@pytest.mark.parametrize("edits,match", [c[1:] for c in bad_cases()], ids=[c[0] for c in bad_cases()])
def test_bad_modelopt_checkpoint(nvfp4_dir, tmp_path, edits, match):
    with pytest.raises(ocria_rt.ModelError, match=match):
        engine(edited(nvfp4_dir, tmp_path / "bad", **edits))


def test_awq_scales_must_agree(tmp_path):
    rng = np.random.default_rng(1)
    q = "model.layers.3.self_attn."
    awq = {q + p: rng.uniform(0.5, 2, 64) for p in ("q_proj", "k_proj", "v_proj")}
    qc.quantize(TEXT, tmp_path / "q", tmp_path / "twin", dict.fromkeys(awq, "fp8"), awq=awq)
    layers = {m: {"quant_algo": "FP8"} for m in awq}
    qc.set_quantization_config(tmp_path / "q", hf_quant_config=qc.modelopt_config("MIXED_PRECISION",
                                                                                 quantized_layers=layers))
    with pytest.raises(ocria_rt.ModelError, match=r"q_proj.pre_quant_scale' and .*k_proj.pre_quant_scale' differ"):
        engine(tmp_path / "q")


def test_nvfp4_needs_k_multiple_of_16(tmp_path):
    """intermediate_size 24: down_proj's 24 inputs cannot hold NVFP4's 16-element blocks."""
    d = tmp_path / "m"
    d.mkdir()
    cfg = json.loads((TEXT / "config.json").read_text())
    cfg["intermediate_size"] = 24
    (d / "config.json").write_text(json.dumps(cfg))
    t = qc.read_safetensors(TEXT / "model.safetensors")
    for name, (dtype, a) in list(t.items()):
        if "gate_proj" in name or "up_proj" in name:
            t[name] = (dtype, a[:24])
        elif "down_proj" in name:
            t[name] = ("U8", np.zeros((a.shape[0], 12), np.uint8))
    qc.write_safetensors(d / "model.safetensors", t)
    qc.set_quantization_config(d, hf_quant_config=qc.modelopt_config(
        "MIXED_PRECISION", quantized_layers={"model.layers.0.mlp.down_proj": {"quant_algo": "NVFP4"}}))
    with pytest.raises(ocria_rt.ModelError, match=r"down_proj.weight': NVFP4 needs the input features \(24\) to be a "
                                                  "multiple of 16"):
        engine(d)


@pytest.mark.parametrize("qcfg,match", [
    ({"quant_method": "gptq", "bits": 4}, r"key 'quantization_config.quant_method' is 'gptq'"),
    (qc.ct_config([qc.ct_scheme("fp8", ["Linear"])], [], "pack-quantized"),
     r"key 'quantization_config.format' is 'pack-quantized'"),
    (qc.ct_config([dict(qc.ct_scheme("fp8", ["Linear"]), weights={"num_bits": 4, "type": "int", "strategy": "group"})],
                  [], "mixed-precision"),
     r"key 'quantization_config.config_groups.group_0.weights.type' is 'int' with num_bits 4"),
    (qc.ct_config([dict(qc.ct_scheme("fp8", ["Linear"]), weights={"num_bits": 8, "type": "float", "strategy": "block"})],
                  [], "float-quantized"), r"weights.strategy' is 'block'"),
    (qc.ct_config([dict(qc.ct_scheme("nvfp4", ["Linear"]), format="float-quantized")], [], "float-quantized"),
     r"group_0.format' is 'float-quantized' but its weights are NVFP4"),
    (qc.ct_config([qc.ct_scheme("fp8", ["re:(unclosed"])], [], "float-quantized"), r"'re:\(unclosed' is not a valid"),
])
def test_bad_quantization_config(tmp_path, qcfg, match):
    d = tmp_path / "m"
    shutil.copytree(TEXT, d)
    qc.set_quantization_config(d, quantization_config=qcfg)
    with pytest.raises(ocria_rt.ModelError, match=match):
        engine(d)
