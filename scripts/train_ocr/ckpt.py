"""Training checkpoints that fit through a small pipe: one JSON + a few safetensors shards.

A checkpoint directory holds ``state.json`` (model config, tokenizer files, step, schedule, RNG
states, data position, run history) and ``shard-NN.safetensors`` files of at most `shard_mb` MiB:

- format ``full``: fp32 weights and fp32 AdamW moments (exact resume; 12 bytes per parameter);
- format ``compact``: BF16 weights and both AdamW moments in 8 bits (4 bytes per parameter, about a
  third): ``exp_avg`` as sign + 7-bit log magnitude, ``exp_avg_sq`` as 8-bit log, each in blocks of
  256 values with the block's log range in fp32. Resuming from it rounds the weights to BF16 once
  (the forward pass already runs in BF16) and perturbs the moments by a few percent, which the next
  steps absorb. It is the format to carry between machines when what comes back is limited.

Written atomically: into ``<dir>.tmp``, then renamed over ``<dir>``.

For carrying, a compact checkpoint can leave its weights out (:func:`strip_weights`, ``python
scripts/train_ocr/ckpt.py strip CKPT MODEL_DIR OUT``) when an export of it ships in the repository
(the package's default model): its BF16 weights are the checkpoint's bit for bit, so ``load`` takes them
from that model.safetensors (state.json names it, relative to the repository, with its SHA-256).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

BLOCK = 256
REPO = Path(__file__).resolve().parents[2]
SHARD_MB = 15.0  # the largest shard: a few files that each pass a small pipe


# --------------------------------------------------------------------------- #
# 8-bit log quantisation of optimizer moments
# --------------------------------------------------------------------------- #
def quantize_log(x: torch.Tensor, signed: bool) -> dict[str, torch.Tensor]:
    """Blockwise 8-bit log coding: code 0 = 0; else magnitude 2**(lo + (c-1) * (hi-lo) / (L-1)) with
    L = 127 (signed: the top bit is the sign) or 255 levels over the block's [lo, hi] log2 range."""
    flat = x.detach().float().reshape(-1)
    n = flat.numel()
    pad = (-n) % BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    blocks = flat.view(-1, BLOCK)
    mag = blocks.abs()
    nz = mag > 0
    lg = torch.where(nz, torch.log2(torch.where(nz, mag, torch.ones_like(mag))), torch.zeros_like(mag))
    big = torch.finfo(torch.float32).max
    lo = torch.where(nz, lg, torch.full_like(lg, big)).amin(dim=1)
    hi = torch.where(nz, lg, torch.full_like(lg, -big)).amax(dim=1)
    empty = ~nz.any(dim=1)
    lo = torch.where(empty, torch.zeros_like(lo), lo)
    hi = torch.where(empty, torch.zeros_like(hi), hi)
    levels = 127 if signed else 255
    span = (hi - lo).clamp_min(1e-12)
    code = 1 + torch.round((lg - lo[:, None]) / span[:, None] * (levels - 1))
    code = torch.where(nz, code, torch.zeros_like(code)).to(torch.uint8)
    if signed:
        code = code | ((blocks < 0).to(torch.uint8) << 7)
    return {"codes": code.reshape(-1)[:n].contiguous(), "lo": lo.contiguous(), "hi": hi.contiguous()}


def dequantize_log(q: dict[str, torch.Tensor], shape: torch.Size, signed: bool) -> torch.Tensor:
    codes = q["codes"].to(torch.int32)
    n = codes.numel()
    pad = (-n) % BLOCK
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    codes = codes.view(-1, BLOCK)
    sign = torch.ones_like(codes, dtype=torch.float32)
    if signed:
        sign = torch.where((codes & 0x80) != 0, -sign, sign)
        codes = codes & 0x7F
    levels = 127 if signed else 255
    lo, hi = q["lo"].float()[:, None], q["hi"].float()[:, None]
    lg = lo + (codes.float() - 1) / (levels - 1) * (hi - lo)
    val = torch.where(codes > 0, sign * torch.exp2(lg), torch.zeros_like(lg))
    return val.reshape(-1)[:n].reshape(shape)


# --------------------------------------------------------------------------- #
# Save / load
# --------------------------------------------------------------------------- #
def _tensors(model: torch.nn.Module, opt: torch.optim.Optimizer | None, fmt: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    wdtype = torch.float32 if fmt == "full" else torch.bfloat16
    for name, p in model.named_parameters():
        out[f"w/{name}"] = p.detach().to("cpu", wdtype).contiguous()
    if opt is None:
        return out
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            name = names[id(p)]
            m, v = st["exp_avg"].detach(), st["exp_avg_sq"].detach()
            if fmt == "full":
                out[f"m/{name}"] = m.to("cpu", torch.float32).contiguous()
                out[f"v/{name}"] = v.to("cpu", torch.float32).contiguous()
            else:  # coded where the moments live (the GPU: fast, whatever the CPUs are busy with)
                for key, t, signed in (("m", m, True), ("v", v, False)):
                    q = quantize_log(t, signed)
                    for part, val in q.items():
                        out[f"{key}/{name}/{part}"] = val.cpu()
    return out


def save(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer | None, state: dict[str, Any],
         fmt: str = "compact", shard_mb: float = SHARD_MB, extra_files: dict[str, Path] | None = None) -> list[Path]:
    """Writes the checkpoint directory atomically; returns its files."""
    if fmt not in ("full", "compact"):
        raise ValueError(f"checkpoint format must be 'full' or 'compact', got {fmt!r}")
    return _write(Path(path), _tensors(model, opt, fmt), dict(state, format=fmt), shard_mb, extra_files)


def _write(path: Path, tensors: dict[str, torch.Tensor], state: dict[str, Any], shard_mb: float,
           extra_files: dict[str, Path] | None) -> list[Path]:
    """Shards `tensors` (weights first) into <path>.tmp with state.json, then renames it over `path`."""
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    limit = int(shard_mb * 2**20) - 64 * 1024  # room for the header
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors, key=lambda k: (k.split("/")[0] != "w", k)):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if nbytes > limit:
            raise ValueError(f"tensor {name} ({nbytes} bytes) is larger than a shard ({shard_mb} MiB)")
        if size + nbytes > limit and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    files = []
    for i, sh in enumerate(shards):
        f = tmp / f"shard-{i:02d}.safetensors"
        save_file(sh, str(f), metadata={"format": state["format"]})
        files.append(f)
    st = dict(state, shards=[f.name for f in files])
    (tmp / "state.json").write_text(json.dumps(st, indent=1) + "\n")
    for name, src in (extra_files or {}).items():
        if Path(src).exists():
            shutil.copyfile(src, tmp / name)
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    if old.exists():
        shutil.rmtree(old)
    return sorted(path.iterdir())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def strip_weights(ckpt_dir: Path, model_dir: Path, out: Path) -> list[Path]:
    """A copy of the compact checkpoint `ckpt_dir` without its weights, which `load` then reads from
    `model_dir`/model.safetensors: an export of this checkpoint inside the repository (checked here:
    the same tensor names, every one equal bit for bit)."""
    state, tensors = load(ckpt_dir)
    weights_file = (Path(model_dir) / "model.safetensors").resolve()
    if state["format"] != "compact":
        raise ValueError(f"{ckpt_dir}: only a compact checkpoint has BF16 weights an export can stand for")
    try:
        rel = weights_file.relative_to(REPO)
    except ValueError:
        raise ValueError(f"{weights_file} is not inside the repository {REPO}") from None
    exported = load_file(str(weights_file))
    own = {k[2:]: v for k, v in tensors.items() if k.startswith("w/")}
    if set(own) != set(exported):
        raise ValueError(f"{weights_file} holds other tensors than {ckpt_dir} "
                         f"(only there: {sorted(set(exported) ^ set(own))[:4]})")
    differ = [k for k in own if own[k].dtype != exported[k].dtype or not torch.equal(own[k], exported[k])]
    if differ:
        raise ValueError(f"{weights_file} is not an export of {ckpt_dir}: {len(differ)} tensors differ, e.g. {differ[0]}")
    state.pop("shards")
    state.update(weights_file=str(rel), weights_sha256=_sha256(weights_file))
    rest = {k: v for k, v in tensors.items() if not k.startswith("w/")}
    log = Path(ckpt_dir) / "log.jsonl"
    return _write(Path(out), rest, state, SHARD_MB, {"log.jsonl": log})


def load(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(state, tensors) of a checkpoint directory."""
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in state["shards"]:
        tensors.update(load_file(str(path / f)))
    if "weights_file" in state:  # strip_weights: the weights are an export's in the repository
        wf = REPO / state["weights_file"]
        if not wf.is_file() or _sha256(wf) != state["weights_sha256"]:
            raise ValueError(f"{path}: its weights are {wf} with SHA-256 {state['weights_sha256'][:12]}..., "
                             "which is missing or has changed")
        tensors.update({f"w/{k}": v for k, v in load_file(str(wf)).items()})
        del state["weights_file"], state["weights_sha256"]
    return state, tensors


def model_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[2:]: v.float() for k, v in tensors.items() if k.startswith("w/")}


def restore_optimizer(model: torch.nn.Module, opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                      step: int, fmt: str) -> int:
    """Loads the saved moments into a freshly built optimizer; returns how many parameters got state."""
    params = dict(model.named_parameters())
    sd = opt.state_dict()
    index = {}
    i = 0
    for group in opt.param_groups:
        for p in group["params"]:
            index[id(p)] = i
            i += 1
    n = 0
    for name, p in params.items():
        if fmt == "full":
            if f"m/{name}" not in tensors:
                continue
            m, v = tensors[f"m/{name}"], tensors[f"v/{name}"]
        else:
            if f"m/{name}/codes" not in tensors:
                continue
            m = dequantize_log({k: tensors[f"m/{name}/{k}"] for k in ("codes", "lo", "hi")}, p.shape, True)
            v = dequantize_log({k: tensors[f"v/{name}/{k}"] for k in ("codes", "lo", "hi")}, p.shape, False)
        sd["state"][index[id(p)]] = {"step": torch.tensor(float(step), dtype=torch.float32),
                                     "exp_avg": m.to(p.dtype).reshape(p.shape),
                                     "exp_avg_sq": v.to(p.dtype).reshape(p.shape)}
        n += 1
    opt.load_state_dict(sd)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description="Checkpoint tools.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("strip", help="a copy of a compact checkpoint whose weights come from an export in the repository")
    st.add_argument("ckpt", type=Path)
    st.add_argument("model_dir", type=Path, help="the export of that checkpoint, e.g. python/ocria_rt/models/ocria-mini")
    st.add_argument("out", type=Path)
    args = ap.parse_args()
    files = strip_weights(args.ckpt, args.model_dir, args.out)
    print(json.dumps({f.name: f.stat().st_size for f in files}, indent=1))


if __name__ == "__main__":
    main()
