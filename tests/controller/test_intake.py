"""controller.intake through ``Writers.ingest``, in the API process's threads and in a real worker process, on
SQLite and PostgreSQL: a report is stored and answered the same way; a canary verified by its report comes back
from the worker process as a patch (``KEEP`` intact) for this process's store; another node's token is refused
(403) and a report for an unknown rollout rejected (422) with nothing stored; a body that does not validate comes
back ``invalid`` (the route parses it again for FastAPI's answer). About 3 s a backend with the worker process
(it is spawned and imports the controller). In either mode the requests waiting together are stored in one
transaction, each answered on its own."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import func, select

from controller.auth import Forbidden, Principal
from controller.db.models import Report
from controller.desired.generation import KEEP, Patch
from controller.desired.writers import Writers
from controller.errors import Invalid, Overloaded
from kernelctl import wire
from tests.controller.enginekit import Kit
from tests.controller.test_serve_phase import _stable_and_candidate


@pytest.fixture
def kit(db_url, tmp_path):
    k = Kit(db_url, tmp_path)
    yield k
    k.close()


@pytest.mark.parametrize("processes", [0, 1])
def test_reports_through_threads_and_a_worker_process(kit: Kit, db_url: str, processes: int) -> None:
    rid, stable, cand = _stable_and_candidate(kit, nodes=1)
    with kit.tx() as s:
        n = kit.node(s, "gpu-000")
        first = kit.report(n, rid, cand, stable, key="first-0001")
        unknown = kit.report(n, 999, cand, stable, key="unknown-01")
    me = Principal(1, "node:gpu-000", "agent", "gpu-000")
    told: list[tuple[int, Patch]] = []

    def body(*reports: wire.TrialReport) -> bytes:
        return wire.ReportBatch(node_name="gpu-000", reports=list(reports)).model_dump_json().encode()

    async def scenario() -> None:
        writers = Writers(kit.factory, ingest_processes=processes, database_url=db_url,
                          on_commit=lambda gen, patch: told.append((gen, patch)))
        writers.start()
        try:
            out = await writers.ingest(body(first), True, me)
            assert out.error is None and out.reply == wire.ReportBatchResponse(accepted=1, duplicates=0)
            again = await writers.ingest(body(first), True, me)
            assert again.reply == wire.ReportBatchResponse(accepted=0, duplicates=1)
            if processes:  # the canary verified in the worker: its commit's patch is told to this process
                ((gen, patch),) = told
                (row,) = patch.rows[n.id].values()
                assert gen > 0 and row.view.phase == "verified" and row.active_id is KEEP
            else:
                assert told == []  # this process's own hooks tell its store
            bad = await writers.ingest(body(first, unknown), True, me)
            assert isinstance(bad.error, Invalid) and "rollout 999 does not exist" in str(bad.error)
            assert bad.reports == 2
            with pytest.raises(Forbidden, match="gpu-000"):
                await writers.ingest(body(first), True, Principal(2, "node:other", "agent", "other"))
            assert (await writers.ingest(b'{"node_name": 1}', True, me)).invalid
        finally:
            await writers.stop()
            writers.close()

    asyncio.run(scenario())
    with kit.tx() as s:
        assert s.scalar(select(func.count()).select_from(Report)) == 1


def test_concurrent_requests_share_a_worker_process_transaction(kit: Kit, db_url: str) -> None:
    """Worker-process mode: requests waiting together go to the worker as one group, parsed there and stored in
    one transaction (fewer transactions than requests: the reports of one share its ``received_at``), each
    answered on its own (a replay a duplicate, a body that does not validate ``invalid``, another node's token
    refused); the canaries verified there come back as patches told to this process (``on_commit``)."""
    rid, stable, cand = _stable_and_candidate(kit, nodes=2)
    with kit.tx() as s:
        n0, n1 = kit.node(s, "gpu-000"), kit.node(s, "gpu-001")
        good = [(n0, kit.report(n0, rid, cand, stable, key=f"worker-{i:04d}")) for i in range(5)]
        good.append((n1, kit.report(n1, rid, cand, stable, key="worker-0101")))
    told: list[tuple[int, Patch]] = []

    def me(name: str) -> Principal:
        return Principal(1, f"node:{name}", "agent", name)

    def body(name: str, *reports: wire.TrialReport) -> bytes:
        return wire.ReportBatch(node_name=name, reports=list(reports)).model_dump_json().encode()

    requests = [(body(n.name, r), me(n.name)) for n, r in good]
    requests.append((body("gpu-000", good[0][1]), me("gpu-000")))  # a replay of the first
    requests.append((b'{"node_name": 1}', me("gpu-000")))  # does not validate
    requests.append((body("gpu-001", good[5][1]), me("gpu-000")))  # another node's token

    async def scenario() -> list:
        writers = Writers(kit.factory, ingest_processes=1, database_url=db_url,
                          on_commit=lambda gen, patch: told.append((gen, patch)))
        writers.start()
        try:
            await writers.ingest(b'{"node_name": 1}', True, me("gpu-000"))  # the worker started and ready
            return await asyncio.gather(*(writers.ingest(b, True, p) for b, p in requests), return_exceptions=True)
        finally:
            await writers.stop()
            writers.close()

    outs = asyncio.run(scenario())
    assert [(o.reply, o.reports) for o in outs[:6]] == [(wire.ReportBatchResponse(accepted=1, duplicates=0), 1)] * 6
    assert outs[6].reply == wire.ReportBatchResponse(accepted=0, duplicates=1)
    assert outs[7].invalid and outs[7].reply is None
    assert isinstance(outs[8], Forbidden) and "gpu-001" in str(outs[8])
    with kit.tx() as s:
        assert s.scalar(select(func.count()).select_from(Report)) == 6
        transactions = s.scalar(select(func.count(func.distinct(Report.received_at))))
    assert transactions < 6  # one a request before: the worker process stored each request alone
    verified = {nid: row.view.phase for _gen, patch in told for nid, rows in patch.rows.items() for row in rows.values()}
    assert verified == {n0.id: "verified", n1.id: "verified"}


def test_a_worker_process_that_died_is_replaced(kit: Kit, db_url: str) -> None:
    """Worker-process mode: a worker killed (out of memory, by hand) breaks the pool: the request is answered
    503 busy (``Overloaded``), the pool is recreated and the next request is stored."""
    import os
    import signal

    rid, stable, cand = _stable_and_candidate(kit, nodes=1)
    with kit.tx() as s:
        n = kit.node(s, "gpu-000")
        report = kit.report(n, rid, cand, stable, key="after-kill")
    me = Principal(1, "node:gpu-000", "agent", "gpu-000")
    body = wire.ReportBatch(node_name="gpu-000", reports=[report]).model_dump_json().encode()

    async def scenario() -> wire.ReportBatchResponse | None:
        writers = Writers(kit.factory, ingest_processes=1, database_url=db_url)
        writers.start()
        try:
            assert (await writers.ingest(b'{"node_name": 1}', True, me)).invalid  # the worker is up
            dead = writers._workers
            for pid in list(dead._processes):  # type: ignore[attr-defined]
                os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.5)  # the pool notices
            with pytest.raises(Overloaded, match="restarted"):
                await writers.ingest(body, True, me)
            assert writers._workers is not dead
            return (await writers.ingest(body, True, me)).reply
        finally:
            await writers.stop()
            writers.close()

    assert asyncio.run(scenario()) == wire.ReportBatchResponse(accepted=1, duplicates=0)


def test_concurrent_requests_share_one_commit_and_a_refused_one_stores_nothing(kit: Kit) -> None:
    """Threads mode: requests waiting together are stored in one transaction (the group commit), each answered on
    its own: the one naming an unknown rollout is answered 422-style with nothing stored, the others commit."""
    rid, stable, cand = _stable_and_candidate(kit, nodes=1)
    with kit.tx() as s:
        n = kit.node(s, "gpu-000")
        good = [kit.report(n, rid, cand, stable, key=f"group-{i:04d}") for i in range(12)]
        unknown = kit.report(n, 999, cand, stable, key="unknown-02")
    me = Principal(1, "node:gpu-000", "agent", "gpu-000")

    def body(*reports: wire.TrialReport) -> bytes:
        return wire.ReportBatch(node_name="gpu-000", reports=list(reports)).model_dump_json().encode()

    async def scenario() -> list:
        writers = Writers(kit.factory)
        writers.start()
        try:
            return await asyncio.gather(*(writers.ingest(body(r), True, me) for r in [*good[:6], unknown, *good[6:]]))
        finally:
            await writers.stop()
            writers.close()

    outs = asyncio.run(scenario())
    assert [o.reply.accepted for o in outs if o.reply is not None] == [1] * 12
    (bad,) = [o for o in outs if o.error is not None]
    assert isinstance(bad.error, Invalid) and "rollout 999 does not exist" in str(bad.error)
    with kit.tx() as s:
        assert s.scalar(select(func.count()).select_from(Report)) == 12


def test_a_batch_the_database_aborted_to_break_a_lock_cycle_is_written_again(kit: Kit, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Threads mode: the group commit's transaction aborted once with PostgreSQL's "deadlock detected" (a rollback
    on the leader locking the same canaries, issue 28's run with a CPU hog) is run again: every report is
    stored and answered, none refused with 503."""
    import psycopg.errors
    from sqlalchemy.exc import OperationalError

    from controller import ingest

    rid, stable, cand = _stable_and_candidate(kit, nodes=1)
    with kit.tx() as s:
        n = kit.node(s, "gpu-000")
        reports = [kit.report(n, rid, cand, stable, key=f"cycle-{i:04d}") for i in range(4)]
    me = Principal(1, "node:gpu-000", "agent", "gpu-000")
    real, aborted = ingest.ingest_many, []

    def once_aborted(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not aborted:
            aborted.append(1)
            raise OperationalError("UPDATE assignments ...", {}, psycopg.errors.DeadlockDetected("deadlock detected"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ingest, "ingest_many", once_aborted)

    async def scenario() -> list:
        writers = Writers(kit.factory)
        writers.start()
        try:
            return await asyncio.gather(*(writers.ingest(wire.ReportBatch(node_name="gpu-000", reports=[r])
                                                         .model_dump_json().encode(), True, me) for r in reports))
        finally:
            await writers.stop()
            writers.close()

    outs = asyncio.run(scenario())
    assert aborted == [1]
    assert [o.error for o in outs] == [None] * 4 and sum(o.reply.accepted for o in outs) == 4
    with kit.tx() as s:
        assert s.scalar(select(func.count()).select_from(Report)) == 4


def test_an_agent_sized_body_is_validated_at_once_and_its_count_checked_after(kit: Kit, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Up to what an agent sends (``COUNT_FIRST_ABOVE``) a body is validated without counting its items first
    and a batch over the limit is refused after, naming the count; a larger body is counted first and refused
    as a body that does not validate (the route answers 422 naming ``body.reports``: test_redteam)."""
    from controller import intake

    rid, stable, cand = _stable_and_candidate(kit, nodes=1)
    with kit.tx() as s:
        n = kit.node(s, "gpu-000")
        reports = [kit.report(n, rid, cand, stable, key=f"count-{i:04d}") for i in range(4)]
    me = Principal(1, "node:gpu-000", "agent", "gpu-000")
    body = wire.ReportBatch(node_name="gpu-000", reports=reports).model_dump_json().encode()
    assert len(body) < intake.COUNT_FIRST_ABOVE
    assert isinstance(intake.parse(body, True, me, 4), wire.ReportBatch)
    with pytest.raises(Invalid, match="4 items in reports is over the limit of 3"):
        intake.parse(body, True, me, 3)
    monkeypatch.setattr(intake, "COUNT_FIRST_ABOVE", len(body) - 1)
    refused = intake.parse(body, True, me, 3)
    assert isinstance(refused, intake.Outcome) and refused.invalid
