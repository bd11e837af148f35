"""The projection groups of a Qwen3.5 decoder, where their AWQ scales fold, and the ModelOpt-format
checkpoint of a plan.

Folds of a group's pre_quant_scale p (its input is multiplied by p; the quantized weight is W diag(1 / p)),
each exact (up to rounding the changed tensor to the checkpoint's dtype), so that no pre_quant_scale is
written (vLLM rejects ModelOpt's *_AWQ algorithms):
- q|k|v and DeltaNet in_proj_qkv|in_proj_z: into input_layernorm, a (1 + w) RMSNorm: w' = (1 + w) p - 1;
  in_proj_a / in_proj_b, which read the same norm and stay unquantized, get their columns divided by p;
- MLP gate|up: into post_attention_layernorm; the LM head: into the final norm;
- o_proj: into v_proj's rows (o_proj's input channel (h, d) is value channel (h / (Hq / Hkv), d) times
  the gate, so the query heads that share a KV head share their scales);
- DeltaNet out_proj: into linear_attn.norm's plain weight [dv], shared by the value heads (so are the scales);
- down_proj: into up_proj's rows (its input is silu(gate) * up).
The groups that fold into another group's weights (o_proj, out_proj, down_proj) are quantized first.
"""

from __future__ import annotations

import json
import re
import shutil
from fnmatch import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import _core
from ..errors import ModelError
from .awq import GroupQuantization, QuantizedWeight, quantize_group
from .formats import NVFP4_BLOCK
from .safetensors_io import Checkpoint, from_float, write_checkpoint as write_tensors

KINDS = {"q_proj": "attn_qkv", "o_proj": "attn_o", "in_proj_qkv": "gdn_in", "out_proj": "gdn_out",
         "gate_proj": "mlp_gate_up", "down_proj": "mlp_down", "lm_head": "lm_head"}
SHORT = {"attn_qkv": "qkv", "attn_o": "o", "gdn_in": "in", "gdn_out": "out", "mlp_gate_up": "mlp", "mlp_down": "down",
         "lm_head": "head"}
KEEP_DENSE = ("in_proj_a", "in_proj_b")  # ModelOpt's defaults: they stay unquantized
FOLDS_INTO_OTHERS = ("attn_o", "gdn_out", "mlp_down")
# The model directory's other files that go with the checkpoint: tokenizer, processor and generation
# configs, chat templates, the training record (its page distribution is what `ocria-rt eval` scores on).
FILES_COPIED = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "README*", "LICENSE*")
FILES_NOT_COPIED = ("config.json", "hf_quant_config.json", "model.safetensors.index.json", "quantization_report.json")


@dataclass
class Group:
    """One projection group: the modules quantized together (one shared global and input scale)."""

    name: str             # e.g. "layers.3.self_attn.q|k|v", "lm_head"
    short: str            # for the plot, e.g. "3 qkv"
    kind: str             # a value of KINDS
    layer: int | None
    slot: int             # index in Engine.linear_groups()
    modules: list[str]    # checkpoint module names, quantized together
    rows: list[int]
    in_features: int
    slot_format: str      # how the engine holds it ("dense" for a checkpoint to quantize)
    kept_dense: list[str] = field(default_factory=list)  # modules of the same projection that stay unquantized

    @property
    def weights(self) -> int:
        return sum(self.rows) * self.in_features

    @property
    def base(self) -> str:
        """The decoder's key prefix: "model.language_model." or "model." ("" for the LM head)."""
        m = self.modules[0]
        return m[: m.index("layers.")] if "layers." in m else ""


def projection_groups(slots: list[dict[str, Any]]) -> list[Group]:
    """The groups of the engine's projections (Engine.linear_groups())."""
    out = []
    for i, s in enumerate(slots):
        names = [m.rsplit(".", 1)[-1] for m in s["modules"]]
        keep = [j for j, n in enumerate(names) if n in KEEP_DENSE]
        take = [j for j in range(len(names)) if j not in keep]
        if not take:  # in_proj_b | in_proj_a on their own (a checkpoint that stores them apart)
            continue
        kind = KINDS.get(names[take[0]])
        if kind is None:
            raise ModelError(f"unknown projection '{s['modules'][take[0]]}'")
        m0 = s["modules"][0]
        layer = int(re.search(r"layers\.(\d+)\.", m0).group(1)) if "layers." in m0 else None
        parent = m0.rsplit(".", 1)[0]
        label = "|".join(names[j].removesuffix("_proj") if kind != "gdn_in" else names[j] for j in take)
        name = "lm_head" if kind == "lm_head" else parent[parent.index("layers."):] + "." + (
            label if len(take) > 1 else names[take[0]])
        out.append(Group(name=name, short=SHORT[kind] if layer is None else f"{layer} {SHORT[kind]}", kind=kind,
                         layer=layer, slot=i, modules=[s["modules"][j] for j in take],
                         rows=[s["rows"][j] for j in take], in_features=int(s["in_features"]),
                         slot_format=s["format"], kept_dense=[s["modules"][j] for j in keep]))
    return out


@dataclass
class Shapes:
    heads: int
    kv_heads: int
    head_dim: int
    value_heads: int
    value_dim: int

    @staticmethod
    def of(config: dict[str, Any]) -> Shapes:
        return Shapes(int(config["num_attention_heads"]), int(config["num_key_value_heads"]), int(config["head_dim"]),
                      int(config["linear_num_value_heads"]), int(config["linear_value_head_dim"]))


def tie_classes(g: Group, s: Shapes) -> np.ndarray | None:
    """Per input channel, the class of channels that must share one AWQ scale for the group's fold."""
    if g.kind == "attn_o":  # channel (h, d) <- value channel (h / (Hq / Hkv), d)
        per_kv = s.heads // s.kv_heads
        return np.array([(h // per_kv) * s.head_dim + d for h in range(s.heads) for d in range(s.head_dim)])
    if g.kind == "gdn_out":  # the gated norm's weight [dv] is shared by the value heads
        return np.array([d for _ in range(s.value_heads) for d in range(s.value_dim)])
    return None


def weight_name(g: Group, module: str, ck: Checkpoint) -> str:
    """The checkpoint tensor holding a module's weight (a tied LM head's is the embeddings)."""
    if module + ".weight" in ck:
        return module + ".weight"
    if g.kind == "lm_head":
        for base in ("model.language_model.", "model."):
            if base + "embed_tokens.weight" in ck:
                return base + "embed_tokens.weight"
    raise ModelError(f"checkpoint '{ck.dir}' has no tensor '{module}.weight'")


class SourceWeights:
    """The checkpoint's float tensors as float32, with the changes folds make (kept apart)."""

    def __init__(self, ck: Checkpoint, groups: list[Group]) -> None:
        self.ck = ck
        self.changed: dict[str, np.ndarray] = {}
        self._group_of = {m: g for g in groups for m in g.modules}

    def tensor(self, name: str) -> np.ndarray:
        return self.changed[name] if name in self.changed else self.ck.f32(name)

    def get(self, module: str) -> np.ndarray:
        """A module's weight [out, in]."""
        g = self._group_of.get(module)
        return self.tensor(weight_name(g, module, self.ck) if g is not None else module + ".weight")

    def set(self, name: str, value: np.ndarray) -> None:
        if name not in self.ck:
            raise ModelError(f"checkpoint '{self.ck.dir}' has no tensor '{name}' to fold a scale into")
        self.changed[name] = np.asarray(value, np.float32)


def fold(g: Group, p: np.ndarray, w: SourceWeights, s: Shapes) -> dict[str, np.ndarray]:
    """Folds the group's pre_quant_scale p [K] into the tensors before it (module docstring); returns the
    projections whose output rows it scaled, with their row factors."""
    layer = f"{g.base}layers.{g.layer}."
    norm = {"attn_qkv": layer + "input_layernorm.weight", "gdn_in": layer + "input_layernorm.weight",
            "mlp_gate_up": layer + "post_attention_layernorm.weight"}.get(g.kind)
    if g.kind == "lm_head":
        norm = next(b + "norm.weight" for b in ("model.language_model.", "model.") if b + "norm.weight" in w.ck)
    if norm is not None:  # (1 + w') = (1 + w) p
        w.set(norm, (1.0 + w.tensor(norm)) * p - 1.0)
    if g.kind == "gdn_in":
        for m in g.kept_dense:
            w.set(m + ".weight", w.get(m) / p[None, :])
    elif g.kind == "attn_o":
        v = layer + "self_attn.v_proj.weight"
        per_kv = s.heads // s.kv_heads
        rows = np.array([p[(kv * per_kv) * s.head_dim + d] for kv in range(s.kv_heads) for d in range(s.head_dim)],
                        np.float32)
        w.set(v, w.tensor(v) * rows[:, None])
        return {v[: -len(".weight")]: rows}
    elif g.kind == "gdn_out":
        n = layer + "linear_attn.norm.weight"
        w.set(n, w.tensor(n) * p[: s.value_dim])
    elif g.kind == "mlp_down":
        up = layer + "mlp.up_proj.weight"
        w.set(up, w.tensor(up) * p[:, None])
        return {up[: -len(".weight")]: p}
    return {}


@dataclass
class Built:
    quant_algo: str
    modules: dict[str, str]  # quantized module -> format, in the decoder's order
    alphas: dict[str, float]  # group -> AWQ alpha (0: plain rounding)
    # The written weight of module m computes, on the source model's inputs, what
    # dequant(m) * input_scales[m][None, :] / row_scales[m][:, None] does (each factor 1 where absent).
    input_scales: dict[str, np.ndarray] = field(default_factory=dict)
    row_scales: dict[str, np.ndarray] = field(default_factory=dict)


def modelopt_configs(modules: dict[str, str], excluded: list[str]) -> tuple[str, dict, dict]:
    """(quant_algo, hf_quant_config.json, config.json's quantization_config) as ModelOpt 0.47 writes them
    (tests/fixtures/README.md), for the quantized modules' formats; excluded: the unquantized modules
    (one format only)."""
    producer = {"name": "ocria_rt", "version": _core.version()}
    algo = {"fp8": {"quant_algo": "FP8"}, "nvfp4": {"quant_algo": "NVFP4", "group_size": NVFP4_BLOCK}}
    args = {"fp8": {"dynamic": False, "num_bits": 8, "type": "float"},
            "nvfp4": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_BLOCK}}
    formats = sorted(set(modules.values()), key=["nvfp4", "fp8"].index)
    if len(formats) == 1:
        f = formats[0]
        quant_algo = algo[f]["quant_algo"]
        hf = {"quant_algo": quant_algo, "kv_cache_quant_algo": None, **({"group_size": NVFP4_BLOCK} if f == "nvfp4" else {}),
              "exclude_modules": excluded}
        qc = {"config_groups": {"group_0": {"input_activations": args[f], "weights": args[f], "targets": ["Linear"]}},
              "ignore": excluded, "quant_algo": quant_algo, "producer": producer, "quant_method": "modelopt"}
    else:
        quant_algo = "MIXED_PRECISION"
        layers = {m: algo[f] for m, f in modules.items()}
        hf = {"quant_algo": quant_algo, "kv_cache_quant_algo": None, "quantized_layers": layers}
        qc = {"config_groups": {f"group_{i}": {"input_activations": args[f], "weights": args[f],
                                                "targets": sorted(m for m, mf in modules.items() if mf == f)}
                                for i, f in enumerate(formats)},
              "quantized_layers": layers, "ignore": [], "quant_algo": quant_algo, "producer": producer,
              "quant_method": "modelopt"}
    return quant_algo, {"producer": producer, "quantization": hf}, qc


def _excluded(groups: list[Group], plan: dict[str, str], ck: Checkpoint, config: dict[str, Any]) -> list[str]:
    """ModelOpt's exclude_modules: the LM head, the embeddings, each DeltaNet layer's conv1d, in_proj_a and
    in_proj_b (and any projection kept dense), in layer order; the vision encoder as a wildcard."""
    base = next((g.base for g in groups if g.layer is not None), "model.")
    out = [] if plan.get("lm_head", "dense") != "dense" else ["lm_head"]
    out.append(base + "embed_tokens")
    for g in sorted((g for g in groups if g.layer is not None), key=lambda g: (g.layer, g.slot)):
        if g.kind == "gdn_in":
            out.append(f"{base}layers.{g.layer}.linear_attn.conv1d")
            out += sorted(g.kept_dense)
        if plan[g.name] == "dense":
            out += g.modules
    if "vision_config" in config:
        out.append("model.visual*")
    return out


def write_checkpoint(out: Path, model_dir: Path, ck: Checkpoint, groups: list[Group], plan: dict[str, str],
                     stats: list[dict], method: str, shapes: Shapes, threads: int = 0,
                     quantized_source: dict[str, GroupQuantization] | None = None) -> Built:
    """Quantizes the groups as `plan` says and writes the checkpoint, its configs and the model directory's
    other files (tokenizer, processor, chat template, generation config) to `out`. quantized_source: group
    name -> its quantization (in the plan's format) of the source weights, taken as it is where no fold
    has changed the group's weights."""
    w = SourceWeights(ck, groups)
    quantized: dict[str, QuantizedWeight] = {}
    built = Built("none", {}, {})
    order = sorted((g for g in groups if plan[g.name] != "dense"),
                   key=lambda g: (g.layer if g.layer is not None else 1 << 30, g.kind not in FOLDS_INTO_OTHERS))
    for g in order:
        unchanged = not any(weight_name(g, m, ck) in w.changed for m in g.modules)
        gq = (quantized_source or {}).get(g.name) if unchanged else None
        if gq is None:
            gq = quantize_group([w.get(m) for m in g.modules], plan[g.name], stats[g.slot], method, tie_classes(g, shapes),
                                threads)
        if gq.pre_quant_scale is not None:
            built.row_scales.update(fold(g, gq.pre_quant_scale, w, shapes))
            built.input_scales.update(dict.fromkeys(g.modules, gq.pre_quant_scale))
        built.alphas[g.name] = gq.alpha
        for m, q in zip(g.modules, gq.weights):
            quantized[m] = q
    built.modules = {m: quantized[m].fmt for g in groups for m in g.modules if m in quantized}

    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for name in ck.names():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module in quantized:
            continue
        dtype = ck.dtype(name)
        tensors[name] = (dtype, from_float(w.changed[name], dtype)) if name in w.changed else (dtype, ck.raw(name))
    for m, q in quantized.items():
        tensors.update(q.tensors(m))
    write_tensors(out, tensors)

    config = json.loads((model_dir / "config.json").read_text())
    formats = built.modules
    lm_head = next(g for g in groups if g.kind == "lm_head")
    if plan[lm_head.name] != "dense" and "lm_head.weight" not in ck:  # the head gets a tensor of its own
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):
            config["text_config"]["tie_word_embeddings"] = False
    if formats:
        built.quant_algo, hf, qc = modelopt_configs(formats, _excluded(groups, plan, ck, config))
        config["quantization_config"] = qc
        (out / "hf_quant_config.json").write_text(json.dumps(hf, indent=4) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and f.name not in FILES_NOT_COPIED and any(fnmatch(f.name, p) for p in FILES_COPIED):
            shutil.copy2(f, out / f.name)
    return built
