"""controller.ingest.ingest_batch, the API's path, on SQLite and PostgreSQL: screening and storing on one read of
the rollouts (refusals per reason, nothing stored when all are refused), stable bundle ids from the node's
assignment or a lookup, the statements a steady-state batch costs (one read, one insert), and non-ASCII text
stored as sent."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import event, func, select

from controller.db.models import Assignment, Node, Report
from controller.errors import Invalid
from controller.ingest import ingest_batch
from controller.rollouts import rollback
from kernelctl import wire
from tests.controller.enginekit import T0, Kit
from tests.controller.test_serve_phase import _stable_and_candidate


@pytest.fixture
def kit(db_url, tmp_path):
    k = Kit(db_url, tmp_path)
    yield k
    k.close()


def _batch(kit: Kit, node: str, reports: list[wire.TrialReport], now: dt.datetime = T0):  # type: ignore[no-untyped-def]
    with kit.tx() as s:
        return ingest_batch(s, kit.node(s, node), wire.ReportBatch(node_name=node, reports=reports), now)


def test_refusals_by_reason_and_unknown_rollouts(kit: Kit) -> None:
    rid, stable, cand = _stable_and_candidate(kit, nodes=1)
    kit.nodes(1, prefix="amp", arch="sm_80")  # not in the rollout's strata: not a canary
    with kit.tx() as s:
        n, other = kit.node(s, "gpu-000"), kit.node(s, "amp-000")
        ok = kit.report(n, rid, cand, stable, key="ok-000001")
        foreign = kit.report(other, rid, cand, stable, key="amp-000001")
        unknown = kit.report(n, 999, cand, stable, key="unknown-01")
    assert _batch(kit, "amp-000", [foreign]) == (0, 0, {
        "amp-000001": ("not_canary", f"node amp-000 is not a current canary of rollout {rid}")})
    with pytest.raises(Invalid, match="rollout 999 does not exist"):
        _batch(kit, "gpu-000", [ok, unknown])
    assert _batch(kit, "gpu-000", [ok, ok]) == (1, 1, {})
    with kit.tx() as s:
        rollback(s, rid, actor="op", reason="test", now=T0 + dt.timedelta(seconds=1))
    late = ok.model_copy(update={"idempotency_key": "late-00001"})
    accepted, duplicates, refused = _batch(kit, "gpu-000", [late])
    assert (accepted, duplicates, list(refused)) == (0, 0, ["late-00001"])
    assert refused["late-00001"][0] == "rollout_not_live" and "rolled_back" in refused["late-00001"][1]
    with kit.tx() as s:
        assert s.scalar(select(func.count()).select_from(Report)) == 1


def test_stable_ids_steady_state_statements_and_text(kit: Kit) -> None:
    rid, stable, cand = _stable_and_candidate(kit, nodes=1)
    with kit.tx() as s:
        n = kit.node(s, "gpu-000")
        first = kit.report(n, rid, cand, stable, key="first-0001")
        reports = [kit.report(n, rid, cand, stable, key=f"steady-{i:04d}") for i in range(20)]
        odd = [kit.report(n, rid, cand, cand, key="odd-stable-1"),  # a stable version the assignment does not name
               kit.report(n, rid, cand, stable.model_copy(update={"digest": "e" * 64}), key="unknown-stable",
                          detail="segfault ☠ in kernel \u00e9\\ \"q\"")]
        stable_id = s.scalar(select(Assignment.stable_bundle_id).join(Node, Node.id == Assignment.node_id)
                             .where(Node.name == "gpu-000"))
    assert _batch(kit, "gpu-000", [first]) == (1, 0, {})  # verifies the canary: more statements, once
    statements: list[str] = []

    def count(_conn, _cursor, statement, *_a) -> None:  # type: ignore[no-untyped-def]
        statements.append(statement)

    with kit.tx() as s:
        node = kit.node(s, "gpu-000")
        event.listen(kit.engine, "before_cursor_execute", count)
        try:
            assert ingest_batch(s, node, wire.ReportBatch(node_name="gpu-000", reports=reports), T0) == (20, 0, {})
        finally:
            event.remove(kit.engine, "before_cursor_execute", count)
    assert len(statements) == 2, statements  # the rollouts as this node sees them, then the insert
    assert _batch(kit, "gpu-000", odd) == (2, 0, {})
    with kit.tx() as s:
        got = dict(s.execute(select(Report.idempotency_key, Report.stable_bundle_id)).all())
        text = s.scalar(select(Report.detail).where(Report.idempotency_key == "unknown-stable"))["text"]
    cand_id = got["odd-stable-1"]
    assert cand_id is not None and cand_id != stable_id
    assert {got[k] for k in ("first-0001", *(r.idempotency_key for r in reports))} == {stable_id}
    assert got["unknown-stable"] is None
    assert text == "segfault ☠ in kernel \u00e9\\ \"q\""
