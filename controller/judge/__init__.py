"""Statistical judge for canary latency: anytime-valid margin tests, the metric family, baselines.

Public entry points: :func:`judge_latency` (one metric), :func:`controller.judge.family.judge_family`
(every judged metric of a stratum, with the multiplicity correction; what the rollout engine calls every
tick; with a :class:`~controller.judge.family.FamilyState` it carries the tests between ticks,
:mod:`controller.judge.running`, and :mod:`controller.judge.series` builds a stratum's series by appending),
:mod:`controller.judge.statistic` (the per-report mean and p99 log-ratios of a cell),
:func:`controller.judge.mannwhitney.judge_mannwhitney` (the Kayenta-style baseline, for comparison only;
imported on demand since it needs scipy). The judge simulator (``kernelctl sim judge``) is the
separate :mod:`sim.judge` package, on top of this one.
"""

from controller.judge.confseq import (
    DEFAULT_BET_CAP,
    DEFAULT_CLIP,
    DEFAULT_RESOLUTION,
    confidence_bound,
    margin_test,
)
from controller.judge.latency import (
    DEFAULT_MAX_NODE_SHARE,
    LatencyVerdict,
    balance_by_node,
    default_clip,
    default_resolution,
    judge_latency,
)

__all__ = [
    "DEFAULT_BET_CAP",
    "DEFAULT_CLIP",
    "DEFAULT_MAX_NODE_SHARE",
    "DEFAULT_RESOLUTION",
    "LatencyVerdict",
    "balance_by_node",
    "confidence_bound",
    "default_clip",
    "default_resolution",
    "judge_latency",
    "margin_test",
]
