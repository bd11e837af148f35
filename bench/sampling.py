"""The device sampler on one row of the 248,320-entry vocabulary, per configuration: the median time
per call and, from a torch.profiler (CUPTI) trace, the time of each CUDA kernel.

    python bench/sampling.py                    # PDL on: a kernel's time includes its wait in pdl_wait()
    OCRIA_RT_PDL=0 python bench/sampling.py     # ordinary launches: the time of each kernel by itself

Each configuration is timed by ocria_rt._core.KernelBench.sample (random logits in [-3, 3], `iters`
back-to-back calls captured in one CUDA graph, replayed `reps` times), after a warm-up. Needs a CUDA
build and torch.
"""

from __future__ import annotations

import collections

import torch

from ocria_rt import _core

V = 248320
# (label, temperature, top_k, top_p)
CONFIGS = [("greedy", 0.0, 0, 1.0), ("T0.7 k50 p0.95", 0.7, 50, 0.95), ("T1 nocut", 1.0, 0, 1.0),
           ("T1 p0.9", 1.0, 0, 0.9), ("T0.3 nocut", 0.3, 0, 1.0)]


def main() -> None:
    kb = _core.KernelBench("cuda")
    for label, t, k, p in CONFIGS:
        kb.sample(1, V, t, k, p, iters=5, reps=1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            us = kb.sample(1, V, t, k, p, iters=10, reps=3)
        per_kernel = collections.defaultdict(lambda: [0, 0.0])  # name -> [calls, total device us]
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                entry = per_kernel[e.name[:60]]
                entry[0] += 1
                entry[1] += e.device_time
        print(f"== {label}: median {sorted(us)[len(us) // 2]:.1f} us per call")
        for name, (n, total) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1]):
            print(f"   {name:60s} calls {n:4d}  avg {total / n:8.2f} us")


if __name__ == "__main__":
    main()
