"""A family of judged metrics for one stratum: per cell and statistic, the traffic-weighted aggregate, e2e.

Interface (stable; the statistics behind it may change): the caller (``controller.gates``) hands in one
:class:`MetricSeries` per judged metric, each a series of per-report log-ratios ``ln(candidate/stable)`` in
arrival order — every sample of the rollout for the stratum, across steps — with the node of each sample and
the metric's own margin (issue 25: the mean and the p99 of every cell, of the aggregate and end to end, each
against its own margin). ``must_pass`` marks the metrics whose *pass* is needed to advance (by default all:
a candidate is promoted only if every cell, the aggregate and e2e are within margin on both statistics);
``summary`` marks the aggregate and e2e metrics for the multiplicity split.

Decision of the family:

* ``regress``: some metric's regress test rejected (the first such metric, in the caller's order, is
  the deciding one);
* ``pass``: every ``must_pass`` metric passes *now* (its current pass wealth, not a past one) and no metric
  regressed;
* ``hold``: otherwise.

Multiplicity: each metric's regress test is an anytime-valid level-``alpha_m`` test, so by the union bound
the family's false-rollback probability over *all* ticks of the rollout is at most ``sum_m alpha_m = alpha``
(valid under any dependence between metrics). **Weighted Bonferroni**: half of alpha is shared equally by the
summary metrics (aggregate, e2e), half by the cells (all of alpha to one group when the other is empty): the
cells mostly catch gross regressions, which win many nats per sample, while the aggregate has to resolve
small gaps. The *pass* tests run at the full ``alpha`` each (``alpha_pass``), no split: the family passes only
if *every* must-pass metric passes (an intersection-union test).

Per-metric parameters: near bound D = ``default_resolution(margin)``; far clip ``default_clip(margin)`` for
the summary metrics and at least 0.75 (x2.1) for the cells, so that a cell 2x slower is measured as such.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from controller.judge.confseq import DEFAULT_BET_CAP
from controller.judge.latency import (
    DEFAULT_MAX_NODE_SHARE,
    LatencyVerdict,
    NodePlan,
    default_clip,
    default_resolution,
    judge_latency,
)
from controller.judge.running import LatencyState

CELL_CLIP = 0.75
"""Far winsorisation bound of the per-cell tests: a 2x slower cell (ln 2 = 0.69) is not clipped."""

SUMMARY_SHARE = 0.5
"""Share of the family's alpha given to the summary metrics (aggregate, e2e; the rest to the cells)."""

METHOD = "weighted bonferroni over one-sided betting tests"


@dataclass(frozen=True)
class MetricSeries:
    """One judged metric's per-report samples (log-ratios, arrival order) and its margin (log-ratio)."""

    samples: Sequence[float]
    node_ids: Sequence[str]
    margin: float
    summary: bool = False  # the aggregate or e2e (multiplicity split)
    must_pass: bool = True
    resolution: float | None = None  # None: family default for the metric's kind
    clip: float | None = None


@dataclass(frozen=True)
class FamilyVerdict:
    decision: Literal["regress", "pass", "hold"]
    metrics: dict[str, LatencyVerdict]
    deciding: str | None  # the metric that decided a regress (or the first holding must-pass metric)
    alpha_per_metric: float  # the smallest per-metric level (the cells' share)
    method: str = field(default=METHOD)
    alphas: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {"decision": self.decision, "deciding": self.deciding, "alpha_per_metric": self.alpha_per_metric,
                "method": self.method, "alphas": dict(self.alphas),
                "metrics": {k: v.as_dict() for k, v in self.metrics.items()}}


def split_alpha(summary: Mapping[str, bool], alpha: float) -> dict[str, float]:
    """Per-metric levels of the weighted Bonferroni split (they sum to ``alpha``)."""
    n_sum = sum(1 for a in summary.values() if a)
    n_other = len(summary) - n_sum
    share = SUMMARY_SHARE if n_sum and n_other else (1.0 if n_sum else 0.0)
    return {name: alpha * share / n_sum if is_sum else alpha * (1.0 - share) / n_other
            for name, is_sum in summary.items()}


def metric_params(m: MetricSeries) -> tuple[float, float]:
    """(resolution, clip) used for one metric."""
    res = default_resolution(m.margin) if m.resolution is None else m.resolution
    clip = default_clip(m.margin) if m.summary else max(CELL_CLIP, default_clip(m.margin))
    return res, clip if m.clip is None else m.clip


class FamilyState:
    """The family's tests carried between calls (:mod:`controller.judge.running`), one state per metric: a metric
    whose ``samples`` is the list object it was last time, grown by appends, is continued; any other starts again."""

    def __init__(self) -> None:
        self.metrics: dict[str, LatencyState] = {}

    def of(self, name: str, m: MetricSeries, resolution: float, clip: float) -> LatencyState:
        st = self.metrics.get(name)
        params = (m.margin, resolution, clip, DEFAULT_BET_CAP, DEFAULT_MAX_NODE_SHARE)
        if st is None or st.params != params:
            st = self.metrics[name] = LatencyState(margin=m.margin, resolution=resolution, clip=clip)
        return st


def judge_family(metrics: Mapping[str, MetricSeries], *, alpha: float, min_samples: int,
                 state: FamilyState | None = None) -> FamilyVerdict:
    """Judge every metric at its share of ``alpha`` and combine (see the module docstring). ``state``: the tests
    carried from an earlier call on the same, since appended, series (the same verdict, bit for bit)."""
    if not metrics:
        raise ValueError("judge_family needs at least one metric")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    alphas = split_alpha({k: m.summary for k, m in metrics.items()}, alpha)
    verdicts = {}
    plans: list[tuple[Sequence[str], NodePlan]] = []  # node ids are usually shared by all metrics
    for name, m in metrics.items():
        res, clip = metric_params(m)
        if state is not None:
            st = state.of(name, m, res, clip)
            try:
                st.extend_to(m.samples, m.node_ids)
                verdicts[name] = st.verdict(alpha=alphas[name], min_samples=min_samples, alpha_pass=alpha)
            except ValueError as exc:
                raise ValueError(f"metric {name!r}: {exc}") from None
            continue
        plan = None
        if len(m.node_ids) == len(m.samples):
            plan = next((p for ids, p in plans if ids is m.node_ids or list(ids) == list(m.node_ids)), None)
            if plan is None:
                plan = NodePlan.of(m.node_ids)
                plans.append((m.node_ids, plan))
        try:
            verdicts[name] = judge_latency(m.samples, node_ids=m.node_ids, margin=m.margin, alpha=alphas[name],
                                           min_samples=min_samples, resolution=res, clip=clip, alpha_pass=alpha,
                                           node_plan=plan)
        except ValueError as exc:
            raise ValueError(f"metric {name!r}: {exc}") from None
    a_min = min(alphas.values())
    regressed = [k for k, v in verdicts.items() if v.decision == "regress"]
    if regressed:
        return FamilyVerdict("regress", verdicts, regressed[0], a_min, alphas=alphas)
    waiting = [k for k, m in metrics.items() if m.must_pass and verdicts[k].decision != "pass"]
    if waiting or not any(m.must_pass for m in metrics.values()):
        return FamilyVerdict("hold", verdicts, waiting[0] if waiting else None, a_min, alphas=alphas)
    return FamilyVerdict("pass", verdicts, None, a_min, alphas=alphas)
