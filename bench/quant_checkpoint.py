"""Quantized checkpoints in NVIDIA ModelOpt's export format (/work/shared/QUANT.md), made from a BF16
checkpoint with torch ops on any device: the random-weight models bench/decode.py --quant measures.

Formats, by the name bench/decode.py takes:
  bf16   the checkpoint as it is
  fp8    FP8 (E4M3, one fp32 scale per tensor) on every quantizable linear; LM head BF16
  nvfp4  NVFP4 (E2M1 in blocks of 16 along K, E4M3 block scales, one fp32 global scale) on every
         quantizable linear; LM head BF16
  mixed  NVFP4 as above and the LM head FP8 (quant_algo MIXED_PRECISION with quantized_layers); the
         LM head becomes an untied lm_head.weight (the embeddings stay BF16)
Quantizable: attention q/k/v/o_proj, DeltaNet in_proj_qkv, in_proj_z, out_proj, MLP gate/up/down_proj.
Never: in_proj_a / in_proj_b, conv1d, norms, embeddings (ModelOpt's defaults for Qwen3.5).

Tensors per quantized linear (ModelOpt): FP8 `weight` float8_e4m3fn [N, K], `weight_scale` f32 scalar
(amax / 448); NVFP4 `weight` uint8 [N, K/2] (element 2j in the low nibble), `weight_scale`
float8_e4m3fn [N, K/16], `weight_scale_2` f32 scalar (amax / (6 * 448)). Both also carry `input_scale`
(f32 scalar), the static activation scale of W8A8 / W4A4 kernels; with no calibration data it comes
from NOMINAL_ACTIVATION_AMAX (weight-only kernels, ours and Hopper's, ignore it). The parts of a fused
projection (q|k|v, gate|up, in_proj_qkv|in_proj_z) share one global scale, as ModelOpt exports them.
Both hf_quant_config.json and config.json's quantization_config are written (SGLang reads the first,
vLLM either), in the layout ModelOpt 0.47 writes; the producer is named "modelopt" because readers
dispatch on that name.
"""

from __future__ import annotations

import json
from pathlib import Path

from common import weight_shapes

FORMATS = ("bf16", "fp8", "nvfp4", "mixed")
FP8_MAX = 448.0
FP4_MAX = 6.0
NVFP4_BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 7 indexes this; bit 3 is the sign
NOMINAL_ACTIVATION_AMAX = 8.0
QUANTIZABLE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
         ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"))
EXCLUDED = ["lm_head", "model.embed_tokens", "model.layers.*.linear_attn.conv1d",
            "model.layers.*.linear_attn.in_proj_a", "model.layers.*.linear_attn.in_proj_b"]
PRODUCER = {"name": "modelopt", "version": "0.47.0"}


def module_format(module: str, fmt: str) -> str:
    """How `fmt` stores the linear `module` (a weight's name without '.weight'): BF16, FP8 or NVFP4."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r} (one of {', '.join(FORMATS)})")
    if module == "lm_head":
        return "FP8" if fmt == "mixed" else "BF16"
    if fmt == "bf16" or not module.endswith(QUANTIZABLE):
        return "BF16"
    return "FP8" if fmt == "fp8" else "NVFP4"


def linear_bytes(n: int, k: int, storage: str) -> int:
    """Bytes a decode step reads for an [n, k] linear: packed values, block scales and the fp32 row
    scale the engine keeps per output row."""
    if storage == "BF16":
        return 2 * n * k
    if storage == "FP8":
        return n * k + 4 * n
    if storage == "NVFP4":
        return n * k // 2 + n * k // NVFP4_BLOCK + 4 * n
    raise ValueError(f"unknown storage {storage!r}")


# ---- quantizers (torch, any device) ----

def quantize_fp8(w, amax=None):
    """w [N, K] -> (float8_e4m3fn [N, K], f32 scalar scale) with w ~ q * scale; amax: the (shared) |w| max."""
    import torch

    amax = w.abs().max().float() if amax is None else amax.float()
    scale = torch.clamp(amax / FP8_MAX, min=torch.finfo(torch.float32).tiny)
    q = torch.clamp(w.float() / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.reshape(())


def quantize_nvfp4(w, amax=None):
    """w [N, K] -> (uint8 [N, K/2], float8_e4m3fn block scales [N, K/16], f32 scalar global scale)
    with w[n, k] ~ e2m1(code) * block_scale[n, k/16] * global_scale. E2M1 rounds to nearest on its
    grid, ties to the even code (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4)."""
    import torch

    N, K = w.shape
    if K % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs K divisible by {NVFP4_BLOCK}, got a [{N}, {K}] weight")
    amax = w.abs().max().float() if amax is None else amax.float()
    global_scale = torch.clamp(amax / (FP4_MAX * FP8_MAX), min=torch.finfo(torch.float32).tiny)
    blocks = w.float().reshape(N, K // NVFP4_BLOCK, NVFP4_BLOCK)
    block_amax = blocks.abs().amax(-1)
    block_scale = torch.clamp(block_amax / (FP4_MAX * global_scale), 2.0 ** -9, FP8_MAX).to(torch.float8_e4m3fn)
    block_scale = torch.where(block_amax == 0, torch.ones_like(block_scale, dtype=torch.float32),
                              block_scale.float()).to(torch.float8_e4m3fn)
    x = blocks / (block_scale.float() * global_scale)[..., None]
    m = x.abs()
    # ties go down where the lower code is even (0.25, 1.25, 2.5, 5) and up where the upper one is
    code = ((m > 0.25).to(torch.uint8) + (m >= 0.75) + (m > 1.25) + (m >= 1.75) + (m > 2.5) + (m >= 3.5) + (m > 5.0))
    code = (code.to(torch.uint8) | ((x < 0).to(torch.uint8) << 3)).reshape(N, K)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), block_scale, global_scale.reshape(())


def dequantize_fp8(q, scale):
    return q.float() * scale.float()


def dequantize_nvfp4(packed, block_scale, global_scale):
    import torch

    N = packed.shape[0]
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(N, -1).long()
    grid = torch.tensor(E2M1_VALUES, device=packed.device)
    values = grid[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    return values * block_scale.float().repeat_interleave(NVFP4_BLOCK, -1) * global_scale.float()


# ---- the checkpoint ----

def fused_group(module: str) -> list[str]:
    """The modules whose weights an engine fuses with `module`'s (so they share a global scale)."""
    for group in FUSED:
        for part in group:
            if module.endswith("." + part):
                prefix = module[: -len(part)]
                return [prefix + p for p in group]
    return [module]


def quant_config(fmt: str, quantized: list[str]) -> tuple[dict, dict]:
    """(hf_quant_config.json, config.json's quantization_config) for the quantized modules listed."""
    groups = {"FP8": {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                      "weights": {"dynamic": False, "num_bits": 8, "type": "float"}},
              "NVFP4": {"input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_BLOCK},
                        "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_BLOCK}}}
    if fmt == "mixed":
        layers = {m: ({"quant_algo": "FP8"} if module_format(m, fmt) == "FP8" else
                      {"quant_algo": "NVFP4", "group_size": NVFP4_BLOCK}) for m in quantized}
        hf = {"producer": PRODUCER, "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                                                     "quantized_layers": layers}}
        config_groups, seen = {}, []
        for m, layer in layers.items():
            if layer not in seen:
                seen.append(layer)
            key = f"group_{seen.index(layer)}"
            config_groups.setdefault(key, {**groups[layer["quant_algo"]], "targets": []})["targets"].append(m)
        for g in config_groups.values():
            g["targets"].sort()
        qc = {"config_groups": config_groups, "quantized_layers": layers, "ignore": [],
              "quant_algo": "MIXED_PRECISION", "producer": PRODUCER, "quant_method": "modelopt"}
        return hf, qc
    algo = {"fp8": "FP8", "nvfp4": "NVFP4"}[fmt]
    q = {"quant_algo": algo, "kv_cache_quant_algo": None}
    if algo == "NVFP4":
        q["group_size"] = NVFP4_BLOCK
    q["exclude_modules"] = EXCLUDED
    hf = {"producer": PRODUCER, "quantization": q}
    qc = {"config_groups": {"group_0": {**groups[algo], "targets": ["Linear"]}}, "ignore": EXCLUDED,
          "quant_algo": algo, "producer": PRODUCER, "quant_method": "modelopt"}
    return hf, qc


def write_quantized_checkpoint(src: Path, dst: Path, fmt: str, device: str = "cuda") -> Path:
    """The BF16 checkpoint `src` (text decoder, model.* keys, one model.safetensors) in format `fmt`
    at `dst`, quantized on `device`. Returns dst; an existing dst (config.json present) is kept."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    if fmt == "bf16":
        return Path(src)
    dst = Path(dst)
    if (dst / "config.json").exists():
        return dst
    config = json.loads((Path(src) / "config.json").read_text())
    with safe_open(str(Path(src) / "model.safetensors"), framework="pt", device=device) as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if fmt == "mixed" and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        config["tie_word_embeddings"] = False
    expected = set(weight_shapes(config)) | {"lm_head.weight"}
    if not set(tensors) <= expected:
        raise ValueError(f"{src}: tensors {sorted(set(tensors) - expected)[:4]} are not those of a Qwen3.5 text decoder")

    out, quantized = {}, []
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        storage = module_format(module, fmt) if name.endswith(".weight") and w.dim() == 2 else "BF16"
        if storage == "BF16":
            out[name] = w
            continue
        quantized.append(module)
        amax = max(tensors[m + ".weight"].abs().max().float() for m in fused_group(module))
        if storage == "FP8":
            out[name], out[module + ".weight_scale"] = quantize_fp8(w, amax)
            out[module + ".input_scale"] = torch.tensor(NOMINAL_ACTIVATION_AMAX / FP8_MAX, device=w.device)
        else:
            out[name], out[module + ".weight_scale"], out[module + ".weight_scale_2"] = quantize_nvfp4(w, amax)
            out[module + ".input_scale"] = torch.tensor(NOMINAL_ACTIVATION_AMAX / (FP4_MAX * FP8_MAX), device=w.device)
    hf, qc = quant_config(fmt, sorted(quantized))
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in out.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "hf_quant_config.json").write_text(json.dumps(hf, indent=1))
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qc}, indent=1))
    return dst
