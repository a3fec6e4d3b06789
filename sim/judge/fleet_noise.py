"""The fleet simulator's per-report latency noise (:func:`simulate_reports`, used by :mod:`sim.fleet`).

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


