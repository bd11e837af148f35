"""bench/decode.py's greedy-token check between ours and the graph peer, on synthetic logits."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from decode import compare_greedy, token_check_cell  # noqa: E402


def test_disagreements_count_only_above_our_margin():
    ours = np.array([[0.0, 1.0, 0.2],    # margin 0.8: clear
                     [0.5, 0.45, 0.0],   # margin 0.05: within noise
                     [2.0, 0.0, 1.0],    # margin 1.0: clear
                     [0.0, 0.0, 3.0]])   # margin 3.0: clear
    theirs = ours.copy()
    theirs[1] = [0.44, 0.46, 0.0]        # flips the close call
    theirs[2] = [1.0, 0.0, 1.5]          # flips a clear one
    theirs[3, 2] += 0.01                 # agrees, 0.01 off
    tokens = [1, 0, 0, 2]
    r = compare_greedy(ours, theirs, tokens, margin=0.25)
    assert (r["steps"], r["steps_above_margin"], r["disagreements"], r["disagreements_above_margin"]) == (4, 3, 2, 1)
    assert r["margins_where_they_differ"] == [pytest.approx(0.05), pytest.approx(1.0)]
    assert r["max_abs_logit_diff"] == pytest.approx(1.0) and r["median_margin"] == pytest.approx(0.9)
    assert token_check_cell(r) == "1/3 (2/4)" and token_check_cell(None) == "-"
    # the same logits: nothing differs
    same = compare_greedy(ours, ours, tokens, margin=0.25)
    assert same["disagreements"] == 0 and same["max_abs_logit_diff"] == 0 and same["median_rel_logit_err"] == 0
