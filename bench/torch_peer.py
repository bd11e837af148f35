"""A batch-1 Qwen3.5 decoder built the way serving engines (vLLM, SGLang) run it, as the peer that
bench/decode.py measures ocria_rt against.

The checkpoint's weights become plain tensors (fused q|k|v, in_proj_qkv|z|b|a and gate|up, so each
projection is one cuBLAS GEMM), with static buffers for everything a decode step touches: the KV
caches ([max_context, kv_heads, head_dim] per attention layer), the DeltaNet conv windows and
recurrent states, the input token, its position and the sampled tokens. On CUDA with
flash-linear-attention (fla) installed a decode step runs

- fla's fused recurrent Gated DeltaNet kernel (gates, beta, q / k L2 norms inside the kernel; the
  state read from and written back to its static buffer in place), fla's causal_conv1d_update,
  fla's fused residual-add + RMSNorm, gated RMSNorm and SwiGLU kernels (Triton);
- torch's flash attention (varlen form, one query over the static cache, the used length read from
  a device tensor so the step needs no host value; split-KV for decode);
- greedy sampling (argmax) on the GPU, writing the next input token and advancing the position;

and the whole step is captured once in a torch.cuda.CUDAGraph and replayed per token, with no host
synchronisation between tokens (so, unlike an engine streaming tokens, no stop-token check).

Without CUDA or fla every kernel has a pure-torch equivalent (the same math) and steps run eagerly:
that path runs on the CPU, in fp32 if asked, and is what tests/test_torch_peer.py checks against
ocria_rt's CPU engine. The prompt is prefilled with cuBLAS GEMMs, torch SDPA (causal), a depthwise
conv1d and the recurrent DeltaNet kernel over the prompt (fla's fused one on CUDA); the prefill is not
what this peer is for and is not timed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ocria_rt.errors import InvalidArgumentError, ModelError


def text_config(model_dir: Path) -> dict:
    """The decoder's config, read as transformers reads a Qwen3.5 config.json (the VLM's text_config;
    layer_types or every full_attention_interval-th layer; rope_parameters or the legacy keys)."""
    path = Path(model_dir) / "config.json"
    root = json.loads(path.read_text())
    if root.get("model_type") == "qwen3_5":
        if not isinstance(root.get("text_config"), dict):
            raise ModelError(f"config '{path}': model_type 'qwen3_5' needs a 'text_config' object")
        c = dict(root["text_config"])
        if "tie_word_embeddings" in root:
            c["tie_word_embeddings"] = root["tie_word_embeddings"]
    elif root.get("model_type") == "qwen3_5_text":
        c = dict(root)
    else:
        raise ModelError(f"config '{path}': unsupported model_type {root.get('model_type')!r}")
    n = c["num_hidden_layers"]
    if "layer_types" in c:
        if len(c["layer_types"]) != n:
            raise ModelError(f"config '{path}': layer_types must list {n} layer types")
        c["full_attention"] = [t in ("full_attention", "attention") for t in c["layer_types"]]
    else:
        every = c.get("full_attention_interval", 4)
        c["full_attention"] = [(i + 1) % every == 0 for i in range(n)]
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    c["rope_theta"] = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    c["rotary_dim"] = int(c["head_dim"] * rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)))
    c.setdefault("tie_word_embeddings", False)
    c.setdefault("rms_norm_eps", 1e-6)
    c.setdefault("linear_conv_kernel_dim", 4)
    return c


def load_tensors(model_dir: Path, device: str) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, on `device`, as stored."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    out = {}
    for name in files:
        with safe_open(str(model_dir / name), framework="pt", device=str(device)) as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out


# ---- the kernels, each with its pure-torch equivalent ----

def _fla_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("fla") is not None


class TorchKernels:
    """Reference implementations (any device, any float dtype): what the fused kernels compute."""

    name = "torch"
    attention = "SDPA over the masked static cache"

    @staticmethod
    def add_rms_norm(delta, residual, weight, eps):
        """residual + delta (rounded to the residual's dtype) and its RMSNorm times weight."""
        x = residual if delta is None else (residual.float() + delta.float()).to(residual.dtype)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight
        return y.to(x.dtype), x

    @staticmethod
    def gated_rms_norm(x, gate, weight, eps):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight * F.silu(gate.float())
        return y.to(x.dtype)

    @staticmethod
    def swiglu(gate, up):
        return (F.silu(gate.float()) * up.float()).to(gate.dtype)

    @staticmethod
    def conv_step(x, window, weight):
        """One token through the depthwise causal conv + SiLU. window [1, C, W] holds the last W
        inputs, newest last; it shifts left and takes x in place."""
        window[:, :, :-1] = window[:, :, 1:].clone()
        window[:, :, -1] = x
        return F.silu((window.float() * weight.float()).sum(-1)).to(x.dtype)

    @staticmethod
    def gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, scale):
        """Gated DeltaNet over T tokens from `state` [1, HV, dk, dv] (fp32, updated in place).
        q, k [1, T, HK, dk]; v [1, T, HV, dv]; a, b [1, T, HV] (raw: the decay's and beta's logits).
        Returns o [1, T, HV, dv]."""
        HK, HV = q.shape[2], v.shape[2]
        qf = q.float()
        qf = qf * torch.rsqrt(qf.pow(2).sum(-1, keepdim=True) + 1e-6) * scale
        kf = k.float()
        kf = kf * torch.rsqrt(kf.pow(2).sum(-1, keepdim=True) + 1e-6)
        qf, kf = qf.repeat_interleave(HV // HK, dim=2), kf.repeat_interleave(HV // HK, dim=2)
        decay = torch.exp(-torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float()))  # [1, T, HV]
        beta = torch.sigmoid(b.float())
        S = state[0]
        outs = []
        for t in range(q.shape[1]):
            S.mul_(decay[0, t, :, None, None])
            u = beta[0, t, :, None] * (v[0, t].float() - torch.einsum("hkv,hk->hv", S, kf[0, t]))
            S.add_(kf[0, t, :, :, None] * u[:, None, :])
            outs.append(torch.einsum("hkv,hk->hv", S, qf[0, t]))
        return torch.stack(outs)[None].to(v.dtype)

    @staticmethod
    def decode_attention(q, k_cache, v_cache, used, scale):
        """One query [Hq, hd] over the first `used` (a device tensor [1]) rows of the static cache."""
        Hq, hd = q.shape
        Hkv = k_cache.shape[1]
        mask = (torch.arange(k_cache.shape[0], device=q.device) < used)[None, None, None, :]
        out = F.scaled_dot_product_attention(q.view(1, Hkv, Hq // Hkv, hd), k_cache.transpose(0, 1)[None],
                                             v_cache.transpose(0, 1)[None], attn_mask=mask, scale=scale)
        return out.reshape(Hq, hd)


class FusedKernels(TorchKernels):
    """fla's Triton kernels and torch's flash attention (CUDA), for a static cache of max_context rows."""

    name = "fla + flash attention"
    attention = "flash attention (varlen, seqused_k)"

    def __init__(self, max_context: int, device: torch.device):
        self.cu_q = torch.tensor([0, 1], device=device, dtype=torch.int32)
        self.cu_k = torch.tensor([0, max_context], device=device, dtype=torch.int32)
        # Flash attention must honour seqused_k (rows past it hold other data): checked against the
        # masked SDPA on random data; a torch where it fails or differs falls back to that SDPA.
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(shape, device=device, generator=g).to(torch.bfloat16)
                   for shape in ((4, 64), (max_context, 2, 64), (max_context, 2, 64)))
        used = torch.full((1,), min(3, max_context), device=device, dtype=torch.int32)
        try:
            err = (self.flash_decode(q, k, v, used, 0.125).float() - TorchKernels.decode_attention(q, k, v, used, 0.125).float())
            failure = None if float(err.abs().max()) < 2e-2 else f"differs from SDPA by {float(err.abs().max()):.3g}"
        except (RuntimeError, TypeError, NotImplementedError) as e:
            failure = str(e).splitlines()[0][:120]
        if failure:
            self.decode_attention = TorchKernels.decode_attention
            self.attention = f"{TorchKernels.attention} (flash attention: {failure})"

    @staticmethod
    def add_rms_norm(delta, residual, weight, eps):
        from fla.modules.norm.layernorm import rms_norm

        if delta is None:
            return rms_norm(residual, weight, None, eps=eps), residual
        return rms_norm(delta, weight, None, residual=residual, eps=eps, prenorm=True)

    @staticmethod
    def gated_rms_norm(x, gate, weight, eps):
        from fla.modules.norm.fused_norm_gate import rms_norm_gated

        return rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)

    @staticmethod
    def swiglu(gate, up):
        from fla.modules.activations import swiglu

        return swiglu(gate, up)

    @staticmethod
    def conv_step(x, window, weight):
        from fla.modules.causal_conv1d import causal_conv1d_update

        return causal_conv1d_update(x, window, weight=weight, activation="silu")[0]

    @staticmethod
    def gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, scale):
        """fla's fused recurrent kernel launched directly with the state buffer as both its initial
        and its final state: each program loads its [dk, dv/BV] tile first and stores the same tile
        last, so the update is in place (the public wrapper would allocate a new final state)."""
        import triton
        from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd_kernel

        _, T, HK, dk = k.shape
        HV, dv = v.shape[2], v.shape[3]
        BV = min(8, triton.next_power_of_2(dv))
        o = torch.empty_like(v)
        fused_recurrent_gated_delta_rule_fwd_kernel[(triton.cdiv(dv, BV) * HV,)](
            q=q, k=k, v=v, g=a, gk=None, gv=None, beta=b, A_log=A_log, dt_bias=dt_bias, o=o, h0=state, ht=state,
            cu_seqlens=None, scale=scale, T=T, H=HK, HV=HV, K=dk, V=dv, BK=triton.next_power_of_2(dk), BV=BV,
            IS_BETA_HEADWISE=True, USE_QK_L2NORM_IN_KERNEL=True, APPLY_BETA_SIGMOID=True, ALLOW_NEG_EIGVAL=False,
            STATE_V_FIRST=False, num_warps=1, num_stages=3)
        return o

    def decode_attention(self, q, k_cache, v_cache, used, scale):
        return self.flash_decode(q, k_cache, v_cache, used, scale)

    def flash_decode(self, q, k_cache, v_cache, used, scale):
        """torch's flash attention, varlen form: one sequence whose keys are the whole static cache
        (cu_k = [0, max_context]) of which only seqused_k = `used` rows count."""
        out = torch.ops.aten._flash_attention_forward(q[None], k_cache, v_cache, self.cu_q, self.cu_k, 1, k_cache.shape[0],
                                                      0.0, False, False, scale=scale, seqused_k=used)[0]
        return out.reshape(q.shape)


# ---- the model ----

class TorchPeer:
    """The decoder of `model_dir` on `device` with static caches for up to `max_context` positions
    and `max_new_tokens` sampled tokens. fused (default: CUDA with fla importable) picks the fused
    kernels; cuda_graph (default: fused) captures the decode step."""

    def __init__(self, model_dir, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 max_context: int = 4096, max_new_tokens: int = 1024, fused: bool | None = None,
                 cuda_graph: bool | None = None):
        self.device = torch.device(device)
        self.dtype = dtype
        self.cfg = c = text_config(model_dir)
        if fused is None:
            fused = self.device.type == "cuda" and _fla_available()
        if fused and self.device.type != "cuda":
            raise InvalidArgumentError("the fused kernels need a CUDA device")
        self.kernels = FusedKernels(max_context, self.device) if fused else TorchKernels()
        self.use_graph = fused if cuda_graph is None else cuda_graph
        self.max_context, self.max_new_tokens = max_context, max_new_tokens
        self.H, self.I, self.hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
        self.Hq, self.Hkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.HK, self.HV = c["linear_num_key_heads"], c["linear_num_value_heads"]
        self.dk, self.dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        self.W, self.eps, self.rot = c["linear_conv_kernel_dim"], c["rms_norm_eps"], c["rotary_dim"]
        self.C = 2 * self.HK * self.dk + self.HV * self.dv
        self._load(model_dir)
        self._allocate()
        self.graph = None

    # -- set-up --
    def _load(self, model_dir) -> None:
        t = load_tensors(model_dir, str(self.device))
        base = "model.language_model." if any(k.startswith("model.language_model.") for k in t) else "model."

        def get(name, dtype=None):
            key = name if name.startswith("lm_head") else base + name
            if key not in t:
                raise ModelError(f"checkpoint '{model_dir}': tensor '{key}' is missing")
            return t[key].to(dtype or self.dtype)

        f32 = torch.float32
        self.embed = get("embed_tokens.weight")
        self.lm_head = self.embed if self.cfg["tie_word_embeddings"] else get("lm_head.weight")
        self.final_norm = 1 + get("norm.weight", f32)  # Qwen3.5's RMSNorm multiplies by (1 + w)
        self.layers = []
        for i, full in enumerate(self.cfg["full_attention"]):
            p = f"layers.{i}."
            L = {"attn": full, "in_norm": 1 + get(p + "input_layernorm.weight", f32),
                 "post_norm": 1 + get(p + "post_attention_layernorm.weight", f32)}
            if full:
                a = p + "self_attn."
                L["qkv"] = torch.cat([get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")])
                L["o"] = get(a + "o_proj.weight")
                L["q_norm"], L["k_norm"] = 1 + get(a + "q_norm.weight", f32), 1 + get(a + "k_norm.weight", f32)
            else:
                g = p + "linear_attn."
                L["in_proj"] = torch.cat([get(g + n + ".weight") for n in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                           "in_proj_a")])
                L["out"] = get(g + "out_proj.weight")
                L["conv"] = get(g + "conv1d.weight").reshape(self.C, self.W).contiguous()
                L["A_log"], L["dt_bias"] = get(g + "A_log", f32), get(g + "dt_bias", f32)
                L["norm"] = get(g + "norm.weight", f32)
            L["gate_up"] = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
            L["down"] = get(p + "mlp.down_proj.weight")
            self.layers.append(L)

    def _allocate(self) -> None:
        dev, n = self.device, self.max_context
        # RoPE as x * cos + x[perm] * sin over the whole head: perm swaps the two rotated halves, the
        # sign of the first half's sine is folded into the table, and dims past `rot` get cos 1, sin 0
        half, hd = self.rot // 2, self.hd
        inv_freq = 1.0 / self.cfg["rope_theta"] ** (torch.arange(0, self.rot, 2, dtype=torch.float64) / self.rot)
        ang = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]
        cos, sin = torch.ones(n, hd, dtype=torch.float64), torch.zeros(n, hd, dtype=torch.float64)
        cos[:, : self.rot] = torch.cos(ang).repeat(1, 2)
        sin[:, :half], sin[:, half: self.rot] = -torch.sin(ang), torch.sin(ang)
        self.rope_table = torch.stack([cos, sin], 1).to(dev, torch.float32)  # [n, 2, hd], indexed by position
        self.rope_perm = torch.cat([torch.arange(half, self.rot), torch.arange(half), torch.arange(self.rot, hd)]).to(dev)
        for L in self.layers:
            if L["attn"]:
                L["k_cache"] = torch.zeros(n, self.Hkv, self.hd, device=dev, dtype=self.dtype)
                L["v_cache"] = torch.zeros(n, self.Hkv, self.hd, device=dev, dtype=self.dtype)
            else:
                L["window"] = torch.zeros(1, self.C, self.W, device=dev, dtype=self.dtype)
                L["state"] = torch.zeros(1, self.HV, self.dk, self.dv, device=dev, dtype=torch.float32)
        self.token = torch.zeros(1, device=dev, dtype=torch.long)  # the step's input token
        self.pos = torch.zeros(1, device=dev, dtype=torch.long)  # its position
        self.used = torch.ones(1, device=dev, dtype=torch.int32)  # pos + 1: the cache rows attention reads
        self.step_index = torch.zeros(1, device=dev, dtype=torch.long)
        self.out_tokens = torch.zeros(self.max_new_tokens, device=dev, dtype=torch.long)

    # -- pieces shared by prefill and decode --
    def _rope(self, x, cos_sin):
        """Rotates the first `rot` dims of x [T, heads, hd] (the two-halves layout); cos_sin [T, 2, hd]."""
        xf = x.float()
        rotated = torch.addcmul(xf * cos_sin[:, None, 0], xf.index_select(-1, self.rope_perm), cos_sin[:, None, 1])
        return rotated.to(x.dtype)

    def _qkv_heads(self, L, h, cos_sin):
        """The attention projections of h [T, H]: q and k normed and rotated [T, heads, hd], v, and
        the output gate [T, Hq, hd]."""
        T, hd = h.shape[0], self.hd
        qkv = F.linear(h, L["qkv"])
        qg = qkv[:, : self.Hq * 2 * hd].view(T, self.Hq, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:]
        k = qkv[:, self.Hq * 2 * hd: (self.Hq * 2 + self.Hkv) * hd].view(T, self.Hkv, hd)
        v = qkv[:, (self.Hq * 2 + self.Hkv) * hd:].view(T, self.Hkv, hd)
        q = self.kernels.add_rms_norm(None, q.contiguous(), L["q_norm"], self.eps)[0]
        k = self.kernels.add_rms_norm(None, k.contiguous(), L["k_norm"], self.eps)[0]
        qk = self._rope(torch.cat([q, k], 1), cos_sin)
        return qk[:, : self.Hq], qk[:, self.Hq:], v, gate

    def _gdn_split(self, proj):
        """in_proj's output [T, C + vd + 2HV] as the conv's input (q|k|v) [T, C], the output gate z
        [T, vd], and the raw b (beta) and a (decay) logits [T, HV]."""
        C, vd, HV = self.C, self.HV * self.dv, self.HV
        return proj[:, :C], proj[:, C: C + vd], proj[:, C + vd: C + vd + HV], proj[:, C + vd + HV:]

    def _gdn_core(self, L, conv_out, z, b, a):
        T = conv_out.shape[0]
        HK, HV, dk, dv = self.HK, self.HV, self.dk, self.dv
        # the fused kernel addresses [1, T, heads, dim] as dense: copies where T > 1 (no-ops at T = 1)
        q = conv_out[:, : HK * dk].contiguous().view(1, T, HK, dk)
        k = conv_out[:, HK * dk: 2 * HK * dk].contiguous().view(1, T, HK, dk)
        v = conv_out[:, 2 * HK * dk:].contiguous().view(1, T, HV, dv)
        a, b = a.contiguous().view(1, T, HV), b.contiguous().view(1, T, HV)
        o = self.kernels.gated_delta_rule(q, k, v, a, b, L["A_log"], L["dt_bias"], L["state"], dk ** -0.5)
        y = self.kernels.gated_rms_norm(o.reshape(T * HV, dv), z.reshape(T * HV, dv), L["norm"], self.eps)
        return F.linear(y.reshape(T, HV * dv), L["out"])

    def _mlp(self, L, h):
        gu = F.linear(h, L["gate_up"])
        return F.linear(self.kernels.swiglu(gu[:, : self.I], gu[:, self.I:]), L["down"])

    # -- prefill --
    @torch.no_grad()
    def prefill(self, prompt: list[int]) -> torch.Tensor:
        """Resets the sequence and runs the prompt: caches and states filled, the greedy next token
        in place as the decode step's input. Returns the last position's logits [vocab] (fp32)."""
        T = len(prompt)
        if not 0 < T < self.max_context:
            raise InvalidArgumentError(f"prompt of {T} tokens for a context of {self.max_context}")
        ids = torch.tensor(prompt, device=self.device, dtype=torch.long)
        x, delta = F.embedding(ids, self.embed), None
        cos_sin = self.rope_table[:T]
        for L in self.layers:
            h, x = self.kernels.add_rms_norm(delta, x, L["in_norm"], self.eps)
            if L["attn"]:
                q, k, v, gate = self._qkv_heads(L, h, cos_sin)
                L["k_cache"][:T], L["v_cache"][:T] = k, v
                rep = self.Hq // self.Hkv
                o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.repeat_interleave(rep, 1).transpose(0, 1)[None],
                                                   v.repeat_interleave(rep, 1).transpose(0, 1)[None], is_causal=True,
                                                   scale=self.hd ** -0.5)[0].transpose(0, 1)
                delta = F.linear((o * torch.sigmoid(gate)).reshape(T, self.Hq * self.hd), L["o"])
            else:
                mixed, z, b, a = self._gdn_split(F.linear(h, L["in_proj"]))
                # causal depthwise conv over the prompt from a zero window; the window keeps the last W inputs
                padded = torch.cat([torch.zeros(self.W - 1, self.C, device=self.device, dtype=self.dtype), mixed])
                conv = F.conv1d(padded.t()[None].float(), L["conv"].float()[:, None, :], groups=self.C)[0].t()
                L["window"].copy_(torch.cat([torch.zeros(1, self.C, device=self.device, dtype=self.dtype), padded])
                                  [-self.W:].t()[None])
                L["state"].zero_()
                delta = self._gdn_core(L, F.silu(conv).to(self.dtype), z, b, a)
            h, x = self.kernels.add_rms_norm(delta, x, L["post_norm"], self.eps)
            delta = self._mlp(L, h)
        h = self.kernels.add_rms_norm(delta[-1:], x[-1:], self.final_norm, self.eps)[0]
        logits = F.linear(h, self.lm_head)[0]
        self.token.copy_(logits.argmax(-1, keepdim=True))
        self.pos.fill_(T)
        self.used.fill_(T + 1)
        self.step_index.zero_()
        return logits.float()

    # -- decode --
    def _step(self) -> torch.Tensor:
        """One decode step on the static buffers: the input token at self.pos in, the greedy next
        token out (into self.token and self.out_tokens); pos advances. Returns the logits [1, vocab]."""
        x, delta = F.embedding(self.token, self.embed), None
        cos_sin = self.rope_table.index_select(0, self.pos)
        for L in self.layers:
            h, x = self.kernels.add_rms_norm(delta, x, L["in_norm"], self.eps)
            if L["attn"]:
                q, k, v, gate = self._qkv_heads(L, h, cos_sin)
                L["k_cache"].index_copy_(0, self.pos, k)
                L["v_cache"].index_copy_(0, self.pos, v)
                o = self.kernels.decode_attention(q[0], L["k_cache"], L["v_cache"], self.used, self.hd ** -0.5)
                delta = F.linear((o * torch.sigmoid(gate[0])).reshape(1, self.Hq * self.hd), L["o"])
            else:
                mixed, z, b, a = self._gdn_split(F.linear(h, L["in_proj"]))
                conv_out = self.kernels.conv_step(mixed, L["window"], L["conv"])
                delta = self._gdn_core(L, conv_out, z, b, a)
            h, x = self.kernels.add_rms_norm(delta, x, L["post_norm"], self.eps)
            delta = self._mlp(L, h)
        h = self.kernels.add_rms_norm(delta, x, self.final_norm, self.eps)[0]
        logits = F.linear(h, self.lm_head)
        self.token.copy_(logits.argmax(-1))
        self.out_tokens.index_copy_(0, self.step_index, self.token)
        self.pos.add_(1)
        self.used.add_(1)
        self.step_index.add_(1)
        return logits

    @torch.no_grad()
    def capture(self) -> None:
        """Warms the step up (Triton compilation and autotuning happen outside the graph) and
        captures it. The warm-up steps leave garbage in the caches and states: prefill resets them."""
        if not self.use_graph or self.graph is not None:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.pos.zero_()
                self.used.fill_(1)
                self.step_index.zero_()
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.pos.zero_()
        self.used.fill_(1)
        self.step_index.zero_()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._graph_logits = self._step()
        torch.cuda.synchronize()

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """One decode step (a graph replay when captured). Returns its logits [vocab], a view that
        the next step overwrites."""
        if self.graph is not None:
            self.graph.replay()
            return self._graph_logits[0]
        return self._step()[0]

    def set_token(self, token: int) -> None:
        """Replaces the next step's input token (teacher forcing)."""
        self.token.fill_(int(token))

    @torch.no_grad()
    def generate(self, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
        """Greedy: the prompt's next token, then new_tokens - 1 decode steps queued back to back.
        Returns the tokens and the seconds the decode steps took (wall clock, synchronised)."""
        import time

        if not 0 < new_tokens <= self.max_new_tokens + 1:
            raise InvalidArgumentError(f"new_tokens must be in 1..{self.max_new_tokens + 1}, got {new_tokens}")
        if len(prompt) + new_tokens > self.max_context:
            raise InvalidArgumentError(f"prompt + new tokens exceed the context of {self.max_context}")
        self.capture()
        first = int(self.prefill(prompt).argmax())
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.step()
        sync()
        seconds = time.perf_counter() - t0
        return [first] + self.out_tokens[: new_tokens - 1].tolist(), seconds

    @torch.no_grad()
    def teacher_forced_logits(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """The logits [len(tokens), vocab] (fp32, on the CPU) that predict each of `tokens` after
        the prompt and the tokens before it: the prefill's last row, then a decode step per token."""
        if len(prompt) + len(tokens) > self.max_context or len(tokens) - 1 > self.max_new_tokens:
            raise InvalidArgumentError("prompt + tokens exceed the peer's context or output buffer")
        self.capture()
        rows = [self.prefill(prompt).cpu()]
        for t in tokens[:-1]:
            self.set_token(t)
            rows.append(self.step().float().cpu())
        return torch.stack(rows)
