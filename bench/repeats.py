# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0
"""Statistics over the benchmark's interleaved repeats, and the target lines it prints.

Pure Python (no torch), shared by ``run_bench.py``, ``plots.py`` and the tests.

A row of ``results.json`` keeps, for each timing and memory field ``key`` (seconds or bytes),
the value of every repeat as ``row[key + "_per_repeat"]``, aligned with ``row["repeat_index"]``
(the repeat numbers 0, 1, ... that ran; a repeat that crashed is absent). Repeat ``i`` of every
build ran in the same round of launches (interleaved: repeat 1 of every build, then repeat 2,
...), so a ratio between two builds pairs repeat ``i`` with repeat ``i``: machine noise that hit
round ``i`` hits both sides of its ratio.
"""

import math
import statistics
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional


@dataclass(frozen=True)
class Spread:
    """Median and range of a set of samples (same unit as the samples), and how many there were."""
    median: float
    low: float
    high: float
    n: int

    def format(self, spec: str = "auto", scale: float = 1.0) -> str:
        """``median [low-high]`` (just ``median`` for one sample) with every value multiplied by
        ``scale`` (e.g. 1e3 for ms); ``spec`` a format spec, or ``auto``: no decimals from 100 up,
        else 3 significant digits."""
        m, lo, hi = (_number(v * scale, spec) for v in (self.median, self.low, self.high))
        return m if self.n == 1 else f"{m} [{lo}-{hi}]"


def _number(value: float, spec: str) -> str:
    if spec == "auto":
        spec = ".0f" if abs(value) >= 100 else ".3g"
    return format(value, spec)


def spread(values: Iterable[Optional[float]]) -> Optional[Spread]:
    """Median, min and max of the values that are not None; None when there are none."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return Spread(statistics.median(vals), min(vals), max(vals), len(vals))


def per_repeat(row: Optional[Mapping], key: str) -> Dict[int, float]:
    """``{repeat: value}`` of ``key`` in an aggregated row (repeats where it was None left out).

    A row without ``key + "_per_repeat"`` (e.g. a field an older worker does not write) gives
    ``{}``."""
    if not row:
        return {}
    values = row.get(key + "_per_repeat")
    if values is None:
        return {}
    return {i: v for i, v in zip(row["repeat_index"], values) if v is not None}


def paired_ratios(numerator: Mapping[int, float], denominator: Mapping[int, float]) -> List[float]:
    """``numerator[i] / denominator[i]`` for every repeat ``i`` both have, in repeat order.

    A zero denominator gives ``inf`` (or 1.0 when the numerator is zero too): "patched needs
    memory where stock needs none" must not vanish from a worst-case check."""
    out = []
    for i in sorted(set(numerator) & set(denominator)):
        n, d = numerator[i], denominator[i]
        if d == 0:
            out.append(1.0 if n == 0 else math.inf)
        else:
            out.append(n / d)
    return out


def ratio_spread(numerator_row: Optional[Mapping], denominator_row: Optional[Mapping], key: str,
                 denominator_key: Optional[str] = None) -> Optional[Spread]:
    """Median and min-max of the per-repeat ratios ``numerator_row[key] / denominator_row[key]``
    (``denominator_key`` instead of ``key`` for the denominator if given), repeat ``i`` paired
    with repeat ``i``; None when no repeat has both."""
    return spread(paired_ratios(per_repeat(numerator_row, key), per_repeat(denominator_row, denominator_key or key)))


def target_line(name: str, value: Optional[float], met: bool, reason: Optional[str] = None,
                spec: str = ".2f") -> str:
    """One target line: ``target <name>: <value> <met|MISSED>``, and ``(reason)`` after MISSED.

    ``value`` None (not measured) prints ``-`` and is always MISSED: a target nobody measured is
    not met. ``name`` must not contain ``": "`` (the separator a reader splits on).

    Raises ValueError for a name containing ``": "``."""
    if ": " in name:
        raise ValueError(f"target name {name!r} contains ': '")
    met = bool(met) and value is not None
    shown = "-" if value is None else format(value, spec)
    line = f"target {name}: {shown} {'met' if met else 'MISSED'}"
    if not met and reason:
        line += f" ({reason})"
    return line
