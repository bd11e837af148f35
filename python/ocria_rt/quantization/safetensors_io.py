"""Reading and writing safetensors checkpoints with numpy: one file or a sharded set with
``model.safetensors.index.json``. Tensors are memory-mapped when read; BF16 is held as its uint16 bits
and F8_E4M3 as its uint8 codes, so tensors are copied to a new checkpoint bit for bit."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import FileError, ModelError

_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "F8_E4M3": np.uint8, "BOOL": np.bool_}
FLOAT_DTYPES = ("F32", "F16", "BF16")
DTYPE_BYTES = {name: np.dtype(t).itemsize for name, t in _NUMPY.items()}


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bits (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_float(x: np.ndarray, dtype: str) -> np.ndarray:
    """float values -> the raw array of a tensor of safetensors dtype `dtype` (F32, F16 or BF16)."""
    if dtype == "BF16":
        return bf16_bits(x)
    return np.asarray(x, _NUMPY[dtype])


class Checkpoint:
    """The tensors of a checkpoint directory (names, dtypes, shapes), read lazily."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise FileError(f"cannot read the shard index '{index}': {e}") from e
            files = sorted(set(weight_map.values()))
        elif (self.dir / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise FileError(f"'{self.dir}' holds no model.safetensors (nor model.safetensors.index.json)")
        self._entries: dict[str, tuple[Path, str, list[int], int, int]] = {}
        for f in files:
            self._read_header(self.dir / f)

    def _read_header(self, path: Path) -> None:
        try:
            with open(path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error) as e:
            raise FileError(f"cannot read the safetensors header of '{path}': {e}") from e
        base = 8 + n
        for name, e in header.items():
            if name == "__metadata__":
                continue
            if e["dtype"] not in _NUMPY:
                raise ModelError(f"tensor '{name}' in '{path}' has dtype {e['dtype']}, which cannot be read")
            b0, b1 = e["data_offsets"]
            self._entries[name] = (path, e["dtype"], list(e["shape"]), base + b0, b1 - b0)

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def dtype(self, name: str) -> str:
        return self._entries[name][1]

    def shape(self, name: str) -> list[int]:
        return list(self._entries[name][2])

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (BF16 as uint16 bits, F8_E4M3 as uint8 codes), memory-mapped."""
        path, dtype, shape, offset, nbytes = self._entries[name]
        if nbytes == 0:
            return np.zeros(shape, _NUMPY[dtype])
        return np.memmap(path, dtype=_NUMPY[dtype], mode="r", offset=offset, shape=tuple(shape))

    def f32(self, name: str) -> np.ndarray:
        """A float tensor as float32."""
        dtype, a = self.dtype(name), self.raw(name)
        if dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        if dtype not in FLOAT_DTYPES:
            raise ModelError(f"tensor '{name}' in '{self.dir}' has dtype {dtype}; expected F32, F16 or BF16")
        return np.asarray(a, np.float32).copy()


def write_checkpoint(directory: Path, tensors: dict[str, tuple[str, np.ndarray]],
                     max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Writes `tensors` (name -> (safetensors dtype, raw array)) to directory/model.safetensors, or to
    model-0000i-of-0000n.safetensors shards with an index when they exceed max_shard_bytes. Returns the
    files written."""
    names = sorted(tensors)
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = tensors[name][1].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, shard in zip(files, shards):
        _write_file(directory / file, {n: tensors[n] for n in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(tensors[n][1].nbytes for n in names)},
                 "weight_map": {n: f for f, shard in zip(files, shards) for n in shard}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [directory / f for f in files]


def _write_file(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, a) in tensors.items():
        if np.dtype(_NUMPY[dtype]) != a.dtype:
            raise ValueError(f"tensor {name}: {a.dtype} data for dtype {dtype}")
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())
