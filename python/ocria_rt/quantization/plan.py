"""Choosing a format per projection group: budgets and the greedy mixed-precision plan."""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..errors import InvalidArgumentError

_BUDGET = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z%]*)\s*$", re.IGNORECASE)
_BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_budget(text: str | float | int, weights: int) -> int:
    """The byte budget for the quantized projections' `weights` weights: "4.5" or "4.5bits" (average bits
    per weight, scales included), "40%" (of their BF16 bytes), or bytes: "3000000", "3MB", "2.5GiB" (a bare
    number above 32 is bytes)."""
    m = _BUDGET.match(str(text))
    if m is None or (m.group(2).lower() not in ("", "bit", "bits", "%") and m.group(2).lower() not in _BYTE_UNITS):
        raise InvalidArgumentError(f"budget {text!r}: expected bits per weight (e.g. 4.5 or 4.5bits), a share of the "
                                   f"BF16 bytes (e.g. 40%) or bytes (e.g. 3MB, 2.5GiB)")
    value, unit = float(m.group(1)), m.group(2).lower()
    if value <= 0:
        raise InvalidArgumentError(f"budget {text!r} must be positive")
    if unit == "%":
        return int(value / 100 * 2 * weights)
    if unit in ("bit", "bits") or (unit == "" and value <= 32):
        return int(value / 8 * weights)
    return int(value * _BYTE_UNITS.get(unit, 1))


def smallest_bytes(nbytes: Mapping[str, Mapping[str, int]]) -> int:
    """The bytes of the smallest plan: every group in its smallest format."""
    return sum(min(b.values()) for b in nbytes.values())


def _total(plan: Mapping[str, str], nbytes: Mapping[str, Mapping[str, int]]) -> int:
    return sum(nbytes[g][f] for g, f in plan.items())


def choose_mixed(kl: Mapping[str, Mapping[str, float]], nbytes: Mapping[str, Mapping[str, int]],
                 budget: int | None = None, max_kl: float | None = None) -> dict[str, str]:
    """A format per group from each group's KL and bytes by format (each dict has "dense" and the formats the
    group may take; dense has KL 0). Greedy from all dense: each step takes the move to a smaller format with
    the least KL added per byte saved.

    budget: the lowest summed KL within `budget` bytes: moves until the total fits, then moves back to
    larger formats that still fit where they lower the KL most per byte added. Otherwise max_kl: the fewest
    bytes whose summed KL stays at most max_kl (moves that would pass it are skipped)."""
    if (budget is None) == (max_kl is None):
        raise ValueError("give a budget or a max_kl")
    plan = {g: "dense" for g in nbytes}
    summed = 0.0

    def moves(smaller: bool):
        for g, f0 in plan.items():
            for f, b in nbytes[g].items():
                saved = nbytes[g][f0] - b
                if (saved > 0) == smaller and saved != 0:
                    yield g, f, max(kl[g][f], 0.0) - max(kl[g][f0], 0.0), saved

    while True:
        if budget is not None and _total(plan, nbytes) <= budget:
            break
        options = [(dk / saved, g, f, dk) for g, f, dk, saved in moves(smaller=True)
                   if max_kl is None or summed + dk <= max_kl]
        if not options:
            break
        _, g, f, dk = min(options)
        plan[g], summed = f, summed + dk
    if budget is not None:
        if _total(plan, nbytes) > budget:
            raise InvalidArgumentError(f"budget of {budget} bytes is below the smallest plan "
                                       f"({_total(plan, nbytes)} bytes)")
        while True:  # give bytes back where they buy the most KL
            room = budget - _total(plan, nbytes)
            # dk < 0 and saved < 0: the most negative dk / -saved lowers the KL most per byte added
            options = [(dk / -saved, g, f) for g, f, dk, saved in moves(smaller=False) if -saved <= room and dk < 0]
            if not options:
                break
            _, g, f = min(options)
            plan[g] = f
    return plan
