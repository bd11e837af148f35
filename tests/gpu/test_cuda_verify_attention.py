"""attention for a speculative verify block (T = 2..16 tokens over the KV cache) on the CUDA backend:
the tensor-core kernel (verify_attention_kernel, csrc/ops/cuda/attention.cu) against the CPU backend
and against the flash-decoding kernels it replaces (OCRIA_RT_ATTN_VERIFY=0; T = 1 always runs those).

The caches are larger than the context, as in the engine: the kernel's split count comes from the
capacity, the lengths and its chunk from the positions on the device. Cache rows past the longest
position are NaN, so any read of them shows (relerr() fails on NaN); rows below it hold finite data,
as a sequence's cache does. The kernel rounds P to BF16 before P V (as the prefill flash kernel does):
a NumPy model of its arithmetic on these inputs puts it 1.2-1.6e-3 (relative, whole output) from the
exact result rounded to BF16, hence VS_SPLIT_TOL against the fp32 flash-decoding kernels.
Skipped (by tests/conftest.py) where ocria_rt has no CUDA support or no GPU is visible.
"""

from __future__ import annotations

import numpy as np
import pytest

from support import relerr
from ocria_rt import _core

pytestmark = pytest.mark.gpu

OUT_TOL = 1e-2  # a BF16 output against the CPU's fp32
VS_SPLIT_TOL = 4e-3  # against the flash-decoding kernels: BF16 P and output rounding (see above)


@pytest.fixture(scope="module")
def cpu():
    return _core.OpRunner("cpu")


@pytest.fixture(scope="module")
def gpu():
    return _core.OpRunner("cuda")


@pytest.fixture(scope="module")
def split_gpu():
    """A CUDA runner whose backend runs 2..16 tokens through the flash-decoding kernels."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OCRIA_RT_ATTN_VERIFY", "0")
        return _core.OpRunner("cuda")


def bf16(a: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest BF16 (ties to even), kept as float32."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def randn(rng, *shape, scale=1.0):
    return bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def verify_inputs(rng, hq, hkv, hd, pos, rows):
    """q (scale 2: peaked softmax rows too), a cache of `rows` rows, NaN past the longest position, and
    qkv (the gates)."""
    T = len(pos)
    q = randn(rng, T, hq, hd, scale=2)
    kc, vc = randn(rng, rows, hkv, hd), randn(rng, rows, hkv, hd)
    kc[pos.max() + 1 :] = vc[pos.max() + 1 :] = np.nan
    qkv = randn(rng, T, (2 * hq + 2 * hkv) * hd)
    return q, kc, vc, qkv


def check(cpu, gpu, split_gpu, q, kc, vc, qkv, pos, hq, hkv, hd):
    """Against the CPU and the flash-decoding kernels; a second launch gives the same bits."""
    got = gpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd)
    assert relerr(got, cpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd)) <= OUT_TOL
    assert relerr(got, split_gpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd)) <= VS_SPLIT_TOL
    np.testing.assert_array_equal(gpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd), got)


# The 4B shape (16 q / 4 kv heads of 256) for every T at an 8k context, the block's rows on both sides
# of row 8192 (a multiple of every chunk size up to 256 rows: the tokens' non-empty splits differ);
# T = 1 takes the flash-decoding kernels.
@pytest.mark.parametrize("T", range(1, 17))
def test_verify_4b_every_T(cpu, gpu, split_gpu, T):
    rng = np.random.default_rng(T)
    pos = np.arange(8192 - T // 2, 8192 - T // 2 + T, dtype=np.int32)
    check(cpu, gpu, split_gpu, *verify_inputs(rng, 16, 4, 256, pos, 9000), pos, 16, 4, 256)


VERIFY_CASES = [
    # hq, hkv, hd, T, first position, cache rows
    (16, 4, 256, 16, 0, 32768),  # from the first row: one non-empty split of many
    (16, 4, 256, 2, 0, 4096),  # two rows
    (16, 4, 256, 16, 37, 4096),  # 53 rows: a partial tile
    (16, 4, 256, 16, 1010, 2048),  # 1k, across a multiple of 32
    (16, 4, 256, 16, 8176, 8192),  # 8k, the whole cache
    (16, 4, 256, 16, 33000, 33100),  # 33k
    (16, 4, 256, 16, 0, 32),  # a 32-row cache: one split, the block writes out itself
    (16, 4, 256, 7, 3, 16),  # a 16-row cache, T < 16
    (8, 2, 256, 16, 5000, 6000),  # the 0.8B shape
    (8, 2, 256, 11, 999, 1200),
    (8, 1, 256, 16, 4000, 4500),  # group of 8 with head_dim 256: 128 query rows
    (8, 1, 256, 9, 700, 800),  # 72 query rows
    (4, 2, 64, 16, 0, 8192),  # ocria-mini's shape
    (4, 2, 64, 16, 300, 1000),
    (4, 2, 64, 5, 8100, 8192),
    (4, 2, 64, 10, 20, 64),  # a 64-row cache: one split
    (8, 1, 64, 16, 2000, 2100),  # group of 8, head_dim 64: 128 query rows
    (8, 8, 128, 16, 3000, 3100),  # no GQA
    (6, 2, 128, 5, 70, 200),  # group of 3: 15 query rows
    (10, 2, 128, 13, 2222, 4000),  # group of 5: 65 query rows
    (14, 2, 128, 16, 6000, 6100),  # group of 7: 112 query rows
    (8, 1, 128, 3, 33000, 33024),  # group of 8, 33k
]


@pytest.mark.parametrize("hq,hkv,hd,T,start,rows", VERIFY_CASES)
def test_verify(cpu, gpu, split_gpu, hq, hkv, hd, T, start, rows):
    rng = np.random.default_rng(hq * hd + T * 7 + start + rows)
    pos = np.arange(start, start + T, dtype=np.int32)
    check(cpu, gpu, split_gpu, *verify_inputs(rng, hq, hkv, hd, pos, rows), pos, hq, hkv, hd)


@pytest.mark.parametrize("hq,hkv,hd", [(16, 4, 256), (4, 2, 64), (8, 1, 128)])
def test_verify_positions_not_contiguous(cpu, gpu, split_gpu, hq, hkv, hd):
    """Each token attends over exactly its own prefix 0..positions[t], whatever the others' are: the first
    row alone, the whole context, repeats, descending runs, and a block whose first token is not its
    earliest."""
    rng = np.random.default_rng(hd + 3)
    pos = np.array([3000, 0, 4999, 17, 1024, 63, 63, 2500, 2499, 2498, 31, 32, 4000, 4001, 1, 64], dtype=np.int32)
    check(cpu, gpu, split_gpu, *verify_inputs(rng, hq, hkv, hd, pos, 6000), pos, hq, hkv, hd)


# Needle cases: hq, hkv, hd, T, first position, cache rows.
NEEDLE_CASES = [
    (16, 4, 256, 16, 8176, 8192),
    (16, 4, 256, 16, 1010, 4096),
    (16, 4, 256, 5, 33000, 33100),
    (8, 1, 256, 16, 3000, 3500),
    (4, 2, 64, 16, 700, 2048),
    (10, 2, 128, 12, 5000, 5100),
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("hq,hkv,hd,T,start,rows", NEEDLE_CASES)
def test_verify_boundary_rows(cpu, gpu, hq, hkv, hd, T, start, rows, seed):
    """Whether exactly the right rows are attended, where a row's weight is large enough to show. Each
    q head's query is a multiple of one direction u per kv head, and "needle" cache rows hold a large
    multiple of u in K, the rest small noise: each token's output is about the mean of V over the
    needles it sees, and attending one needle too many or too few moves it by ~1 / sqrt(needles), far
    beyond OUT_TOL. The needles: the verify block's rows and the row before (the causal mask inside the
    block), row 0, and rows on both sides of multiples of 32 (every split and K / V tile starts at
    one) picked at random."""
    rng = np.random.default_rng(seed * 1000 + hq * hd + T + start)
    G = hq // hkv
    pos = np.arange(start, start + T, dtype=np.int32)
    length = int(pos.max()) + 1
    u = rng.standard_normal((hkv, hd))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    gain = rng.uniform(0.8, 1.2, hq)  # per q head: the GQA group's heads differ
    q = bf16(np.stack([gain[h] * np.sqrt(hd) * 3 * u[h // G] for h in range(hq)])[None].repeat(T, 0))
    kc, vc = randn(rng, rows, hkv, hd, scale=0.1), randn(rng, rows, hkv, hd)
    edges = np.arange(32, length, 32)
    picked = rng.choice(edges, size=min(24, len(edges)), replace=False)
    needles = np.unique(np.concatenate([[0], pos, [start - 1] if start > 0 else [], picked - 1, picked]))
    needles = needles[(needles >= 0) & (needles < length)].astype(np.int64)
    kc[needles] = bf16(10 * u[None].repeat(len(needles), 0))  # scores ~30 above the rest
    kc[length:] = vc[length:] = np.nan
    qkv = randn(rng, T, (2 * hq + 2 * hkv) * hd)
    got = gpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd)
    want = cpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd)
    for t in range(T):
        assert relerr(got[t], want[t]) <= OUT_TOL, f"token {t} (position {pos[t]})"


REPLAY_CASES = [
    # hq, hkv, hd, T, first position, cache rows, steps, positions advance per step
    (16, 4, 256, 16, 0, 16384, 6, 2500),  # 16 rows, then 2516, ... 12516 rows
    (8, 1, 256, 9, 40, 4096, 5, 777),
    (4, 2, 64, 16, 3, 8192, 5, 1500),
    (14, 2, 128, 16, 100, 3000, 4, 900),
]


@pytest.mark.parametrize("hq,hkv,hd,T,start,rows,steps,advance", REPLAY_CASES)
def test_verify_replay(cpu, gpu, hq, hkv, hd, T, start, rows, steps, advance):
    """One attention op captured in a CUDA graph and replayed while the positions grow on the device,
    as a speculative decoding loop's verify step does: the split count stays the capture's, the
    length and the chunk do not."""
    rng = np.random.default_rng(hq * hd + T + rows + steps)
    pos = np.arange(start, start + T, dtype=np.int32)
    last = pos + (steps - 1) * advance
    q, kc, vc, qkv = verify_inputs(rng, hq, hkv, hd, last, rows)
    got = gpu.attention_steps(q, kc, vc, qkv, pos, hq, hkv, hd, steps, advance)
    assert got.shape == (steps, T, hq * hd)
    for i in range(steps):
        want = cpu.attention(q, kc, vc, qkv, pos + i * advance, hq, hkv, hd)
        assert relerr(got[i], want) <= OUT_TOL, f"step {i}"


@pytest.mark.parametrize("hq,hkv,hd,T,start,rows", [(16, 4, 256, 16, 8176, 8192), (4, 2, 64, 7, 300, 1000),
                                                    (14, 2, 128, 16, 6000, 6100)])
def test_flash_decoding_fallback(cpu, split_gpu, hq, hkv, hd, T, start, rows):
    """OCRIA_RT_ATTN_VERIFY=0 still runs the flash-decoding kernels correctly for these shapes."""
    rng = np.random.default_rng(hq + hd + T + start)
    pos = np.arange(start, start + T, dtype=np.int32)
    q, kc, vc, qkv = verify_inputs(rng, hq, hkv, hd, pos, rows)
    want = cpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd)
    assert relerr(split_gpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd), want) <= OUT_TOL


def test_model_scores_in_verify_blocks(monkeypatch):
    """ocria-mini (head_dim 64, 4 q / 2 kv heads) scoring a sequence 16 tokens per forward pass, as a
    speculative decoding step verifies a block: its logits are as close to the CPU's with the verify
    kernel as with the flash-decoding kernels (OCRIA_RT_ATTN_VERIFY=0, read when the engine's backend is
    constructed)."""
    import ocria_rt

    text = "Invoice no. 4471, 12 March: 3 x widgets at 19.99 each; shipping 4.50; total due 64.47.\n" * 6
    want = ocria_rt.Engine().score(text)
    got = {}
    for verify in ("1", "0"):
        monkeypatch.setenv("OCRIA_RT_ATTN_VERIFY", verify)
        got[verify] = ocria_rt.Engine(device="cuda").score(text, chunk=16)
    assert len(want) > 64
    errs = {v: np.mean([relerr(g[t], want[t]) for t in range(len(want))]) for v, g in got.items()}
    assert np.isfinite(errs["1"]) and errs["1"] <= 1.25 * errs["0"] + 5e-3, errs
