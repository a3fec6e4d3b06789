"""Gates: outcome escalation and the pure per-stratum decision rule over typed signals (mean and p99)."""

from __future__ import annotations

import datetime as dt
import math
import random

import pytest

from controller.db.models import RolloutStratum
from controller.gates import HardFailure, StepEvidence, decide, effective_outcome, numerics_summary
from controller.plan import PlanSpec, StepSpec
from controller.signals import AggregateSignal, ArmSignal, LatencySignal, NumericSignal, ReportSignals
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


def test_numerics_summary_names_the_worst_check() -> None:
    s = numerics_summary(report(numerics=[check(), check(max_abs_err=3.0, within_tolerance=False)]))
    assert (s["checks"], s["out_of_tolerance"], s["max_abs_err"], s["worst"]["max_abs_err"]) == (2, 1, 3.0, 3.0)


NUMERIC = NumericSignal(checks=3, max_abs_err=1e-6, kinds=["edge", "fuzz", "production"])


def lat(mean: float, p99: float | None = None) -> LatencySignal:
    """A cell's signal: stable 1 ms mean / 1.2 ms p99, candidate moved by the given log-ratios."""
    p99 = mean if p99 is None else p99
    st = ArmSignal(n=512, mean_s=1e-3, p50_s=1e-3, p99_s=1.2e-3)
    ca = ArmSignal(n=512, mean_s=1e-3 * math.exp(mean), p50_s=1e-3 * math.exp(mean), p99_s=1.2e-3 * math.exp(p99))
    return LatencySignal(mean=mean, p99=p99, stable=st, candidate=ca)


def ev(values: list[float], **extra) -> StepEvidence:
    """Reports whose aggregate (mean and p99) is the given value, no cells."""
    nodes = [str(i % 5) for i in range(len(values))]
    reports = [(n, ReportSignals(aggregate=AggregateSignal(mean=v, p99=v), numeric=NUMERIC, **extra))
               for n, v in zip(nodes, values, strict=True)]
    return StepEvidence(ok_reports=len(values), reports=reports)


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


def test_a_running_test_extends_the_deadline_once_and_a_starved_one_does_not() -> None:
    """Past the deadline, a stratum whose every metric is sampled and none regressed collects on (anytime-valid
    tests) until deadline x (1 + deadline_extension), then pauses; with too few samples it pauses at once."""
    rng = random.Random(5)
    values = [0.012 + rng.gauss(0, 0.02) for _ in range(12)]  # inside the margin, not yet shown to be
    at = {s: decide(row(), STEP, PLAN, T0 + dt.timedelta(seconds=s), hard=None, ev=ev(values), canaries=1)
          for s in (300, 601, 1199, 1201)}
    assert [(d.decision, d.gate) for d in at.values()] == [("hold", "latency")] * 3 + [("pause", "deadline")]
    assert "extended to 1200s" in at[601].reason and at[601].evidence["deadline_extended"] is True
    assert "deadline_extended" not in at[300].evidence
    strict = StepSpec(nodes=1, bake_seconds=60, min_samples=5, deadline_seconds=600, deadline_extension=0)
    d = decide(row(), strict, PlanSpec(steps=[strict]), T0 + dt.timedelta(seconds=601), hard=None, ev=ev(values),
               canaries=1)
    assert (d.decision, d.gate) == ("pause", "deadline")
    d = decide(row(), STEP, PLAN, T0 + dt.timedelta(seconds=601), hard=None, ev=ev(values[:3]), canaries=1)
    assert (d.decision, d.gate) == ("pause", "deadline") and "too few samples" in d.reason


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


def test_no_fixed_sample_advance_before_the_family_passes() -> None:
    """Few clean samples: the confidence sequence is still inconclusive, so the stratum holds (the fixed-sample
    t bound is gone: it assumed independent samples; at 6 such samples it would advance). The betting test passes
    this steady a series after 7 (its near bound follows the noise: controller.judge.confseq.pass_resolution)."""
    clean = [0.004, -0.006, 0.002, -0.001, 0.003, -0.004]
    d = decide(row(), STEP, PLAN, T0 + dt.timedelta(seconds=61), hard=None, ev=ev(clean), canaries=1)
    assert d.evidence["latency"]["decision"] == "hold"
    assert (d.decision, d.gate) == ("hold", "latency") and "advance_t_upper" not in d.evidence
    assert d.evidence["deciding_metric"] == "latency:aggregate:mean"


# ------------------------------------------------------------------------------------- every signal decides
def sig(cells: dict[str, float | tuple[float, float]] | None = None, *, e2e: float | tuple[float, float] | None = None,
        numeric: NumericSignal | None = NUMERIC, **extra) -> ReportSignals:
    cells = cells if cells is not None else {"swiglu@1": -0.05, "swiglu@64": -0.05}
    typed = {k: lat(*(v if isinstance(v, tuple) else (v,))) for k, v in cells.items()}
    agg = None
    if typed:
        agg = AggregateSignal(mean=sum(c.mean for c in typed.values()) / len(typed),
                              p99=sum(c.p99 for c in typed.values()) / len(typed))
    e = None if e2e is None else lat(*(e2e if isinstance(e2e, tuple) else (e2e,)))
    return ReportSignals(cells=typed, aggregate=agg, e2e=e, numeric=numeric, **extra)


def cell_ev(sigs: list[ReportSignals]) -> StepEvidence:
    nodes = [str(i % 5) for i in range(len(sigs))]
    return StepEvidence(ok_reports=len(sigs), reports=list(zip(nodes, sigs, strict=True)))


def judge_at(sigs: list[ReportSignals], plan: PlanSpec = PLAN, seconds: float = 61):
    return decide(row(), STEP, plan, T0 + dt.timedelta(seconds=seconds), hard=None, ev=cell_ev(sigs), canaries=1)


def test_one_regressed_cell_rolls_back_and_is_named() -> None:
    d = judge_at([sig({"swiglu@1": 0.67, **{f"op{k}@8": 0.0 for k in range(40)}}) for _ in range(40)])
    assert (d.decision, d.gate, d.deciding_metric) == ("rollback", "latency", "latency:swiglu@1:mean")
    assert d.reason.startswith("regression: swiglu at 1 token, mean: +95.4% (lower bound +")
    m = {x["metric"]: x for x in d.evidence["metrics"]}
    c = m["latency:swiglu@1:mean"]
    assert c["deciding"] and c["decision"] == "regress" and c["bound_side"] == "lower" and c["bound"] > c["margin"]
    assert c["kind"] == "latency_cell" and m["latency:aggregate:mean"]["kind"] == "latency_aggregate"
    assert c["arms"]["stable"]["n"] == 512 and c["arms"]["contended_windows"] == 0 and c["statistic"] == "mean"
    assert sum(x["deciding"] for x in d.evidence["metrics"]) == 1
    # the aggregate alone moved by under 2%: inside the margin
    assert abs(m["latency:aggregate:mean"]["value"]) < math.log1p(PLAN.latency_margin)


def test_a_p99_regression_behind_a_faster_mean_rolls_back_naming_the_p99() -> None:
    d = judge_at([sig({"swiglu@1": (-0.03, math.log(1.3)), "swiglu@64": -0.03}) for _ in range(40)])
    assert (d.decision, d.gate, d.deciding_metric) == ("rollback", "latency", "latency:swiglu@1:p99")
    assert "swiglu at 1 token, p99" in d.reason and "margin +10.0%" in d.reason
    # the p99 margin is its own setting
    wide = PLAN.model_copy(update={"p99_margin": 0.5})
    assert judge_at([sig({"swiglu@1": (-0.03, math.log(1.3)), "swiglu@64": -0.03}) for _ in range(40)],
                    wide).decision == "advance"


def test_a_pass_holds_only_while_it_still_holds() -> None:
    rng = random.Random(0)

    def at(mu: float) -> ReportSignals:
        return sig({"swiglu@1": rng.gauss(mu, 0.004), "swiglu@64": rng.gauss(mu, 0.004)})

    good = [at(-0.005) for _ in range(20)]
    assert judge_at(good).decision == "advance"
    # +8% after the pass: within a few reports it no longer advances, and it rolls back (not a pause)
    slow = [at(0.08) for _ in range(20)]
    later = [judge_at(good + slow[:k]).decision for k in range(1, 21)]
    assert later[0] == "advance" and "hold" in later[:10] and later[-1] == "rollback"


def test_memory_over_margin_or_headroom_rolls_back() -> None:
    ok = {"swiglu@1": (1000, 1050)}
    assert judge_at([sig(memory=ok)] * 40).decision == "advance"  # +5% < 10%
    d = judge_at([sig(memory={"swiglu@1": (1000, 1200), "swiglu@64": (10, 10)})] * 2)
    assert (d.decision, d.gate, d.deciding_metric) == ("rollback", "memory", "memory:swiglu@1")
    m = {x["metric"]: x for x in d.evidence["metrics"]}["memory:swiglu@1"]
    assert (m["unit"], m["value"], m["margin"], m["n"]) == ("ratio", 1.2, 0.1, 2)
    loose = PLAN.model_copy(update={"memory_margin": 0.5})
    assert judge_at([sig(memory={"swiglu@1": (1000, 1200)})] * 2, loose).gate != "memory"
    # within the margin but past the node's free memory
    d = judge_at([sig(memory={"swiglu@1": (1000, 1000)}, free_memory_bytes=500)] * 2)
    assert (d.decision, d.gate) == ("rollback", "memory")


def test_launches_roll_back_by_default_and_warn_when_the_plan_says_so() -> None:
    lau = {"swiglu@1": (1, 2), "swiglu@64": (1, 1)}
    d = judge_at([sig(launches=lau)] * 2)
    assert (d.decision, d.gate, d.deciding_metric) == ("rollback", "launches", "launches:swiglu@1")
    assert "2 vs stable 1" in d.reason
    warn = PLAN.model_copy(update={"launch_gate": "warn"})
    d = judge_at([sig(launches=lau)] * 40, warn)
    assert d.decision == "advance" and d.evidence["launch_warnings"] == ["launches:swiglu@1"]
    assert {x["metric"]: x["decision"] for x in d.evidence["metrics"]}["launches:swiglu@1"] == "warn"


def test_e2e_is_its_own_judged_metric() -> None:
    d = judge_at([sig(e2e=0.3)] * 40)
    assert (d.decision, d.gate, d.deciding_metric) == ("rollback", "e2e", "e2e:mean")
    assert "end to end, mean" in d.reason
    assert judge_at([sig(e2e=-0.05)] * 40).decision == "advance"
    m = {x["metric"]: x for x in judge_at([sig(e2e=-0.05)] * 40).evidence["metrics"]}
    assert m["e2e:mean"]["margin"] == pytest.approx(math.log1p(PLAN.e2e_margin)) and m["e2e:mean"]["kind"] == "e2e"
    assert m["e2e:p99"]["margin"] == pytest.approx(math.log1p(PLAN.p99_margin))


def test_a_missing_metric_is_not_a_pass() -> None:
    # e2e in only two of forty reports: the stratum holds for it
    sigs = [sig(e2e=-0.05) if i < 2 else sig() for i in range(40)]
    d = judge_at(sigs)
    assert (d.decision, d.gate, d.deciding_metric) == ("hold", "e2e", "e2e:mean") and "too few samples" in d.reason
    # a cell only some reports measured
    sigs = [sig({"swiglu@1": 0.0, "swiglu@64": 0.0}) if i < 2 else sig({"swiglu@1": 0.0}) for i in range(40)]
    assert judge_at(sigs).deciding_metric == "latency:swiglu@64:mean" and judge_at(sigs).decision == "hold"
    # reports without numeric checks
    sigs = [sig(numeric=None) for _ in range(40)]
    d = judge_at(sigs)
    assert (d.decision, d.deciding_metric) == ("hold", "numeric")
    # plan that requires e2e, none measured yet
    req = PLAN.model_copy(update={"e2e_required": True})
    assert judge_at([sig()] * 40, req).deciding_metric == "e2e:mean"


def test_hard_gate_evidence_names_the_gate() -> None:
    hard = HardFailure("numeric", {"numeric_error": 1}, 1, T0)
    d = decide(row(), STEP, PLAN, T0, hard=hard, ev=ev([]), canaries=1)
    assert d.deciding_metric == "numeric"
    assert d.evidence["metrics"] == [{"metric": "numeric", "kind": "numeric", "unit": "count", "value": 1.0,
                                      "lower": None, "upper": None, "margin": None, "n": 1, "decision": "fail",
                                      "deciding": True, "statistic": None, "bound": None, "bound_side": None,
                                      "arms": None}]


def test_the_decision_function_stays_small() -> None:
    """Issue 25: ``gates._decide`` and the gate modules at cyclomatic complexity <= 15 (ruff's C901)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    ruff = Path(sys.executable).with_name("ruff")
    res = subprocess.run([str(ruff), "check", "--select", "C901", "--config", "lint.mccabe.max-complexity=15",
                          "controller/gates.py", "controller/judge"], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
