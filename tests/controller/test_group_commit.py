"""Group-committed writes: the one heartbeat rule (``controller.desired.effects.heartbeat_effects``) applied by
its batch writer writes exactly what its single-row writer writes; registration (written once, in
``controller.enrollment``) refuses items one by one; a hub batches concurrent requests and patches the rows
commits declare into its snapshot.

On SQLite and PostgreSQL. Switches: ``controller.switches.record_switches`` vs ``registry.heartbeat``
(assignment rows, canary phases, activation history with its rollout/verification tags, events, the reply).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re

import pytest
from sqlalchemy import select

from controller import registry
from controller.auth import Principal, authenticate, issue_node_token
from controller.db.models import Activation, ApiToken, Assignment, Event, Node
from controller.desired.hub import DesiredHub
from controller.desired.snapshot import load_snapshot
from controller.enrollment import Registered, Registration, register_many
from controller.errors import Conflict
from controller.switches import FULL, Switch, Switched, record_switches
from kernelctl import wire
from tests.controller.enginekit import T0, Kit, generation, generation_kit, inventory
from tests.controller.test_serve_phase import _send, _stable_and_candidate

ENROLL = Principal(token_id=1, name="enroll", role="agent")


def _reg(name: str, principal: Principal = ENROLL, **inv) -> Registration:
    return Registration(wire.RegisterRequest(node_name=name, inventory=inventory(**inv)), principal.actor,
                        principal.is_enrollment)


@pytest.fixture
def kit(db_url, tmp_path):
    yield from generation_kit(db_url, tmp_path)


def _events(kit: Kit, node: str) -> list[tuple[str, str | None, dict]]:
    return [(e.action, e.bundle, e.payload) for e in kit.events(node=node)]


def _norm(rows: list[tuple[str, str | None, dict]], name: str) -> list[tuple[str, str | None, str]]:
    return [(a, b, re.sub(r"\d+", "#", str(p).replace(name, "N"))) for a, b, p in rows]  # ids differ


def test_register_many_revokes_earlier_tokens_of_the_names_it_creates(kit: Kit) -> None:
    with kit.tx() as s:  # an operator issued a token for b-1 before it registered: it is superseded
        old = issue_node_token(s, "b-1", actor="op")
    with kit.tx() as s:
        done = register_many(s, [_reg(f"b-{i}") for i in range(3)], now=T0)
    assert all(isinstance(d, Registered) and d.new for d in done)
    actions = [e[0] for e in _events(kit, "b-1")]
    assert actions[-4:] == ["node.registered", "token.revoked", "token.created", "token.node_reissued"]
    with kit.tx() as s:
        nodes = {n.name: n for n in s.scalars(select(Node))}
        live = {t.node_name: t for t in s.scalars(select(ApiToken).where(ApiToken.revoked_at.is_(None)))}
        assert sorted(live) == ["b-0", "b-1", "b-2"]  # one live token each: the new one
        for d, name in zip(done, ("b-0", "b-1", "b-2"), strict=True):
            assert d.node_id == nodes[name].id
            assert authenticate(s, d.token).node == name
        with pytest.raises(Exception, match="revoked"):
            authenticate(s, old)


def test_register_many_refuses_items_one_by_one(kit: Kit) -> None:
    kit.nodes(1, prefix="old")
    with kit.tx() as s:
        node_token = issue_node_token(s, "old-000", actor="op")
        own = authenticate(s, node_token)
    items = [_reg(n, p, driver=d) for n, d, p in [
        ("new-0", "550.54.15", ENROLL),
        ("old-000", "550.54.15", ENROLL),  # exists: an enrollment token registers new nodes only
        ("new-0", "550.54.15", ENROLL),  # twice in one batch: the second is refused like a late duplicate
        ("old-000", "560.28.03", own),  # re-registration with the node's own token: inventory updated
        ("new-1", "550.54.15", ENROLL),
    ]]
    with kit.tx() as s:
        out = register_many(s, items, now=T0)
    assert [type(o).__name__ for o in out] == ["Registered", "Conflict", "Conflict", "Registered", "Registered"]
    assert "already registered" in str(out[1]) and not out[3].new
    with kit.tx() as s:
        assert s.scalar(select(Node.driver_version).where(Node.name == "old-000")) == "560.28.03"
        assert authenticate(s, out[3].token).node == "old-000"
        with pytest.raises(Exception, match="revoked"):
            authenticate(s, node_token)
        assert sorted(s.scalars(select(Node.name))) == ["new-0", "new-1", "old-000"]


def _ids(kit: Kit, node: str, active: list[wire.BundleRef]) -> tuple[int, dict[str, int | None]]:
    snap = load_snapshot(kit.factory)
    view = snap.nodes[node]
    ids = snap.reported(view, wire.HeartbeatRequest(node_name=node, active=active))
    assert ids is not None
    return view.id, ids


def _state(kit: Kit, node: str) -> tuple:
    with kit.tx() as s:
        nid = s.scalar(select(Node.id).where(Node.name == node))
        a = s.scalar(select(Assignment).where(Assignment.node_id == nid))
        acts = [(x.bundle_id, x.started_at, x.ended_at, x.rollout_id, x.verified_at is not None)
                for x in s.scalars(select(Activation).where(Activation.node_id == nid).order_by(Activation.id))]
        return (a.active_bundle_id, a.phase), acts


def test_switches_write_what_the_heartbeat_transaction_writes(kit: Kit) -> None:
    rid, stable, cand = _stable_and_candidate(kit, nodes=4)  # plan 100%: every node is a canary
    t = [T0 + dt.timedelta(seconds=i) for i in range(10)]
    steps = [(t[1], [stable]), (t[3], [cand]), (t[4], [stable]), (t[5], [cand]), (t[6], []), (t[7], [stable])]
    for at, active in steps:
        if at == t[3]:
            for n in ("gpu-000", "gpu-002"):
                _send(kit, n, rid, cand, stable, "ok", t[2])  # verified: may serve the candidate
        with kit.tx() as s:
            reply = registry.heartbeat(s, wire.HeartbeatRequest(node_name="gpu-000", active=active), at,
                                       heartbeat_seconds=5)
        nid, ids = _ids(kit, "gpu-002", active)
        g0 = generation(kit)
        with kit.tx() as s:
            (res,) = record_switches(s, [Switch(nid, "gpu-002", ids, at)])
        assert isinstance(res, Switched)
        assert (generation(kit) > g0) == res.changed
        assert _state(kit, "gpu-000") == _state(kit, "gpu-002")
        # the reply built from the switched rows is the transaction's reply
        snap = load_snapshot(kit.factory)
        assert snap.desired(snap.nodes["gpu-002"]) == reply.desired
        assert {n: v.phase for n, (v, _a) in res.rows.items()} == {d.name: d.phase for d in reply.desired}
    assert _state(kit, "gpu-000")[0] == (stable_id := _state(kit, "gpu-002")[0]) and stable_id[1] == "verified"
    assert _norm(_events(kit, "gpu-000"), "gpu-000")[-6:] == _norm(_events(kit, "gpu-002"), "gpu-002")[-6:]
    acts = _state(kit, "gpu-002")[1]
    assert [(a[3] is not None, a[4]) for a in acts if a[0] != acts[0][0]] == [(True, True), (True, True)]


def test_switch_of_a_stale_node_or_one_twice_in_a_batch_takes_the_full_path(kit: Kit) -> None:
    _rid, stable, _cand = _stable_and_candidate(kit, nodes=2)
    nid0, ids0 = _ids(kit, "gpu-000", [stable])
    nid1, ids1 = _ids(kit, "gpu-001", [stable])
    with kit.tx() as s:
        s.get(Node, nid1).state = "stale"
    with kit.tx() as s:
        out = record_switches(s, [Switch(nid0, "gpu-000", ids0, T0), Switch(nid0, "gpu-000", ids0, T0),
                                  Switch(nid1, "gpu-001", ids1, T0)])
    assert isinstance(out[0], Switched) and out[1] is FULL and out[2] is FULL


def test_hub_batches_concurrent_switches_and_registrations_in_few_transactions(kit: Kit, db_url: str) -> None:
    _rid, stable, _cand = _stable_and_candidate(kit, nodes=30)

    async def run() -> tuple[list, list, int]:
        hub = DesiredHub(kit.factory, db_url)
        await hub.start()
        batches: list[int] = []
        write = hub.writers.switches.write
        hub.writers.switches.write = lambda items: (batches.append(len(items)), write(items))[1]  # type: ignore
        try:
            g0 = hub.snapshot.generation
            hub.writers.heartbeat = lambda r, _hb: pytest.fail(f"{r.node_name} took the full transaction")
            replies = await asyncio.gather(*(hub.heartbeat(
                wire.HeartbeatRequest(node_name=f"gpu-{i:03d}", active=[stable]), heartbeat_seconds=5)
                for i in range(30)))
            regs = await asyncio.gather(*(hub.register(_reg(f"late-{i}")) for i in range(20)))
            assert hub.snapshot.generation > g0  # patched in place: the batches' generations are known
            return replies, regs, len(batches)
        finally:
            await hub.stop()

    replies, regs, n_batches = asyncio.run(run())
    assert all(path == "switch" for _r, _held, path in replies)
    assert all(r.desired[0].active == stable for r, _h, _p in replies)
    assert n_batches < 30  # concurrent requests share transactions
    assert all(isinstance(r, Registered) for r in regs)
    with kit.tx() as s:
        assert s.scalar(select(Node).where(Node.name == "late-19")) is not None
        assert len(list(s.scalars(select(Event).where(Event.action == "assignment.activated")))) >= 30
    with pytest.raises(Conflict), kit.tx() as s:
        (again,) = register_many(s, [_reg("late-0")])
        raise again


def test_a_verified_canary_is_patched_into_the_snapshot_without_a_reload(kit: Kit, db_url: str) -> None:
    rid, stable, cand = _stable_and_candidate(kit, nodes=2)

    async def run() -> None:
        hub = DesiredHub(kit.factory, db_url, poll_seconds=60)
        await hub.start()
        try:
            before = hub.snapshot
            (d,) = before.desired(before.nodes["gpu-000"])
            assert (d.active, d.phase) == (stable, "staged")
            _send(kit, "gpu-000", rid, cand, stable, "ok", T0)  # its trial passed: verified, generation g
            g = generation(kit)
            await asyncio.sleep(0)  # the commit's declared rows reach the loop
            assert hub.snapshot is not before and hub.snapshot.generation == g  # patched, not reloaded
            assert hub.snapshot.nodes["gpu-001"] is before.nodes["gpu-001"]  # copy-on-write: the rest is shared
            assert before.desired(before.nodes["gpu-000"])[0].phase == "staged"  # the old snapshot never changes
            (d,) = hub.snapshot.desired(hub.snapshot.nodes["gpu-000"])
            assert (d.active, d.phase) == (cand, "verified")
            assert hub.snapshot.desired(hub.snapshot.nodes["gpu-000"]) == load_snapshot(kit.factory).desired(
                load_snapshot(kit.factory).nodes["gpu-000"])
            (d1,) = hub.snapshot.desired(hub.snapshot.nodes["gpu-001"])
            assert d1.phase == "staged"  # only that node
        finally:
            await hub.stop()

    asyncio.run(run())


def test_writes_queued_past_the_deadline_are_refused_not_written() -> None:
    """A write that waited longer than the deadline is answered 503 (Overloaded) instead of written, and while
    the oldest queued write is that old, new ones are refused at once; once the queue is served, writes go in
    again. Without the deadline every abandoned request was written (a registration storm, docs/benchmarks.md)."""
    import threading

    from controller.errors import Overloaded
    from controller.group_commit import GroupCommit

    written: list[str] = []
    release = threading.Event()

    def write(items: list[str]) -> list[str]:
        if items == ["first"]:
            release.wait(10)  # the writer is busy with the first batch while the others queue
        written.extend(items)
        return items

    async def main() -> dict[str, object]:
        gc: GroupCommit[str] = GroupCommit("things", write, deadline_seconds=0.2)
        gc.start()
        first = asyncio.ensure_future(gc.submit("first"))
        await asyncio.sleep(0.05)
        queued = [asyncio.ensure_future(gc.submit(x)) for x in ("second", "third")]
        await asyncio.sleep(0.3)  # the queued ones are past the deadline now
        with pytest.raises(Overloaded, match=r"wait more than 0\.2 s"):
            await gc.submit("refused at once")
        release.set()
        out = {"first": await first}
        for name, fut in zip(("second", "third"), queued, strict=True):
            out[name] = await asyncio.gather(fut, return_exceptions=True)
        out["later"] = await gc.submit("later")  # the queue was served: written again
        await gc.stop()
        return out

    out = asyncio.run(main())
    assert out["first"] == "first" and out["later"] == "later"
    for name in ("second", "third"):
        (err,) = out[name]
        assert isinstance(err, Overloaded) and "waited more than 0.2 s" in str(err) and err.retry_after >= 1, err
    assert written == ["first", "later"]  # the abandoned writes were never written


def test_a_group_commit_with_concurrency_writes_that_many_batches_at_once() -> None:
    """``concurrency=2`` (as for two report worker processes): a second batch is written while the first runs,
    each taking what was queued when a writer came free; what arrives while both run waits and goes as one."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from controller.group_commit import GroupCommit

    release = threading.Event()
    batches: list[list[int]] = []

    def write(items: list[int]) -> list[int]:
        batches.append(list(items))
        release.wait(10)
        return [i * 10 for i in items]

    async def until(n: int) -> None:
        for _ in range(1000):
            if len(batches) >= n:
                return
            await asyncio.sleep(0.01)

    async def scenario() -> list[int]:
        executor = ThreadPoolExecutor(2)
        gc: GroupCommit[int] = GroupCommit("t", write, concurrency=2, executor=executor)
        gc.start()
        try:
            first = asyncio.ensure_future(gc.submit(1))
            await until(1)
            second = [asyncio.ensure_future(gc.submit(i)) for i in (2, 3)]
            await until(2)
            third = [asyncio.ensure_future(gc.submit(i)) for i in (4, 5)]
            await asyncio.sleep(0.2)
            assert batches == [[1], [2, 3]]  # both writers busy: 4 and 5 wait
            release.set()
            return list(await asyncio.gather(first, *second, *third))
        finally:
            release.set()
            await gc.stop()
            executor.shutdown()

    assert asyncio.run(scenario()) == [10, 20, 30, 40, 50]
    assert batches == [[1], [2, 3], [4, 5]]
