"""Shared pieces of the benchmarks: ceilings measured on the device, timing, random checkpoints."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

# Model shapes (text decoder). OCRIA-1 = Qwen3.5-4B text; 0.8B = Qwen3.5-0.8B text.
SHAPES: dict[str, dict] = {
    "ocria1-4b": dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=9216, num_attention_heads=16,
                      num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                      linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=True),
    "qwen3.5-0.8b": dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=3584, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                         linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=True),
}


# The OCRia-1 (Qwen3.5-4B) vision encoder.
OCRIA1_VISION: dict = dict(depth=24, hidden_size=1024, num_heads=16, intermediate_size=4096, out_hidden_size=2560,
                           patch_size=16, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
                           num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh", model_type="qwen3_5_vision",
                           rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
# transformers' defaults for Qwen3.5 VLM configs
VISION_TOKENS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                     vision_end_token_id=248054)


def full_config(shape: dict, max_pos: int = 65536) -> dict:
    c = dict(shape)
    c.update(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], hidden_act="silu", rms_norm_eps=1e-6,
             max_position_embeddings=max_pos, linear_conv_kernel_dim=4, attention_bias=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                              "mrope_section": [11, 11, 10], "mrope_interleaved": True},
             partial_rotary_factor=0.25, torch_dtype="bfloat16", eos_token_id=None)
    return c


def layer_is_attention(i: int) -> bool:
    return (i + 1) % 4 == 0


def weight_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a text checkpoint (transformers key names)."""
    H, I, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    Hq, Hkv = c["num_attention_heads"], c["num_key_value_heads"]
    HK, HV, dk, dv = c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
    C = 2 * HK * dk + HV * dv
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], H), "model.norm.weight": (H,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = (H,)
        s[p + "post_attention_layernorm.weight"] = (H,)
        if layer_is_attention(i):
            s[p + "self_attn.q_proj.weight"] = (Hq * hd * 2, H)
            s[p + "self_attn.k_proj.weight"] = (Hkv * hd, H)
            s[p + "self_attn.v_proj.weight"] = (Hkv * hd, H)
            s[p + "self_attn.o_proj.weight"] = (H, Hq * hd)
            s[p + "self_attn.q_norm.weight"] = (hd,)
            s[p + "self_attn.k_norm.weight"] = (hd,)
        else:
            g = p + "linear_attn."
            s[g + "in_proj_qkv.weight"] = (C, H)
            s[g + "in_proj_z.weight"] = (HV * dv, H)
            s[g + "in_proj_b.weight"] = (HV, H)
            s[g + "in_proj_a.weight"] = (HV, H)
            s[g + "out_proj.weight"] = (H, HV * dv)
            s[g + "conv1d.weight"] = (C, 1, 4)
            s[g + "A_log"] = (HV,)
            s[g + "dt_bias"] = (HV,)
            s[g + "norm.weight"] = (dv,)
        s[p + "mlp.gate_proj.weight"] = (I, H)
        s[p + "mlp.up_proj.weight"] = (I, H)
        s[p + "mlp.down_proj.weight"] = (H, I)
    return s


def vision_weight_shapes(v: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the vision encoder (transformers key names)."""
    D, I, M = v["hidden_size"], v["intermediate_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2
    p = "model.visual."
    s: dict[str, tuple[int, ...]] = {
        p + "patch_embed.proj.weight": (D, v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["patch_size"]),
        p + "patch_embed.proj.bias": (D,),
        p + "pos_embed.weight": (v["num_position_embeddings"], D),
        p + "merger.norm.weight": (D,), p + "merger.norm.bias": (D,),
        p + "merger.linear_fc1.weight": (M, M), p + "merger.linear_fc1.bias": (M,),
        p + "merger.linear_fc2.weight": (v["out_hidden_size"], M), p + "merger.linear_fc2.bias": (v["out_hidden_size"],),
    }
    for i in range(v["depth"]):
        b = f"{p}blocks.{i}."
        for n in ("norm1", "norm2"):
            s[b + n + ".weight"], s[b + n + ".bias"] = (D,), (D,)
        for n, (o, k) in {"attn.qkv": (3 * D, D), "attn.proj": (D, D), "mlp.linear_fc1": (I, D), "mlp.linear_fc2": (D, I)}.items():
            s[b + n + ".weight"], s[b + n + ".bias"] = (o, k), (o,)
    return s


def make_random_checkpoint(shape_name: str, directory: Path, seed: int = 0, vision: dict | None = None,
                           device: str = "cuda") -> Path:
    """A BF16 checkpoint of random weights drawn on `device` (scaled so activations stay O(1)); with
    `vision`, a Qwen3_5ForConditionalGeneration checkpoint holding that vision encoder too."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "config.json").exists():
        return directory
    c = full_config(SHAPES[shape_name])
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = weight_shapes(c)
    if vision is not None:
        shapes = {k.replace("model.", "model.language_model.", 1): v for k, v in shapes.items()}
        shapes.update(vision_weight_shapes(vision))
    tensors = {}
    for name, shp in shapes.items():
        if "visual" in name and ".norm" in name and name.endswith("weight"):
            t = torch.ones(shp, device=device)  # LayerNorm scale
        elif name.endswith("A_log"):
            t = torch.log(torch.rand(shp, device=device, generator=g) * 15 + 1)
        elif name.endswith("dt_bias"):
            t = torch.ones(shp, device=device)
        elif name.endswith("norm.weight") and "linear_attn" in name:
            t = torch.ones(shp, device=device)
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t = torch.zeros(shp, device=device)
        elif name.endswith("conv1d.weight"):
            t = torch.randn(shp, device=device, generator=g) * 0.3
        elif name.endswith(".bias"):
            t = torch.zeros(shp, device=device)
        elif name.endswith("pos_embed.weight"):
            t = torch.randn(shp, device=device, generator=g) * 0.02
        else:
            fan_in = 1
            for d in shp[1:]:
                fan_in *= d
            t = torch.randn(shp, device=device, generator=g) * fan_in**-0.5
        tensors[name] = t.to(torch.bfloat16).cpu()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if vision is not None:
        c = dict(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"], text_config=c,
                 vision_config=vision, tie_word_embeddings=c["tie_word_embeddings"], **VISION_TOKENS)
        # Qwen3.5's image processor: the model's patch geometry, pixels in [-1, 1], up to 4096^2 px.
        processor = dict(image_processor_type="Qwen2VLImageProcessorFast", patch_size=vision["patch_size"],
                         temporal_patch_size=vision["temporal_patch_size"], merge_size=vision["spatial_merge_size"],
                         image_mean=[0.5] * 3, image_std=[0.5] * 3, do_rescale=True, rescale_factor=1 / 255,
                         do_normalize=True, do_convert_rgb=True, resample=3,
                         size={"shortest_edge": 65536, "longest_edge": 16777216})
        (directory / "preprocessor_config.json").write_text(json.dumps(processor, indent=1))
    (directory / "config.json").write_text(json.dumps(c, indent=1))
    return directory


def bytes_per_decode_step(c: dict, context: int, quant: str = "bf16") -> dict[str, float]:
    """The fewest bytes one batch-1 decode step must move: every weight once (BF16, or as `quant`
    stores it: bench/quant_checkpoint.py; the embedding table only for its one row unless tied, when
    it is the LM head), the KV cache up to `context`, and the DeltaNet states read and written (fp32)."""
    from quant_checkpoint import linear_bytes, module_format

    shapes = weight_shapes(c)
    weights = 0
    for name, shp in shapes.items():
        if name == "model.embed_tokens.weight":
            continue
        if len(shp) == 2:
            weights += linear_bytes(*shp, module_format(name.removesuffix(".weight"), quant))
        else:
            n = 1
            for d in shp:
                n *= d
            weights += 2 * n
    # LM head (tied or not, it is read once)
    weights += linear_bytes(c["vocab_size"], c["hidden_size"], module_format("lm_head", quant))
    n_attn = sum(layer_is_attention(i) for i in range(c["num_hidden_layers"]))
    n_gdn = c["num_hidden_layers"] - n_attn
    kv = n_attn * context * 2 * c["num_key_value_heads"] * c["head_dim"] * 2
    HV, dk, dv = c["linear_num_value_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
    conv = 2 * c["linear_num_key_heads"] * dk + HV * dv
    state = n_gdn * (HV * dk * dv * 4 * 2 + conv * 3 * 4 * 2)
    return {"weights": float(weights), "kv_cache": float(kv), "gdn_state": float(state), "total": float(weights + kv + state)}


def linear_params(c: dict) -> int:
    """Weights that multiply each token (for prefill FLOPs): every projection and the LM head."""
    total = 0
    for name, shp in weight_shapes(c).items():
        if len(shp) == 2 and name != "model.embed_tokens.weight":
            total += shp[0] * shp[1]
    return total + c["vocab_size"] * c["hidden_size"]


def measure_copy_bandwidth(gib: float = 2.0, reps: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (median)."""
    import torch

    n = int(gib * (1 << 30)) // 2
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    times = cuda_times(lambda: b.copy_(a), reps)
    return 2 * a.numel() * 2 / statistics.median(times)


def measure_matmul_rate(n: int = 8192, reps: int = 20) -> float:
    """BF16 n x n x n matrix product through torch (cuBLAS), FLOP/s on random data (median)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    times = cuda_times(lambda: a @ b, reps)
    return 2 * n**3 / statistics.median(times)


def cuda_times(fn, reps: int, warmup: int = 3) -> list[float]:
    """Seconds per call, timed with CUDA events after a warm-up."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) / 1e3)
    return out


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def profiled_trace_events(fn) -> list[dict]:
    """Runs fn() under torch.profiler (CPU + CUDA activities; CUPTI also records ocria_rt's kernels,
    those inside replayed CUDA graphs included) and returns the Chrome trace's events."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return json.loads(trace.read_text())["traceEvents"]
