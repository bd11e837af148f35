"""The seeded fuzz of scripts/fuzz_inputs.py: corrupted checkpoints, side files and documents through
the public API end in success or an OcriaError; no crash, hang, foreign exception or non-finite logits.
The long run is the same script with --cases N."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import fuzz_inputs  # noqa: E402

CI_CASES = 800  # about 20 CPU-seconds; the mix of fuzz_inputs.KINDS


def test_the_runner_tells_every_outcome_apart():
    """Probe cases that succeed, raise an OcriaError, a foreign exception or an InternalError, score NaN,
    abort or hang, in the worker itself and forked: each is recorded as such, and the cases after a
    crash or a hang of the worker still run."""
    n = len(fuzz_inputs.PROBE_BEHAVIOURS)
    cases = [(kind, 0, i) for kind in fuzz_inputs.PROBE_KINDS for i in range(n)]
    report = fuzz_inputs.run_fuzz(cases, jobs=2, timeout=1.0)
    got = {(r["kind"], r["index"]): r["outcome"] for r in report.results}
    assert len(report.results) == len(cases)
    for kind, _, i in cases:
        assert got[(kind, i)] == fuzz_inputs.PROBE_BEHAVIOURS[i], (kind, i, report.summary())
    assert {r["what"] for r in report.failures} == {f"probe: {b}" for b in fuzz_inputs.FAILING}


def test_fuzz_inputs(capsys):
    cases = fuzz_inputs.plan(CI_CASES, seed=0)
    report = fuzz_inputs.run_fuzz(cases, jobs=2, timeout=60.0)
    with capsys.disabled():
        print(f"\nfuzz_inputs: seed 0, {len(cases)} cases\n{report.summary()}")
    assert len(report.results) == len(cases)
    assert not report.failures, report.summary()
    counts = report.counts()
    for kind in fuzz_inputs.KINDS:  # every kind ran, and its mutations were not all harmless or all fatal
        assert counts[kind]["error"] > 0, (kind, counts[kind])
    assert sum(c["ok"] for c in counts.values()) > len(cases) // 10
