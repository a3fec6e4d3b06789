"""The judge's state carried between calls (controller.judge.running, the gates' observations in a JudgeMemo)
equals the full recomputation, bit for bit.

Random series (a candidate within the margin, at it, past it, a late regression, autocorrelated nodes, exact
zeros of both signs, a node hogging the samples) fed in random chunks, in chunks of one and in one piece: after
every chunk the carried verdict (decision, log-wealths, bounds, counts, reason) is the one
:func:`judge_latency` gives on the series so far; ``repr`` compares floats exactly (-0.0 included). A list other
than the one read before, or a shorter one, starts the state again (and it still agrees).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from controller.judge.family import FamilyState, MetricSeries, judge_family
from controller.judge.gates import GateContext, StepEvidence
from controller.judge.gates.launches import LaunchesGate
from controller.judge.gates.memory import MemoryGate
from controller.judge.latency import judge_latency
from controller.judge.running import LatencyState
from controller.judge.series import JudgeMemo
from controller.plan import PlanSpec, StepSpec
from controller.signals import ReportSignals

MARGIN = math.log(1.02)


def _series(rng: np.random.Generator, kind: str, n: int) -> tuple[list[float], list[str]]:
    nodes = [str(int(v)) for v in rng.integers(0, int(rng.integers(1, 12)), n)]
    if kind == "hog":  # one node sends most samples: the per-node balance drops some
        nodes = ["0" if rng.random() < 0.7 else str(int(v)) for v in rng.integers(1, 8, n)]
    shift = {"within": -0.005, "at": MARGIN, "past": 0.06, "late": 0.0, "hog": 0.01, "ar": 0.01}[kind]
    x = rng.normal(shift, float(rng.choice([0.004, 0.02, 0.1])), n)
    if kind == "late":  # a regression after a pass: the restarted tests catch it
        x[n // 2:] += 0.08
    if kind == "ar":
        level = {nd: 0.0 for nd in set(nodes)}
        for i, nd in enumerate(nodes):
            level[nd] = 0.9 * level[nd] + 0.03 * rng.standard_normal()
            x[i] += level[nd]
    x[rng.random(n) < 0.04] = 0.0
    x[rng.random(n) < 0.04] = -0.0
    return [float(v) for v in x], nodes


def _chunks(rng: np.random.Generator, n: int, how: str) -> list[int]:
    if how == "one":
        return [n]
    if how == "single":
        return list(range(1, n + 1))
    cuts = sorted({int(c) for c in rng.integers(0, n + 1, int(rng.integers(1, 12)))} | {n})
    return cuts


@pytest.mark.parametrize("kind", ["within", "at", "past", "late", "hog", "ar"])
def test_chunks_give_the_full_verdict_bit_for_bit(kind: str) -> None:
    rng = np.random.default_rng(sum(map(ord, kind)))
    regressed = passed = 0
    for trial in range(6):
        n = int(rng.integers(20, 140))
        x, nodes = _series(rng, kind, n)
        margin, res, clip = (MARGIN, 0.03, 0.75) if trial % 2 else (math.log(1.1), 0.15, 0.5)
        for how in ("random", "single" if trial == 0 else "random", "one"):
            st = LatencyState(margin=margin, resolution=res, clip=clip)
            xs: list[float] = []
            ns: list[str] = []
            for cut in _chunks(rng, n, how):
                xs.extend(x[len(xs):cut])
                ns.extend(nodes[len(ns):cut])
                st.extend_to(xs, ns if trial != 3 else None)
                got = st.verdict(alpha=0.01, min_samples=5, alpha_pass=0.05)
                want = judge_latency(xs, node_ids=ns if trial != 3 else None, margin=margin, alpha=0.01,
                                     alpha_pass=0.05, min_samples=5, resolution=res, clip=clip)
                assert repr(got) == repr(want), (kind, trial, how, len(xs))
            regressed += got.decision == "regress"
            passed += got.decision == "pass"
            assert st.restarts == 0
    if kind == "past":
        assert regressed  # not vacuous: the regress side's bound was bisected
    if kind == "within":
        assert passed


def test_family_state_equals_judge_family_and_restarts_on_a_new_list() -> None:
    rng = np.random.default_rng(8)
    x, nodes = _series(rng, "late", 120)
    y, _ = _series(rng, "within", 120)
    state = FamilyState()
    xs: list[float] = []
    ys: list[float] = []
    ns: list[str] = []

    def family() -> dict[str, MetricSeries]:
        return {"latency:a@1:mean": MetricSeries(xs, ns, MARGIN), "latency:aggregate:mean":
                MetricSeries(ys, ns, MARGIN, summary=True)}

    for cut in (3, 40, 41, 90, 120):
        xs.extend(x[len(xs):cut])
        ys.extend(y[len(ys):cut])
        ns.extend(nodes[len(ns):cut])
        got = judge_family(family(), alpha=0.05, min_samples=5, state=state)
        assert repr(got) == repr(judge_family(family(), alpha=0.05, min_samples=5))
    assert all(st.restarts == 0 for st in state.metrics.values())
    # not an append: an earlier sample changed and the series handed as a new list -> started again, still equal
    xs = [*xs[:10], xs[10] + 0.5, *xs[11:]]
    got = judge_family(family(), alpha=0.05, min_samples=5, state=state)
    assert repr(got) == repr(judge_family(family(), alpha=0.05, min_samples=5))
    assert state.metrics["latency:a@1:mean"].restarts == 1
    assert state.metrics["latency:aggregate:mean"].restarts == 0


def test_a_shorter_series_restarts_and_bad_samples_are_refused_without_a_trace() -> None:
    rng = np.random.default_rng(9)
    x, nodes = _series(rng, "past", 60)
    st = LatencyState(margin=MARGIN, resolution=0.03, clip=0.75)
    xs, ns = x[:50], nodes[:50]
    st.extend_to(xs, ns)
    del xs[40:], ns[40:]  # the same list, shorter: not an append
    st.extend_to(xs, ns)
    assert st.restarts == 1
    want = judge_latency(xs, node_ids=ns, margin=MARGIN, alpha=0.05, resolution=0.03, clip=0.75)
    assert repr(st.verdict(alpha=0.05, min_samples=5)) == repr(want)
    xs.append(math.nan)
    ns.append("1")
    with pytest.raises(ValueError, match=r"samples\[40\] is np.float64\(nan\)"):
        st.extend_to(xs, ns)
    xs[40] = 0.01  # the refused sample left nothing behind
    st.extend_to(xs, ns)
    want = judge_latency(xs, node_ids=ns, margin=MARGIN, alpha=0.05, resolution=0.03, clip=0.75)
    assert repr(st.verdict(alpha=0.05, min_samples=5)) == repr(want)


def test_bounds_reuse_the_points_of_the_last_search() -> None:
    rng = np.random.default_rng(10)
    x, nodes = _series(rng, "within", 200)
    st = LatencyState(margin=MARGIN, resolution=0.03, clip=0.75)
    st.extend_to(x, nodes)
    v = st.verdict(alpha=0.05, min_samples=5)
    assert v.upper is not None  # the pass side's bound was bisected
    first = st.bounds["pass"].computed
    st.verdict(alpha=0.05, min_samples=5)  # nothing new: every point asked about is carried
    assert st.bounds["pass"].computed == first


def test_memory_and_launch_observations_carried_equal_a_full_read() -> None:
    """The memory and launches gates' measurements carried by a JudgeMemo (sorted per cell, extended by the
    appended reports) give the views of a read of every report, at every tick; a new list starts them again."""
    rng = np.random.default_rng(12)
    plan = PlanSpec(steps=[StepSpec(percent=50, bake_seconds=40, min_samples=6, deadline_seconds=900)])
    ctx = GateContext(plan, plan.steps[0])
    reports: list[tuple[str, ReportSignals]] = []
    memo = JudgeMemo()
    decisions = set()
    for tick in range(6):
        for _ in range(int(rng.integers(0, 9))):
            cells = [c for c in ("a@1", "b@8", "c@64") if rng.random() < 0.8]
            mem = {c: (float(rng.choice([0, 1000, 2000])), float(rng.choice([0, 900, 1000, 2600]))) for c in cells}
            lau = {c: (float(rng.integers(1, 4)), float(rng.integers(1, 4))) for c in cells}
            free = None if rng.random() < 0.3 else int(rng.choice([500, 2500]))
            reports.append((str(int(rng.integers(0, 5))),
                            ReportSignals(memory=mem, launches=lau, free_memory_bytes=free)))
        for gate in (MemoryGate(), LaunchesGate()):
            full = gate.measure(StepEvidence(len(reports), list(reports)), ctx)
            carried = gate.measure(StepEvidence(len(reports), reports, judge=memo), ctx)
            assert repr([v.as_dict() for v in carried]) == repr([v.as_dict() for v in full]), tick
            decisions |= {v.decision.value for v in full}
    assert {"regress", "pass"} <= decisions  # not vacuous
    assert memo.restarts == 0
    reports = reports[1:]  # not an append: a fresh list
    full = MemoryGate().measure(StepEvidence(len(reports), list(reports)), ctx)
    assert repr(MemoryGate().measure(StepEvidence(len(reports), reports, judge=memo), ctx)) == repr(full)
    assert memo.restarts == 1
