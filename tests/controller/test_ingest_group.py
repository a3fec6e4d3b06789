"""Report intake's group commit (``controller.intake.store_many`` over ``controller.ingest.ingest_many``: many
requests in one transaction with set-based statements) against the one-by-one path (``controller.intake.take``:
a transaction per request), on SQLite and PostgreSQL, each on a database of its own with the same fleet: the
same requests get the same answers and leave the same report rows, canary phases, events and hard-failure
clocks. A batch refused on its own (unknown rollout, unknown node, a report of another stratum) gets its own
error while the others commit; a replay is a duplicate, within one group and across groups; a group's
statements do not grow with its requests; a hard failure and a passing report of one stratum in one group
leave the canary unverified (failures first, as within one batch).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, func, select

from controller import intake
from controller.auth import Principal
from controller.db.models import Assignment, Event, Node, Report, RolloutStratum
from controller.errors import Invalid, NotFound
from kernelctl import wire
from tests import dbutil
from tests.controller.enginekit import Kit, generation_kit
from tests.controller.test_serve_phase import _stable_and_candidate

NODES = 6  # gpu-000 .. gpu-005, every one a canary of the rollout (plan 100%); amp-000 in a stratum outside it


@dataclass
class World:
    """A database with the fleet and the rollout (the candidate's and stable's refs: the kit signs its own)."""

    kit: Kit
    rid: int
    stable: wire.BundleRef
    cand: wire.BundleRef
    setup_events: int  # the last event of the setup: the ones after it are ingestion's


@pytest.fixture
def worlds(db_backend: str, tmp_path: Path) -> Iterator[tuple[World, World]]:
    """Two fresh databases with the same fleet and rollout: one for each path."""
    with dbutil.fresh_database(db_backend, tmp_path) as one_url, dbutil.fresh_database(db_backend, tmp_path) as many_url:
        kits = generation_kit(one_url, tmp_path / "one"), generation_kit(many_url, tmp_path / "many")
        out = []
        for kit in (next(k) for k in kits):
            rid, stable, cand = _stable_and_candidate(kit, nodes=NODES)
            kit.nodes(1, prefix="amp", arch="sm_80")
            with kit.tx() as s:
                out.append(World(kit, rid, stable, cand, s.scalar(select(func.max(Event.id)))))
        yield out[0], out[1]
        for gen in kits:
            next(gen, None)


def _me(name: str) -> Principal:
    return Principal(1, f"node:{name}", "agent", name)


def _requests(w: World, phase: int) -> list[wire.ReportBatch]:
    """The requests of one phase, in arrival order (the same keys and contents in either database)."""
    kit, rid, stable, cand = w.kit, w.rid, w.stable, w.cand
    with kit.tx() as s:
        n = {node.name: node for node in s.scalars(select(Node))}

        def r(name: str, key: str, **kw: Any) -> wire.TrialReport:
            return kit.report(n[name], rid, cand, kw.pop("stable", stable), key=key, **kw)

        def b(name: str, *reports: wire.TrialReport) -> wire.ReportBatch:
            return wire.ReportBatch(node_name=name, reports=list(reports))

        if phase == 1:
            return [
                b("gpu-000", r("gpu-000", "key-0001")),
                b("gpu-001", r("gpu-001", "key-0002"), r("gpu-001", "key-0003", ratio=0.05)),
                b("gpu-000", r("gpu-000", "key-0001"), r("gpu-000", "key-0004")),  # a replay and a new one
                b("gpu-002", r("gpu-002", "key-0005"), kit.report(n["gpu-002"], 999, cand, stable, key="key-0006")),
                b("amp-000", r("amp-000", "key-0007")),  # not a canary: refused in a 200
                b("ghost-000", r("gpu-003", "key-0014")),  # not registered
                b("gpu-001", r("gpu-001", "key-0002")),  # a replay of a key stored earlier in this group
                b("gpu-005", r("gpu-005", "key-0008"), r("gpu-005", "key-0008")),  # a key twice in one batch
                b("gpu-002", r("gpu-002", "key-0009", stable=stable.model_copy(update={"digest": "e" * 64}))),
                b("gpu-003", r("gpu-003", "key-0010").model_copy(update={"stratum": "sm_80|550|3.6"})),
            ]
        return [
            b("gpu-003", r("gpu-003", "key-0011", outcome="crash")),  # a hard failure: the stratum's clock starts
            b("gpu-004", r("gpu-004", "key-0012")),  # passes after it: not verified
            b("gpu-000", r("gpu-000", "key-0001")),  # a replay of an earlier group
            b("gpu-000", r("gpu-000", "key-0013")),  # already verified
        ]


def _one_by_one(kit: Kit, batches: list[wire.ReportBatch]) -> list[intake.Outcome]:
    return [intake.take(kit.factory, b.model_dump_json().encode(), True, _me(b.node_name), 1000) for b in batches]


def _grouped(kit: Kit, batches: list[wire.ReportBatch]) -> list[intake.Outcome]:
    parsed = [intake.parse(b.model_dump_json().encode(), True, _me(b.node_name), 1000) for b in batches]
    assert all(isinstance(p, wire.ReportBatch) for p in parsed)
    return intake.store_many(kit.factory, parsed)  # type: ignore[arg-type]


def _answers(outs: list[intake.Outcome]) -> list[tuple]:
    return [(o.reply.model_dump() if o.reply else None, type(o.error).__name__, str(o.error or ""), o.reports,
             o.refused_reasons) for o in outs]


def _stored(w: World) -> dict[str, Any]:
    """Everything ingestion writes, without ids of events and timestamps of this run."""
    with w.kit.tx() as s:
        names = dict(s.execute(select(Node.id, Node.name)).all())
        reports = [(names[r.node_id], r.idempotency_key, r.rollout_id, r.stratum, r.bundle_id, r.stable_bundle_id,
                    r.outcome, r.latency_log_ratio, r.n_pairs, r.peak_memory_bytes, r.measured_at, r.detail,
                    r.signals) for r in s.scalars(select(Report).order_by(Report.idempotency_key))]
        phases = [(names[a.node_id], a.bundle_name, a.rollout_id, a.phase, a.phase_at is not None)
                  for a in s.scalars(select(Assignment).order_by(Assignment.node_id, Assignment.bundle_name))]
        events = sorted((e.action, e.actor, e.subject, e.node or "", e.bundle or "", e.rollout_id or 0, e.reason or "",
                         re.sub(r"[0-9a-f]{16,}", "#", str(e.payload)))
                        for e in s.scalars(select(Event).where(Event.id > w.setup_events)))
        strata = [(st.rollout_id, st.stratum, st.state, st.first_failure_at is not None)
                  for st in s.scalars(select(RolloutStratum).order_by(RolloutStratum.id))]
    return {"reports": reports, "phases": phases, "events": events, "strata": strata}


def test_a_group_answers_and_stores_what_one_request_at_a_time_does(worlds: tuple[World, World]) -> None:
    one, many = worlds
    for phase in (1, 2):
        expected = _one_by_one(one.kit, _requests(one, phase))
        got = _grouped(many.kit, _requests(many, phase))
        assert _answers(got) == _answers(expected)
        assert _stored(many) == _stored(one)
        if phase == 1:  # what they are, not only that they agree
            replies = [(o.reply.accepted, o.reply.duplicates, list(o.reply.refused or {})) if o.reply else None
                       for o in got]
            assert replies == [(1, 0, []), (2, 0, []), (1, 1, []), None, (0, 0, ["key-0007"]), None, (0, 1, []),
                               (1, 1, []), (1, 0, []), None]
            assert isinstance(got[3].error, Invalid) and "rollout 999 does not exist" in str(got[3].error)
            assert isinstance(got[5].error, NotFound) and "ghost-000 is not registered" in str(got[5].error)
            assert isinstance(got[9].error, Invalid) and "does not match node gpu-003's stratum" in str(got[9].error)
            assert got[4].refused_reasons == ["not_canary"]
        else:
            assert [(o.reply.accepted, o.reply.duplicates) for o in got if o.reply] == [(1, 0), (1, 0), (0, 1), (1, 0)]
    stored = _stored(many)
    assert [k for _n, k, *_ in stored["reports"]] == [f"key-{i:04d}" for i in (1, 2, 3, 4, 8, 9, 11, 12, 13)]
    assert {(n, p) for n, _b, _r, p, _at in stored["phases"]} == {
        ("gpu-000", "verified"), ("gpu-001", "verified"), ("gpu-002", "verified"), ("gpu-003", "staged"),
        ("gpu-004", "staged"), ("gpu-005", "verified")}  # amp-000: no assignment (not in the strata)
    assert [e[3] for e in stored["events"] if e[0] == "assignment.verified"] == [
        "gpu-000", "gpu-001", "gpu-002", "gpu-005"]  # once each
    assert any(failing for _r, _s, _st, failing in stored["strata"])


def test_a_group_costs_the_statements_of_one_request(worlds: tuple[World, World]) -> None:
    _one, w = worlds
    kit = w.kit
    with kit.tx() as s:
        names = sorted(s.scalars(select(Node.name).where(Node.name.like("gpu-%"))))
    first = _requests(w, 1)[:1]  # verifies gpu-000
    assert all(o.error is None for o in _grouped(kit, first))
    statements: list[str] = []

    def count(_conn, _cursor, statement, *_a) -> None:  # type: ignore[no-untyped-def]
        statements.append(statement)

    def cost(keys: list[tuple[str, str]]) -> int:
        with kit.tx() as s:
            n = {node.name: node for node in s.scalars(select(Node))}
            batches = [wire.ReportBatch(node_name=name, reports=[kit.report(n[name], w.rid, w.cand, w.stable,
                                                                            key=key)])
                       for name, key in keys]
        statements.clear()
        event.listen(kit.engine, "before_cursor_execute", count)
        try:
            outs = _grouped(kit, batches)
        finally:
            event.remove(kit.engine, "before_cursor_execute", count)
        assert [o.reply.accepted for o in outs if o.reply] == [1] * len(keys)
        return len(statements)

    alone = cost([("gpu-000", "cost-0001")])
    # a group of requests from a canary already verified: the nodes, the rollouts, the insert (SQLite: BEGIN too)
    assert cost([("gpu-000", f"cost-00{i:02d}") for i in range(2, 10)]) == alone <= 4, statements
    # verifying canaries: their rows read, updated and their events inserted, the generation bumped: as many
    # statements for one canary as for four
    one = cost([("gpu-000", "cost-0101"), ("gpu-001", "cost-0102")])
    assert sum(s.startswith("UPDATE assignments") for s in statements) == 1, statements
    four = cost([(name, f"cost-1{i:03d}") for i, name in enumerate(names)])
    assert sum(s.startswith("UPDATE assignments") for s in statements) == 1, statements
    assert four == one <= alone + 5, [s[:60] for s in statements]


def test_a_failure_and_a_pass_of_one_stratum_in_one_group_leave_the_canary_unverified(
        worlds: tuple[World, World]) -> None:
    _one, w = worlds
    kit, rid, stable, cand = w.kit, w.rid, w.stable, w.cand
    with kit.tx() as s:
        n = {node.name: node for node in s.scalars(select(Node))}
        batches = [wire.ReportBatch(node_name="gpu-000", reports=[kit.report(n["gpu-000"], rid, cand, stable)]),
                   wire.ReportBatch(node_name="gpu-001", reports=[kit.report(n["gpu-001"], rid, cand, stable,
                                                                             outcome="crash")])]
    outs = _grouped(kit, batches)
    assert [(o.reply.accepted, o.reply.duplicates) for o in outs if o.reply] == [(1, 0), (1, 0)]
    stored = _stored(w)
    assert {(name, phase) for name, _b, _r, phase, _at in stored["phases"] if name in ("gpu-000", "gpu-001")} == {
        ("gpu-000", "staged"), ("gpu-001", "staged")}
    assert not [e for e in stored["events"] if e[0] == "assignment.verified"]
    assert any(failing for _r, _s, _st, failing in stored["strata"])
