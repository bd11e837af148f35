"""A DFlash2 drafter in torch for training, saved and loaded in z-lab's checkpoint format.

The math matches ocria_rt's csrc/model/dflash.cpp (and z-lab's reference): Qwen3 layers whose keys and
values see the fused target taps of the context, a grouped dynamic convolution around each sublayer,
and a low-rank candidate selector. The target's embedding table and LM head are inputs, never trained.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DrafterSpec:
    hidden_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    num_layers: int = 1
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 64
    selector_top_k: int = 16
    extra: dict = field(default_factory=dict)  # recorded in dflash_config (e.g. the position convention)

    def config_json(self) -> dict:
        """z-lab's config.json (a Qwen3Config plus dflash_config), every drafter layer bidirectional."""
        return {
            "architectures": ["DFlash2DraftModel"], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": False, "max_position_embeddings": 32768,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "layer_types": ["full_attention"] * self.num_layers, "use_sliding_window": False, "sliding_window": None,
            "is_causal": False, "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                "block_size": self.block_size, "conv_kernel_size": self.conv_kernel_size,
                "conv_group_size": self.conv_group_size, "selector_rank": self.selector_rank,
                "selector_top_k": self.selector_top_k, **self.extra,
            },
        }


class RMSNorm(nn.Module):
    """Qwen3's: x / rms(x) * w."""

    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE over the whole head (halves rotated against each other). x [..., T, heads, hd], positions [..., T]."""
    hd = x.shape[-1]
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd)
    ang = positions.to(torch.float32)[..., None] * inv  # [..., T, hd/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[..., None, :], torch.cat([ang.sin()] * 2, -1)[..., None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class DynamicConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution within a block: side 0 filters a sublayer's input,
    side 1 its output; out[t, c] = sum_o (base[side, o, c] + dyn[t, side, o, c // group]) x[t - o, c]."""

    def __init__(self, hidden: int, kernel: int, group: int) -> None:
        super().__init__()
        self.kernel, self.group = kernel, group
        base = torch.zeros(2, kernel, hidden)
        base[:, 0] = 1.0  # identity at start (z-lab leaves this tensor uninitialized)
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def taps(self, normed: torch.Tensor) -> torch.Tensor:
        """[..., B, 2, K, H/group] from the sublayer's normed input."""
        return self.kernel_projection(normed).unflatten(-1, (2, self.kernel, -1))

    def apply(self, x: torch.Tensor, dyn: torch.Tensor, side: int) -> torch.Tensor:
        """x [..., B, H] (B = the block axis, never crossed)."""
        out = torch.zeros_like(x)
        B = x.shape[-2]
        for o in range(min(self.kernel, B)):
            w = self.base_kernel[side, o] + dyn[..., side, o, :].repeat_interleave(self.group, -1)
            out[..., o:, :] += w[..., o:, :] * x[..., : B - o, :]
        return out


class DraftLayer(nn.Module):
    def __init__(self, s: DrafterSpec) -> None:
        super().__init__()
        H, hd = s.hidden_size, s.head_dim
        self.s = s
        self.input_layernorm = RMSNorm(H, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, s.rms_norm_eps)
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_proj = nn.Linear(H, s.num_heads * hd, bias=False)
        a.k_proj = nn.Linear(H, s.num_kv_heads * hd, bias=False)
        a.v_proj = nn.Linear(H, s.num_kv_heads * hd, bias=False)
        a.o_proj = nn.Linear(s.num_heads * hd, H, bias=False)
        a.q_norm = RMSNorm(hd, s.rms_norm_eps)
        a.k_norm = RMSNorm(hd, s.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(H, s.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(H, s.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(s.intermediate_size, H, bias=False)
        self.attention_conv = DynamicConv(H, s.conv_kernel_size, s.conv_group_size)
        self.mlp_conv = DynamicConv(H, s.conv_kernel_size, s.conv_group_size)

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of context rows ctx [S, N, H] at positions [S, N]."""
        a, hd = self.self_attn, self.s.head_dim
        k = a.k_norm(a.k_proj(ctx).unflatten(-1, (-1, hd)))
        return rotate(k, positions, self.s.rope_theta), a.v_proj(ctx).unflatten(-1, (-1, hd))

    def forward(self, x, positions, ctx_k, ctx_v, ctx_visible):
        """x [S, A, B, H]: A blocks of B tokens per sequence at positions [S, A, B]; ctx_k / ctx_v
        [S, N, Hkv, hd]; ctx_visible [S, A, N] (a block sees context strictly before its anchor)."""
        s, a, hd = self.s, self.self_attn, self.s.head_dim
        S, A, B, H = x.shape
        normed = self.input_layernorm(x)
        dyn = self.attention_conv.taps(normed)
        inp = self.attention_conv.apply(normed, dyn, 0)
        q = rotate(a.q_norm(a.q_proj(inp).unflatten(-1, (-1, hd))), positions, s.rope_theta)  # [S,A,B,Hq,hd]
        k = rotate(a.k_norm(a.k_proj(inp).unflatten(-1, (-1, hd))), positions, s.rope_theta)
        v = a.v_proj(inp).unflatten(-1, (-1, hd))
        rep = s.num_heads // s.num_kv_heads
        N = ctx_k.shape[1]
        # keys per block: the whole context (masked) then the block itself (all visible)
        keys = torch.cat([ctx_k[:, None].expand(S, A, N, -1, -1), k], 2).repeat_interleave(rep, -2)
        vals = torch.cat([ctx_v[:, None].expand(S, A, N, -1, -1), v], 2).repeat_interleave(rep, -2)
        mask = torch.cat([ctx_visible, ctx_visible.new_ones(S, A, B)], -1)[:, :, None, None, :]  # [S,A,1,1,N+B]
        out = F.scaled_dot_product_attention(q.transpose(2, 3), keys.transpose(2, 3), vals.transpose(2, 3),
                                             attn_mask=mask, scale=1.0 / math.sqrt(hd))
        out = a.o_proj(out.transpose(2, 3).flatten(-2))
        x = x + self.attention_conv.apply(out, dyn, 1)
        normed = self.post_attention_layernorm(x)
        dyn = self.mlp_conv.taps(normed)
        inp = self.mlp_conv.apply(normed, dyn, 0)
        m = self.mlp
        out = m.down_proj(F.silu(m.gate_proj(inp)) * m.up_proj(inp))
        return x + self.mlp_conv.apply(out, dyn, 1)


class CandidateSelector(nn.Module):
    def __init__(self, s: DrafterSpec) -> None:
        super().__init__()
        self.hidden_projection = nn.Linear(s.hidden_size, s.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.randn(s.vocab_size, s.selector_rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(s.vocab_size, s.selector_rank) * 0.02)

    def pair_scores(self, hidden, prev, cand):
        """sum_r A[prev, r] (P h)[r] B[cand, r]: hidden [..., H], prev [...], cand [..., K] -> [..., K]."""
        w = self.predecessor_codebook[prev] * self.hidden_projection(hidden)
        return (self.successor_codebook[cand] * w[..., None, :]).sum(-1)


class DFlash2Drafter(nn.Module):
    def __init__(self, s: DrafterSpec) -> None:
        super().__init__()
        self.spec = s
        H = s.hidden_size
        self.fc = nn.Linear(len(s.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, s.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(s) for _ in range(s.num_layers))
        self.norm = RMSNorm(H, s.rms_norm_eps)
        self.candidate_selector = CandidateSelector(s)
        for name, p in self.named_parameters():
            if p.ndim == 2 and "kernel_projection" not in name and "codebook" not in name:
                nn.init.normal_(p, std=0.02)

    def forward(self, taps, block_ids, anchors, embed):
        """taps [S, N, n_taps*H] (the context of each sequence, position = row), block_ids [S, A, B]
        ([anchor, mask, ...]), anchors [S, A] (the anchor's position) -> final-normed hidden [S, A, B, H]."""
        S, N, _ = taps.shape
        ctx = self.hidden_norm(self.fc(taps))
        ctx_pos = torch.arange(N, device=taps.device).expand(S, N)
        B = block_ids.shape[-1]
        positions = anchors[..., None] + torch.arange(B, device=taps.device)
        visible = ctx_pos[:, None, :] < anchors[..., None]
        x = embed[block_ids]
        for layer in self.layers:
            k, v = layer.context_kv(ctx, ctx_pos)
            x = layer(x, positions, k, v, visible)
        return self.norm(x)

    # ---- z-lab's checkpoint format ----
    def save(self, directory: Path, dtype: torch.dtype = torch.float32) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()}
        tmp = directory / "model.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(directory / "model.safetensors")
        (directory / "config.json").write_text(json.dumps(self.spec.config_json(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, directory: Path) -> "DFlash2Drafter":
        from safetensors.torch import load_file

        c = json.loads((Path(directory) / "config.json").read_text())
        d = dict(c["dflash_config"])
        known = {f for f in DrafterSpec.__dataclass_fields__}
        spec = DrafterSpec(
            hidden_size=c["hidden_size"], vocab_size=c["vocab_size"], num_target_layers=c["num_target_layers"],
            target_layer_ids=d.pop("target_layer_ids"), mask_token_id=d.pop("mask_token_id"),
            block_size=d.pop("block_size"), num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
            num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"], intermediate_size=c["intermediate_size"],
            rope_theta=c["rope_parameters"]["rope_theta"], rms_norm_eps=c["rms_norm_eps"],
            **{k: d.pop(k) for k in list(d) if k in known})
        spec.extra = d
        model = cls(spec)
        model.load_state_dict(load_file(str(Path(directory) / "model.safetensors")))
        return model




@torch.no_grad()
def propose(model: DFlash2Drafter, taps: torch.Tensor, anchor: int, embed: torch.Tensor, head: torch.Tensor) -> list[int]:
    """The greedy proposals (temperature 0 selector walk) of the block after a context of taps [N, n_taps*H]
    whose next token is `anchor` (placed at position N)."""
    s = model.spec
    block = torch.full((1, 1, s.block_size), s.mask_token_id)
    block[0, 0, 0] = anchor
    hidden = model(taps[None].float(), block, torch.tensor([[taps.shape[0]]]), embed)[0, 0, 1:]
    logits = hidden @ head.T
    prev, out = anchor, []
    for t in range(s.block_size - 1):
        cand = logits[t].topk(s.selector_top_k).indices
        scores = logits[t][cand] + model.candidate_selector.pair_scores(hidden[t], torch.tensor(prev), cand)
        prev = int(cand[scores.argmax()])
        out.append(prev)
    return out
