"""Every CUDA op against the CPU backend, op by op (llama.cpp test-backend-ops style).

Fresh random inputs per case, several shapes including odd ones that take the fallback paths
(K or strides not a multiple of 8, GQA groups that are not a power of two, T = 1, 3, 16, 100, long
contexts). Inputs are rounded to BF16 first, so both backends see the same numbers and the
tolerances measure the kernels (BF16 outputs, fp32 accumulation), not the input rounding. Outputs
are poisoned with NaN by OpRunner before each op, and relerr() fails on any NaN left behind.
Skipped (by tests/conftest.py) where ocria_rt has no CUDA support or no GPU is visible.
"""

from __future__ import annotations

import numpy as np
import pytest

import reference_ops as ref
from support import check_post_mailbox, relerr
from ocria_rt import _core

pytestmark = pytest.mark.gpu

OUT_TOL = 1e-2  # a BF16 output against the fp32 reference
STATE_TOL = 2e-3  # fp32 state through BF16 inputs
CHAIN_TOL = 2e-2  # several BF16 ops in a row against the fp32 reference
# The chunked GDN kernels' state: BF16 tensor-core products with the terms that feed the state split
# into hi + lo BF16 parts; a NumPy model of the kernels gives ~5e-5 on these inputs.
CHUNKED_STATE_TOL = 5e-4


@pytest.fixture(scope="module")
def cpu():
    return _core.OpRunner("cpu")


@pytest.fixture(scope="module")
def gpu():
    return _core.OpRunner("cuda")


def bf16(a: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest BF16 (ties to even), kept as float32."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def randn(rng, *shape, scale=1.0):
    return bf16((rng.standard_normal(shape) * scale).astype(np.float32))


# ---- linear: skinny GEMM (M <= 16), CUTLASS (M > 16), fallback (K % 8 != 0) ----

LINEAR_SHAPES = [
    (1, 64, 96), (1, 2560, 2560), (2, 4096, 200), (3, 33, 17), (4, 1000, 300), (8, 264, 1000), (9, 512, 31),
    (16, 128, 250), (16, 2560, 1040), (17, 256, 136), (70, 257, 31), (100, 512, 1000), (256, 2560, 512),
    (300, 100, 77),
]


@pytest.mark.parametrize("M,K,N", LINEAR_SHAPES)
def test_linear(cpu, gpu, M, K, N):
    rng = np.random.default_rng(M * 7919 + K * 31 + N)
    x, w = randn(rng, M, K), randn(rng, N, K, scale=K**-0.5)
    assert relerr(gpu.linear(x, w), cpu.linear(x, w)) <= OUT_TOL


def test_embedding(cpu, gpu):
    rng = np.random.default_rng(1)
    for V, D, T in [(50, 24, 13), (1000, 2560, 5), (77, 33, 1)]:
        table = randn(rng, V, D)
        ids = rng.integers(0, V, T).astype(np.int32)
        np.testing.assert_array_equal(gpu.embedding(table, ids), cpu.embedding(table, ids))


# Rows beyond what a block holds in registers (2 packs per thread, 512 threads) run on in a loop:
# (2, 9000) and (1, 20000) in 8-element packs, (1, 20001) and (3, 1500) element by element.
NORM_SHAPES = [(1, 2560), (5, 37), (33, 256), (3, 4096), (100, 1024), (2, 9000), (1, 20000), (1, 20001), (3, 1500)]


@pytest.mark.parametrize("R,D", NORM_SHAPES)
def test_norms(cpu, gpu, R, D):
    rng = np.random.default_rng(R + D)
    x, w = randn(rng, R, D, scale=3), randn(rng, D, scale=0.1)
    assert relerr(gpu.rms_norm(x, w, 1e-6), cpu.rms_norm(x, w, 1e-6)) <= OUT_TOL
    assert relerr(gpu.rms_norm(x, None, 1e-6), cpu.rms_norm(x, None, 1e-6)) <= OUT_TOL  # the unit weight


@pytest.mark.parametrize("T,I", [(7, 40), (1, 9216), (16, 9216), (100, 512)])
def test_silu_mul(cpu, gpu, T, I):
    rng = np.random.default_rng(T + I)
    gu = randn(rng, T, 2 * I, scale=2)  # the GLU layout: the op's reading of the columns
    assert relerr(gpu.silu_mul(gu), cpu.silu_mul(gu)) <= OUT_TOL


def glu_case(seed: int, T: int, K: int, I: int):
    """x [T, K] and a gate / up weight [2I, K] in the GLU layout."""
    rng = np.random.default_rng(seed)
    x = randn(rng, T, K)
    w = ref.glu_layout(randn(rng, I, K, scale=2 * K**-0.5), randn(rng, I, K, scale=2 * K**-0.5))
    return x, w


# T, K, I: OCRIA-1's gate_up (persistent blocks), one and two token tiles, one row tile (I = 8),
# K % 8 != 0 (the fallback GEMM, then silu_mul), and a prefill size (CUTLASS, then silu_mul).
GLU_CASES = [(1, 2560, 9216), (5, 72, 40), (16, 1024, 512), (3, 96, 8), (2, 33, 24), (40, 512, 256)]


@pytest.mark.parametrize("T,K,I", GLU_CASES)
def test_linear_glu(cpu, gpu, T, K, I):
    """Against the CPU's linear + silu_mul; decode sizes apply the activation in the GEMM's store,
    and are bit for bit the GPU's own linear + silu_mul (the same sums, rounded to BF16 alike)."""
    x, w = glu_case(T + K + I, T, K, I)
    got = gpu.linear_glu(x, w)
    assert relerr(got, cpu.linear_glu(x, w)) <= OUT_TOL
    np.testing.assert_array_equal(got, gpu.silu_mul(gpu.linear(x, w)))


# ---- skinny GEMM split-K: K in ranges over several blocks, the last block of a tile sums them ----

# M, K, N, forced splits. Odd N (a partial last row tile), K a multiple of 8 but not of 32 (a partial
# last chunk), more splits than chunks per warp; both block configurations (16 warps where
# tiles * splits < 4 * SMs, else 8) with one and two token tiles (M <= 8, M > 8); 9 splits of K = 264
# (9 chunks: one chunk per split, most warps idle). The first two are OCRIA-1's o_proj and a fused
# in_proj shape.
SPLITK_CASES = [
    (1, 4096, 2560, 4), (3, 1000, 999, 3), (8, 2632, 1001, 5), (9, 4104, 77, 7), (16, 9216, 2560, 4),
    (3, 2560, 12352, 2), (16, 264, 250, 9),
]


@pytest.fixture(scope="module")
def gpu_with_env():
    """CUDA runners whose backend was constructed with one environment variable set (the skinny-GEMM
    switches are read then), one per (variable, value)."""
    runners = {}

    def get(var: str, value):
        key = (var, str(value))
        if key not in runners:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(var, str(value))
                runners[key] = _core.OpRunner("cuda")
        return runners[key]

    return get


@pytest.mark.parametrize("out_f32", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("M,K,N,ksplit", SPLITK_CASES)
def test_linear_splitk(cpu, gpu_with_env, M, K, N, ksplit, with_bias, out_f32):
    """Forced split-K against the CPU; three calls on one backend give the same bits (the tile
    counters are back at zero after each launch, and the partials are summed in a fixed order)."""
    rng = np.random.default_rng(M * 7919 + K * 31 + N + ksplit)
    x, w = randn(rng, M, K), randn(rng, N, K, scale=K**-0.5)
    bias = randn(rng, N) if with_bias else None
    want = cpu.linear(x, w, bias)
    gpu = gpu_with_env("OCRIA_RT_SKINNY_KSPLIT", ksplit)
    first = gpu.linear(x, w, bias, out_f32)
    assert relerr(first, want) <= OUT_TOL
    for _ in range(2):
        np.testing.assert_array_equal(gpu.linear(x, w, bias, out_f32), first)


# ---- skinny GEMM cluster split-K: K in ranges over the blocks of a cluster, block 0 sums them ----

# M, K, N, blocks per cluster: OCRIA-1's o_proj / MLP down shapes, odd N, K not a multiple of 32, one
# and two token tiles, and K = 40 (2 chunks) with 4 asked for, which runs without a cluster.
CLUSTER_CASES = [(1, 4096, 2560, 2), (1, 4096, 2560, 4), (16, 9216, 2560, 4), (3, 1000, 999, 2), (9, 2632, 1001, 4),
                 (8, 4104, 77, 4), (5, 40, 33, 4)]


@pytest.mark.parametrize("out_f32", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("M,K,N,cs", CLUSTER_CASES)
def test_linear_cluster_splitk(cpu, gpu_with_env, M, K, N, cs, with_bias, out_f32):
    """Cluster split-K against the CPU; repeated calls give the same bits (block 0 adds the partial
    tiles in split order)."""
    rng = np.random.default_rng(M * 7919 + K * 31 + N + 100 * cs)
    x, w = randn(rng, M, K), randn(rng, N, K, scale=K**-0.5)
    bias = randn(rng, N) if with_bias else None
    gpu = gpu_with_env("OCRIA_RT_SKINNY_CLUSTER", cs)
    first = gpu.linear(x, w, bias, out_f32)
    assert relerr(first, cpu.linear(x, w, bias)) <= OUT_TOL
    for _ in range(2):
        np.testing.assert_array_equal(gpu.linear(x, w, bias, out_f32), first)


# linear_glu's decode path with K split over the grid (OCRIA_RT_SKINNY_KSPLIT) or over the blocks of
# a cluster (OCRIA_RT_SKINNY_CLUSTER): T, K, I, splits.
GLU_SPLIT_CASES = [("OCRIA_RT_SKINNY_KSPLIT", T, K, I, n)
                   for T, K, I, n in [(1, 9216, 1280, 4), (3, 1000, 504, 3), (9, 2632, 128, 5), (16, 9216, 1280, 4)]]
GLU_SPLIT_CASES += [("OCRIA_RT_SKINNY_CLUSTER", T, K, I, n)
                    for T, K, I, n in [(1, 9216, 1280, 4), (3, 1000, 504, 2), (16, 9216, 1280, 2)]]


@pytest.mark.parametrize("var,T,K,I,splits", GLU_SPLIT_CASES)
def test_linear_glu_split(cpu, gpu_with_env, var, T, K, I, splits):
    """Against the CPU; a second call gives the same bits, and so does the same backend's linear +
    silu_mul (the partials are summed in a fixed order before the activation)."""
    x, w = glu_case(T + K + I + splits, T, K, I)
    gpu = gpu_with_env(var, splits)
    first = gpu.linear_glu(x, w)
    assert relerr(first, cpu.linear_glu(x, w)) <= OUT_TOL
    np.testing.assert_array_equal(gpu.linear_glu(x, w), first)
    np.testing.assert_array_equal(gpu.silu_mul(gpu.linear(x, w)), first)


@pytest.mark.parametrize("M,K,N", [(1, 4096, 2560), (8, 9216, 2560), (1, 3584, 1024), (1, 1024, 7168), (1, 2048, 1600),
                                   (16, 9216, 2560), (9, 4096, 2560), (16, 1024, 7168)])
def test_linear_cluster_default(gpu_with_env, M, K, N):
    """Unset (or empty), OCRIA_RT_SKINNY_CLUSTER takes 2 blocks per cluster for the shapes of few row
    tiles above 8 tokens (where they measured faster) and none up to 8, also for the 4B's N = 2560
    (160 tiles on 132 SMs), where the decode step measured slower with them: bit for bit the launch
    of an explicit 2 resp. 0, and not that of the other (F32 output: the two launches sum in different
    orders, so a wrong choice shows)."""
    rng = np.random.default_rng(M + K + N)
    x, w = randn(rng, M, K), randn(rng, N, K, scale=K**-0.5)
    unset = gpu_with_env("OCRIA_RT_SKINNY_CLUSTER", "").linear(x, w, None, True)
    chosen, other = ("2", "0") if M > 8 else ("0", "2")
    np.testing.assert_array_equal(unset, gpu_with_env("OCRIA_RT_SKINNY_CLUSTER", chosen).linear(x, w, None, True))
    assert not np.array_equal(unset, gpu_with_env("OCRIA_RT_SKINNY_CLUSTER", other).linear(x, w, None, True))


# ---- skinny GEMM with persistent blocks: each block streams several row tiles ----

# M, K, N: more row tiles than 4 blocks per SM (the 8-warp configuration, where persistent blocks
# apply): OCRIA-1's fused in_proj and gate_up, an odd N with a partial last tile, K not a multiple of
# 32, and K = 40 (2 chunks for 8 warps: most warps load zeros) with N = 20000.
PERSISTENT_CASES = [(1, 2560, 12352), (16, 2560, 18432), (3, 1000, 9001), (9, 2632, 10007), (5, 40, 20000)]


@pytest.mark.parametrize("out_f32", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("M,K,N", PERSISTENT_CASES)
def test_linear_persistent(cpu, gpu_with_env, M, K, N, with_bias, out_f32):
    """Persistent blocks against the CPU and bit for bit against one block per tile (the same sums
    in the same order, only the block that computes a tile changes)."""
    rng = np.random.default_rng(M * 7919 + K * 31 + N)
    x, w = randn(rng, M, K), randn(rng, N, K, scale=K**-0.5)
    bias = randn(rng, N) if with_bias else None
    got = gpu_with_env("OCRIA_RT_SKINNY_PERSISTENT", 1).linear(x, w, bias, out_f32)
    assert relerr(got, cpu.linear(x, w, bias)) <= OUT_TOL
    np.testing.assert_array_equal(got, gpu_with_env("OCRIA_RT_SKINNY_PERSISTENT", 0).linear(x, w, bias, out_f32))


@pytest.mark.parametrize("T,K,I", [(1, 1000, 4504), (16, 2632, 5000), (9, 2560, 9216)])
def test_linear_glu_persistent(cpu, gpu_with_env, T, K, I):
    """linear_glu's decode path with persistent blocks (2I large enough for them): the activation of
    every tile a block takes, not only its last."""
    x, w = glu_case(T + K + I, T, K, I)
    got = gpu_with_env("OCRIA_RT_SKINNY_PERSISTENT", 1).linear_glu(x, w)
    assert relerr(got, cpu.linear_glu(x, w)) <= OUT_TOL
    np.testing.assert_array_equal(got, gpu_with_env("OCRIA_RT_SKINNY_PERSISTENT", 0).linear_glu(x, w))


# ---- a residual block's ends: the RMSNorm scale and the residual add in the skinny GEMM ----

def test_fold_norm_weight(cpu, gpu):
    """The fold rounds W * (1 + w) once, to BF16: exactly the CPU's fp32 fold, rounded."""
    rng = np.random.default_rng(11)
    w, nw = randn(rng, 300, 2560, scale=0.05), randn(rng, 2560, scale=0.2)
    np.testing.assert_array_equal(gpu.fold_norm_weight(w, nw), bf16(cpu.fold_norm_weight(w, nw)))


# M, K, N (GLU: N = 2I): the persistent (OCRIA-1's in_proj, qkv, gate_up), 16-warp (N = 2560, 1024:
# few row tiles) and 8-warp configurations with one and two token tiles, odd N (a partial last tile),
# K not a multiple of 32; M > 16 and K % 8 != 0 take the default (norm through memory, then the GEMM).
NORM_LINEAR_CASES = [(1, 2560, 12352), (1, 2560, 10240), (16, 2560, 10240), (1, 2560, 2560), (3, 1000, 999),
                     (9, 2632, 1001), (8, 1024, 5120), (5, 40, 20000), (17, 256, 136), (2, 33, 17), (40, 512, 1000)]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("M,K,N", NORM_LINEAR_CASES)
def test_rms_norm_linear(cpu, gpu_with_env, M, K, N, with_bias):
    """rms_norm(x, unit) · W^T against the CPU (x the un-normed residual, of large and varied scale
    per token), `normed` left untouched where the GEMM scales its sums (M <= 16, K % 8 == 0) and formed
    otherwise; split-K asked for does not apply (every block needs the whole row), and persistent
    blocks give the bits of one block per tile."""
    rng = np.random.default_rng(M * 7919 + K * 31 + N)
    x = bf16(randn(rng, M, K) * rng.uniform(0.5, 40, (M, 1)).astype(np.float32))
    w, bias = randn(rng, N, K, scale=K**-0.5), (randn(rng, N) if with_bias else None)
    want, want_normed = cpu.rms_norm_linear(x, w, 1e-6, bias)
    got, normed = gpu_with_env("OCRIA_RT_SKINNY_KSPLIT", "").rms_norm_linear(x, w, 1e-6, bias)
    assert relerr(got, want) <= OUT_TOL
    if M <= 16 and K % 8 == 0:
        assert np.isnan(normed).all()
    else:
        assert relerr(normed, want_normed) <= OUT_TOL
    np.testing.assert_array_equal(gpu_with_env("OCRIA_RT_SKINNY_KSPLIT", 3).rms_norm_linear(x, w, 1e-6, bias)[0], got)
    for persistent in ("0", "1"):
        np.testing.assert_array_equal(
            gpu_with_env("OCRIA_RT_SKINNY_PERSISTENT", persistent).rms_norm_linear(x, w, 1e-6, bias)[0], got)


@pytest.mark.parametrize("T,K,I", GLU_CASES + [(9, 2560, 9216), (1, 1024, 3584)])
def test_rms_norm_linear_glu(cpu, gpu, T, K, I):
    """silu(gate) * up of rms_norm(x, unit) · W^T against the CPU: the scale applied before the
    activation (OCRIA-1's and Qwen3.5-0.8B's gate_up among the shapes)."""
    x, w = glu_case(T + K + I + 1, T, K, I)
    x = bf16(x * np.random.default_rng(T).uniform(0.5, 40, (T, 1)).astype(np.float32))
    got, _ = gpu.rms_norm_linear(x, w, 1e-6, glu=True)
    assert relerr(got, cpu.rms_norm_linear(x, w, 1e-6, glu=True)[0]) <= OUT_TOL


# M, K, N, the skinny-GEMM switch set: OCRIA-1's o_proj / MLP down (16 warps by default, cluster
# split-K over 2 or 4 blocks, and split-K over the grid: the last block adds), Qwen3.5-0.8B's N = 1024
# (16 warps), persistent blocks, odd N, M > 16 (linear, then add).
LINEAR_ADD_CASES = [(1, 4096, 2560, None), (16, 9216, 2560, None), (16, 9216, 2560, ("OCRIA_RT_SKINNY_CLUSTER", 2)),
                    (1, 4096, 2560, ("OCRIA_RT_SKINNY_CLUSTER", 4)),
                    (3, 9216, 2560, ("OCRIA_RT_SKINNY_KSPLIT", 3)), (1, 3584, 1024, None), (9, 1000, 999, None),
                    (5, 2560, 12352, ("OCRIA_RT_SKINNY_PERSISTENT", 1)), (40, 512, 1000, None), (2, 33, 17, None)]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("M,K,N,env", LINEAR_ADD_CASES)
def test_linear_add(cpu, gpu_with_env, M, K, N, env, with_bias):
    """residual += x · W^T against the CPU, and bit for bit the same backend's linear, then the add
    (the product rounded to BF16, then the sum rounded)."""
    rng = np.random.default_rng(M * 7919 + K * 31 + N)
    x, w, res = randn(rng, M, K), randn(rng, N, K, scale=K**-0.5), randn(rng, M, N, scale=4)
    bias = randn(rng, N) if with_bias else None
    gpu = gpu_with_env(*env) if env else gpu_with_env("OCRIA_RT_SKINNY_KSPLIT", "")
    got = gpu.linear_add(x, w, res, bias)
    assert relerr(got, cpu.linear_add(x, w, res, bias)) <= OUT_TOL
    np.testing.assert_array_equal(got, bf16(res + gpu.linear(x, w, bias)))


# ---- block tiles of two row tiles (OCRIA_RT_SKINNY_ROWS=32): the same sums as 16-row blocks ----

# M, K, N: one and two token tiles; OCRIA-1's in_proj and gate_up (persistent blocks), N = 2560 and
# 1024 (16 warps; clusters, which these shapes take above 8 tokens, turned off), 8-warp blocks of many
# tiles, an odd N (a partial last row tile, and N = 999 a partial second row tile of the last block),
# K not a multiple of 32.
ROWS32_CASES = [(1, 2560, 12352), (16, 2560, 18432), (9, 2560, 2560), (5, 3584, 1024), (3, 1000, 999),
                (12, 2632, 10007), (16, 256, 250), (1, 264, 40016)]


@pytest.mark.parametrize("M,K,N", ROWS32_CASES)
def test_linear_rows32(cpu, gpu_with_env, M, K, N):
    """Every op of the decode GEMM with two row tiles per block: against the CPU, and bit for bit the
    16-row blocks (each thread adds the same products in the same order; only which block stores a
    row tile changes): linear (BF16 and F32 out, with a bias), linear_glu, rms_norm_linear(_glu) and
    linear_add, with the automatic launch shapes and with persistent blocks forced."""
    rng = np.random.default_rng(M * 7919 + K * 31 + N + 32)
    x = bf16(randn(rng, M, K) * rng.uniform(0.5, 20, (M, 1)).astype(np.float32))
    w, bias, res = randn(rng, N, K, scale=K**-0.5), randn(rng, N), randn(rng, M, N, scale=4)
    glu_w = w[: N // 16 * 16]  # gate and up in the GLU layout: any 2I rows, I a multiple of 8

    def outputs(r):
        return (r.linear(x, w), r.linear(x, w, bias, True), r.linear_glu(x, glu_w),
                r.rms_norm_linear(x, w, 1e-6, bias)[0], r.rms_norm_linear(x, glu_w, 1e-6, glu=True)[0],
                r.linear_add(x, w, res))

    runs = {}
    for rows in ("16", "32"):
        for persistent in ("", "1"):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("OCRIA_RT_SKINNY_ROWS", rows)
                mp.setenv("OCRIA_RT_SKINNY_PERSISTENT", persistent)
                mp.setenv("OCRIA_RT_SKINNY_CLUSTER", "0")
                runs[rows, persistent] = outputs(_core.OpRunner("cuda"))
    want = outputs(cpu)
    for persistent in ("", "1"):
        for got, ref16, cpu_out in zip(runs["32", persistent], runs["16", persistent], want):
            assert relerr(got, cpu_out) <= OUT_TOL
            np.testing.assert_array_equal(got, ref16)


# ---- quantized weights (ops.h LinearWeight kFp8 / kNvfp4): the skinny GEMM decodes them in
# registers (M <= 16), prefill and shapes it cannot take go through dequantized BF16 rows ----


def quant_weight(rng, fmt, N, K, input_scale=False, random_bytes=True):
    """A QuantWeight of [N, K]: random bytes (every FP8 code but NaN, subnormals included; every E2M1
    nibble; block scales from 0 to 2^-9 .. 8, subnormal ones included) or a normal matrix quantized as
    ModelOpt does; per-row scales; input_scale in [0.5, 2] where asked for."""
    if fmt == "fp8":
        if random_bytes:
            bits = rng.integers(0, 256, (N, K), dtype=np.uint8)
            bits[(bits & 0x7F) == 0x7F] = 0x3C
            row_scale = rng.uniform(0.5, 2, N) / (200 * K**0.5)
        else:
            bits, scale = ref.quantize_fp8(rng.standard_normal((N, K)) * K**-0.5, per_channel=True)
            row_scale = scale
        block_scale = None
    else:
        if random_bytes:
            bits = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
            block_scale = rng.integers(0x00, 0x58, (N, K // 16), dtype=np.uint8)
            row_scale = rng.uniform(0.5, 2, N) / (3 * K**0.5)
        else:
            bits, block_scale, g = ref.quantize_nvfp4(rng.standard_normal((N, K)) * K**-0.5)
            row_scale = np.full(N, g) * rng.uniform(0.5, 2, N)  # fused parts: a global scale per row
    s_in = rng.uniform(0.5, 2, K).astype(np.float32) if input_scale else None
    return _core.QuantWeight(fmt, bits, block_scale, np.asarray(row_scale, np.float32), s_in)


# fmt, M, K, N: one and two token tiles (M = 1, 2, 5, 9, 16), 8-warp blocks of one or two row tiles,
# persistent blocks (N = 12352, 18432), 16-warp blocks and clusters of 2 (N = 2560), odd N (a partial
# last row tile), K with a partial last chunk (FP8 chunks are 64 wide: K = 208; NVFP4 128: K = 320,
# 448), prefill sizes (17, 100: dequantized rows, then CUTLASS), and K that the skinny GEMM cannot take
# (FP8 K % 16, NVFP4 K % 64, e.g. 208: dequantized rows and the tiled GEMM at M <= 16); x staged in
# shared memory up to M K = 9216 (1 x 9216, 4 x 2304), past it two token tiles (5 x 2560).
QUANT_LINEAR_CASES = [
    (fmt, M, K, N) for fmt in ("fp8", "nvfp4") for M, K, N in [
        (1, 256, 96), (2, 512, 1001), (5, 2560, 2560), (16, 2560, 12352), (9, 4096, 2560), (1, 2560, 18432),
        (16, 9216, 2560), (1, 320, 40), (3, 448, 33), (4, 208, 50), (17, 256, 136), (100, 512, 1000),
        (1, 9216, 2560), (4, 2304, 96)]
] + [("fp8", 3, 40, 24), ("fp8", 1, 72, 17), ("nvfp4", 2, 48, 24), ("nvfp4", 1, 96, 17)]


@pytest.mark.parametrize("input_scale", [False, True])
@pytest.mark.parametrize("fmt,M,K,N", QUANT_LINEAR_CASES)
def test_linear_quantized(cpu, gpu, fmt, M, K, N, input_scale):
    """(x * input_scale) · W^T (+ bias) against the CPU's dequantized fp32 product: BF16 out, and F32
    out with a bias."""
    rng = np.random.default_rng(M * 7919 + K * 31 + N + 8 * input_scale)
    w = quant_weight(rng, fmt, N, K, input_scale)
    x, bias = randn(rng, M, K), randn(rng, N)
    assert relerr(gpu.linear(x, w), cpu.linear(x, w)) <= OUT_TOL
    assert relerr(gpu.linear(x, w, bias, True), cpu.linear(x, w, bias)) <= OUT_TOL


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("M,K,N", [(1, 512, 200), (16, 1024, 64), (40, 256, 72)])
def test_linear_quantized_modelopt_weights(cpu, gpu, fmt, M, K, N):
    """Weights quantized from a normal matrix (ModelOpt's recipe): the product of the dequantized
    weights, with input_scale."""
    rng = np.random.default_rng(M + K + N)
    w = quant_weight(rng, fmt, N, K, input_scale=True, random_bytes=False)
    x = randn(rng, M, K)
    assert relerr(gpu.linear(x, w), cpu.linear(x, w)) <= OUT_TOL


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("M,K,N", [(17, 256, 33000), (20, 2560, 13256)])
def test_linear_quantized_slabs(cpu, gpu, fmt, M, K, N):
    """Prefill through dequantized rows in two slabs of the 64 MiB scratch (at most 32768 rows; for
    K = 2560 the 13107 rows that fit rounded down to 13056): each slab's columns of out and of the
    bias, BF16 out (CUTLASS per slab) and F32 out (the tiled GEMM per slab)."""
    rng = np.random.default_rng(M + K + N)
    w = quant_weight(rng, fmt, N, K, input_scale=True)
    x, bias = randn(rng, M, K), randn(rng, N)
    assert relerr(gpu.linear(x, w, bias), cpu.linear(x, w, bias)) <= OUT_TOL
    assert relerr(gpu.linear(x, w, bias, True), cpu.linear(x, w, bias)) <= OUT_TOL


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_linear_quantized_no_inputs(gpu, fmt):
    """K = 0 (no products, no rows to dequantize): out is the bias, as for a dense weight."""
    N = 40
    bits = np.zeros((N, 0), np.uint8)
    block_scale = np.zeros((N, 0), np.uint8) if fmt == "nvfp4" else None
    w = _core.QuantWeight(fmt, bits, block_scale, np.ones(N, np.float32))
    bias = randn(np.random.default_rng(3), N)
    x = np.zeros((3, 0), np.float32)
    np.testing.assert_array_equal(gpu.linear(x, w, bias, True), np.broadcast_to(bias, (3, N)))
    np.testing.assert_array_equal(gpu.linear(x, w), np.zeros((3, N), np.float32))


# fmt, M, K, I (GLU: N = 2I): the 4B's gate_up at one token (persistent), one and two token tiles,
# a prefill size, and K the skinny GEMM cannot take.
QUANT_GLU_CASES = [(fmt, M, K, I) for fmt in ("fp8", "nvfp4")
                   for M, K, I in [(1, 2560, 9216), (5, 512, 264), (16, 1024, 512), (17, 256, 64), (2, 48, 16)]]


@pytest.mark.parametrize("input_scale", [False, True])
@pytest.mark.parametrize("fmt,M,K,I", QUANT_GLU_CASES)
def test_quantized_glu(cpu, gpu, fmt, M, K, I, input_scale):
    """linear_glu and rms_norm_linear_glu (the norm's scale from the x before input_scale) against the
    CPU; the rows are taken to be in the GLU layout. The decode path applies the activation to the fp32
    sums (one BF16 rounding); the others round the product to BF16 before the activation rounds again
    (and the dequantized path the weights times input_scale before that): CHAIN_TOL."""
    rng = np.random.default_rng(M * 31 + K + I + input_scale)
    w = quant_weight(rng, fmt, 2 * I, K, input_scale)
    x = bf16(randn(rng, M, K) * rng.uniform(0.5, 40, (M, 1)).astype(np.float32))
    skinny = M <= 16 and K % (16 if fmt == "fp8" else 64) == 0
    tol = OUT_TOL if skinny else CHAIN_TOL
    assert relerr(gpu.linear_glu(x, w), cpu.linear_glu(x, w)) <= tol
    got, normed = gpu.rms_norm_linear(x, w, 1e-6, glu=True)
    assert relerr(got, cpu.rms_norm_linear(x, w, 1e-6, glu=True)[0]) <= tol
    if skinny:
        assert np.isnan(normed).all()  # the decode path scales the sums, never forms the normed rows


# fmt, M, K, N: the 4B's in_proj and qkv (persistent), o_proj and down (16 warps; above 8 tokens
# clusters of 2), odd N, prefill.
QUANT_BLOCK_END_CASES = [(fmt, M, K, N) for fmt in ("fp8", "nvfp4")
                         for M, K, N in [(1, 2560, 12352), (16, 2560, 10240), (1, 4096, 2560), (9, 9216, 2560),
                                         (5, 1024, 999), (17, 512, 256)]]


@pytest.mark.parametrize("input_scale", [False, True])
@pytest.mark.parametrize("fmt,M,K,N", QUANT_BLOCK_END_CASES)
def test_quantized_block_ends(cpu, gpu, fmt, M, K, N, input_scale):
    """rms_norm_linear (x the un-normed residual, of varied scale per token; with a bias) and
    linear_add against the CPU."""
    rng = np.random.default_rng(M * 7 + K + N + input_scale)
    w = quant_weight(rng, fmt, N, K, input_scale)
    x = bf16(randn(rng, M, K) * rng.uniform(0.5, 40, (M, 1)).astype(np.float32))
    bias, res = randn(rng, N), randn(rng, M, N, scale=4)
    got, normed = gpu.rms_norm_linear(x, w, 1e-6, bias)
    assert relerr(got, cpu.rms_norm_linear(x, w, 1e-6, bias)[0]) <= OUT_TOL
    if M <= 16:
        assert np.isnan(normed).all()
    x = randn(rng, M, K)
    assert relerr(gpu.linear_add(x, w, res), cpu.linear_add(x, w, res)) <= OUT_TOL


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("env", [("OCRIA_RT_SKINNY_PERSISTENT", "1"), ("OCRIA_RT_SKINNY_PERSISTENT", "0"),
                                 ("OCRIA_RT_SKINNY_ROWS", "32"), ("OCRIA_RT_SKINNY_ROWS", "16"),
                                 ("OCRIA_RT_SKINNY_CLUSTER", "2"), ("OCRIA_RT_SKINNY_CLUSTER", "4"),
                                 ("OCRIA_RT_SKINNY_CLUSTER", "0"), ("OCRIA_RT_SKINNY_KSPLIT", "3")])
@pytest.mark.parametrize("M,K,N", [(1, 2560, 2560), (12, 1536, 5008), (16, 4096, 1000)])
def test_quantized_launch_shapes(cpu, gpu_with_env, fmt, env, M, K, N):
    """Each of the skinny GEMM's switches with a quantized weight (split-K over the grid asked for does
    not apply, 4 blocks a cluster become 2): linear, linear_glu and linear_add against the CPU."""
    rng = np.random.default_rng(M + K + N)
    w = quant_weight(rng, fmt, N // 16 * 16, K, input_scale=True)
    x, res = randn(rng, M, K), randn(rng, M, N // 16 * 16, scale=4)
    gpu = gpu_with_env(*env)
    assert relerr(gpu.linear(x, w), cpu.linear(x, w)) <= OUT_TOL
    assert relerr(gpu.linear_glu(x, w), cpu.linear_glu(x, w)) <= OUT_TOL
    assert relerr(gpu.linear_add(x, w, res), cpu.linear_add(x, w, res)) <= OUT_TOL


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_element_positions(gpu, fmt):
    """Row n of W is zero but for one element k_n = 1.0 (spread over the pieces, words and nibbles of
    a chunk), x[k] = k + 1: out[n] = k_n + 1 exactly, so every K position reaches its own x (NVFP4: the
    low nibble of byte k // 2 is element 2j, the high one 2j + 1)."""
    K, N = 256, 64
    ks = (37 * np.arange(N) + 5) % K
    if fmt == "fp8":
        bits = np.zeros((N, K), np.uint8)
        bits[np.arange(N), ks] = 0x38  # e4m3 1.0
        block_scale = None
    else:
        bits = np.zeros((N, K // 2), np.uint8)
        bits[np.arange(N), ks // 2] = (0x2 << (4 * (ks % 2))).astype(np.uint8)  # e2m1 code 2 = 1.0
        block_scale = np.full((N, K // 16), 0x38, np.uint8)
    w = _core.QuantWeight(fmt, bits, block_scale, np.ones(N, np.float32))
    x = np.arange(1, K + 1, dtype=np.float32)[None, :]
    np.testing.assert_array_equal(gpu.linear(x, w)[0], ks + 1.0)
    np.testing.assert_array_equal(gpu.linear(np.repeat(x, 17, 0), w)[16], ks + 1.0)  # dequantized rows


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("M", [1, 16])
def test_quantized_dependent_op_chain(cpu, monkeypatch, fmt, M):
    """Three MLP residual blocks with quantized gate_up / down weights, back to back with PDL: against
    the CPU, and bit for bit the same chain with PDL off."""
    rng = np.random.default_rng(M + 5)
    H, I = 2560, 4608
    res = randn(rng, M, H, scale=3)
    w_gate_up, w_down = quant_weight(rng, fmt, 2 * I, H, True), quant_weight(rng, fmt, H, I)
    args = (res, w_gate_up, w_down, 3, 1e-6)
    want_res, want_out = cpu.block_chain(*args)
    got = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("OCRIA_RT_PDL", pdl)
        got[pdl] = _core.OpRunner("cuda").block_chain(*args)
    assert relerr(got["1"][0], want_res) <= CHAIN_TOL
    assert relerr(got["1"][1], want_out) <= CHAIN_TOL
    np.testing.assert_array_equal(got["0"][0], got["1"][0])
    np.testing.assert_array_equal(got["0"][1], got["1"][1])


# ---- programmatic dependent launch: dependent kernels back to back ----

# (M, H, I): H = 2560 with I = 4608 takes both skinny-GEMM configurations without split-K (gate_up
# N = 9216: 8 warps per tile; down N = 2560: 16 warps) with their L2 weight prefetch; the odd shape
# mixes PDL kernels with ordinary launches (gate_up's K = 1001: the fallback GEMM, then silu_mul).
CHAIN_CASES = [(1, 2560, 4608), (5, 2560, 4608), (16, 2560, 4608), (3, 1001, 1496)]


@pytest.mark.parametrize("ksplit,cluster,persistent,prefetch", [("", "", "", ""), ("1", "0", "0", "0"),
                                                                ("3", "0", "0", "16"), ("1", "4", "0", "4"),
                                                                ("1", "0", "1", "64")])
@pytest.mark.parametrize("M,H,I", CHAIN_CASES)
def test_dependent_op_chain(cpu, monkeypatch, M, H, I, ksplit, cluster, persistent, prefetch):
    """Three MLP residual blocks (rms_norm_linear_glu -> linear_add), then rms_norm, enqueued without
    host synchronisation in between, so that with PDL each kernel starts while its predecessor still
    runs and the residual is rewritten while earlier kernels may still read it. Against the CPU, and
    bit for bit against the same chain with PDL off (same kernels, same arithmetic: a missing
    pdl_wait() shows as a difference). The skinny GEMM's defaults (empty: its automatic choices),
    everything off, split-K forced to 3 splits everywhere it applies (the down projections; back-to-back
    launches share the scratch), cluster split-K over 4 blocks, and persistent blocks (gate_up's 576
    tiles); some with an L2 prefetch budget (OCRIA_RT_L2_PREFETCH_MB, a hint: the same bits)."""
    monkeypatch.setenv("OCRIA_RT_SKINNY_KSPLIT", ksplit)
    monkeypatch.setenv("OCRIA_RT_L2_PREFETCH_MB", prefetch)
    monkeypatch.setenv("OCRIA_RT_SKINNY_CLUSTER", cluster)
    monkeypatch.setenv("OCRIA_RT_SKINNY_PERSISTENT", persistent)
    rng = np.random.default_rng(M + H + I)
    res = randn(rng, M, H, scale=3)
    w_gate_up, w_down = randn(rng, 2 * I, H, scale=H ** -0.5), randn(rng, H, I, scale=I ** -0.5)
    args = (res, w_gate_up, w_down, 3, 1e-6)
    want_res, want_out = cpu.block_chain(*args)
    got = {}
    for pdl in ("1", "0"):  # the backend reads OCRIA_RT_PDL when it is constructed
        monkeypatch.setenv("OCRIA_RT_PDL", pdl)
        got[pdl] = _core.OpRunner("cuda").block_chain(*args)
    got_res, got_out = got["1"]
    assert relerr(got_res, want_res) <= CHAIN_TOL
    assert relerr(got_out, want_out) <= CHAIN_TOL
    np.testing.assert_array_equal(got["0"][0], got_res)
    np.testing.assert_array_equal(got["0"][1], got_out)
    if prefetch not in ("", "0"):  # the same chain without the prefetch
        monkeypatch.setenv("OCRIA_RT_L2_PREFETCH_MB", "0")
        np.testing.assert_array_equal(_core.OpRunner("cuda").block_chain(*args)[0], got_res)


# ---- attention: prepare (norms, RoPE, cache write) and split-K decode / simple prefill ----

ATTN_CASES = [
    # hq, hkv, hd, rot, T, start, M-RoPE section
    (16, 4, 256, 64, 1, 0, ()),
    (16, 4, 256, 64, 1, 1000, ()),
    (16, 4, 256, 64, 3, 5, ()),
    (16, 4, 256, 64, 16, 300, ()),
    (16, 4, 256, 64, 9, 40, (11, 11, 10)),  # vision tokens: distinct (t, h, w) rotary positions
    (8, 2, 128, 32, 100, 0, ()),
    (6, 2, 128, 32, 4, 70, ()),  # GQA group of 3
    (4, 2, 32, 8, 5, 0, ()),  # the test fixtures' head_dim
    (4, 2, 32, 8, 40, 3, ()),
    (4, 4, 64, 16, 2, 9000, ()),  # no GQA, long context
    (8, 1, 64, 64, 1, 4097, ()),  # group of 8, full rotation
]


@pytest.mark.parametrize("hq,hkv,hd,rot,T,start,section", ATTN_CASES)
def test_attention(cpu, gpu, hq, hkv, hd, rot, T, start, section):
    rng = np.random.default_rng(hq * hd + T + start)
    ctx = start + T + 4
    qkv = randn(rng, T, (2 * hq + 2 * hkv) * hd)
    qn, kn = randn(rng, hd, scale=0.1), randn(rng, hd, scale=0.1)
    k_cache, v_cache = randn(rng, ctx, hkv, hd), randn(rng, ctx, hkv, hd)
    pos = np.arange(start, start + T, dtype=np.int32)
    rope_pos = np.repeat(pos[:, None], 3, 1) if not section else rng.integers(0, 5000, (T, 3)).astype(np.int32)
    args = (qkv, qn, kn, pos, rope_pos, k_cache, v_cache, hq, hkv, hd, rot, 1e7, 1e-6, list(section))
    gq, gk, gv = gpu.attention_prepare(*args)
    cq, ck, cv = cpu.attention_prepare(*args)
    assert relerr(gq, cq) <= OUT_TOL
    assert relerr(gk[pos], ck[pos]) <= OUT_TOL
    np.testing.assert_array_equal(gv[pos], cv[pos])
    untouched = np.setdiff1d(np.arange(ctx), pos)
    np.testing.assert_array_equal(gk[untouched], k_cache[untouched])
    np.testing.assert_array_equal(gv[untouched], v_cache[untouched])
    # attention itself on identical (BF16) inputs
    q, kc, vc = bf16(cq), bf16(ck), bf16(cv)
    assert relerr(gpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd), cpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd)) <= OUT_TOL


def test_attention_positions_not_contiguous(cpu, gpu):
    """Each token attends over its own prefix (0..positions[t]), whatever the others do."""
    rng = np.random.default_rng(11)
    hq, hkv, hd, T, ctx = 16, 4, 256, 5, 3000
    qkv = randn(rng, T, (2 * hq + 2 * hkv) * hd)
    q = randn(rng, T, hq, hd)
    kc, vc = randn(rng, ctx, hkv, hd), randn(rng, ctx, hkv, hd)
    pos = np.array([0, 2999, 17, 1024, 63], dtype=np.int32)
    assert relerr(gpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd), cpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd)) <= OUT_TOL


# Decode (T <= 16) against a cache larger than the context, as in the engine: the number of splits is
# fixed from the capacity, the lengths (and so the chunk size and the non-empty splits) come from the
# positions on the device. The kernel's splits are max(ceil(len / nsplit), 32) rows. (T = 2..16 with head_dim
# 64 / 128 / 256 runs the verify kernel: test_cuda_verify_attention.py.)
DECODE_CASES = [
    # hq, hkv, hd, T, first position, cache rows
    (16, 4, 256, 1, 0, 32768),  # a single row: one non-empty split out of many
    (16, 4, 256, 1, 40, 32768),  # two minimum-size splits, the second partial
    (16, 4, 256, 1, 1023, 32768),  # 1k context
    (16, 4, 256, 1, 8190, 8192),
    (16, 4, 256, 1, 32767, 32768),  # the whole cache: every split full
    (16, 4, 256, 3, 777, 4096),  # lengths not a multiple of the chunk
    (16, 4, 256, 16, 2000, 4096),  # T = 16: each token its own length
    (16, 4, 256, 16, 10, 64),  # T = 16 at the start of a small cache
    (8, 8, 128, 2, 5000, 6000),  # no GQA
    (8, 4, 128, 5, 100, 20000),  # group of 2
    (10, 2, 128, 1, 3000, 4000),  # group of 5
    (8, 1, 256, 4, 999, 2048),  # group of 8 with head_dim 256
    (12, 2, 64, 7, 513, 1024),  # group of 6
    (4, 2, 32, 12, 64, 200),
    (4, 4, 32, 1, 3, 16),  # a 16-row cache: one split, the block writes the output itself
    (6, 2, 64, 1, 31, 32),  # one split, a full chunk
    (14, 2, 128, 9, 4000, 4500),  # group of 7
]


@pytest.mark.parametrize("hq,hkv,hd,T,start,rows", DECODE_CASES)
def test_attention_decode(cpu, gpu, hq, hkv, hd, T, start, rows):
    rng = np.random.default_rng(hq * hd + T * 7 + start + rows)
    q = randn(rng, T, hq, hd, scale=2)  # peaked softmax rows too
    kc, vc = randn(rng, rows, hkv, hd), randn(rng, rows, hkv, hd)
    qkv = randn(rng, T, (2 * hq + 2 * hkv) * hd)
    pos = np.arange(start, start + T, dtype=np.int32)
    assert relerr(gpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd), cpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd)) <= OUT_TOL


REPLAY_CASES = [
    # hq, hkv, hd, T, first position, cache rows, steps, positions advance per step
    (16, 4, 256, 1, 0, 8192, 7, 1201),  # 1 row, then 1202, ... 7207 rows
    (16, 4, 256, 4, 30, 4096, 6, 613),
    (8, 1, 128, 2, 3, 3000, 5, 700),  # group of 8, head_dim 128
    (4, 2, 64, 16, 0, 1024, 4, 250),
    (4, 4, 32, 1, 0, 100, 5, 24),  # a few splits: 1 row up to all four splits non-empty
]


@pytest.mark.parametrize("hq,hkv,hd,T,start,rows,steps,advance", REPLAY_CASES)
def test_attention_decode_replay(cpu, gpu, hq, hkv, hd, T, start, rows, steps, advance):
    """One attention op captured in a CUDA graph and replayed while the positions grow on the device,
    as the engine's decode step does: the split count stays the capture's, the lengths do not."""
    rng = np.random.default_rng(hq * hd + T + rows + steps)
    q = randn(rng, T, hq, hd, scale=2)
    kc, vc = randn(rng, rows, hkv, hd), randn(rng, rows, hkv, hd)
    qkv = randn(rng, T, (2 * hq + 2 * hkv) * hd)
    pos = np.arange(start, start + T, dtype=np.int32)
    got = gpu.attention_steps(q, kc, vc, qkv, pos, hq, hkv, hd, steps, advance)
    assert got.shape == (steps, T, hq * hd)
    for i in range(steps):
        want = cpu.attention(q, kc, vc, qkv, pos + i * advance, hq, hkv, hd)
        assert relerr(got[i], want) <= OUT_TOL, f"step {i}"


# ---- attention_decode: a decode step's attention (T = 1) as one kernel ----

# hq, hkv, hd, rot, M-RoPE section: the 4B's shape (with distinct (t, h, w) rope positions too), GQA
# groups 1 .. 8 including odd ones (3, 5, 7: fewer heads than the kernel's group size), head_dim 32 .. 256,
# full rotation.
STEP_SHAPES = [
    (16, 4, 256, 64, ()),
    (16, 4, 256, 64, (11, 11, 10)),
    (8, 1, 256, 64, ()),
    (8, 8, 128, 32, ()),
    (6, 2, 128, 32, ()),
    (10, 2, 128, 128, ()),
    (4, 2, 64, 16, ()),
    (14, 2, 64, 64, (2, 1, 1)),
    (4, 4, 32, 8, ()),
    (12, 2, 32, 32, ()),
]
# Context rows (the new row is the last) and cache rows: one row, a context inside one 32-row split of
# a cache of one split and of many splits, two splits, and 1000 / 5000 rows (tens of splits: the two
# levels of the in-kernel merge).
STEP_CONTEXTS = [(1, 2048), (31, 32), (31, 2048), (33, 2048), (1000, 2048), (5000, 5007)]
# The fused kernel adds the new row after the other rows of its split and merges the splits in its own
# order (attention_prepare + attention: the new row in its warp's last group of rows, the combine
# kernel's order), so the outputs differ by fp32 rounding, at most an ulp of BF16 here and there.
SPLIT_ORDER_TOL = 1e-3


def attention_step_inputs(rng, hq, hkv, hd, rot, ctx, rows, section):
    """attention_decode's arguments for one token at cache row ctx - 1 of a random cache of `rows`;
    that row is NaN until the op writes it, so attending over its old contents shows."""
    qkv = randn(rng, 1, (2 * hq + 2 * hkv) * hd)
    qn, kn = randn(rng, hd, scale=0.1), randn(rng, hd, scale=0.1)
    kc, vc = randn(rng, rows, hkv, hd), randn(rng, rows, hkv, hd)
    kc[ctx - 1] = vc[ctx - 1] = np.nan
    pos = np.array([ctx - 1], dtype=np.int32)
    rope_pos = np.repeat(pos[:, None], 3, 1) if not section else rng.integers(0, 5000, (1, 3)).astype(np.int32)
    return (qkv, qn, kn, pos, rope_pos, kc, vc, hq, hkv, hd, rot, 1e7, 1e-6, list(section))


@pytest.mark.parametrize("ctx,rows", STEP_CONTEXTS)
@pytest.mark.parametrize("hq,hkv,hd,rot,section", STEP_SHAPES)
def test_fused_attention_step(cpu, gpu, hq, hkv, hd, rot, section, ctx, rows):
    """The one-kernel decode step against the CPU's attention_prepare + attention (cache and out) and
    against the same GPU's two ops: the cache bits always, the output within SPLIT_ORDER_TOL. q never goes through memory (q comes back NaN), the other cache
    rows are untouched, and a second launch gives the same bits (the merge does not depend on which
    block finishes last, and the counters are back at zero)."""
    rng = np.random.default_rng(hq * hd + rot + ctx + rows + len(section))
    args = attention_step_inputs(rng, hq, hkv, hd, rot, ctx, rows, section)
    pos, k_cache, v_cache = args[3], args[5], args[6]
    gq, gk, gv, gout = gpu.attention_decode(*args)
    _, bk, bv, bout = gpu.attention_decode(*args, fused=False)
    _, ck, cv, cout = cpu.attention_decode(*args)
    assert np.isnan(gq).all()
    np.testing.assert_array_equal(gk, bk)
    np.testing.assert_array_equal(gv, bv)
    assert relerr(gk[pos], ck[pos]) <= OUT_TOL
    np.testing.assert_array_equal(gv[pos], cv[pos])
    rest = np.arange(rows) != pos[0]
    np.testing.assert_array_equal(gk[rest], k_cache[rest])
    np.testing.assert_array_equal(gv[rest], v_cache[rest])
    assert relerr(gout, cout) <= OUT_TOL
    assert relerr(gout, bout) <= SPLIT_ORDER_TOL
    np.testing.assert_array_equal(gpu.attention_decode(*args)[3], gout)


@pytest.mark.parametrize("merge_group", ["1", "3", "1024"])
@pytest.mark.parametrize("hq,hkv,hd,rot,ctx,rows", [(16, 4, 256, 64, 100, 2048), (16, 4, 256, 64, 1000, 2048),
                                                    (16, 4, 256, 64, 5000, 5007), (8, 1, 256, 64, 3000, 4096),
                                                    (6, 2, 128, 32, 2500, 3000)])
def test_fused_attention_step_merge_levels(cpu, gpu_with_env, merge_group, hq, hkv, hd, rot, ctx, rows):
    """OCRIA_RT_ATTN_MERGE_GROUP sets where the in-kernel merge takes two levels (1: groups of about
    sqrt(splits) from three splits on, 3: beyond three, 1024: never; the cases have 4 to about 100
    non-empty splits): each within BF16 rounding of the CPU and of the two ops, the same bits on a
    second launch."""
    rng = np.random.default_rng(hq * hd + ctx + rows)
    args = attention_step_inputs(rng, hq, hkv, hd, rot, ctx, rows, ())
    gpu = gpu_with_env("OCRIA_RT_ATTN_MERGE_GROUP", merge_group)
    out = gpu.attention_decode(*args)[3]
    assert relerr(out, cpu.attention_decode(*args)[3]) <= OUT_TOL
    assert relerr(out, gpu.attention_decode(*args, fused=False)[3]) <= SPLIT_ORDER_TOL
    np.testing.assert_array_equal(gpu.attention_decode(*args)[3], out)


STEP_REPLAY_CASES = [
    # hq, hkv, hd, rot, M-RoPE section, first position, cache rows, steps, positions advance per step
    (16, 4, 256, 64, (), 0, 8192, 7, 1201),  # 1 row, then 1202, ... 7207 rows
    (16, 4, 256, 64, (11, 11, 10), 30, 4096, 6, 613),
    (8, 1, 128, 32, (), 3, 3000, 5, 700),  # group of 8, head_dim 128
    (10, 2, 64, 64, (), 20, 2000, 6, 333),  # group of 5
    (4, 4, 32, 8, (), 0, 100, 5, 24),  # a few splits: 1 row up to all four splits non-empty
]


@pytest.mark.parametrize("hq,hkv,hd,rot,section,start,rows,steps,advance", STEP_REPLAY_CASES)
def test_fused_attention_step_replay(cpu, gpu, hq, hkv, hd, rot, section, start, rows, steps, advance):
    """The decode step captured in a CUDA graph and replayed while the positions grow on the device,
    as the engine's decode step does: each replay writes its (NaN until then) cache row and attends
    over the grown context with the capture's split count, and its in-kernel merge finds its counters
    at zero (a count left over would leave the poisoned output unwritten, or merge too early)."""
    rng = np.random.default_rng(hq * hd + start + rows + steps)
    args = attention_step_inputs(rng, hq, hkv, hd, rot, start + 1, rows, section)
    k_cache, v_cache = args[5], args[6]
    written = start + advance * np.arange(steps)
    k_cache[written] = v_cache[written] = np.nan  # each step's row until that step writes it
    got, gk, gv = gpu.attention_decode_steps(*args, steps, advance)
    want, ck, cv = cpu.attention_decode_steps(*args, steps, advance)
    assert got.shape == (steps, 1, hq * hd)
    for i in range(steps):
        assert relerr(got[i], want[i]) <= OUT_TOL, f"step {i}"
    assert relerr(gk[written], ck[written]) <= OUT_TOL
    np.testing.assert_array_equal(gv[written], cv[written])
    rest = np.setdiff1d(np.arange(rows), written)
    np.testing.assert_array_equal(gk[rest], k_cache[rest])
    np.testing.assert_array_equal(gv[rest], v_cache[rest])


# ---- attention prefill (T > 16): the tensor-core flash kernel ----

FLASH_CASES = [
    # hq, hkv, hd, T, start (cache rows of earlier chunks before this one)
    (16, 4, 256, 17, 0),  # one query tile, mostly padding rows
    (16, 4, 256, 64, 0),
    (16, 4, 256, 100, 37),
    (16, 4, 256, 257, 1000),  # three query tiles, a long prefix
    (8, 2, 256, 130, 64),
    (8, 8, 128, 17, 5),  # no GQA
    (8, 4, 128, 257, 0),  # group of 2
    (4, 1, 128, 100, 300),  # group of 4
    (6, 2, 128, 64, 1),  # group of 3
    (8, 2, 64, 64, 130),
    (4, 4, 64, 257, 64),
    (8, 2, 64, 100, 0),
]


@pytest.mark.parametrize("hq,hkv,hd,T,start", FLASH_CASES)
def test_attention_prefill(cpu, gpu, hq, hkv, hd, T, start):
    """A prefill chunk at cache rows start .. start + T - 1 over the earlier rows and itself."""
    rng = np.random.default_rng(hq * hd + T * 7 + start)
    ctx = start + T + 5  # rows past the chunk hold data that must not be attended
    q = randn(rng, T, hq, hd, scale=2)  # peaked softmax rows too
    kc, vc = randn(rng, ctx, hkv, hd), randn(rng, ctx, hkv, hd)
    qkv = randn(rng, T, (2 * hq + 2 * hkv) * hd)
    pos = np.arange(start, start + T, dtype=np.int32)
    assert relerr(gpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd), cpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd)) <= OUT_TOL


@pytest.mark.parametrize("hd", [64, 256])
def test_attention_prefill_positions_not_contiguous(cpu, gpu, hd):
    """The flash kernel takes any positions: each token still attends over exactly 0..positions[t]."""
    rng = np.random.default_rng(hd + 5)
    hq, hkv, T, ctx = 8, 2, 150, 2000
    q = randn(rng, T, hq, hd, scale=2)
    kc, vc = randn(rng, ctx, hkv, hd), randn(rng, ctx, hkv, hd)
    qkv = randn(rng, T, (2 * hq + 2 * hkv) * hd)
    pos = rng.integers(0, ctx, T).astype(np.int32)
    pos[:3] = [0, ctx - 1, 0]  # a single key, the whole cache, a repeat
    pos[3:40] = np.arange(500, 463, -1)  # descending
    assert relerr(gpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd), cpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd)) <= OUT_TOL


# ---- Gated DeltaNet ----


@pytest.mark.parametrize("T,C", [(1, 48), (2, 160), (6, 160), (70, 33), (130, 8192)])
def test_gdn_conv(cpu, gpu, T, C):
    rng = np.random.default_rng(T + C)
    x, w, state = randn(rng, T, C), randn(rng, C, 4, scale=0.3), randn(rng, C, 3)
    gout, gstate = gpu.gdn_conv(x, w, state)
    cout, cstate = cpu.gdn_conv(x, w, state)
    assert relerr(gout, cout) <= OUT_TOL
    assert relerr(gstate, cstate) <= 1e-6  # the state is a copy of (BF16) inputs


def gdn_inputs(rng, hk, hv, dk, dv, T):
    qkv = randn(rng, T, 2 * hk * dk + hv * dv)
    ba = randn(rng, T, 2 * hv)
    A_log = np.log(rng.uniform(0.05, 8, hv)).astype(np.float32)
    dt_bias = randn(rng, hv, scale=0.1)
    state = randn(rng, hv, dk, dv, scale=0.2)
    return qkv, ba, A_log, dt_bias, state


GDN_CASES = [
    # hk, hv, dk, dv, T
    (16, 32, 128, 128, 1),
    (16, 32, 128, 128, 16),
    (4, 8, 128, 128, 3),
    (2, 4, 64, 64, 1),
    (2, 4, 128, 64, 100),
    (1, 3, 256, 32, 17),
    (2, 4, 16, 16, 40),  # the test fixtures' shapes: small dk, dv not a multiple of 32
    (2, 4, 16, 24, 5),
    (2, 4, 32, 32, 1),
]


@pytest.mark.parametrize("hk,hv,dk,dv,T", GDN_CASES)
@pytest.mark.parametrize("chunked", [False, True])
def test_gdn(cpu, gpu, hk, hv, dk, dv, T, chunked):
    rng = np.random.default_rng(hv * dv + T + dk)
    args = gdn_inputs(rng, hk, hv, dk, dv, T)
    gout, gstate = gpu.gdn(*args, hk, hv, dk, dv, chunked)
    cout, cstate = cpu.gdn(*args, hk, hv, dk, dv, chunked)
    assert relerr(gout, cout) <= OUT_TOL
    assert relerr(gstate, cstate) <= STATE_TOL


GDN_CHUNKED_CASES = [
    # hk, hv, dk, dv, T: one chunk, partial last chunks, GQA 1 and 2
    (4, 8, 128, 128, 64),
    (4, 8, 128, 128, 100),
    (4, 4, 128, 128, 257),
    (2, 4, 128, 128, 1000),
    (2, 4, 64, 128, 100),
    (2, 2, 64, 128, 257),
    (2, 4, 64, 128, 1000),
    (2, 4, 64, 48, 130),  # dv not a multiple of 32: the last 32-column state slice is half empty
    (16, 32, 128, 128, 2500),  # the 4B shape over 3 passes of 16 chunks
]


@pytest.mark.parametrize("hk,hv,dk,dv,T", GDN_CHUNKED_CASES)
def test_gdn_chunked(cpu, gpu, hk, hv, dk, dv, T):
    """The tensor-core chunked kernels from a non-zero state against the CPU's chunked form and the
    GPU recurrence."""
    rng = np.random.default_rng(hk * dk + hv * dv + T)
    args = gdn_inputs(rng, hk, hv, dk, dv, T)
    gout, gstate = gpu.gdn(*args, hk, hv, dk, dv, True)
    cout, cstate = cpu.gdn(*args, hk, hv, dk, dv, True)
    rout, rstate = gpu.gdn(*args, hk, hv, dk, dv, False)
    assert relerr(gout, cout) <= OUT_TOL
    assert relerr(gstate, cstate) <= CHUNKED_STATE_TOL
    assert relerr(gout, rout) <= OUT_TOL
    assert relerr(gstate, rstate) <= CHUNKED_STATE_TOL


def test_gdn_chunked_continues_state(cpu, gpu):
    """Two chunked calls (the second from the state the first left, neither a whole number of
    chunks) equal one CPU call over all the tokens."""
    rng = np.random.default_rng(77)
    hk, hv, dk, dv, T1, T2 = 2, 4, 128, 128, 150, 201
    qkv, ba, A_log, dt_bias, state = gdn_inputs(rng, hk, hv, dk, dv, T1 + T2)
    o1, s1 = gpu.gdn(qkv[:T1], ba[:T1], A_log, dt_bias, state, hk, hv, dk, dv, True)
    o2, s2 = gpu.gdn(qkv[T1:], ba[T1:], A_log, dt_bias, s1, hk, hv, dk, dv, True)
    cout, cstate = cpu.gdn(qkv, ba, A_log, dt_bias, state, hk, hv, dk, dv, False)
    assert relerr(np.concatenate([o1, o2]), cout) <= OUT_TOL
    assert relerr(s2, cstate) <= CHUNKED_STATE_TOL


@pytest.mark.parametrize("T,hv,dv", [(5, 4, 24), (1, 32, 128), (16, 32, 128), (3, 2, 256)])
def test_gdn_gated_norm(cpu, gpu, T, hv, dv):
    rng = np.random.default_rng(T * hv + dv)
    o, z, w = randn(rng, T, hv * dv), randn(rng, T, hv * dv), bf16(1 + randn(rng, dv, scale=0.1))
    assert relerr(gpu.gdn_gated_norm(o, z, w, hv, dv, 1e-6), cpu.gdn_gated_norm(o, z, w, hv, dv, 1e-6)) <= OUT_TOL


def gdn_decode_inputs(rng, hk, hv, dk, dv, rows, pad, width=4):
    """gdn_decode's inputs: the in_proj output [rows, qkv | z | b | a] with `pad` more columns (the
    op gets a column range, as from the model's wider buffer), conv weight [C, width] and state,
    A_log, dt_bias, the norm weight and the recurrent state."""
    C = 2 * hk * dk + hv * dv
    proj = randn(rng, rows, C + hv * dv + 2 * hv + pad)
    conv_w, conv_state = randn(rng, C, width, scale=0.3), randn(rng, C, width - 1)
    A_log = np.log(rng.uniform(0.05, 8, hv)).astype(np.float32)
    dt_bias, norm_w = randn(rng, hv, scale=0.1), bf16(1 + randn(rng, dv, scale=0.1))
    state = randn(rng, hv, dk, dv, scale=0.2)
    return proj, conv_w, conv_state, A_log, dt_bias, norm_w, state


# gdn_decode against the CPU: the GPU rounds the conv output and o to BF16 between the steps (the
# three ops store them as BF16), and the gated norm's RMS rescaling amplifies that where o nearly
# cancels. The CPU ops with those roundings modelled give up to 1.2e-2 (out) and 2.8e-3 (state) on
# the cases below, and up to 2.9e-2 and 3.0e-3 over 30 seeds of the small shapes.
DECODE_OUT_TOL = 5e-2
DECODE_STATE_TOL = 5e-3


def check_gdn_decode(cpu, gpu, hk, hv, dk, dv, T, calls=3, pad=8, width=4):
    """`calls` gdn_decode ops of T tokens back to back from non-zero states, on the GPU fused, on the
    GPU as the three ops, and on the CPU."""
    rng = np.random.default_rng(hk * dk + hv * dv + T)
    args = gdn_decode_inputs(rng, hk, hv, dk, dv, calls * T, pad, width)
    fused = gpu.gdn_decode(*args, hk, hv, dk, dv, calls, pad, True)
    split = gpu.gdn_decode(*args, hk, hv, dk, dv, calls, pad, False)
    ref = cpu.gdn_decode(*args, hk, hv, dk, dv, calls, pad, True)
    for name, f, s in zip(("out", "conv_state", "state"), fused, split):
        assert np.all(np.isfinite(f)), f"{name}: non-finite values (poisoned output left unwritten?)"
        np.testing.assert_array_equal(f, s, err_msg=f"{name}: fused kernel vs the three ops")
    out, conv_state, state = fused
    assert relerr(out, ref[0]) <= DECODE_OUT_TOL
    assert relerr(conv_state, ref[1]) <= 1e-6  # a copy of (BF16) inputs
    assert relerr(state, ref[2]) <= DECODE_STATE_TOL


@pytest.mark.parametrize("T", [1, 2, 5, 16])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("dk,dv", [(128, 128), (64, 128), (32, 64), (16, 16), (16, 24)])
def test_gdn_decode(cpu, gpu, dk, dv, group, T):
    """The fused decode kernel: the same bits as gdn_conv + gdn_recurrent + gdn_gated_norm on the
    GPU, over HV/HK = 1 and 2 (the conv state of q, k shared by a cluster of value heads), dk 16 .. 128
    and dv not a multiple of 32 (the fixtures' 16 and 24)."""
    check_gdn_decode(cpu, gpu, 2, 2 * group, dk, dv, T)


@pytest.mark.parametrize("hk,hv,dk,dv,T", [
    (16, 32, 128, 128, 1),  # the 4B
    (16, 16, 128, 128, 1),  # the 0.8B
    (16, 32, 128, 128, 16),
    (1, 8, 32, 40, 3),  # a cluster of 8 value heads
    (3, 6, 64, 100, 7),
    # shapes the fused kernel does not take: the three ops run instead
    (1, 3, 256, 32, 2),  # dk 256
    (2, 2, 64, 160, 1),  # dv > 128
    (2, 4, 64, 128, 17),  # more than 16 tokens
    (1, 16, 32, 32, 1),  # HV / HK > 8
])
def test_gdn_decode_shapes(cpu, gpu, hk, hv, dk, dv, T):
    check_gdn_decode(cpu, gpu, hk, hv, dk, dv, T)


@pytest.mark.parametrize("width", [2, 3, 6])
def test_gdn_decode_conv_width(cpu, gpu, width):
    """Conv widths other than Qwen3.5's 4 at dv = 128: the fused kernel's run-time instantiation
    (dv = 128 with width 4 has one of its own, with both as constants)."""
    check_gdn_decode(cpu, gpu, 2, 4, 128, 128, 3, width=width)


# ---- sampling: greedy exactly, seeded draws identical to the CPU ----


def test_greedy_matches_cpu(cpu, gpu):
    rng = np.random.default_rng(3)
    for R, V in [(1, 248320), (4, 248320), (3, 1000), (2, 7)]:
        logits = randn(rng, R, V, scale=3)  # BF16 values: many exact ties among the 248k
        logits[0, [5, V - 1]] = logits.max() + 1  # a tie for the maximum: the lower index wins
        gt, gs = gpu.sample(logits, 0.0, 0, 1.0, 0, 11)
        ct, cs = cpu.sample(logits, 0.0, 0, 1.0, 0, 11)
        np.testing.assert_array_equal(gt, ct)
        assert gt[0] == 5
        assert gs == cs == 11 + R


SAMPLE_CONFIGS = [
    # temperature, top_k, top_p
    (0.7, 50, 1.0),
    (1.0, 0, 0.9),
    (0.8, 40, 0.95),
    (1.0, 1, 1.0),
    (1.0, 5000, 1.0),  # a large top-k: the fast path sorts thousands of candidates
    (1.0, 0, 1.0),  # plain temperature sampling: only the bin the draw lands in is sorted
    (2.0, 0, 0.999),  # a flat distribution cut deep: the cut bin alone, the draw mostly before it
    (1.0, 100000, 0.5),
]


def check_seeded_draws(cpu, gpu, logits, temperature, top_k, top_p, seed, step):
    """The GPU draws the CPU's tokens for every row and advances the step counter as it does."""
    gt, gs = gpu.sample(logits, temperature, top_k, top_p, seed, step)
    ct, cs = cpu.sample(logits, temperature, top_k, top_p, seed, step)
    assert gs == cs == step + len(logits)
    np.testing.assert_array_equal(gt, ct, err_msg=f"seed {seed}, step {step}")


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLE_CONFIGS)
@pytest.mark.parametrize("V", [1000, 248320])
def test_seeded_sampling_matches_cpu(cpu, gpu, temperature, top_k, top_p, V):
    rng = np.random.default_rng(V + top_k)
    R = 3
    for trial in range(4):
        logits = randn(rng, R, V, scale=2.5)
        check_seeded_draws(cpu, gpu, logits, temperature, top_k, top_p, 1000 + trial, 7 * trial)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.0, 0, 0.5), (0.9, 100000, 1.0)])
def test_seeded_sampling_of_tied_rows_matches_cpu(cpu, gpu, temperature, top_k, top_p):
    """Rows whose logits are all equal but for a few: the first-level bin that decides the draw holds
    nearly the whole vocabulary, more than the fast path sorts, so the radix descent resolves it (the
    ties in index order). The configurations above mostly take the fast path."""
    rng = np.random.default_rng(17)
    R, V = 3, 248320
    for trial in range(3):
        logits = np.zeros((R, V), dtype=np.float32)
        hot = rng.choice(V, size=64, replace=False)
        logits[:, hot] = randn(rng, R, 64, scale=2.0)
        check_seeded_draws(cpu, gpu, logits, temperature, top_k, top_p, 50 + trial, 5 * trial)


def test_sampling_distribution_on_gpu(gpu):
    """Many rows of the same logits: token frequencies follow the kept, renormalised distribution."""
    logits = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0], dtype=np.float32)
    n = 20000
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (1.5, 4, 0.9), (1.0, 0, 0.8)]:
        tokens, step = gpu.sample(np.tile(logits, (n, 1)), temperature, top_k, top_p, 99, 0)
        assert step == n
        p = np.exp(logits.astype(np.float64) / temperature)
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        keep = order[: top_k or len(p)]
        if top_p < 1:
            keep = keep[: int(np.searchsorted(np.cumsum(p[keep]), top_p) + 1)]
        q = np.zeros_like(p)
        q[keep] = p[keep] / p[keep].sum()
        counts = np.bincount(tokens, minlength=len(p))
        assert np.all(counts[q == 0] == 0)
        kept = q > 0
        chi2 = float((((counts[kept] - n * q[kept]) ** 2) / (n * q[kept])).sum())
        assert chi2 < 25.0, f"chi2 {chi2:.1f}: counts {counts}, expected {n * q}"


# ---- vision encoder ops ----


@pytest.mark.parametrize("R,D", [(5, 32), (100, 1024), (3, 4096)])
def test_layer_norm_and_gelu(cpu, gpu, R, D):
    rng = np.random.default_rng(R + D)
    x, w, b = randn(rng, R, D, scale=3), randn(rng, D), randn(rng, D)
    assert relerr(gpu.layer_norm(x, w, b, 1e-6), cpu.layer_norm(x, w, b, 1e-6)) <= OUT_TOL
    for tanh in (True, False):
        assert relerr(gpu.gelu(x, tanh), cpu.gelu(x, tanh)) <= OUT_TOL


@pytest.mark.parametrize("heads,hd,lengths", [(2, 16, [8, 12]), (3, 32, [40]), (16, 64, [256, 100, 4]),
                                              (4, 128, [33]), (16, 64, [520, 37, 1, 300]), (4, 128, [129, 200]),
                                              (2, 64, [17])])
def test_vision_attention(cpu, gpu, heads, hd, lengths):
    """head_dim 64 / 128 take the flash kernel (images starting and ending inside query and key tiles),
    16 / 32 the CUDA-core one."""
    rng = np.random.default_rng(heads * hd + len(lengths))
    N = sum(lengths)
    qkv = randn(rng, N, 3 * heads * hd)
    pos = rng.integers(0, 60, (N, 2)).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    assert relerr(gpu.vision_attention(qkv, pos, cu, heads, 10000.0), cpu.vision_attention(qkv, pos, cu, heads, 10000.0)) <= OUT_TOL


# (R table rows, N patches, D, pad rows, pad cols of x): the OCRia-1 page (2,304-row table, 4,480
# patches, D 1024) and odd sizes; D % 8 != 0 takes the scalar path, the others 16-byte vectors.
BLEND_CASES = [(2304, 4480, 1024, 3, 8), (49, 37, 33, 2, 5), (16, 1, 8, 1, 0), (100, 301, 1000, 0, 24)]


@pytest.mark.parametrize("R,N,D,pad_rows,pad_cols", BLEND_CASES)
@pytest.mark.parametrize("f32_table", [True, False])
def test_gather_blend_add(cpu, gpu, R, N, D, pad_rows, pad_cols, f32_table):
    """The position-embedding blend (4 taps per row, rows repeated across and within patches) into
    the top-left [N, D] block of a NaN-poisoned x: the block against the CPU, the rest untouched."""
    rng = np.random.default_rng(R + N + D + f32_table)
    table = randn(rng, R, D, scale=0.5)
    rows = rng.integers(0, R, (N, 4)).astype(np.int32)
    rows[::3, 1] = rows[::3, 0]
    rows[1::4] = rows[0]
    weights = rng.uniform(0, 1, (N, 4)).astype(np.float32)
    weights /= weights.sum(1, keepdims=True)
    x = np.full((N + pad_rows, D + pad_cols), np.nan, np.float32)
    x[:N, :D] = randn(rng, N, D)
    got = gpu.gather_blend_add(table, rows, weights, x, N, D, f32_table)
    want = cpu.gather_blend_add(table, rows, weights, x, N, D)
    assert relerr(got[:N, :D], want[:N, :D]) <= OUT_TOL
    assert np.isnan(got[N:]).all() and np.isnan(got[:, D:]).all()


@pytest.mark.parametrize("N,D", [(4100, 1100), (2, 4_300_001)])
def test_upload_rounds_f32_to_bf16_on_device(gpu, N, D):
    """copy_from_host of F32 data into a BF16 tensor rounds on the device, chunk by chunk through the
    workspace (more than one 16 MiB staging chunk here; the second shape splits rows into column
    pieces): bit for bit the host's round-to-nearest-even, inf and NaN kept. Read back through
    gather_blend_add with zero weights (x + 0)."""
    rng = np.random.default_rng(N + D)
    x = (rng.standard_normal((N, D)) * 100).astype(np.float32)  # not BF16 values: every one rounds
    x[0, :5] = [np.inf, -np.inf, 3.4e38, np.nan, 1.0 + 2.0**-8]  # 3.4e38 rounds to inf; a tie rounds to even
    x[-1, -3:] = np.nan
    table = np.zeros((1, D), np.float32)
    got = gpu.gather_blend_add(table, np.zeros((N, 1), np.int32), np.zeros((N, 1), np.float32), x, N, D)
    np.testing.assert_array_equal(got, bf16(x))


def test_post_mailbox(gpu):
    """The decode step's token readback: a kernel writes into mapped host memory from inside a graph."""
    check_post_mailbox(gpu)
