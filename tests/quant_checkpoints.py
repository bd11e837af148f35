"""Quantized checkpoints written with numpy, in the layouts ModelOpt and llm-compressor (compressed-tensors)
write (see /work/shared/QUANT.md), from a dense fixture; and each one's dense twin: the same model with the
dequantized weights in F32, which the engine must score identically (up to fp32 rounding)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np

import reference_ops as ref

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
               "out_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U8": np.uint8, "F8_E4M3": np.uint8}


def read_safetensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (safetensors dtype, array): BF16 as its uint16 bits, F8_E4M3 as its uint8 bits."""
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b0, b1 = e["data_offsets"]
        out[name] = (e["dtype"], np.frombuffer(data[b0:b1], _NP[e["dtype"]]).reshape(e["shape"]).copy())
    return out


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    header, blobs, offset = {}, [], 0
    for name, (dtype, a) in tensors.items():
        b = np.ascontiguousarray(a.astype(_NP[dtype], copy=False)).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))


def to_float(dtype: str, a: np.ndarray) -> np.ndarray:
    if dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def to_bf16(x) -> np.ndarray:
    """float -> bf16 bits, round to nearest even."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def linear_modules(tensors) -> list[str]:
    """The decoder's projections (and lm_head) of a checkpoint, as module names (without .weight)."""
    return sorted(n[: -len(".weight")] for n in tensors
                  if n.endswith(".weight") and n[: -len(".weight")].rsplit(".", 1)[-1] in PROJECTIONS)


def quantize(src: Path, dst: Path, twin: Path, formats: dict[str, str], producer: str = "modelopt",
             awq: dict[str, np.ndarray] | None = None, scale_dtype: str = "F32") -> dict[str, np.ndarray]:
    """Writes dst/model.safetensors with the modules of `formats` quantized ("fp8": one scale per tensor,
    "fp8_channel": one per output row, "nvfp4"; each module on its own, so the parts of a fused projection
    get scales of their own) in `producer`'s layout ("modelopt" or "compressed-tensors"), and twin/ (config
    and all) with every weight as the engine must see it: dequantized, in F32. awq: module -> pre_quant_scale
    s [K] (ModelOpt): the weight's columns are divided by s before quantization and x is multiplied by s.
    Config files other than config.json are the caller's. Returns the dequantized weights by module."""
    tensors = read_safetensors(Path(src) / "model.safetensors")
    out, dense, dequantized = {}, {}, {}
    ct = producer == "compressed-tensors"
    for name, (dtype, a) in tensors.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module not in formats:
            out[name] = (dtype, a)
            dense[name] = ("F32", to_float(dtype, a))
            continue
        w = to_float(dtype, a)
        s = None if awq is None else awq.get(module)
        if s is not None:
            w = w / s[None, :]
            out[module + ".pre_quant_scale"] = ("F32", s.astype(np.float32))
        fmt = formats[module]
        if fmt == "nvfp4":
            packed, block_scale, g = ref.quantize_nvfp4(w)
            out[module + (".weight_packed" if ct else ".weight")] = ("U8", packed)
            out[module + ".weight_scale"] = ("F8_E4M3", block_scale)
            if ct:
                glob = np.float32(1 / g)
                out[module + ".weight_global_scale"] = ("F32", np.array([glob]))
                out[module + ".input_global_scale"] = ("F32", np.array([1.0], np.float32))
                row = np.float32(1) / glob
            else:
                out[module + ".weight_scale_2"] = ("F32", np.array(g, np.float32))
                out[module + ".input_scale"] = ("F32", np.array(0.01, np.float32))  # read by no one
                row = g
            deq = ref.dequant_nvfp4(packed, block_scale, np.full(w.shape[0], row, np.float32))
        else:
            per_channel = fmt == "fp8_channel"
            bits, scale = ref.quantize_fp8(w, per_channel)
            if ct:  # [1] or [N, 1], in the model dtype
                scale = scale.reshape(-1, 1) if per_channel else scale.reshape(1)
            if scale_dtype == "BF16":
                stored, scale = ("BF16", to_bf16(scale)), to_float("BF16", to_bf16(scale))
            else:
                stored = ("F32", scale)
            out[module + ".weight"] = ("F8_E4M3", bits)
            out[module + ".weight_scale"] = stored
            out[module + ".input_scale"] = stored  # activations stay unquantized: never read
            deq = ref.dequant_fp8(bits, np.broadcast_to(np.asarray(scale, np.float64).reshape(-1), (w.shape[0],)))
        if s is not None:
            deq = deq * s[None, :]
        dense[name] = ("F32", deq)
        dequantized[module] = deq
    for d, t in ((dst, out), (twin, dense)):
        d = Path(d)
        d.mkdir(parents=True, exist_ok=True)
        write_safetensors(d / "model.safetensors", t)
        shutil.copy(Path(src) / "config.json", d / "config.json")
    return dequantized


def set_quantization_config(model_dir: Path, quantization_config: dict | None = None,
                            hf_quant_config: dict | None = None) -> None:
    """config.json's quantization_config and / or hf_quant_config.json."""
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    path.write_text(json.dumps(cfg, indent=1))
    if hf_quant_config is not None:
        (Path(model_dir) / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=1))


def modelopt_config(quant_algo: str, exclude: list[str] | None = None, quantized_layers: dict | None = None) -> dict:
    """hf_quant_config.json as ModelOpt writes it."""
    q = {"quant_algo": quant_algo, "kv_cache_quant_algo": None}
    if "NVFP4" in quant_algo:
        q["group_size"] = 16
    if quantized_layers is not None:
        q["quantized_layers"] = quantized_layers
    else:
        q["exclude_modules"] = exclude or []
    return {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": q}


def ct_scheme(fmt: str, targets: list[str]) -> dict:
    """A compressed-tensors config group: NVFP4 (weights and activations, as llm-compressor's "NVFP4") or
    FP8 per channel with dynamic per-token activations ("FP8_DYNAMIC")."""
    if fmt == "nvfp4":
        args = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
                "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}
        return {"format": "nvfp4-pack-quantized", "targets": targets, "weights": args,
                "input_activations": dict(args, dynamic="local")}
    return {"format": "float-quantized", "targets": targets,
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "group_size": None, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}


def ct_config(groups: list[dict], ignore: list[str], fmt: str) -> dict:
    """config.json's quantization_config as llm-compressor writes it."""
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {f"group_{i}": g for i, g in enumerate(groups)}, "ignore": ignore,
            "kv_cache_scheme": None, "sparsity_config": {}, "version": "0.19.0"}
