"""Reading and dequantizing quantized safetensors checkpoints with numpy alone.

Written from the format description in shared QUANT.md, independently of the tools that write the
checkpoints (nvidia-modelopt, llm-compressor / compressed-tensors) and of the engine's loader. Used by
tests/fixtures/make_quant_fixtures.py to build the reference models and by tests/test_quant_fixtures.py.

Weight-only semantics: input scales are ignored; a pre_quant_scale s (x is multiplied by s before the
product) is folded into the weight's columns, W[:, k] * s[k].

The encoding section is the reference of the codes ocria_rt.quantize writes (its library's
csrc/engine/weight_codes.cpp must match it bit for bit): the rules of QUANT.md with numpy alone.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

NVFP4_BLOCK = 16

# E2M1 code -> value: bit 3 is the sign, bits 0-2 index the magnitudes.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_TABLE = np.concatenate([E2M1_VALUES, -E2M1_VALUES])


def _e4m3fn_table() -> np.ndarray:
    """float8_e4m3fn byte -> float32: 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 is
    subnormal (m / 8 * 2^-6); S.1111.111 is NaN; there is no infinity."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    mag = np.where((exp == 15) & (man == 7), np.nan, mag)
    return (sign * mag).astype(np.float32)


E4M3_TABLE = _e4m3fn_table()

_PLAIN_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I64": np.int64, "I32": np.int32,
                 "U8": np.uint8, "F8_E4M3": np.uint8, "BF16": np.uint16}


class Tensor:
    """One safetensors entry: its dtype name as written and its raw array (F8_E4M3 as uint8 codes,
    BF16 as uint16 bits); `f32()` decodes a floating-point tensor to float32."""

    def __init__(self, dtype: str, raw: np.ndarray):
        self.dtype = dtype
        self.raw = raw

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.raw.shape)

    def f32(self) -> np.ndarray:
        if self.dtype == "BF16":
            return (self.raw.astype(np.uint32) << 16).view(np.float32)
        if self.dtype == "F8_E4M3":
            return E4M3_TABLE[self.raw]
        if self.dtype in ("F32", "F16", "F64"):
            return self.raw.astype(np.float32)
        raise ValueError(f"tensor of dtype {self.dtype} is not floating point")


def read_safetensors(path: Path) -> dict[str, Tensor]:
    data = Path(path).read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    body = memoryview(data)[8 + header_len :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info["dtype"]
        if dtype not in _PLAIN_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        begin, end = info["data_offsets"]
        arr = np.frombuffer(body[begin:end], dtype=_PLAIN_DTYPES[dtype]).reshape(info["shape"])
        out[name] = Tensor(dtype, arr)
    return out


def read_checkpoint(directory: Path) -> dict[str, Tensor]:
    tensors: dict[str, Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(read_safetensors(f))
    return tensors


def decode_e2m1(packed: np.ndarray, low_first: bool = True) -> np.ndarray:
    """[N, K/2] uint8 -> [N, K] float32. low_first: element 2j is the low nibble of byte j."""
    lo = E2M1_TABLE[packed & 0x0F]
    hi = E2M1_TABLE[packed >> 4]
    first, second = (lo, hi) if low_first else (hi, lo)
    return np.stack([first, second], axis=-1).reshape(packed.shape[0], 2 * packed.shape[1])


def dequant_nvfp4(packed: np.ndarray, block_scale: np.ndarray, global_scale: float,
                  low_first: bool = True) -> np.ndarray:
    """W[n, k] = e2m1(q[n, k]) * block_scale[n, k // 16] * global_scale (all float32)."""
    values = decode_e2m1(packed, low_first)
    n, k = values.shape
    if block_scale.shape != (n, k // NVFP4_BLOCK):
        raise ValueError(f"block scale shape {block_scale.shape} does not fit weight [{n}, {k}]")
    scales = np.repeat(block_scale.astype(np.float32), NVFP4_BLOCK, axis=1)
    return values * scales * np.float32(global_scale)


def dequant_fp8(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """W = e4m3(codes) * scale, scale per tensor (size 1) or per output row ([N] or [N, 1])."""
    w = E4M3_TABLE[codes]
    s = np.asarray(scale, dtype=np.float32)
    if s.size == 1:
        return w * s.reshape(())
    if s.size != w.shape[0]:
        raise ValueError(f"FP8 scale of {s.size} elements for weight {w.shape}")
    return w * s.reshape(-1, 1)


def quantized_linears(tensors: dict[str, Tensor]) -> dict[str, str]:
    """Module path -> format for every quantized linear: "nvfp4" (ModelOpt: U8 weight + weight_scale_2),
    "ct_nvfp4" (compressed-tensors: weight_packed + weight_global_scale) or "fp8" (F8_E4M3 weight)."""
    formats = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            formats[name[: -len(".weight_packed")]] = "ct_nvfp4"
        elif name.endswith(".weight") and t.dtype == "U8":
            formats[name[: -len(".weight")]] = "nvfp4"
        elif name.endswith(".weight") and t.dtype == "F8_E4M3":
            formats[name[: -len(".weight")]] = "fp8"
    return formats


def dequant_linear(tensors: dict[str, Tensor], module: str, fmt: str, low_first: bool = True) -> np.ndarray:
    """The dense fp32 weight [N, K] of one quantized linear (pre_quant_scale folded into the columns)."""
    if fmt == "nvfp4":
        w = dequant_nvfp4(tensors[module + ".weight"].raw, tensors[module + ".weight_scale"].f32(),
                          float(tensors[module + ".weight_scale_2"].f32()), low_first)
    elif fmt == "ct_nvfp4":
        w = dequant_nvfp4(tensors[module + ".weight_packed"].raw, tensors[module + ".weight_scale"].f32(),
                          1.0 / float(tensors[module + ".weight_global_scale"].f32().reshape(())), low_first)
    elif fmt == "fp8":
        w = dequant_fp8(tensors[module + ".weight"].raw, tensors[module + ".weight_scale"].f32())
    else:
        raise ValueError(f"unknown quantized format {fmt} for {module}")
    pre = tensors.get(module + ".pre_quant_scale")
    if pre is not None:
        w = w * pre.f32().reshape(1, -1)
    return w


# Tensors that belong to a quantized linear besides its weight; they have no dense counterpart.
QUANT_AUX_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".weight_global_scale",
                      ".input_global_scale", ".pre_quant_scale")


def checksum(w: np.ndarray) -> list[float]:
    """[sum, sum |w|, sum w * pattern] in float64; the position-dependent pattern catches a permutation
    (a swapped nibble order, a transposed block scale) that the first two would miss."""
    w64 = w.astype(np.float64)
    pattern = np.cos(0.37 * np.arange(w64.size, dtype=np.float64)).reshape(w64.shape)
    return [float(w64.sum()), float(np.abs(w64).sum()), float((w64 * pattern).sum())]


def relerr(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| (Frobenius)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def write_safetensors_f32(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file of float32 tensors (names sorted, data 8-byte aligned as the header is padded)."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def dense_equivalent(tensors: dict[str, Tensor]) -> dict[str, np.ndarray]:
    """Every tensor as float32, each quantized linear replaced by its dequantized `weight`: the checkpoint
    that a weight-only engine computes with."""
    formats = quantized_linears(tensors)
    out = {n: t.f32() for n, t in tensors.items() if n.rsplit(".", 1)[0] not in formats}
    for module, fmt in formats.items():
        out[module + ".weight"] = dequant_linear(tensors, module, fmt)
    return out


# ---- encoding (the reference of csrc/engine/weight_codes.cpp) ----

_E4M3_POSITIVE = E4M3_TABLE[:0x7F]  # codes 0 .. 126: ascending, finite
_E2M1_MIDPOINTS = (E2M1_VALUES[:-1] + E2M1_VALUES[1:]) / 2


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 codes: the nearest value, ties to the even code, |x| above 448 saturating, -0 keeping
    its sign bit (as torch's cast)."""
    x = np.asarray(x, np.float32)
    mag = np.minimum(np.abs(x), np.float32(448.0))
    hi = np.clip(np.searchsorted(_E4M3_POSITIVE, mag, side="left"), 1, 0x7E)  # first value >= mag
    lo = hi - 1
    d_lo, d_hi = mag - _E4M3_POSITIVE[lo], _E4M3_POSITIVE[hi] - mag
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    code = np.where(mag <= 0, 0, code)
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def encode_e2m1(q: np.ndarray) -> np.ndarray:
    """float32 (divided by its scales) -> 4-bit codes: bit 3 the sign (of -0 too), bits 0-2 the index of the
    nearest magnitude (ties to the even index; above 6 saturates)."""
    mag = np.abs(np.asarray(q, np.float32))
    index = np.zeros(mag.shape, np.uint8)
    for i, m in enumerate(_E2M1_MIDPOINTS):
        index += (mag >= m) if i % 2 else (mag > m)  # a tie goes up only from an odd index
    return index | np.where(np.signbit(q), 8, 0).astype(np.uint8)


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """[N, K] codes -> [N, K/2] bytes, element 2j in the low nibble of byte j."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def block_amax(w: np.ndarray) -> np.ndarray:
    n, k = w.shape
    return np.abs(w).reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK).max(axis=2)


def nvfp4_block_scales(amax: np.ndarray, global_scale: np.float32, clip: float = 1.0) -> np.ndarray:
    """E4M3 codes of the block scales amax * clip / (6 * global_scale), clamped to [2^-9, 448]; 1.0 for an
    all-zero block."""
    ideal = (amax.astype(np.float32) * np.float32(clip)) / (np.float32(6.0) * np.float32(global_scale))
    codes = encode_e4m3(np.clip(ideal, np.float32(2.0**-9), np.float32(448.0)))
    return np.where(amax > 0, codes, encode_e4m3(np.float32(1.0))).astype(np.uint8)


def nvfp4_codes(w: np.ndarray, block_scale: np.ndarray, global_scale: np.float32) -> np.ndarray:
    """Unpacked E2M1 codes [N, K] of w under the block scale codes and the global scale."""
    scale = np.repeat(E4M3_TABLE[block_scale], NVFP4_BLOCK, axis=1) * np.float32(global_scale)
    return encode_e2m1(np.asarray(w, np.float32) / scale)


def nvfp4_block_errors(w: np.ndarray, global_scale: np.float32, block_moments: np.ndarray, clip: float,
                       dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """The block scales of factor `clip` and each block's d^T C_b d (d = w - its dequantization), [N, K/16],
    the quadratic form evaluated in `dtype`."""
    n, k = w.shape
    bs = nvfp4_block_scales(block_amax(w), global_scale, clip)
    deq = dequant_nvfp4(pack_e2m1(nvfp4_codes(w, bs, global_scale)), E4M3_TABLE[bs], float(global_scale))
    d = (w - deq).reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK).astype(dtype)
    return bs, np.einsum("nbi,bij,nbj->nb", d, block_moments.astype(dtype), d)


def nvfp4_searched_block_scales(w: np.ndarray, global_scale: np.float32, block_moments: np.ndarray,
                                factors: np.ndarray, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """Each block's scale of the factor (in order; the first of equal errors) with the least d^T C_b d, and
    the errors of every factor [factors, N, K/16]."""
    best, errs = None, []
    for c in factors:
        bs, err = nvfp4_block_errors(w, global_scale, block_moments, float(c), dtype)
        best = bs if best is None else np.where(err < np.min(errs, axis=0), bs, best)
        errs.append(err)
    return best, np.array(errs)
