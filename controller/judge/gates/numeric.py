"""Numeric evidence gate: the stratum holds until some ok report carried numeric checks (the worst error of
those shown). Failing checks never reach here: they make the report's outcome ``numeric_error``/``mismatch``,
which the hard gates in ``controller.gates`` roll back on."""

from __future__ import annotations

from controller.judge.gates.base import Breach, GateContext, MetricView, StepEvidence
from kernelctl.vocab import GateName, MetricDecision, MetricKind


class NumericGate:
    name = GateName.NUMERIC

    def measure(self, ev: StepEvidence, ctx: GateContext) -> list[MetricView]:
        checks = [sig.numeric for _n, sig in ev.reports if sig.numeric is not None]
        worst = max((c.max_abs_err for c in checks), default=None)
        return [MetricView("numeric", MetricKind.NUMERIC, "error", worst, None, None, None, len(checks),
                           MetricDecision.PASS if checks else MetricDecision.HOLD, must_pass=True)]

    def evaluate(self, views: list[MetricView], ctx: GateContext) -> Breach | None:
        return None
