"""The per-report statistic of one latency cell: one number from a trial's interleaved stable/candidate pairs.

Interface (stable; the estimator behind it may change): ``cell_log_ratio(stable_s, candidate_s)`` takes the
paired timings of one (op, batch-size) cell from one trial report, in measurement order, and returns one
paired log-ratio sample ``ln(candidate/stable)`` for the judge's sequential tests.

Estimator (issue 13): the **lower-quarter mean difference**. For each arm, the mean of the
``ceil(n/4)`` smallest log-timings; the sample is the candidate's minus the stable's. Why not the median of
the paired log-ratios (the first version): contention on a GPU node only ever *slows* a timing, and a
burst often hits one arm of the interleaving only (a neighbour's job starting between two launches). If a
share h of one arm's timings is slowed, the median paired ratio moves to the ``0.5 / (1 - h)`` quantile
of the clean pair distribution plus whatever the slowed pairs contribute past it; the mean of the fastest
quarter of the hit arm stays clean as long as a quarter of its timings are. Measured (8 pairs, per-timing
log-sd 2%, a burst slowing 40% of one arm's timings by x1.2-3; 200,000 reports): median paired ratio
shifted by +15.2% (sd 20.5%), lower-half mean by +3.4% (sd 6.9%), lower-quarter mean by **+0.9% (sd
2.6%)**; without a burst their sds are 1.16%, 1.16% and 1.41%. So the quarter costs ~1.5x the variance
on clean reports and removes almost all of a one-arm burst, which is what lets a stratum with contention
decide instead of holding to the deadline. Under symmetric noise without bursts every one of these
estimators is unbiased for a pure location shift.

Limit, by design: the statistic measures the *fast quarter* of each arm's timings. A candidate slower only
in its slower calls (a data-dependent slow path taken by fewer than ~3/4 of calls) is under-measured by the
per-cell statistic; the end-to-end
metric, timed as a whole decoder block, is the judge's check on such tails.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def lower_quarter_mean(log_t: np.ndarray) -> np.ndarray:
    """Mean of the ``ceil(n/4)`` smallest values along the last axis (vectorised)."""
    n = log_t.shape[-1]
    k = max(1, (n + 3) // 4)
    part = np.partition(log_t, k - 1, axis=-1)[..., :k]
    return part.mean(axis=-1)


def cell_log_ratios(stable_s: np.ndarray, candidate_s: np.ndarray) -> np.ndarray:
    """Vectorised :func:`cell_log_ratio` over leading axes (pairs on the last axis, positive timings)."""
    return lower_quarter_mean(np.log(candidate_s)) - lower_quarter_mean(np.log(stable_s))


def cell_log_ratio(stable_s: Sequence[float], candidate_s: Sequence[float]) -> float:
    """Robust paired log-ratio of one cell of one report (both sequences positive, finite, equal length)."""
    if len(stable_s) != len(candidate_s) or not stable_s:
        raise ValueError(f"cell needs equal, non-empty pair lists (got {len(stable_s)} and {len(candidate_s)})")
    s = np.asarray(stable_s, dtype=np.float64)
    c = np.asarray(candidate_s, dtype=np.float64)
    bad = ~(np.isfinite(s) & np.isfinite(c) & (s > 0) & (c > 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"cell pair {i} has a non-positive or non-finite timing ({s[i]!r}, {c[i]!r})")
    return float(cell_log_ratios(s, c))
