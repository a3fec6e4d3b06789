"""Statistical judge for canary latency: anytime-valid confidence sequence, Kayenta-style baseline, simulator.

Public entry points: :func:`judge_latency` (the judge the rollout engine calls every tick),
:func:`controller.judge.mannwhitney.judge_mannwhitney` (the Kayenta-style baseline, for comparison only; imported on demand since it needs scipy) and ``sim_app`` in
:mod:`controller.judge.cli` (``kernelctl sim judge``).
"""

from controller.judge.confseq import DEFAULT_CLIP, DEFAULT_LAMBDA_CAP, clip_log_ratios, eb_confseq
from controller.judge.latency import (
    DEFAULT_MAX_NODE_SHARE,
    LatencyVerdict,
    balance_by_node,
    default_clip,
    judge_latency,
)

__all__ = [
    "DEFAULT_CLIP",
    "DEFAULT_LAMBDA_CAP",
    "DEFAULT_MAX_NODE_SHARE",
    "LatencyVerdict",
    "balance_by_node",
    "clip_log_ratios",
    "default_clip",
    "eb_confseq",
    "judge_latency",
]
