"""The latency judge the rollout engine calls every tick: regress / pass / hold for one stratum.

Input: one paired sample per trial report, ``ln(candidate_time / stable_time)`` (the median over that
report's interleaved pairs), in arrival order, optionally with the node id of each. The judge winsorises
the samples (see :mod:`controller.judge.confseq`), applies per-node balance, computes the anytime-valid
PrPl-EB confidence sequence [lower, upper] for the mean log-ratio and decides:

* ``hold``    fewer than ``min_samples`` usable samples (no data is never a pass), or the interval
              still contains the margin;
* ``regress`` the lower bound is above ``+margin``: the candidate is slower than allowed (roll back);
* ``pass``    the upper bound is below ``+margin``: the candidate is clearly not worse than the margin.

Because the interval holds uniformly over time, evaluating after every tick does not inflate the
false-rollback rate. Per-node balance (noisy-neighbour protection): with m distinct nodes, no node may
contribute more than ``max(max_node_share, 1/m)`` of the samples used (default share 20%). The cap is the
largest per-node count k with k <= share * sum_j min(count_j, k); a node over the cap keeps its *earliest*
k samples, so the selection depends only on arrival order, never on the values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from controller.judge.confseq import DEFAULT_CLIP, DEFAULT_LAMBDA_CAP, clip_log_ratios, eb_confseq

DEFAULT_MAX_NODE_SHARE = 0.2
"""Largest share of the samples one node may contribute (when there are at least 5 nodes)."""

METHOD = "prpl-eb-cs (Waudby-Smith & Ramdas 2024)"

HOLD, PASS, REGRESS = 0, 1, 2
_NAMES: dict[int, Literal["regress", "pass", "hold"]] = {HOLD: "hold", PASS: "pass", REGRESS: "regress"}


@dataclass(frozen=True)
class LatencyVerdict:
    """Decision and evidence for one stratum at one tick (log-ratio units; ``pct`` helpers for humans)."""

    decision: Literal["regress", "pass", "hold"]
    n: int
    mean: float | None
    lower: float
    upper: float
    margin: float
    alpha: float
    clipped: int
    method: str
    reason: str
    dropped: int = 0
    nodes: int = 0

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
        }


def decide(
    lower: np.ndarray, upper: np.ndarray, n: np.ndarray, *, margin: float, min_samples: int
) -> np.ndarray:
    """Vectorised decision rule shared by :func:`judge_latency` and the simulator (HOLD/PASS/REGRESS codes)."""
    lower, upper, n = np.asarray(lower), np.asarray(upper), np.asarray(n)
    enough = n >= min_samples
    out = np.full(np.broadcast(lower, upper, n).shape, HOLD, dtype=np.int8)
    out[enough & (upper < margin)] = PASS
    out[enough & (lower > margin)] = REGRESS
    return out


def balance_by_node(node_ids: Sequence[str], max_share: float = DEFAULT_MAX_NODE_SHARE) -> np.ndarray:
    """Boolean mask of the samples kept by the per-node share cap (see module docstring)."""
    if not 0 < max_share <= 1:
        raise ValueError(f"max_node_share must be in (0, 1], got {max_share!r}")
    if len(node_ids) == 0:
        return np.zeros(0, dtype=bool)
    _, inverse, counts = np.unique(np.asarray(node_ids, dtype=object).astype(str), return_inverse=True,
                                   return_counts=True)
    share = max(max_share, 1.0 / len(counts))
    lo, hi = 1, int(counts.max())  # f(k) = share * sum(min(c, k)) - k is concave with f(0)=0, f(1)>=0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid <= share * np.minimum(counts, mid).sum() + 1e-9:
            lo = mid
        else:
            hi = mid - 1
    cap = lo
    # rank of each sample within its node, in arrival order
    order = np.argsort(inverse, kind="stable")
    rank = np.empty(len(inverse), dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rank[order] = np.arange(len(inverse)) - np.repeat(starts, counts)
    return rank < cap


def default_clip(margin: float) -> float:
    """Clip bound used when none is given: ``max(DEFAULT_CLIP, 5 * margin)``."""
    return max(DEFAULT_CLIP, 5.0 * margin)


def _pct(log_ratio: float) -> str:
    return f"{math.expm1(log_ratio) * 100:+.1f}%"


def _validate(samples: Sequence[float], node_ids: Sequence[str] | None, margin: float, alpha: float,
              min_samples: int) -> np.ndarray:
    if isinstance(samples, (str, bytes)):
        raise ValueError("samples must be a sequence of numbers (log-ratios), not a string")
    try:
        x = np.asarray(list(samples), dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"samples must be a sequence of numbers (log-ratios): {exc}") from None
    if x.ndim != 1:
        raise ValueError(f"samples must be a flat sequence of numbers, got shape {x.shape}")
    bad = np.flatnonzero(~np.isfinite(x))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"samples[{i}] is {x[i]!r}: log-ratios must be finite ({bad.size} non-finite sample(s); "
            "a zero, negative or missing latency gives nan/inf)"
        )
    if node_ids is not None and len(node_ids) != len(x):
        raise ValueError(f"node_ids has {len(node_ids)} entries but samples has {len(x)}: they must pair up")
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(f"margin must be a finite log-ratio >= 0 (e.g. math.log(1.02)), got {margin!r}")
    if not (isinstance(alpha, (int, float)) and 0 < alpha < 1):
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    if not (isinstance(min_samples, int) and min_samples >= 1):
        raise ValueError(f"min_samples must be an integer >= 1, got {min_samples!r}")
    return x


def judge_latency(
    samples: Sequence[float],
    *,
    margin: float = math.log(1.02),
    alpha: float = 0.05,
    min_samples: int = 5,
    node_ids: Sequence[str] | None = None,
    clip: float | None = None,
    lambda_cap: float = DEFAULT_LAMBDA_CAP,
    max_node_share: float = DEFAULT_MAX_NODE_SHARE,
) -> LatencyVerdict:
    """Judge paired log-ratios ``ln(candidate/stable)`` (arrival order) against ``+margin``.

    ``clip`` defaults to ``default_clip(margin)``. Raises ``ValueError`` naming the problem for non-finite
    samples, mismatched ``node_ids`` or bad parameters.
    """
    x = _validate(samples, node_ids, margin, alpha, min_samples)
    clip = default_clip(margin) if clip is None else clip
    if not (math.isfinite(clip) and clip > 2 * margin):
        raise ValueError(f"clip {clip!r} must be finite and more than twice the margin {margin:.4f}")
    dropped, nodes = 0, 0
    if node_ids is not None:
        keep = balance_by_node(node_ids, max_node_share)
        dropped = int((~keep).sum())
        nodes = len(set(map(str, node_ids)))
        x = x[keep]
    xc, n_clipped = clip_log_ratios(x, clip)
    n = int(x.size)
    common = {"n": n, "margin": margin, "alpha": alpha, "clipped": int(n_clipped), "method": METHOD,
              "dropped": dropped, "nodes": nodes}
    notes = ""
    if n_clipped:
        notes += f"; {int(n_clipped)} sample(s) clipped to ±{_pct(clip)[1:]}"
    if dropped:
        notes += f"; {dropped} sample(s) ignored by per-node balance (max share {max(max_node_share, 1 / nodes):.0%})"
    if n == 0:
        return LatencyVerdict(decision="hold", mean=None, lower=-clip, upper=clip,
                              reason=f"no samples yet (need {min_samples}){notes}", **common)
    lower_s, upper_s, _ = eb_confseq(xc, alpha=alpha, bound=clip, lambda_cap=lambda_cap)
    lower, upper, mean = float(lower_s[-1]), float(upper_s[-1]), float(xc.mean())
    code = int(decide(np.array(lower), np.array(upper), np.array(n), margin=margin, min_samples=min_samples))
    span = f"over {n} samples"
    if n < min_samples:
        reason = f"too few samples: {n} < min_samples {min_samples}"
    elif code == REGRESS:
        reason = f"candidate slower: lower bound {_pct(lower)} > margin {_pct(margin)} {span}"
    elif code == PASS:
        reason = f"candidate within margin: upper bound {_pct(upper)} < margin {_pct(margin)} {span}"
    else:
        reason = (f"inconclusive: interval [{_pct(lower)}, {_pct(upper)}] contains margin {_pct(margin)} "
                  f"{span} (mean {_pct(mean)})")
    return LatencyVerdict(decision=_NAMES[code], mean=mean, lower=lower, upper=upper,
                          reason=reason + notes, **common)


def advance_upper_bound(samples: Sequence[float], *, alpha: float = 0.05,
                        node_ids: Sequence[str] | None = None,
                        max_node_share: float = DEFAULT_MAX_NODE_SHARE) -> float | None:
    """One-sided Student-t upper confidence bound on the mean log-ratio, for the *advance* decision.

    The two directions carry different risks. A false rollback is what the anytime-valid confidence
    sequence above rules out, however often it is evaluated. A false advance only widens the canary, where
    the confidence sequence keeps watching with more evidence; so advancing uses this fixed-sample bound,
    which is far tighter at small n (the EB sequence needs 20+ samples however clean the data), taken once
    the step's bake time and minimum samples are met. None when fewer than 2 samples.
    """
    from scipy import stats

    x = np.asarray(samples, dtype=float)
    if node_ids is not None:
        x = x[balance_by_node(node_ids, max_node_share)]
    if x.size < 2:
        return None
    sd = float(x.std(ddof=1))
    return float(x.mean() + stats.t.ppf(1 - alpha, x.size - 1) * sd / math.sqrt(x.size))
