"""The latency judge: regress / pass / hold for one judged metric of one stratum, every tick.

Input: per-report samples ``ln(candidate / stable)`` of one statistic (the mean or the p99 of the report's timed
calls, see :mod:`controller.judge.statistic`), in arrival order, with the node of each — *all* of the rollout's
samples for the stratum, across steps (evidence is carried: widening the canary adds nodes, it does not
reset the sequence).

Decision rule (issue 13): two one-sided **tests by betting** at the margin (Waudby-Smith & Ramdas,
"Estimating means of bounded random variables by betting", JRSS B 86(1), 2024, arXiv:2010.09686,
Sec. 4-5: the hedged-capital construction, one side at a time; see :mod:`controller.judge.confseq`):

* ``regress`` the wealth of the bet "the mean is above the margin" reached ``1/alpha`` (over the whole
  series or a restarted one, each at its share of alpha): by Ville's inequality and the union bound this
  happens with probability at most alpha, *at any time*, when the true (winsorised) mean is at or below the
  margin — so looking every tick, for the whole rollout, is allowed;
* ``pass``    the wealth of the bet "the mean is below the margin" is at ``1/alpha`` *now* (not at some
  past tick: a pass holds only while it still holds) — anytime-valid in the same way;
* ``hold``    neither, or fewer than ``min_samples`` usable samples (no data is never a pass).

The reported ``lower``/``upper`` are the confidence bounds obtained by inverting each test over m (the
set of means each bet has not refuted); ``lower >= margin`` iff ``regress``.

Why betting and not the empirical-Bernstein sequence of the first version: a bounded-data sequence pays
for the *range* of the data, and the EB sequence's bet is capped at ``c / (2 * clip)`` in both
directions, so a +5% regression on one node took ~36 samples. Each one-sided bet only has to survive a
sample at its *near* winsorisation bound, ``resolution`` (D, default 3%) on the safe side of the margin:
the regress test winsorises to ``[margin - D, clip]`` and may stake up to ``c / D`` per unit; the pass
test winsorises to ``[-clip, margin + D]``. Winsorising at ``margin - D`` raises the mean of a report
distribution only by ``E[(margin - D - X)+]`` (reports more than D *below* the margin: a candidate
clearly faster); the guarantee is for the winsorised mean.

Within-node dependence: Ville's inequality needs each sample's conditional mean, given the past, to be
at most the margin. Autocorrelated node states break that for a naive Kelly bet, which stakes as if
every sample were new information. Here the bet is the Gaussian-Kelly fraction ``g / (kappa * v)`` with
``kappa = (1 + rho) / (1 - rho)``, rho the lag-1 correlation between consecutive samples *of the same
node* (estimated predictably, rho up to 0.995, no cap at 10): the long-run-variance (batch-means) correction, so a run of
correlated samples buys as much wealth as the independent information it carries. This is a robustness
device, not an exact proof under arbitrary dependence (no test is at one node: a node whose ratio really
sits above the margin for a long stretch is, for that stretch, a slower candidate); the simulator
measures it under strong within-node AR(1) (``kernelctl sim judge --classes plus1_ar``).

Per-node balance (noisy-neighbour protection), decided **online** so that a sample's use never changes
later (the sequence is nested in time, as Ville's inequality needs): with m distinct nodes seen so far
(m >= 5), a sample is used only if its node then holds less than ``max_node_share`` (20%) of the used
samples (+1). With fewer than 5 nodes nobody is capped, so the first canary's history is kept in full
when the canary widens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from controller.judge.confseq import (
    DEFAULT_BET_CAP,
    DEFAULT_CLIP,
    DEFAULT_RESOLUTION,
    confidence_bound,
    margin_test,
)

DEFAULT_MAX_NODE_SHARE = 0.2
"""Largest share of the samples one node may contribute (when there are at least 5 nodes)."""

METHOD = "one-sided betting tests at the margin (Waudby-Smith & Ramdas 2024), node-dependence-robust bets"

HOLD, PASS, REGRESS = 0, 1, 2
_NAMES: dict[int, Literal["regress", "pass", "hold"]] = {HOLD: "hold", PASS: "pass", REGRESS: "regress"}


@dataclass(frozen=True)
class LatencyVerdict:
    """Decision and evidence for one metric at one tick (log-ratio units; ``pct`` helpers for humans)."""

    decision: Literal["regress", "pass", "hold"]
    n: int
    mean: float | None
    lower: float | None  # None: the regress side has refuted nothing (no lower bound beyond the clip)
    upper: float | None  # None: the pass side has refuted nothing
    margin: float
    alpha: float
    clipped: int
    method: str
    reason: str
    dropped: int = 0
    nodes: int = 0
    log_wealth_regress: float = 0.0
    log_wealth_pass: float = 0.0
    resolution: float = DEFAULT_RESOLUTION
    clip: float = DEFAULT_CLIP
    alpha_pass: float = 0.05

    def as_dict(self) -> dict[str, object]:
        """JSON-safe evidence for the changelog."""
        return {
            "decision": self.decision,
            "n": self.n,
            "mean": self.mean,
            "lower": self.lower,
            "upper": self.upper,
            "margin": self.margin,
            "alpha": self.alpha,
            "clipped": self.clipped,
            "dropped": self.dropped,
            "nodes": self.nodes,
            "method": self.method,
            "reason": self.reason,
            "log_wealth_regress": self.log_wealth_regress,
            "log_wealth_pass": self.log_wealth_pass,
            "alpha_pass": self.alpha_pass,
            "threshold": math.log(1.0 / self.alpha),
            "threshold_pass": math.log(1.0 / self.alpha_pass),
            "resolution": self.resolution,
            "clip": self.clip,
        }


def decide(regress_wealth: np.ndarray, pass_wealth: np.ndarray, n: np.ndarray, *, alpha: float,
           min_samples: int, alpha_pass: float | None = None) -> np.ndarray:
    """Vectorised decision rule shared by :func:`judge_latency` and the simulator (HOLD/PASS/REGRESS codes).

    Inputs are the log-wealths of the two margin tests (regress: its running maximum; pass: its current
    value, so a pass holds only while it still holds) and the sample counts at the same looks.
    """
    thr = math.log(1.0 / alpha)
    thr_pass = thr if alpha_pass is None else math.log(1.0 / alpha_pass)
    regress_wealth, pass_wealth, n = np.asarray(regress_wealth), np.asarray(pass_wealth), np.asarray(n)
    enough = n >= min_samples
    out = np.full(np.broadcast(regress_wealth, pass_wealth, n).shape, HOLD, dtype=np.int8)
    out[enough & (pass_wealth >= thr_pass)] = PASS
    out[enough & (regress_wealth >= thr)] = REGRESS
    return out


def sequential_wealth(x: np.ndarray, *, margin: float, resolution: float, clip: float,
                      cap: float = DEFAULT_BET_CAP, prev: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Log-wealth of the regress (running max) and pass (current) tests over the last axis (vectorised)."""
    up = margin_test(x, side="regress", margin=margin, resolution=resolution, far=clip, cap=cap, prev=prev)
    down = margin_test(x, side="pass", margin=margin, resolution=resolution, far=clip, cap=cap, prev=prev)
    return up, down


def balance_by_node(node_ids: Sequence[str], max_share: float = DEFAULT_MAX_NODE_SHARE) -> np.ndarray:
    """Boolean mask of the samples kept by the online per-node share cap (see module docstring)."""
    if not 0 < max_share <= 1:
        raise ValueError(f"max_node_share must be in (0, 1], got {max_share!r}")
    keep = np.zeros(len(node_ids), dtype=bool)
    kept: dict[str, int] = {}
    total = 0
    min_nodes = math.ceil(1.0 / max_share - 1e-9)
    for i, node in enumerate(node_ids):
        k = str(node)
        c = kept.setdefault(k, 0)
        if len(kept) < min_nodes or c < max_share * (total + 1) or c == 0:
            keep[i] = True
            kept[k] = c + 1
            total += 1
    return keep


@dataclass(frozen=True)
class NodePlan:
    """What the judge derives from the node ids alone (shared by every metric of one stratum)."""

    keep: np.ndarray  # samples used (online per-node balance)
    prev: np.ndarray  # per used sample: index (among used samples) of its node's previous one, or -1
    nodes: int

    @classmethod
    def of(cls, node_ids: Sequence[str], max_share: float = DEFAULT_MAX_NODE_SHARE) -> NodePlan:
        keep = balance_by_node(node_ids, max_share)
        ids = [str(x) for x in node_ids]
        kept = [ids[i] for i in np.flatnonzero(keep)]
        return cls(keep=keep, prev=previous_of_node(kept), nodes=len(set(ids)))


def previous_of_node(node_ids: Sequence[str]) -> np.ndarray:
    """Index of the previous sample of the same node (-1 for a node's first sample)."""
    last: dict[str, int] = {}
    prev = np.full(len(node_ids), -1, dtype=np.int64)
    for i, node in enumerate(node_ids):
        k = str(node)
        prev[i] = last.get(k, -1)
        last[k] = i
    return prev


def default_clip(margin: float) -> float:
    """Far winsorisation bound used when none is given: ``max(DEFAULT_CLIP, 5 * margin)``."""
    return max(DEFAULT_CLIP, 5.0 * margin)


def default_resolution(margin: float) -> float:
    """Near-bound distance D used when none is given: ``max(DEFAULT_RESOLUTION, 1.5 * margin)``."""
    return max(DEFAULT_RESOLUTION, 1.5 * margin)


def _pct(log_ratio: float) -> str:
    return f"{math.expm1(log_ratio) * 100:+.1f}%"


def _validate(samples: Sequence[float], node_ids: Sequence[str] | None, margin: float, alpha: float,
              min_samples: int, *, start: int = 0) -> np.ndarray:
    """The samples from index ``start`` on as a float array, and the parameters checked (a clear ValueError)."""
    if isinstance(samples, (str, bytes)):
        raise ValueError("samples must be a sequence of numbers (log-ratios), not a string")
    try:
        x = np.asarray(list(samples[start:] if start else samples), dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"samples must be a sequence of numbers (log-ratios): {exc}") from None
    if x.ndim != 1:
        raise ValueError(f"samples must be a flat sequence of numbers, got shape {x.shape}")
    bad = np.flatnonzero(~np.isfinite(x))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"samples[{start + i}] is {x[i]!r}: log-ratios must be finite ({bad.size} non-finite sample(s); "
            "a zero, negative or missing latency gives nan/inf)"
        )
    if node_ids is not None and len(node_ids) != start + x.size:
        raise ValueError(f"node_ids has {len(node_ids)} entries but samples has {start + x.size}: they must pair up")
    _check_levels(margin, alpha, min_samples)
    return x


def _check_levels(margin: float, alpha: float, min_samples: int) -> None:
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(f"margin must be a finite log-ratio >= 0 (e.g. math.log(1.02)), got {margin!r}")
    if not (isinstance(alpha, (int, float)) and 0 < alpha < 1):
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    if not (isinstance(min_samples, int) and min_samples >= 1):
        raise ValueError(f"min_samples must be an integer >= 1, got {min_samples!r}")


def check_params(margin: float, alpha: float, alpha_pass: float | None, clip: float | None,
                 resolution: float | None, lambda_cap: float) -> tuple[float, float, float]:
    """(alpha_pass, clip, resolution) with their defaults, checked (a ValueError naming the problem)."""
    alpha_pass = alpha if alpha_pass is None else alpha_pass
    if not (isinstance(alpha_pass, (int, float)) and 0 < alpha_pass < 1):
        raise ValueError(f"alpha_pass must be in (0, 1), got {alpha_pass!r}")
    clip = default_clip(margin) if clip is None else clip
    resolution = default_resolution(margin) if resolution is None else resolution
    if not (math.isfinite(resolution) and resolution > 0):
        raise ValueError(f"resolution must be a positive finite log-ratio, got {resolution!r}")
    if not (math.isfinite(clip) and clip > 2 * margin and clip > margin + resolution / 2):
        raise ValueError(f"clip {clip!r} must be finite and more than twice the margin {margin:.4f} "
                         f"and above margin + resolution / 2")
    if not 0 < lambda_cap < 1:
        raise ValueError(f"lambda_cap must be in (0, 1), got {lambda_cap!r}")
    return alpha_pass, clip, resolution


def judge_latency(
    samples: Sequence[float],
    *,
    margin: float = math.log(1.02),
    alpha: float = 0.05,
    min_samples: int = 5,
    node_ids: Sequence[str] | None = None,
    clip: float | None = None,
    lambda_cap: float = DEFAULT_BET_CAP,
    max_node_share: float = DEFAULT_MAX_NODE_SHARE,
    resolution: float | None = None,
    alpha_pass: float | None = None,
    node_plan: NodePlan | None = None,
) -> LatencyVerdict:
    """Judge paired log-ratios ``ln(candidate/stable)`` (arrival order) against ``+margin``.

    ``clip`` (far winsorisation bound) defaults to ``default_clip(margin)``, ``resolution`` (distance of
    each test's near bound from the margin) to ``default_resolution(margin)``; ``lambda_cap`` is the bet
    cap c in (0, 1); ``alpha_pass`` (default ``alpha``) is the level of the pass test. Raises
    ``ValueError`` naming the problem for non-finite samples, mismatched
    ``node_ids`` or bad parameters. (:class:`controller.judge.running.LatencyState` gives the same verdict
    from state carried between calls, for a series that only grows.)
    """
    x = _validate(samples, node_ids, margin, alpha, min_samples)
    alpha_pass, clip, resolution = check_params(margin, alpha, alpha_pass, clip, resolution, lambda_cap)
    dropped, nodes = 0, 0
    prev = None
    if node_ids is not None:
        plan = NodePlan.of(node_ids, max_node_share) if node_plan is None else node_plan
        if plan.keep.size != x.size:
            raise ValueError(f"node_plan covers {plan.keep.size} samples but samples has {x.size}")
        dropped = int((~plan.keep).sum())
        nodes = plan.nodes
        x = x[plan.keep]
        prev = plan.prev

    def tests() -> tuple[float, float, float, float]:
        kw = {"margin": margin, "resolution": resolution, "far": clip, "cap": lambda_cap, "prev": prev}
        up, down = sequential_wealth(x, margin=margin, resolution=resolution, clip=clip, cap=lambda_cap, prev=prev)
        lower = confidence_bound(x, side="regress", alpha=alpha, **kw)  # type: ignore[arg-type]
        upper = confidence_bound(x, side="pass", alpha=alpha_pass, **kw)  # type: ignore[arg-type]
        return float(up[-1]), float(down[-1]), lower, upper

    return verdict(x, tests, dropped=dropped, nodes=nodes, margin=margin, alpha=alpha, alpha_pass=alpha_pass,
                   min_samples=min_samples, clip=clip, resolution=resolution, max_node_share=max_node_share)


def verdict(x: np.ndarray, tests: Callable[[], tuple[float, float, float, float]], *, dropped: int, nodes: int,
            margin: float, alpha: float, alpha_pass: float, min_samples: int, clip: float, resolution: float,
            max_node_share: float) -> LatencyVerdict:
    """The verdict from the used samples ``x`` and, when there are any, ``tests()``: the regress (running max)
    and pass (current) log-wealths at the margin and the two bisected confidence bounds (lower, upper)."""
    n_clipped = int((np.abs(x) > clip).sum())
    n = int(x.size)
    common = {"n": n, "margin": margin, "alpha": alpha, "alpha_pass": alpha_pass, "clipped": n_clipped, "method": METHOD,
              "dropped": dropped, "nodes": nodes, "resolution": resolution, "clip": clip}
    notes = ""
    if n_clipped:
        notes += f"; {n_clipped} sample(s) winsorised at ±{_pct(clip)[1:]}"
    if dropped:
        notes += f"; {dropped} sample(s) ignored by per-node balance (max share {max_node_share:.0%})"
    if n == 0:
        return LatencyVerdict(decision="hold", mean=None, lower=None, upper=None,
                              reason=f"no samples yet (need {min_samples}){notes}", **common)
    w_up, w_down, lower, upper = tests()
    code = int(decide(np.array(w_up), np.array(w_down), np.array(n), alpha=alpha, min_samples=min_samples,
                      alpha_pass=alpha_pass))
    # resolve the bisection tolerance in favour of the margin tests themselves
    lower = max(lower, margin) if w_up >= math.log(1.0 / alpha) else min(lower, margin - 1e-12)
    upper = min(upper, margin) if w_down >= math.log(1.0 / alpha_pass) else max(upper, margin + 1e-12)
    # a side that refuted nothing has no bound (the clip value it returns is not a measurement)
    low: float | None = lower if lower > -clip + 1e-9 else None
    up_b: float | None = upper if upper < clip - 1e-9 else None
    mean = float(np.clip(x, -clip, clip).mean())
    span = f"over {n} samples"
    if n < min_samples:
        reason = f"too few samples: {n} < min_samples {min_samples}"
    elif code == REGRESS:
        reason = f"candidate slower: lower bound {_pct(lower)} > margin {_pct(margin)} {span}"
    elif code == PASS:
        reason = f"candidate within margin: upper bound {_pct(upper)} < margin {_pct(margin)} {span}"
    else:
        reason = (f"inconclusive: upper bound {'none yet' if up_b is None else _pct(up_b)} not below the margin "
                  f"{_pct(margin)} {span} (mean {_pct(mean)})")
    return LatencyVerdict(decision=_NAMES[code], mean=mean, lower=low, upper=up_b,
                          reason=reason + notes, log_wealth_regress=w_up, log_wealth_pass=w_down, **common)
