"""Kayenta-style baseline judge: a Mann-Whitney U test re-run every tick at a fixed alpha (for comparison).

Netflix/Spinnaker Kayenta's default metric classifier compares the canary and baseline time series of a
metric with a two-sided Mann-Whitney U test at a fixed confidence level and flags the metric "High" when
the difference is significant and the candidate is higher by more than the allowed effect size. Here the
series are per-tick aggregated latencies of the canary group (candidate arm) and the baseline group
(stable arm). It is a fixed-n test: re-evaluating it every tick is exactly the repeated-looks problem the
confidence sequence in :mod:`controller.judge.confseq` avoids, which the simulator measures.

Decision: ``regress`` when p < alpha *and* median(candidate) / median(stable) > exp(margin); ``hold``
with fewer than ``min_samples`` values per arm; otherwise ``pass``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy.stats import mannwhitneyu


@dataclass(frozen=True)
class MannWhitneyVerdict:
    """Outcome of one Mann-Whitney look."""

    decision: Literal["regress", "pass", "hold"]
    n_stable: int
    n_candidate: int
    p_value: float | None
    median_ratio: float | None
    alpha: float
    margin: float
    reason: str


def _as_latencies(name: str, values: Sequence[float]) -> np.ndarray:
    x = np.asarray(list(values), dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of latencies")
    bad = np.flatnonzero(~np.isfinite(x) | (x <= 0))
    if bad.size:
        raise ValueError(f"{name}[{int(bad[0])}] is {x[bad[0]]!r}: latencies must be finite and > 0")
    return x


def mw_regress(
    stable: np.ndarray, candidate: np.ndarray, *, alpha: float, margin: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised over leading axes (samples on the last axis): (regress flags, p-values, median ratios)."""
    p = mannwhitneyu(candidate, stable, alternative="two-sided", axis=-1, method="auto").pvalue
    ratio = np.median(candidate, axis=-1) / np.median(stable, axis=-1)
    return (p < alpha) & (ratio > math.exp(margin)), p, ratio


def judge_mannwhitney(
    stable: Sequence[float],
    candidate: Sequence[float],
    *,
    alpha: float = 0.05,
    margin: float = math.log(1.02),
    min_samples: int = 5,
) -> MannWhitneyVerdict:
    """Kayenta-style fixed-alpha Mann-Whitney judgement of candidate vs stable latencies (seconds)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(f"margin must be a finite log-ratio >= 0, got {margin!r}")
    s, c = _as_latencies("stable", stable), _as_latencies("candidate", candidate)
    if min(s.size, c.size) < min_samples:
        return MannWhitneyVerdict("hold", s.size, c.size, None, None, alpha, margin,
                                  f"too few samples: {min(s.size, c.size)} < min_samples {min_samples}")
    flag, p, ratio = mw_regress(s, c, alpha=alpha, margin=margin)
    p, ratio = float(p), float(ratio)
    if bool(flag):
        reason = f"candidate higher: p={p:.3g} < {alpha}, median ratio {ratio:.4f} > {math.exp(margin):.4f}"
        decision: Literal["regress", "pass", "hold"] = "regress"
    else:
        reason = f"no significant increase: p={p:.3g}, median ratio {ratio:.4f}"
        decision = "pass"
    return MannWhitneyVerdict(decision, s.size, c.size, p, ratio, alpha, margin, reason)
