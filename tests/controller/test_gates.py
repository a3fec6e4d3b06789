"""Gates: outcome escalation, per-report log-ratios, and the pure per-stratum decision rule."""

from __future__ import annotations

import datetime as dt
import math

import pytest

from controller.db.models import RolloutStratum
from controller.gates import HardFailure, StepEvidence, decide, effective_outcome, log_ratio, numerics_summary
from controller.plan import PlanSpec, StepSpec
from kernelctl import wire

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
REF = wire.BundleRef(name="llm-fused", version="1.1.0", digest="a" * 64)
STEP = StepSpec(nodes=1, bake_seconds=60, min_samples=5, deadline_seconds=600)
PLAN = PlanSpec(steps=[STEP])


def report(**kw) -> wire.TrialReport:
    base = {"idempotency_key": "k-000001", "rollout_id": 1, "stratum": "sm_90/drv550/triton3.6.0",
            "candidate": REF, "stable": None, "outcome": "ok", "measured_at": T0}
    return wire.TrialReport(**{**base, **kw})


def check(**kw) -> wire.NumericCheck:
    base = {"op": "bias_gelu", "dtype": "fp16", "shape": {"m": 8}, "max_abs_err": 1e-4, "max_rel_err": 1e-3,
            "within_tolerance": True}
    return wire.NumericCheck(**{**base, **kw})


def row(baseline: int | None = 1, started: float = 0.0) -> RolloutStratum:
    return RolloutStratum(rollout_id=1, stratum="s", baseline_bundle_id=baseline, state="progressing",
                          step_index=0, step_started_at=T0 + dt.timedelta(seconds=started))


def test_effective_outcome_escalates_failed_checks() -> None:
    assert effective_outcome(report(numerics=[check()])) == "ok"
    assert effective_outcome(report(numerics=[check(within_tolerance=False)])) == "numeric_error"
    assert effective_outcome(report(numerics=[check(unwritten=3)])) == "numeric_error"
    assert effective_outcome(report(numerics=[check(vs_stable_within=False)])) == "mismatch"
    assert effective_outcome(report(outcome="oom")) == "oom"


def test_log_ratio_is_mean_over_ops_of_median_pair_log_ratios() -> None:
    pairs = [wire.LatencyPair(op="x", tokens=1, stable_s=2.0, candidate_s=c) for c in (2.0, 4.0, 2.2, 100.0, 1.0)]
    assert log_ratio(report(latency=pairs)) == pytest.approx(math.log(1.1))  # one outlier round is harmless
    # one op of three 8x slower: the sample moves by ln(8)/3, it is not hidden by the unchanged ops
    same = [wire.LatencyPair(op=op, tokens=t, stable_s=1.0, candidate_s=1.0) for op in ("a", "b") for t in (1, 1, 1)]
    slow = [wire.LatencyPair(op="c", tokens=1, stable_s=1.0, candidate_s=8.0) for _ in range(3)]
    assert log_ratio(report(latency=same + slow)) == pytest.approx(math.log(8) / 3)
    assert log_ratio(report()) is None
    s = numerics_summary(report(numerics=[check(), check(max_abs_err=3.0, within_tolerance=False)]))
    assert (s["checks"], s["out_of_tolerance"], s["max_abs_err"], s["worst"]["max_abs_err"]) == (2, 1, 3.0, 3.0)


def ev(values: list[float]) -> StepEvidence:
    return StepEvidence(ok_reports=len(values), samples=list(values), node_ids=[str(i % 5) for i in range(len(values))])


@pytest.mark.parametrize(("values", "seconds", "expected"), [
    ([], 30, ("hold", "latency")),
    ([-0.05] * 3, 30, ("hold", "latency")),
    ([-0.05] * 60, 30, ("hold", "latency")),  # pass, still baking
    ([-0.05] * 60, 61, ("advance", "latency")),
    ([0.3] * 60, 10, ("rollback", "latency")),
    ([-0.05] * 3, 601, ("pause", "deadline")),
    ([], 601, ("pause", "deadline")),
])
def test_decide_latency(values: list[float], seconds: float, expected: tuple[str, str]) -> None:
    d = decide(row(), STEP, PLAN, T0 + dt.timedelta(seconds=seconds), hard=None, ev=ev(values), canaries=1)
    assert (d.decision, d.gate) == expected
    assert d.evidence["latency"]["n"] == len(values) and d.evidence["step"] == 0


def test_hard_gate_wins_over_passing_latency() -> None:
    hard = HardFailure("oom", {"oom": 2}, 1, T0)
    d = decide(row(), STEP, PLAN, T0 + dt.timedelta(seconds=100), hard=hard, ev=ev([-0.05] * 60), canaries=1)
    assert (d.decision, d.gate) == ("rollback", "oom") and "2 oom" in d.reason


def test_no_baseline_uses_sample_count_only() -> None:
    now = T0 + dt.timedelta(seconds=61)
    d = decide(row(baseline=None), STEP, PLAN, now, hard=None, ev=StepEvidence(ok_reports=4), canaries=1)
    assert (d.decision, d.gate) == ("hold", "samples") and d.evidence["baseline"] is None
    d = decide(row(baseline=None), STEP, PLAN, now, hard=None, ev=StepEvidence(ok_reports=5), canaries=1)
    assert (d.decision, d.gate) == ("advance", "samples") and "no baseline" in d.evidence["note"]


def test_margin_is_configurable() -> None:
    loose = PlanSpec(steps=[STEP], latency_margin=0.5)
    now = T0 + dt.timedelta(seconds=61)
    assert decide(row(), STEP, PLAN, now, hard=None, ev=ev([0.1] * 80), canaries=1).decision == "rollback"
    assert decide(row(), STEP, loose, now, hard=None, ev=ev([0.1] * 80), canaries=1).decision == "advance"


def test_advance_after_bake_on_the_t_bound_before_the_sequence_is_decisive() -> None:
    """Few clean samples: the confidence sequence is still inconclusive, the fixed-time t bound advances."""
    clean = [0.004, -0.006, 0.002, -0.001, 0.003, -0.004, 0.001, 0.0]
    d = decide(row(), STEP, PLAN, T0 + dt.timedelta(seconds=61), hard=None, ev=ev(clean), canaries=1)
    assert d.evidence["latency"]["decision"] == "hold"  # the sequence alone would not pass yet
    assert (d.decision, d.gate) == ("advance", "latency") and "t upper bound" in d.reason
    assert d.evidence["advance_t_upper"] < math.log1p(PLAN.latency_margin)
    # the same samples before the bake time: hold
    d = decide(row(), STEP, PLAN, T0 + dt.timedelta(seconds=30), hard=None, ev=ev(clean), canaries=1)
    assert d.decision == "hold"


def test_no_advance_when_the_t_bound_reaches_the_margin() -> None:
    noisy = [0.03, -0.01, 0.04, 0.0, 0.025, 0.01, 0.035, -0.005]  # mean +1.6%, spread too wide for 2%
    d = decide(row(), STEP, PLAN, T0 + dt.timedelta(seconds=61), hard=None, ev=ev(noisy), canaries=1)
    assert d.decision == "hold" and d.evidence["advance_t_upper"] > math.log1p(PLAN.latency_margin)
