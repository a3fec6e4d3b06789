"""The judge's gate interface (issue 25; Flagger's metric providers are the model): a gate *measures* its
metrics from a stratum's evidence and *evaluates* them against the plan. One module per gate
(:mod:`~controller.judge.gates.memory`, :mod:`~controller.judge.gates.launches`,
:mod:`~controller.judge.gates.latency`, :mod:`~controller.judge.gates.numeric`); ``controller.gates`` runs
them in order after the hard gates. Adding a signal touches its gate module, its measurement and its test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from controller.judge.series import C, JudgeMemo
from controller.plan import PlanSpec, StepSpec
from controller.signals import ReportSignals
from kernelctl.vocab import GateName, MetricDecision, MetricKind, Statistic


@dataclass
class StepEvidence:
    """A stratum's usable reports over the whole rollout (ok outcome, non-stale node), in arrival order:
    (node id, the report's typed signals). Evidence is carried across steps (the bake time runs per step).

    ``judge``: the leader's judged state of the stratum carried between ticks (``controller.evidence``), a
    cache only: the decision is the same with or without it, bit for bit (its contract:
    :class:`~controller.judge.series.JudgeMemo`)."""

    ok_reports: int = 0
    reports: list[tuple[str, ReportSignals]] = field(default_factory=list)
    judge: JudgeMemo | None = field(default=None, compare=False, repr=False)

    def observed(self, name: str, factory: Callable[[], C]) -> C:
        """A gate's measurements ``name`` (made by ``factory``) of these reports: carried from the last tick and
        extended by the reports appended since when the leader keeps the stratum's state, else read afresh."""
        if self.judge is None:
            acc = factory()
            acc.extend(self.reports)
            return acc
        return self.judge.carried(name, self.reports, factory)


@dataclass
class MetricView:
    """One judged metric of one stratum at one tick: the row the explain view shows.

    ``bound`` is the confidence bound that decides against the margin (``bound_side``: ``upper`` must fall
    below the margin to pass, ``lower`` above it to regress); None while that side has refuted nothing."""

    metric: str
    kind: MetricKind
    unit: str  # log_ratio | ratio | count | error
    value: float | None
    lower: float | None
    upper: float | None
    margin: float | None
    n: int
    decision: MetricDecision
    deciding: bool = False
    statistic: Statistic | None = None
    must_pass: bool = False
    bound: float | None = None
    bound_side: str | None = None
    arms: dict[str, Any] | None = None  # latest report's per-arm n/mean/p50/p99 (latency metrics)

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "kind": self.kind.value, "unit": self.unit, "value": self.value,
                "lower": self.lower, "upper": self.upper, "margin": self.margin, "n": self.n,
                "decision": self.decision.value, "deciding": self.deciding,
                "statistic": None if self.statistic is None else self.statistic.value, "bound": self.bound,
                "bound_side": self.bound_side, "arms": self.arms}


@dataclass(frozen=True)
class Breach:
    """A gate's rollback: which gate, which metric, and the sentence the verdict carries."""

    gate: GateName
    view: MetricView
    reason: str


@dataclass(frozen=True)
class GateContext:
    plan: PlanSpec
    step: StepSpec


class Gate(Protocol):
    """A judged gate: ``measure`` turns evidence into metric rows, ``evaluate`` finds a breach among them."""

    name: GateName

    def measure(self, ev: StepEvidence, ctx: GateContext) -> list[MetricView]: ...

    def evaluate(self, views: list[MetricView], ctx: GateContext) -> Breach | None: ...
