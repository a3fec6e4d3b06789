"""Candidate classes of ``kernelctl sim judge`` (issue 25): what one trial report of one node looks like.

A report holds, per (op, tokens) cell and for the end-to-end block, ``calls`` individually timed calls per arm,
interleaved (ABBA), after the warm-up: the trial's own measurement (:func:`kernelpack.harness.bench.
interleaved_calls`). Per-call log-time of an arm is

    node level + cell level + e + candidate effect

with ``e`` Gaussian (sd ``sigma`` of the cell: 1-3%), 0.2% of calls (either arm) slowed x U(2, 5), and a
contention burst in 20% of reports slowing a contiguous 20% of the report's calls x U(1.2, 2): the arms are
interleaved call by call, so a burst hits both. Per report the engine's statistics are taken from the raw calls
(:func:`controller.judge.statistic.arm_moments`: mean and p99 per arm). On top, classes may add an AR(1)
log-ratio across a node's consecutive reports (all cells and both statistics of a report share it).

Reports are drawn from pools of per-report arm statistics built once per (class, cell kind) from raw calls.
The fleet simulator's per-report noise lives in :mod:`sim.judge.fleet_noise` (re-exported here).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from controller.judge.statistic import arm_moments
from sim.judge.fleet_noise import NoiseModel, simulate_reports

__all__ = ["CLASSES", "CandidateClass", "NoiseModel", "Pool", "ar1", "pool", "report_calls", "simulate_reports"]

PASS, ROLLBACK = "promote", "roll back"


@dataclass(frozen=True)
class CandidateClass:
    """One candidate of the simulator and the verdict it deserves (see ``CLASSES``)."""

    name: str
    description: str
    expected: str
    shift: float = 0.0  # log-shift of every candidate call (all cells, e2e)
    spread: float = 1.0  # candidate per-call noise multiplier
    tail_frac: float = 0.0  # share of candidate calls slowed by tail_mult
    tail_mult: float = 1.0
    late_frac: float = 0.0  # the candidate's shift applies only after this share of the report's calls
    heavy_cell_shift: float = 0.0  # log-shift of the busiest cell (60% of the traffic) only
    ratio_phi: float = 0.0  # AR(1) of the log-ratio across a node's reports
    ratio_sd: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


L = math.log
CLASSES: dict[str, CandidateClass] = {c.name: c for c in (
    CandidateClass("identical", "candidate identical to stable", PASS),
    CandidateClass("plus1_ar", "+1% everywhere (inside the 2% margin), log-ratio AR(1) phi 0.9 sd 0.5% across "
                   "a node's reports", PASS, shift=L(1.01), ratio_phi=0.9, ratio_sd=0.005),
    CandidateClass("plus5", "+5% everywhere", ROLLBACK, shift=L(1.05)),
    CandidateClass("spread", "mean +5%, per-call spread x10", ROLLBACK, shift=L(1.05), spread=10.0),
    CandidateClass("tail10", "median equal, 10% of calls 2x slower (mean +10%)", ROLLBACK, tail_frac=0.10,
                   tail_mult=2.0),
    CandidateClass("p99", "median 3% faster, 3% of calls x1.35 (p99 about +30%, mean about -2%)", ROLLBACK,
                   shift=L(0.97), tail_frac=0.03, tail_mult=1.35 / 0.97),
    CandidateClass("late", "equal for the first 30% of each trial's calls, then +8%", ROLLBACK, shift=L(1.08),
                   late_frac=0.3),
    CandidateClass("heavy_cell", "+8% in the cell carrying 60% of the traffic (measured in every report)",
                   ROLLBACK, heavy_cell_shift=L(1.08)),
)}

SIGMAS = (0.01, 0.02, 0.03)
OUTLIER_PROB, BURST_PROB, BURST_SHARE = 0.002, 0.2, 0.2


def report_calls(rng: np.random.Generator, cls: CandidateClass, size: int, calls: int, sigma: float,
                 effect: bool, heavy: bool) -> tuple[np.ndarray, np.ndarray]:
    """Raw call times (size, calls) of both arms of ``size`` reports of one cell (level 1)."""
    e = rng.standard_normal((size, calls, 2)) * sigma
    e[..., 1] *= cls.spread if effect else 1.0
    out = rng.random((size, calls, 2)) < OUTLIER_PROB
    e += np.log(rng.uniform(2.0, 5.0, e.shape)) * out
    # contention: a contiguous stretch of the interleaved calls, both arms
    burst = rng.random(size) < BURST_PROB
    start = rng.integers(0, calls, size)
    idx = np.arange(calls)
    stretch = (idx[None, :] >= start[:, None]) & (idx[None, :] < start[:, None] + int(BURST_SHARE * calls))
    e += (np.log(rng.uniform(1.2, 2.0, size))[:, None] * (stretch & burst[:, None]))[..., None]
    if effect:
        shift = np.full((size, calls), cls.shift)
        if cls.late_frac:
            shift[:, : int(cls.late_frac * calls)] = 0.0
        if cls.tail_frac:
            shift += np.log(cls.tail_mult) * (rng.random((size, calls)) < cls.tail_frac)
        e[..., 1] += shift
    if heavy:
        e[..., 1] += cls.heavy_cell_shift
    t = np.exp(e)
    return t[..., 0], t[..., 1]


@dataclass(frozen=True)
class Pool:
    """Per-report arm statistics: (size, 4) = stable mean, stable p99, candidate mean, candidate p99."""

    stats: np.ndarray


def pool(rng: np.random.Generator, cls: CandidateClass, size: int, calls: int, sigma: float, effect: bool,
         heavy: bool) -> Pool:
    st, ca = report_calls(rng, cls, size, calls, sigma, effect, heavy)
    sm, sp = arm_moments(st)
    cm, cp = arm_moments(ca)
    return Pool(np.stack([sm, sp, cm, cp], axis=-1))


def ar1(rng: np.random.Generator, shape: tuple[int, int], ticks: int, phi: float, sd: float) -> np.ndarray:
    """Stationary AR(1) series (runs, ticks, nodes) with marginal sd ``sd``."""
    out = np.empty((shape[0], ticks, shape[1]))
    cur = rng.standard_normal(shape) * sd
    for t in range(ticks):
        if t:
            cur = phi * cur + sd * math.sqrt(1 - phi * phi) * rng.standard_normal(shape)
        out[:, t] = cur
    return out
