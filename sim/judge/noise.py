"""Latency noise model for simulated canaries: what one trial report of one node looks like.

Each report holds ``pairs_per_report`` interleaved (stable, candidate) timings of the same kernel on the
same node. In log space a timing is

    log t[arm] = node_base + noisy_bias + state_t + (arm == candidate) * (delta + node_ratio + ratio_t) + e

=========================  =========  ===========================================================
parameter                  default    meaning
=========================  =========  ===========================================================
pairs_per_report           16         interleaved pairs in one report (the engine keeps their median)
node_baseline_sd           0.10       per-node log speed offset, both arms (different boards/clocks)
state_phi, state_sd        0.8, 0.05  AR(1) node state across consecutive trials, both arms (thermal,
                                      clocks); ``state_sd`` is the stationary sd
ratio_phi, ratio_sd        0.6, 0.004 AR(1) across trials *in the log-ratio* (node state changes the
                                      candidate's relative speed, e.g. memory- vs compute-bound)
node_ratio_sd              0.003      persistent per-node log-ratio offset (heterogeneous effect)
sigma                      0.02       log-sd of one timing (the bulk)
heavy_frac, heavy_mult     0.10, 4.0  lognormal mixture: 10% of timings have a 4x wider log-sd
outlier_prob, outlier_*    0.01, 2-5  a timing is slowed by a factor U(2, 5) (preemption, page faults)
neighbour_frac             0.10       share of nodes with a noisy neighbour:
neighbour_bias             0.3        persistent log slow-down of both arms (x1.35)
neighbour_sigma_mult       3.0        3x the per-timing log-sd on both arms
burst_start, burst_stop    0.1, 0.5   Markov on/off contention bursts per trial (noisy nodes only)
burst_hit_prob, burst_*    0.3, 1.2-3 in a burst each timing is slowed by U(1.2, 3) with prob. 0.3
=========================  =========  ===========================================================

Everything is vectorised over runs x ticks x nodes x pairs in float32.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class NoiseModel:
    """Parameters of the canary latency noise model (see the module table)."""

    pairs_per_report: int = 16
    node_baseline_sd: float = 0.10
    state_phi: float = 0.8
    state_sd: float = 0.05
    ratio_phi: float = 0.6
    ratio_sd: float = 0.004
    node_ratio_sd: float = 0.003
    sigma: float = 0.02
    heavy_frac: float = 0.10
    heavy_mult: float = 4.0
    outlier_prob: float = 0.01
    outlier_min: float = 2.0
    outlier_max: float = 5.0
    neighbour_frac: float = 0.10
    neighbour_bias: float = 0.3
    neighbour_sigma_mult: float = 3.0
    burst_start: float = 0.1
    burst_stop: float = 0.5
    burst_hit_prob: float = 0.3
    burst_min: float = 1.2
    burst_max: float = 3.0

    def as_dict(self) -> dict[str, float]:
        """Parameters as a plain dict (for reports)."""
        return asdict(self)


@dataclass(frozen=True)
class Reports:
    """Simulated reports, each array shaped (runs, ticks, nodes).

    ``ratio`` is the report's median ln(candidate/stable) over its pairs (what the engine hands the
    judge); ``stable``/``candidate`` are the report's median latency per arm (relative units).
    """

    ratio: np.ndarray
    stable: np.ndarray
    candidate: np.ndarray


def _ar1(rng: np.random.Generator, shape: tuple[int, int], ticks: int, phi: float, sd: float) -> np.ndarray:
    """Stationary AR(1) paths with marginal sd ``sd``: returns (runs, ticks, nodes)."""
    out = np.empty((shape[0], ticks, shape[1]), dtype=np.float32)
    cur = rng.standard_normal(shape, dtype=np.float32) * sd
    innov = sd * math.sqrt(1.0 - phi * phi)
    for t in range(ticks):
        if t:
            cur = phi * cur + innov * rng.standard_normal(shape, dtype=np.float32)
        out[:, t] = cur
    return out


def _scatter(rng: np.random.Generator, size: int, prob: float) -> np.ndarray:
    """Random flat indices hitting each of ``size`` cells with probability ~``prob``."""
    return rng.integers(0, size, rng.binomial(size, prob)) if prob > 0 else np.zeros(0, dtype=np.int64)


def simulate_reports(
    rng: np.random.Generator, *, runs: int, ticks: int, nodes: int, log_effect: float,
    model: NoiseModel = NoiseModel(),
) -> Reports:
    """Simulate ``runs`` canaries of ``nodes`` nodes for ``ticks`` trials each, true log-ratio ``log_effect``."""
    m = model
    rk = (runs, nodes)
    p = m.pairs_per_report
    noisy = rng.random(rk) < m.neighbour_frac  # (R, K)
    base = rng.standard_normal(rk, dtype=np.float32) * m.node_baseline_sd + noisy * m.neighbour_bias
    node_ratio = rng.standard_normal(rk, dtype=np.float32) * m.node_ratio_sd
    state = _ar1(rng, rk, ticks, m.state_phi, m.state_sd)
    ratio_drift = _ar1(rng, rk, ticks, m.ratio_phi, m.ratio_sd)

    # bursts: two-state Markov chain per noisy node
    burst = np.zeros((runs, ticks, nodes), dtype=bool)
    on = (rng.random(rk) < m.burst_start / (m.burst_start + m.burst_stop)) & noisy
    for t in range(ticks):
        if t:
            u = rng.random(rk)
            on = np.where(on, u >= m.burst_stop, u < m.burst_start) & noisy
        burst[:, t] = on

    # per-timing noise e: (R*T*K, pairs, 2 arms)
    scale = np.where(noisy, m.sigma * m.neighbour_sigma_mult, m.sigma).astype(np.float32)
    e = rng.standard_normal((runs, ticks, nodes, p, 2), dtype=np.float32)
    e *= scale[:, None, :, None, None]
    flat = e.reshape(-1)
    heavy = _scatter(rng, flat.size, m.heavy_frac)
    flat[heavy] *= m.heavy_mult
    out_idx = _scatter(rng, flat.size, m.outlier_prob)
    flat[out_idx] += np.log(rng.uniform(m.outlier_min, m.outlier_max, out_idx.size)).astype(np.float32)
    rows = e.reshape(-1, p, 2)
    hit_rows = np.flatnonzero(burst.reshape(-1))
    if hit_rows.size:
        hits = rng.random((hit_rows.size, p, 2)) < m.burst_hit_prob
        slow = np.log(rng.uniform(m.burst_min, m.burst_max, hits.shape)) * hits
        rows[hit_rows] += slow.astype(np.float32)

    shift = log_effect + node_ratio[:, None, :] + ratio_drift  # (R, T, K) candidate-only log shift
    ratio = np.median(e[..., 1] - e[..., 0], axis=-1) + shift
    level = base[:, None, :] + state
    stable = np.exp(level + np.median(e[..., 0], axis=-1))
    candidate = np.exp(level + shift + np.median(e[..., 1], axis=-1))
    return Reports(ratio=ratio.astype(np.float64), stable=stable, candidate=candidate)


# --------------------------------------------------------------------------------------------------------
# Noise classes of ``kernelctl sim judge --noise NAME`` (issue 13): per-cell reports for the family judge
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NoiseClass:
    """One named noise class of the family simulator (see ``NOISE_CLASSES`` and docs/benchmarks.md).

    A report of node k at tick t holds, for each of ``cells`` (op, batch-size) cells, ``pairs``
    interleaved (stable, candidate) timings; per-timing log-noise has sd ``sigma`` of the cell (cells are
    spread over ``sigmas``). Everything else is added on top of that, in the log-ratio.
    """

    name: str
    description: str
    pairs: int = 8
    sigmas: tuple[float, ...] = (0.01, 0.02, 0.03)
    outlier_prob: float = 0.005  # a timing (either arm) slowed x U(2, 5)
    tail_df: float = 0.0  # > 0: a share tail_frac of timings is slowed by sigma * |t(tail_df)|
    tail_frac: float = 0.0
    heavy_outlier_prob: float = 0.0  # extra outliers x U(2, 10)
    ratio_phi: float = 0.0  # AR(1) of the log-ratio across a node's reports (all cells of a report)
    ratio_sd: float = 0.0  # its stationary sd
    burst_start: float = 0.0  # Markov contention bursts per node: P(off -> on) per tick
    burst_stop: float = 0.5  # P(on -> off)
    burst_hit: float = 0.4  # in a burst, each timing of ONE arm (random per report) is hit with this prob.
    burst_min: float = 1.2
    burst_max: float = 3.0
    offset_ratio: float = 0.0  # node 0 only: persistent log-ratio offset
    offset_sigma_mult: float = 1.0  # node 0 only: per-timing noise multiplier
    drift_sd: float = 0.0  # per-node linear drift of the log-ratio: its value after 60 ticks ~ N(0, drift_sd)
    e2e_pairs: int = 16  # end-to-end metric: interleaved block timings per report, sd e2e_sigma
    e2e_sigma: float = 0.015

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


NOISE_CLASSES: dict[str, NoiseClass] = {c.name: c for c in (
    NoiseClass("iid", "independent reports: Gaussian per-timing noise (sd 1-3% by cell), 0.5% outliers x2-5"),
    NoiseClass("autocorrelated", "iid + strong within-node AR(1) of the log-ratio (phi 0.9, sd 0.5%) shared by "
               "all cells of a report", ratio_phi=0.9, ratio_sd=0.005),
    NoiseClass("contention", "iid + Markov contention bursts (on 30% of reports, mean 2.9 ticks) hitting ONE arm: "
               "40% of its timings slowed x1.2-3", burst_start=0.15, burst_stop=0.35),
    NoiseClass("offset", "iid + node 0 persistently different: log-ratio offset +0.5%, 2x timing noise",
               offset_ratio=0.005, offset_sigma_mult=2.0),
    NoiseClass("heavy", "heavy slow tail: 25% of timings slowed by sd*|t(1.5)| (infinite variance), + 3% "
               "outliers x2-10", tail_df=1.5, tail_frac=0.25, heavy_outlier_prob=0.03),
    NoiseClass("drift", "iid + per-node linear drift of the log-ratio, N(0, 0.7%) after 60 ticks",
               drift_sd=0.007),
)}


def _timing_noise(rng: np.random.Generator, shape: tuple[int, ...], sigma: float, nc: NoiseClass) -> np.ndarray:
    e = rng.standard_normal(shape) * sigma
    if nc.tail_df > 0:  # one-sided: a timing is never much faster than the uncontended kernel
        e += np.abs(rng.standard_t(nc.tail_df, shape)) * sigma * (rng.random(shape) < nc.tail_frac)
    flat = e.reshape(-1)
    idx = _scatter(rng, flat.size, nc.outlier_prob)
    flat[idx] += np.log(rng.uniform(2.0, 5.0, idx.size))
    idx = _scatter(rng, flat.size, nc.heavy_outlier_prob)
    flat[idx] += np.log(rng.uniform(2.0, 10.0, idx.size))
    return e


def statistic_pool(rng: np.random.Generator, nc: NoiseClass, sigma: float, pairs: int, size: int,
                   burst: bool) -> np.ndarray:
    """``size`` draws of the per-report cell statistic (:func:`cell_log_ratios`) from raw timings.

    ``burst``: the candidate arm is in a one-arm contention burst (negate a draw for the stable arm).
    """
    from controller.judge.statistic import cell_log_ratios

    e = _timing_noise(rng, (size, pairs, 2), sigma, nc)
    if burst:
        hit = rng.random((size, pairs)) < nc.burst_hit
        e[..., 1] += np.log(rng.uniform(nc.burst_min, nc.burst_max, (size, pairs))) * hit
    return cell_log_ratios(np.exp(e[..., 0]), np.exp(e[..., 1])).astype(np.float32)


@dataclass(frozen=True)
class FamilyReports:
    """Simulated per-report samples: ``cells`` (runs, ticks, nodes, cells), ``e2e`` (runs, ticks, nodes)."""

    cells: np.ndarray
    e2e: np.ndarray


class FamilyNoise:
    """Draws family reports for one noise class; statistic pools are built once (vectorised, reused)."""

    def __init__(self, nc: NoiseClass, cells: int, seed: int, pool: int = 1 << 15) -> None:
        rng = np.random.default_rng([seed, 7919])
        self.nc = nc
        self.cell_sigma = np.array([nc.sigmas[i % len(nc.sigmas)] for i in range(cells)])
        levels = sorted(set(nc.sigmas) | {s * nc.offset_sigma_mult for s in nc.sigmas} | {nc.e2e_sigma})
        self.levels = levels
        self.clean = {s: statistic_pool(rng, nc, s, nc.pairs, pool, False) for s in levels}
        self.burst = ({s: statistic_pool(rng, nc, s, nc.pairs, pool, True) for s in levels}
                      if nc.burst_start > 0 else {})
        self.e2e_clean = statistic_pool(rng, nc, nc.e2e_sigma, nc.e2e_pairs, pool, False)
        self.e2e_burst = (statistic_pool(rng, nc, nc.e2e_sigma, nc.e2e_pairs, pool, True)
                          if nc.burst_start > 0 else None)
        self.pool = pool

    def draw(self, rng: np.random.Generator, *, runs: int, ticks: int, nodes: int, cell_effect: np.ndarray,
             weights: np.ndarray) -> FamilyReports:
        """Reports with per-cell true log-effects ``cell_effect``; e2e effect = traffic-weighted mean."""
        nc, pool = self.nc, self.pool
        ncell = cell_effect.size
        shape = (runs, ticks, nodes)
        burst = np.zeros(shape, dtype=bool)
        if nc.burst_start > 0:
            on = rng.random((runs, nodes)) < nc.burst_start / (nc.burst_start + nc.burst_stop)
            for t in range(ticks):
                if t:
                    u = rng.random((runs, nodes))
                    on = np.where(on, u >= nc.burst_stop, u < nc.burst_start)
                burst[:, t] = on
        sign = np.where(rng.random(shape) < 0.5, 1.0, -1.0).astype(np.float32)  # which arm the burst hits
        x = np.empty((runs, ticks, nodes, ncell), dtype=np.float32)
        node_mult = np.ones(nodes)
        node_mult[0] = nc.offset_sigma_mult
        for c in range(ncell):
            for k in range(nodes):
                s = float(self.cell_sigma[c] * node_mult[k])
                d = self.clean[s][rng.integers(0, pool, (runs, ticks))]
                if self.burst:
                    b = self.burst[s][rng.integers(0, pool, (runs, ticks))] * sign[:, :, k]
                    d = np.where(burst[:, :, k], b, d)
                x[:, :, k, c] = d
        e2e = self.e2e_clean[rng.integers(0, pool, shape)]
        if self.e2e_burst is not None:
            e2e = np.where(burst, self.e2e_burst[rng.integers(0, pool, shape)] * sign, e2e)
        common = np.zeros(shape, dtype=np.float32)
        if nc.ratio_sd > 0:
            common += _ar1(rng, (runs, nodes), ticks, nc.ratio_phi, nc.ratio_sd)
        if nc.drift_sd > 0:
            slope = rng.standard_normal((runs, nodes)).astype(np.float32) * (nc.drift_sd / 60.0)
            common += slope[:, None, :] * np.arange(ticks, dtype=np.float32)[None, :, None]
        if nc.offset_ratio:
            common[:, :, 0] += nc.offset_ratio
        x += common[..., None] + cell_effect.astype(np.float32)
        e2e = e2e + common + np.float32(np.dot(weights, cell_effect))
        return FamilyReports(cells=x, e2e=e2e.astype(np.float32))
