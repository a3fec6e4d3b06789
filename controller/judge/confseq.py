"""Anytime-valid confidence sequence for the mean of clipped paired log-ratios.

Method: the *predictable plug-in empirical-Bernstein* confidence sequence (PrPl-EB) of
Waudby-Smith & Ramdas, "Estimating means of bounded random variables by betting",
J. R. Stat. Soc. B 86(1), 2024 (arXiv:2010.09686), Theorem 2 with eqs. (13)-(15). For
observations Y_i in [0, 1] whose conditional mean is m and alpha in (0, 1):

    mu_hat_t   = (1/2 + sum_{i<=t} Y_i) / (t + 1)
    sigma2_t   = (1/4 + sum_{i<=t} (Y_i - mu_hat_i)^2) / (t + 1)
    lambda_t   = min( sqrt(2 log(2/alpha) / (sigma2_{t-1} * t * log(1 + t))), c )
    v_t        = 4 (Y_t - mu_hat_{t-1})^2
    psi_E(l)   = (-log(1 - l) - l) / 4
    C_t        = sum(lambda_i Y_i)/sum(lambda_i)  +/-  (log(2/alpha) + sum v_i psi_E(lambda_i)) / sum(lambda_i)

with mu_hat_0 = 1/2 and sigma2_0 = 1/4. P(for all t >= 1: m in C_t) >= 1 - alpha, so the judge may look
after every sample and every tick without inflating its error rate; the running intersection of the
C_t is therefore valid too and is what we return. (If conditional means vary, C_t covers their
lambda-weighted running average, Waudby-Smith & Ramdas Sec. 3.4 — for a balanced fleet that is the
average effect over the canary nodes.)

Heavy tails: the method needs bounded data, so log-ratios are winsorised to [-clip, +clip] and mapped to
[0, 1]. Default ``DEFAULT_CLIP`` = 0.1 (a factor of 1.105 either way; the judge widens it to 5x the margin
for margins above 2%). A report is already the median of many interleaved pairs, so |median log-ratio| >
0.1 is a gross regression or a broken measurement. Clipping is monotone: a gross regression stays a sample
at +clip, 5x the default margin, and is rolled back *faster* (the interval width scales with the clip);
the cost is that the reported mean understates regressions above +10.5%; the number clipped is reported
with the evidence. The interval is for the mean of the *clipped* log-ratio. Why not 0.5: the PrPl-EB
betting fraction is capped at c / (2 * clip), so the samples needed to resolve a gap scale with the clip
(tuned on simulator seed 101, see docs/benchmarks.md (judge section)). Everything is vectorised over the
last axis (prefix sums), so 10,000 nodes x tens of samples is a few milliseconds.
"""

from __future__ import annotations

import math

import numpy as np

DEFAULT_CLIP = 0.1
"""Winsorisation bound for one report's median log-ratio: |ln(candidate/stable)| <= 0.1 (x1.105)."""

DEFAULT_LAMBDA_CAP = 0.75
"""Upper bound c on the betting fraction lambda_t (Waudby-Smith & Ramdas suggest c = 1/2 or 3/4)."""


def clip_log_ratios(x: np.ndarray, bound: float = DEFAULT_CLIP) -> tuple[np.ndarray, np.ndarray]:
    """Winsorise ``x`` to [-bound, bound]; returns (clipped, count of clipped values over the last axis)."""
    if not (bound > 0 and math.isfinite(bound)):
        raise ValueError(f"clip bound must be a positive finite number, got {bound!r}")
    x = np.asarray(x, dtype=np.float64)
    outside = np.abs(x) > bound
    return np.clip(x, -bound, bound), outside.sum(axis=-1)


def eb_confseq(
    x: np.ndarray,
    *,
    alpha: float = 0.05,
    bound: float = DEFAULT_CLIP,
    lambda_cap: float = DEFAULT_LAMBDA_CAP,
    intersect: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PrPl-EB confidence sequence over every prefix of the last axis of ``x`` (values in [-bound, bound]).

    Returns ``(lower, upper, center)`` with the shape of ``x``: element ``[..., t]`` is the interval after
    the first ``t + 1`` observations, in log-ratio units, intersected with all earlier intervals when
    ``intersect`` is true. ``x`` must already be clipped (see :func:`clip_log_ratios`).
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    if not 0 < lambda_cap < 1:
        raise ValueError(f"lambda_cap must be in (0, 1), got {lambda_cap!r}")
    x = np.asarray(x, dtype=np.float64)
    if x.shape[-1] == 0:
        empty = np.empty(x.shape)
        return empty, empty.copy(), empty.copy()
    if np.any(np.abs(x) > bound * (1 + 1e-12)):
        raise ValueError(f"observations must lie in [-{bound}, {bound}]: clip them first")
    width = 2.0 * bound
    y = (x + bound) / width  # in [0, 1]
    n = x.shape[-1]
    t = np.arange(1, n + 1, dtype=np.float64)
    log_term = math.log(2.0 / alpha)

    mu_hat = (0.5 + np.cumsum(y, axis=-1)) / (t + 1.0)  # mu_hat_t, t = 1..n
    sq = (y - mu_hat) ** 2
    sigma2 = (0.25 + np.cumsum(sq, axis=-1)) / (t + 1.0)  # sigma2_t, t = 1..n
    # predictable versions: index t-1 (with mu_hat_0 = 1/2, sigma2_0 = 1/4)
    lead = [(0, 0)] * (x.ndim - 1) + [(1, 0)]
    mu_prev = np.pad(mu_hat[..., :-1], lead, constant_values=0.5)
    sigma2_prev = np.pad(sigma2[..., :-1], lead, constant_values=0.25)

    lam = np.minimum(np.sqrt(2.0 * log_term / (sigma2_prev * t * np.log1p(t))), lambda_cap)
    v = 4.0 * (y - mu_prev) ** 2
    psi = (-np.log1p(-lam) - lam) / 4.0

    sum_lam = np.cumsum(lam, axis=-1)
    center_y = np.cumsum(lam * y, axis=-1) / sum_lam
    half_y = (log_term + np.cumsum(v * psi, axis=-1)) / sum_lam

    lower = np.clip((center_y - half_y) * width - bound, -bound, bound)
    upper = np.clip((center_y + half_y) * width - bound, -bound, bound)
    center = center_y * width - bound
    if intersect:
        lower = np.maximum.accumulate(lower, axis=-1)
        upper = np.minimum.accumulate(upper, axis=-1)
    return lower, upper, center
