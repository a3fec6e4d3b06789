"""The betting tests carried between ticks (issue 28): appending samples continues them, bit for bit.

:func:`controller.judge.latency.judge_latency` recomputes a metric's tests over every sample; the leader judges
each live stratum every few seconds while its series only grows. Every quantity the tests need at the last
sample is a *prefix* quantity, so :class:`LatencyState` keeps it and continues it with the new samples only:

* the online per-node balance and each used sample's previous same-node sample (:class:`NodeState`);
* per one-sided test and restart (:class:`RunningSide`, :class:`CarriedMoments`): the sums over the samples so
  far that the running moments and the dependence factor are made of (the pass side's also over the samples
  winsorised to the far bound only, which set its near bound, :func:`~controller.judge.confseq.pass_resolution`) (:func:`~controller.judge.confseq.moments`,
  :func:`~controller.judge.confseq.dependence`), the recent-mean filter's state, the log-wealth and (regress)
  its running maximum. The regress side's restarted tests (one every ``RESTART_EVERY`` samples) are rows of
  one array, so appending k samples to a series with J restarts costs one vectorised pass over J x k values
  (instead of the J passes over up to n samples of the full recomputation, O(n^2 / 32) values);
* the confidence bounds (:class:`BoundSearch`): the bisection over m asks whether the test *at m* rejected,
  and that wealth is a prefix quantity for a fixed m, but the m asked about move with the data. The bisection
  asks about the same grid points (halvings of a fixed interval) tick after tick until its path turns, so
  the wealth at each point the last tick asked about is kept and continued with the new samples; a point not
  asked about before is computed over the whole series (O(n)), as before. Not incremental in the worst case:
  a tick whose bound moved costs O(n) for each new point on the path below the turn.

**Exactness.** Every value is computed with the same floating-point operations in the same order as the full
recomputation: running sums continue a cumulative sum from the carried total (a test starting in the
middle of a batch continues from ``-0.0``, the exact additive identity, so its first sum is its first
sample as a fresh cumulative sum has it), the filter continues from its carried state, and elementwise
operations do not depend on the array they sit in. ``tests/controller/test_judge_running.py`` checks
bit-identical verdicts, wealths and bounds against :func:`~controller.judge.latency.judge_latency` for
random series fed in random chunks.

**Only appends.** A state continues only the list object it has read before, appended in place: handed a
different list (or a shorter one) it starts again from the whole series (:meth:`LatencyState.extend_to`).
Whoever owns the lists (``controller.evidence``) hands fresh ones whenever the series changed other than by
an append.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from controller.judge.confseq import (
    DEFAULT_BET_CAP,
    PRIOR_N,
    RECENT_HALF_LIFE,
    RESTART_EVERY,
    bet_size,
    bisect_bound,
    dependence,
    log_factors,
    moments,
    pass_prior_var,
    pass_resolution,
    prior_var,
    recent_from_sum,
    restart_penalty,
    side_bounds,
)
from controller.judge.latency import (
    DEFAULT_MAX_NODE_SHARE,
    LatencyVerdict,
    _check_levels,
    _validate,
    check_params,
    verdict,
)

_ID = -0.0  # x + -0.0 == x for every x, -0.0 included: a sum continued from it equals one started fresh


class _Grow:
    """A growing 1-d array (amortised appends)."""

    def __init__(self, dtype: type) -> None:
        self.buf = np.empty(64, dtype=dtype)
        self.n = 0

    def append(self, v: np.ndarray) -> None:
        need = self.n + v.size
        if need > self.buf.size:
            new = np.empty(max(need, 2 * self.buf.size), dtype=self.buf.dtype)
            new[:self.n] = self.buf[:self.n]
            self.buf = new
        self.buf[self.n:need] = v
        self.n = need

    @property
    def view(self) -> np.ndarray:
        return self.buf[:self.n]


def _continue(carry: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Running sums along the last axis continued from ``carry``: column 0 is the carry, column c + 1 the sum
    through ``v[..., c]``, with the additions of one cumulative sum over the whole series."""
    return np.cumsum(np.concatenate([carry[..., None], v], axis=-1), axis=-1)


class NodeState:
    """:func:`~controller.judge.latency.balance_by_node` and :func:`~controller.judge.latency.previous_of_node`
    (over the used samples), continued sample by sample (both are decided online)."""

    def __init__(self, max_share: float = DEFAULT_MAX_NODE_SHARE) -> None:
        if not 0 < max_share <= 1:
            raise ValueError(f"max_node_share must be in (0, 1], got {max_share!r}")
        self.max_share = max_share
        self.min_nodes = math.ceil(1.0 / max_share - 1e-9)
        self.kept: dict[str, int] = {}  # every node seen -> samples of it used
        self.total = 0  # samples used
        self.last: dict[str, int] = {}  # node -> index (among used samples) of its last used one
        self.dropped = 0

    def extend(self, node_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(keep mask of these samples, previous same-node used index of each kept one, or -1)."""
        keep = np.zeros(len(node_ids), dtype=bool)
        prev: list[int] = []
        kept, last = self.kept, self.last
        for i, node in enumerate(node_ids):
            k = str(node)
            c = kept.setdefault(k, 0)
            if len(kept) < self.min_nodes or c < self.max_share * (self.total + 1) or c == 0:
                keep[i] = True
                kept[k] = c + 1
                prev.append(last.get(k, -1))
                last[k] = self.total
                self.total += 1
            else:
                self.dropped += 1
        return keep, np.asarray(prev, dtype=np.int64)


class CarriedMoments:
    """The predictable running mean, variance and dependence factor of one series
    (:func:`~controller.judge.confseq.moments`, :func:`~controller.judge.confseq.dependence`) for each of
    several tests started at ``starts`` (rows), carried as the sums they are made of."""

    def __init__(self, margin: float, prior_var: float) -> None:
        self.margin, self.prior_var = margin, prior_var
        self.y = _Grow(np.float64)  # the series, for the previous-sample look-ups
        self.sums = np.zeros((6, 0))  # per row: sums of y, y^2, pairs, yc*yp, yc, yp over its samples so far

    def add_rows(self, rows: int) -> None:
        self.sums = np.concatenate([self.sums, np.full((6, rows), _ID)], axis=1)

    def extend(self, y: np.ndarray, prev: np.ndarray | None, starts: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Append ``y`` (k samples); (mean, variance, kappa, samples before, live) of each row at each of them,
        shape rows x k (``live`` false where a row's test starts after the sample)."""
        n0, k = self.y.n, y.size
        self.y.append(y)
        t = (n0 + np.arange(k))[None, :] - starts[:, None]
        live = t >= 0  # a restart begun inside this batch has no samples before its start
        t = t.astype(np.float64)
        yb = np.broadcast_to(y, t.shape)
        if prev is None:
            vals = np.stack([yb, yb * yb])
        else:
            yall = self.y.view
            has = (prev[None, :] >= starts[:, None]).astype(np.float64)
            yp = np.where(has > 0, yall[np.maximum(prev, 0)][None, :], yall[starts][:, None]) * has
            yc = y * has
            vals = np.stack([yb, yb * yb, has, yc * yp, yc, yp])
        vals = np.where(live, vals, _ID)
        run = _continue(self.sums[:len(vals)], vals)
        self.sums[:len(vals)] = run[..., -1]
        before = np.where(t == 0, 0.0, run[..., :-1])  # a fresh test's first sum is 0.0, as the full pass has
        mu, var, mean_d, ss = moments(before[0], before[1], t, self.margin, self.prior_var, PRIOR_N)
        kappa = (np.ones_like(var) if prev is None else
                 dependence(before[3], before[4], before[5], before[2], mean_d, ss, t, self.prior_var, PRIOR_N))
        return mu, var, kappa, t, live


class RunningSide:
    """One one-sided test at the margin (regress: with its restarted tests as further rows), carried."""

    def __init__(self, side: str, *, margin: float, resolution: float, far: float, cap: float) -> None:
        self.side, self.margin, self.cap, self.resolution, self.far = side, margin, cap, resolution, far
        self.lo, self.hi = side_bounds(side, margin, resolution, far)
        self.beta = 0.5 ** (1.0 / RECENT_HALF_LIFE)
        self.moments = CarriedMoments(margin, prior_var(resolution))  # of the winsorised samples
        # pass: of the samples winsorised to the far bound only, which set the near bound (pass_resolution)
        self.far_moments = CarriedMoments(margin, pass_prior_var(resolution))
        self.far_moments.add_rows(1)
        self.starts = np.zeros(0, dtype=np.int64)
        self.penalty = np.zeros(0)
        self.zi = np.zeros((0, 1))  # recent-mean filter state (regress)
        self.last_num = np.zeros(0)  # the filter's output at the last sample
        self.wealth = np.zeros(0)  # log-wealth now, per row
        self.peak = np.zeros(0)  # its running maximum (regress)

    @property
    def n(self) -> int:
        return self.moments.y.n

    def _add_rows(self, starts: list[int]) -> None:
        j0 = self.starts.size
        self.starts = np.concatenate([self.starts, np.asarray(starts, dtype=np.int64)])
        self.penalty = np.concatenate([self.penalty, [restart_penalty(j0 + i) for i in range(len(starts))]])
        self.moments.add_rows(len(starts))
        self.zi = np.concatenate([self.zi, np.zeros((len(starts), 1))])
        self.last_num = np.concatenate([self.last_num, np.zeros(len(starts))])
        self.wealth = np.concatenate([self.wealth, np.full(len(starts), _ID)])
        self.peak = np.concatenate([self.peak, np.full(len(starts), -np.inf)])

    def _upper(self, x: np.ndarray, prev: np.ndarray | None) -> float | np.ndarray:
        """Upper winsorisation bound of each of the samples ``x`` (the pass side's follows
        :func:`~controller.judge.confseq.pass_resolution`; the regress side's is fixed)."""
        if self.side != "pass":
            return self.hi
        if x.size == 0:
            return np.zeros(0)
        with np.errstate(all="ignore"):
            _, var, kappa, _, _ = self.far_moments.extend(np.clip(x, self.lo, self.far), prev, np.zeros(1, np.int64))
        return self.margin + pass_resolution(var[0], kappa[0], self.resolution)

    def extend(self, x: np.ndarray, prev: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Append used samples ``x`` (``prev``: index of each one's previous same-node sample, or -1);
        returns their winsorised values, the whole-series test's bets on them and their upper bounds."""
        n0, k = self.n, x.size
        hi = self._upper(x, prev)
        y = np.clip(x, self.lo, hi)
        new = [] if self.starts.size else [0]  # the test over the whole series, then (regress) the restarts
        if self.side == "regress":
            new += list(range(int(self.starts[-1]) + RESTART_EVERY if self.starts.size else RESTART_EVERY,
                              n0 + k, RESTART_EVERY))
        if new:
            self._add_rows(new)
        if k == 0:
            return y, np.zeros(0), np.zeros(0)
        with np.errstate(all="ignore"):  # columns before a row's start are computed, then ignored
            mu, var, kappa, t, live = self.moments.extend(y, prev, self.starts)
            yb = np.broadcast_to(y, t.shape)
            if self.side == "regress":
                from scipy.signal import lfilter

                out, self.zi = lfilter([1.0], [1.0, -self.beta], np.where(live, yb, _ID), axis=-1, zi=self.zi)
                num = np.where(t == 0, 0.0, np.concatenate([self.last_num[:, None], out[:, :-1]], axis=1))
                self.last_num = out[:, -1]
                gap = recent_from_sum(num, t, self.margin, PRIOR_N, self.beta) - self.margin
            else:
                gap = self.margin - mu
            lam = bet_size(gap, kappa, var)
            f = np.where(live, log_factors(yb, lam, self.margin, side=self.side, lo=self.lo, hi=hi,
                                           cap=self.cap), _ID)
        w = _continue(self.wealth, f)
        self.wealth = w[:, -1]
        if self.side == "regress":
            self.peak = np.maximum(self.peak, np.where(live, w[:, 1:], -np.inf).max(axis=1))
        return y, lam[0], np.broadcast_to(hi, y.shape)

    def log_wealth(self) -> float:
        """The test's value at the margin now: regress the best restart's running maximum net of its level
        (:func:`~controller.judge.confseq.margin_test`), pass the current wealth."""
        if self.side == "regress":
            return float((self.peak - self.penalty).max())
        return float(self.wealth[0])


class BoundSearch:
    """The confidence bound of one side (:func:`~controller.judge.confseq.confidence_bound`), with the wealth
    at each m the last search asked about carried and continued (see the module docstring)."""

    def __init__(self, side: str, *, lo: float, hi: float, far: float, cap: float) -> None:
        self.side, self.lo, self.hi, self.far, self.cap = side, lo, hi, far, cap
        self.y = _Grow(np.float64)
        self.lam = _Grow(np.float64)
        self.upper = _Grow(np.float64)  # each sample's upper winsorisation bound
        self.ms: dict[float, int] = {}  # m -> row of ``wealth``/``peak``
        self.wealth = np.zeros(0)
        self.peak = np.zeros(0)
        self.computed = 0  # points computed over the whole series (for the tests and the benchmark)

    def extend(self, y: np.ndarray, lam: np.ndarray, upper: np.ndarray) -> None:
        self.y.append(y)
        self.lam.append(lam)
        self.upper.append(upper)
        if self.ms and y.size:
            m = np.fromiter(self.ms, dtype=np.float64, count=len(self.ms))[:, None]
            w = _continue(self.wealth, log_factors(y[None, :], lam[None, :], m, side=self.side, lo=self.lo,
                                                   hi=upper[None, :], cap=self.cap))
            self.wealth = w[:, -1]
            self.peak = np.maximum(self.peak, w[:, 1:].max(axis=1))

    def _value(self, m: float, asked: dict[float, tuple[float, float]]) -> float:
        if m in asked:
            w, p = asked[m]
        elif m in self.ms:
            i = self.ms[m]
            w, p = float(self.wealth[i]), float(self.peak[i])
        else:
            run = np.cumsum(log_factors(self.y.view, self.lam.view, m, side=self.side, lo=self.lo,
                                        hi=self.upper.view, cap=self.cap))
            w, p = float(run[-1]), float(run.max())
            self.computed += 1
        asked[m] = (w, p)
        return p if self.side == "regress" else w

    def bound(self, alpha: float) -> float:
        thr = math.log(1.0 / alpha)
        asked: dict[float, tuple[float, float]] = {}
        out = bisect_bound(lambda m: self._value(m, asked) >= thr, side=self.side, lo=self.lo, hi=self.hi,
                           far=self.far)
        self.ms = {m: i for i, m in enumerate(asked)}  # keep what this search asked about, drop the rest
        self.wealth = np.array([w for w, _ in asked.values()])
        self.peak = np.array([p for _, p in asked.values()])
        return out


class LatencyState:
    """One metric's tests carried between calls: :meth:`extend_to` the series so far, then :meth:`verdict`
    gives what :func:`~controller.judge.latency.judge_latency` gives on the whole series, bit for bit."""

    def __init__(self, *, margin: float, resolution: float, clip: float, lambda_cap: float = DEFAULT_BET_CAP,
                 max_node_share: float = DEFAULT_MAX_NODE_SHARE) -> None:
        self.params = (margin, resolution, clip, lambda_cap, max_node_share)
        self._reset()

    def _reset(self) -> None:
        margin, resolution, clip, cap, _share = self.params
        self.source: Sequence[float] | None = None
        self.nodes: NodeState | None = None
        self.consumed = 0
        self.x = _Grow(np.float64)
        kw = {"margin": margin, "resolution": resolution, "far": clip, "cap": cap}
        self.sides = {s: RunningSide(s, **kw) for s in ("regress", "pass")}  # type: ignore[arg-type]
        self.bounds = {s: BoundSearch(s, lo=r.lo, hi=r.hi, far=clip, cap=cap) for s, r in self.sides.items()}
        self.restarts = 0  # times the state started again from the whole series

    def extend_to(self, samples: Sequence[float], node_ids: Sequence[str] | None) -> None:
        """Take in the samples (and their nodes) beyond those already read; a different list object than last
        time, or a shorter one, starts again from the whole series. Raises ValueError as judge_latency does."""
        margin = self.params[0]
        if samples is not self.source or len(samples) < self.consumed or (
                self.consumed > 0 and (node_ids is None) != (self.nodes is None)):
            restarts = self.restarts + (self.source is not None)
            self._reset()
            self.restarts = restarts
        x = _validate(samples, node_ids, margin, 0.5, 1, start=self.consumed)
        if self.consumed == 0:
            self.nodes = None if node_ids is None else NodeState(self.params[4])
        prev = None
        if self.nodes is not None and node_ids is not None:
            keep, prev = self.nodes.extend(node_ids[self.consumed:])
            x = x[keep]
        self.source, self.consumed = samples, len(samples)
        self.x.append(x)
        for side, run in self.sides.items():
            self.bounds[side].extend(*run.extend(x, prev))

    def verdict(self, *, alpha: float, min_samples: int, alpha_pass: float | None = None) -> LatencyVerdict:
        margin, resolution, clip, cap, share = self.params
        _check_levels(margin, alpha, min_samples)
        alpha_pass, clip, resolution = check_params(margin, alpha, alpha_pass, clip, resolution, cap)

        def tests() -> tuple[float, float, float, float]:
            return (self.sides["regress"].log_wealth(), self.sides["pass"].log_wealth(),
                    self.bounds["regress"].bound(alpha), self.bounds["pass"].bound(alpha_pass))

        nodes = self.nodes
        return verdict(self.x.view, tests, dropped=0 if nodes is None else nodes.dropped,
                       nodes=0 if nodes is None else len(nodes.kept), margin=margin, alpha=alpha,
                       alpha_pass=alpha_pass, min_samples=min_samples, clip=clip, resolution=resolution,
                       max_node_share=share)
