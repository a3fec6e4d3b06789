"""Report ingestion: idempotency keys, log-ratio medians, refusals, hard-gate first failure, concurrent replays."""

from __future__ import annotations

import datetime as dt
import math
import threading

import pytest
from sqlalchemy import func, select

from controller import rollouts
from controller.db.models import Report, RolloutStratum
from controller.errors import Invalid
from controller.ingest import ingest_reports
from controller.rollouts import get_rollout, start_rollout
from controller.signals import ReportSignals
from kernelctl import wire
from tests.controller.enginekit import T0, Kit


@pytest.fixture
def kit(db_url, tmp_path):
    k = Kit(db_url, tmp_path)
    yield k
    k.close()


@pytest.fixture
def setup(kit: Kit):
    kit.nodes(2, prefix="h", arch="sm_90")
    kit.nodes(1, prefix="a", arch="sm_80")
    bid = kit.push("1.1.0", archs=("sm_90",))
    with kit.tx() as s:
        rid = start_rollout(s, "llm-fused@1.1.0", actor="op").id
    with kit.tx() as s:
        rollouts.begin(s, get_rollout(s, rid), actor="controller", now=T0)
    return rid, kit.ref(bid)


def _ingest(kit: Kit, node: str, reports: list[wire.TrialReport], now: dt.datetime = T0) -> tuple[int, int]:
    with kit.tx() as s:
        return ingest_reports(s, kit.node(s, node), wire.ReportBatch(node_name=node, reports=reports), now)


def _count(kit: Kit) -> int:
    with kit.tx() as s:
        return s.scalar(select(func.count()).select_from(Report))


def test_replayed_and_partial_batches_count_once(kit: Kit, setup) -> None:
    rid, cand = setup
    with kit.tx() as s:
        n = kit.node(s, "h-000")
        reps = [kit.report(n, rid, cand, None, key=f"h0-key-{i:04d}") for i in range(4)]
    assert _ingest(kit, "h-000", reps[:2]) == (2, 0)
    assert _ingest(kit, "h-000", reps[:2]) == (0, 2)
    assert _ingest(kit, "h-000", reps) == (2, 2)
    assert _ingest(kit, "h-000", [reps[0], reps[0]]) == (0, 2)
    assert _count(kit) == 4


def test_log_ratio_median_and_detail(kit: Kit, setup) -> None:
    rid, cand = setup
    with kit.tx() as s:
        n = kit.node(s, "h-000")
    pairs = [wire.LatencyPair(op="bias_gelu", tokens=4, stable_s=1.0, candidate_s=c) for c in (1.3, 1.1, 1.1)]
    check = wire.NumericCheck(op="bias_gelu", dtype="fp16", shape={"m": 4}, max_abs_err=1e-4, max_rel_err=1e-3,
                              within_tolerance=True, vs_stable_max_abs=0.0, vs_stable_within=True)
    rep = kit.report(n, rid, cand, None, ratio=None, key="detail-1").model_copy(update={
        "latency": pairs, "numerics": [check], "e2e_stable_s": 0.01, "e2e_candidate_s": 0.011,
        "peak_memory_bytes": 123456, "detail": "fine"})
    assert _ingest(kit, "h-000", [rep]) == (1, 0)
    with kit.tx() as s:
        r = s.scalar(select(Report))
        # an older agent's rounds: the ratio of the mean latencies (issue 25), no round discarded
        assert r.latency_log_ratio == pytest.approx(math.log(3.5 / 3)) and r.n_pairs == 3
        assert r.outcome == "ok" and r.peak_memory_bytes == 123456 and r.stratum == "sm_90/drv550/triton3.6.0"
        assert r.detail["numerics"]["checks"] == 1 and r.detail["e2e"] == {"stable_s": 0.01, "candidate_s": 0.011}
        assert r.detail["text"] == "fine"


def test_refusals_store_nothing(kit: Kit, setup) -> None:
    rid, cand = setup
    with kit.tx() as s:
        h, a = kit.node(s, "h-000"), kit.node(s, "a-000")
        good = kit.report(h, rid, cand, None, key="good-0001")
        unknown = kit.report(h, 999, cand, None, key="bad-0001")
        foreign = kit.report(a, rid, cand, None, key="bad-0002")
    wrong = good.model_copy(update={"idempotency_key": "bad-0003",
                                    "candidate": cand.model_copy(update={"digest": "f" * 64})})
    cases = [("h-000", [good, unknown], "rollout 999 does not exist"),
             ("a-000", [foreign], "not part of rollout"),
             ("h-000", [wrong], "is not the bundle of rollout")]
    for node, reps, msg in cases:
        with pytest.raises(Invalid, match=msg):
            _ingest(kit, node, reps)
    with pytest.raises(Invalid, match="sent by node"), kit.tx() as s:
        ingest_reports(s, kit.node(s, "h-001"), wire.ReportBatch(node_name="h-000", reports=[good]), T0)
    assert _count(kit) == 0


def test_hard_gate_sets_first_failure_once_and_escalates_ok(kit: Kit, setup) -> None:
    rid, cand = setup
    with kit.tx() as s:
        n = kit.node(s, "h-000")
    bad_check = wire.NumericCheck(op="bias_gelu", dtype="fp16", shape={"m": 4}, max_abs_err=5.0, max_rel_err=1.0,
                                  within_tolerance=False)
    rep = kit.report(n, rid, cand, None, key="num-0001").model_copy(update={"numerics": [bad_check]})
    assert _ingest(kit, "h-000", [kit.report(n, rid, cand, None, key="ok-00001")]) == (1, 0)
    with kit.tx() as s:
        assert s.scalar(select(RolloutStratum.first_failure_at)) is None
    assert _ingest(kit, "h-000", [rep], now=T0 + dt.timedelta(seconds=10)) == (1, 0)
    assert _ingest(kit, "h-000", [kit.report(n, rid, cand, None, outcome="crash", ratio=None, key="crash-001")],
                   now=T0 + dt.timedelta(seconds=20)) == (1, 0)
    with kit.tx() as s:
        first = s.scalar(select(RolloutStratum.first_failure_at))
        assert first.replace(tzinfo=dt.timezone.utc) == T0 + dt.timedelta(seconds=10)
        outcomes = dict(s.execute(select(Report.idempotency_key, Report.outcome)).all())
        assert outcomes == {"ok-00001": "ok", "num-0001": "numeric_error", "crash-001": "crash"}
        assert s.scalar(select(Report.latency_log_ratio).where(Report.idempotency_key == "num-0001")) is None


def test_concurrent_replays_count_once(kit: Kit, setup) -> None:
    rid, cand = setup
    with kit.tx() as s:
        n = kit.node(s, "h-001")
        reps = [kit.report(n, rid, cand, None, key=f"cc-{i:05d}") for i in range(200)]
    barrier = threading.Barrier(3)
    got: list[tuple[int, int]] = []

    def worker() -> None:
        barrier.wait()
        got.append(_ingest(kit, "h-001", reps))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(a for a, _ in got) == 200 and all(a + d == 200 for a, d in got)
    assert _count(kit) == 200


def test_signals_per_cell_weighted_aggregate_e2e_memory_launches(kit: Kit, setup) -> None:
    rid, cand = setup
    with kit.tx() as s:
        n = kit.node(s, "h-000")
    pairs = [wire.LatencyPair(op="swiglu", tokens=1, stable_s=1.0, candidate_s=c) for c in (3.0, 2.0, 2.0)]
    pairs += [wire.LatencyPair(op="swiglu", tokens=64, stable_s=1.0, candidate_s=1.0) for _ in range(3)]
    res = [wire.CellResources(op="swiglu", tokens=1, stable_peak_bytes=100, candidate_peak_bytes=400,
                              stable_launches=1, candidate_launches=2)]
    weights = [wire.CellWeight(op="swiglu", tokens=1, weight=3.0), wire.CellWeight(op="swiglu", tokens=64, weight=1.0)]
    e2e = [wire.E2EPair(stable_s=1.0, candidate_s=x) for x in (1.02, 1.02, 1.5)]
    rep = kit.report(n, rid, cand, None, ratio=None, key="signals-1").model_copy(update={
        "latency": pairs, "resources": res, "weights": weights, "e2e_pairs": e2e, "free_memory_bytes": 10**9})
    failed = kit.report(n, rid, cand, None, outcome="crash", ratio=None, key="signals-2")
    assert _ingest(kit, "h-000", [rep, failed]) == (2, 0)
    with kit.tx() as s:
        rows = {r.idempotency_key: r for r in s.scalars(select(Report))}
    sig = rows["signals-1"].signals
    assert sig["version"] == 2 and {k: c["mean"] for k, c in sig["cells"].items()} == {
        "swiglu@1": pytest.approx(math.log(7 / 3)), "swiglu@64": 0.0}
    assert sig["cells"]["swiglu@1"]["p99"] == pytest.approx(math.log(3.0))
    assert sig["cells"]["swiglu@1"]["candidate"] == {"n": 3, "mean_s": pytest.approx(7 / 3), "p50_s": 2.0, "p99_s": 3.0}
    assert sig["aggregate"]["mean"] == pytest.approx(math.log(2.0))  # time per step, traffic-weighted 3:1
    assert rows["signals-1"].latency_log_ratio == pytest.approx(sig["aggregate"]["mean"])
    assert sig["e2e"]["mean"] == pytest.approx(math.log(1.18))  # the slow round counts: users pay for it
    assert sig["memory"] == {"swiglu@1": [100, 400]} and sig["launches"] == {"swiglu@1": [1, 2]}
    assert sig["free_memory_bytes"] == 10**9 and sig["numeric"]["checks"] == 1
    assert rows["signals-2"].signals is None  # a failed trial contributes no samples
    # a document stored before issue 25 is still read, for what it was (shown, not judged as a mean)
    old = ReportSignals.from_stored({"cells": {"swiglu@1": 0.1}, "aggregate": 0.05, "e2e": 0.01, "numeric": sig["numeric"]})
    assert old.cells == {} and old.legacy_cells == {"swiglu@1": 0.1} and old.legacy_aggregate == 0.05
    assert old.numeric is not None and old.numeric.checks == 1


def test_the_stored_signals_read_as_text_are_the_json_columns_document(kit: Kit, setup) -> None:
    """The judge reads ``reports.signals`` as the database's JSON text (``controller.gates.SIGNALS_TEXT``, parsed by
    pydantic-core in ``ReportSignals.from_stored_text``): the same signals as the JSON column's document through
    ``from_stored``, for this version's documents (both encodings) and one stored before issue 25."""
    from sqlalchemy import update

    from controller.gates import SIGNALS_TEXT

    rid, cand = setup
    with kit.tx() as s:
        n = kit.node(s, "h-000")
    reports = [_real(kit, rid, cand, "text-cols", 30.0, 5).compact(), _real(kit, rid, cand, "text-lists", 12.0, 6)]
    assert _ingest(kit, "h-000", reports) == (2, 0)
    legacy = {"cells": {"swiglu@1": 0.1}, "aggregate": 0.05, "e2e": 0.01}
    with kit.tx() as s:
        s.execute(update(Report).where(Report.idempotency_key == "text-lists").values(signals=legacy))
    with kit.tx() as s:
        got = {key: (doc, text) for key, doc, text in s.execute(
            select(Report.idempotency_key, Report.signals, SIGNALS_TEXT.label("text")).where(Report.node_id == n.id))}
    assert set(got) == {"text-cols", "text-lists"} and isinstance(got["text-cols"][1], str)
    for doc, text in got.values():
        assert ReportSignals.from_stored_text(text) == ReportSignals.from_stored(doc)
    assert ReportSignals.from_stored_text(got["text-lists"][1]).legacy_cells == {"swiglu@1": 0.1}
    assert ReportSignals.from_stored_text(None) == ReportSignals.from_stored(None)


def _real(kit: Kit, rid: int, cand: wire.BundleRef, key: str, kb: float, seed: int,
          **changes: object) -> wire.TrialReport:
    """A real-agent-shaped report (``sim.fleet.realreport``) with optional changes (older fields, gaps)."""
    import random

    from sim.fleet.realreport import real_report

    with kit.tx() as s:
        stratum = kit.report(kit.node(s, "h-000"), rid, cand, None, key="unused-0001").stratum
    trial = {"rollout_id": rid, "stratum": stratum, "candidate": cand.model_dump(), "stable": None}
    doc = real_report(key, trial, kb=kb, rng=random.Random(seed))
    doc.update(changes)
    return wire.TrialReport.model_validate(doc)


def test_columns_store_the_same_row_and_signals_as_lists(kit: Kit, setup) -> None:
    """Encoding 2 (columns, ``kernelctl.wire_columns``) against encoding 1 (lists of objects), on SQLite and
    PostgreSQL: the same report sent both ways (two keys) is stored as the same row, signals included; the
    columns round-trip through JSON and back to the same lists. Varied shapes: no traffic weights, a weight
    of 0 and a profile naming a cell not measured (no aggregate), a resource row without memory, contended
    windows, older agents' per-round pairs and e2e rounds next to cells, no cells at all."""
    rid, cand = setup
    cases = [
        {},
        {"weights": []},
        {"weights": [{"op": "rope", "tokens": 1, "weight": 0.0}, {"op": "nope", "tokens": 3, "weight": 2.0}]},
        {"resources": [{"op": "swiglu", "tokens": 8, "stable_launches": 3, "candidate_launches": 4}]},
        {"latency": [{"op": "x", "tokens": 2, "stable_s": 1e-3, "candidate_s": 1.2e-3}] * 3, "e2e": None,
         "e2e_pairs": [{"stable_s": 1e-3, "candidate_s": 1.1e-3}, {"stable_s": 2e-3, "candidate_s": 1.9e-3}]},
        {"cells": [], "weights": [], "resources": []},
    ]
    lists, columns = [], []
    for i, change in enumerate(cases):
        r = _real(kit, rid, cand, f"enc1-{i:04d}", kb=6 + 7 * i, seed=i, **change)
        if i == 0:
            cells = [c.model_copy(update={"contended_windows": 2}) if j == 1 else c for j, c in enumerate(r.cells)]
            r = r.model_copy(update={"cells": cells})
        c = r.compact().model_copy(update={"idempotency_key": f"enc2-{i:04d}"})
        assert (c.columns is not None) == bool(r.cells or r.resources or r.weights)
        assert not (c.cells or c.resources or c.weights)
        wire_c = wire.TrialReport.model_validate_json(c.model_dump_json())
        assert wire_c == c and wire_c.expanded() == r.model_copy(update={"idempotency_key": c.idempotency_key})
        lists.append(r)
        columns.append(wire_c)
    assert _ingest(kit, "h-000", lists + columns) == (2 * len(cases), 0)
    fields = ("outcome", "latency_log_ratio", "n_pairs", "peak_memory_bytes", "measured_at", "detail", "signals",
              "rollout_id", "stratum", "bundle_id", "stable_bundle_id")
    with kit.tx() as s:
        rows = {r.idempotency_key: r for r in s.scalars(select(Report))}
    for i, case in enumerate(cases):
        one, two = rows[f"enc1-{i:04d}"], rows[f"enc2-{i:04d}"]
        assert {f: getattr(one, f) for f in fields} == {f: getattr(two, f) for f in fields}, case
        sig = ReportSignals.from_stored(two.signals)
        if i == 0:
            assert sig.aggregate is not None and len(sig.cells) == len(lists[0].cells) and sig.e2e is not None
            assert list(sig.cells.values())[1].contended_windows == 2 and sig.memory and sig.launches
        if i == 2:
            assert sig.aggregate is None  # a weighted cell was not measured
        if i == 4:
            assert "x@2" in sig.cells and sig.e2e is not None and sig.e2e.stable.n == 2
        if i == 5:
            assert sig.cells == {} and sig.aggregate is None and two.signals["cells"] == {}
