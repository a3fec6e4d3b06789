"""Writes declare what they change in desired state, and replicas apply it as a patch (issue 28), on SQLite and
PostgreSQL.

* A change declared inside a savepoint (the tick handles each rollout in one) bumps the generation at the outer
  commit; one declared in a savepoint that is rolled back leaves a partial patch (reload), never its rows.
* A rollback is a patch like a switch: a held watch of a canary is answered with the stable version at once,
  with one wake-up and no snapshot reload; the snapshot it replaced is unchanged (copy-on-write).
* Across processes (PostgreSQL): the commit's NOTIFY carries its patch when it fits, and another API worker or
  replica applies it as its own commits, without a reload; a patch too large for a notice sends the generation
  alone (that replica reloads).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Callable
from dataclasses import replace

import pytest

from controller import registry
from controller.db.engine import make_engine, session_factory
from controller.db.models import utcnow
from controller.desired.effects import AssignmentView
from controller.desired.generation import (
    KEEP,
    NOTICE_MAX_BYTES,
    PATCH,
    Patch,
    PatchRow,
    changed,
    install_generation_hooks,
    notice,
    read_notice,
)
from controller.desired.hub import DesiredHub
from controller.desired.snapshot import load_snapshot
from controller.rollouts import rollback
from controller.tick import mark_stale
from kernelctl import wire
from tests.controller.enginekit import T0, Kit, generation, generation_kit
from tests.controller.test_serve_phase import _stable_and_candidate


@pytest.fixture
def kit(db_url, tmp_path):
    yield from generation_kit(db_url, tmp_path)


def test_a_change_declared_in_a_savepoint_bumps_at_the_outer_commit(kit: Kit) -> None:
    g0 = generation(kit)
    with kit.tx() as s:
        with s.begin_nested():
            changed(s, strata={(1, "x"): "paused"})
        assert s.info[PATCH].complete and s.info[PATCH].strata == {(1, "x"): "paused"}
    assert generation(kit) == g0 + 1
    with kit.tx() as s:
        with pytest.raises(RuntimeError), s.begin_nested():
            changed(s, strata={(1, "x"): "paused"})
            raise RuntimeError("undone")
        patch = s.info[PATCH]
        assert not patch.complete and not patch.strata  # its rows are not trusted: the replicas reload
    assert generation(kit) == g0 + 2


def test_a_full_heartbeat_declares_the_rows_it_changes(kit: Kit) -> None:
    """The single-row writer (the full heartbeat transaction) declares its rows as the batch writer does, so
    its commit is a complete patch (other workers patch, none reloads)."""
    _rid, stable, cand = _stable_and_candidate(kit, nodes=2)
    seen: list[Patch] = []
    install_generation_hooks(kit.factory, on_commit=lambda _gen, patch: seen.append(patch))
    with kit.tx() as s:  # the canary downloaded the candidate and stages it: the phase moves
        registry.heartbeat(s, wire.HeartbeatRequest(node_name="gpu-000", active=[stable], staged=[cand]),
                           T0, heartbeat_seconds=5)
    with kit.tx() as s:
        registry.heartbeat(s, wire.HeartbeatRequest(node_name="gpu-000", active=[cand]), T0, heartbeat_seconds=5)
    assert seen and all(p.complete and p.rows for p in seen), seen


def test_an_older_patch_never_overwrites_a_newer_row(kit: Kit, db_url: str) -> None:
    """Another worker's commit g+1 (its NOTIFY on the way) and this process's g+2 touch one row: g+2, arriving
    first, is applied at once (its watches answer; the generation stays, a reload is asked for), and g+1's
    older row then never overwrites the newer one."""
    rid, _stable, _cand = _stable_and_candidate(kit, nodes=2)

    async def run() -> tuple[str, str, int, int]:
        hub = DesiredHub(kit.factory, db_url, poll_seconds=60)
        await hub.start()
        try:
            store = hub.store
            await asyncio.sleep(0.3)
            snap = store.snapshot
            g, nid = snap.generation, snap.nodes["gpu-000"].id
            row = snap.nodes["gpu-000"].rows["llm-fused"].view
            canary = Patch(rows={nid: {"llm-fused": PatchRow(replace(row, rollout_id=rid, phase="staged"))}})
            back = Patch(rows={nid: {"llm-fused": PatchRow(AssignmentView("llm-fused", row.stable_id,
                                                                          row.stable_id, None, None))}})
            store.apply(g + 2, back)  # the newer first: its row at once, the generation stays
            held = store.snapshot.generation
            assert store.snapshot.nodes["gpu-000"].rows["llm-fused"].view.rollout_id is None
            store.apply(g + 1, canary)  # the older: applied, then the newer after it
            final = store.snapshot
            after = final.nodes["gpu-000"].rows["llm-fused"].view
            return (str(after.rollout_id), str(after.phase), final.generation - g, held - g)
        finally:
            await hub.stop()

    rollout_after, phase_after, advanced, held = asyncio.run(run())
    assert held == 0  # g+2 alone changed nothing
    assert advanced == 1 and (rollout_after, phase_after) == ("None", "None")  # the newer row stands


def test_a_notice_carries_the_patch_when_it_fits() -> None:
    patch = Patch(rows={7: {"llm-fused": PatchRow(AssignmentView("llm-fused", 3, 2, 5, "staged"), KEEP)},
                        8: {"llm-fused": PatchRow(AssignmentView("llm-fused", 2, 2, None, None), 4)}},
                  strata={(5, "sm_90/drv550/triton3.6.0"): "rolled_back"}, nodes={9: "stale"}, complete=False)
    assert read_notice(notice(41, patch)) == (41, patch)
    states = Patch(nodes={9: "stale"})  # complete; a replica from before node patches reads it as partial (reloads)
    assert read_notice(notice(44, states)) == (44, states)
    assert json.loads(notice(44, states).split(" ", 1)[1])["c"] is False
    big = Patch(rows={n: {"llm-fused": PatchRow(AssignmentView("llm-fused", n, n + 1, n + 2, "verified"), n + 3)}
                      for n in range(10**6, 10**6 + 3000)})  # too large even compressed: the generation alone
    assert read_notice(notice(42, big)) == (42, None)
    many = Patch(rows={n: {"llm-fused": PatchRow(AssignmentView("llm-fused", 2, 2, None, None))} for n in range(400)})
    text = notice(43, many)  # repetitive rows: compressed to fit
    assert len(text.encode()) <= NOTICE_MAX_BYTES and text.split(" ")[1].startswith("z")
    assert read_notice(text) == (43, many)


@pytest.mark.parametrize("db_backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_a_rollback_committed_by_another_process_is_applied_from_its_notice(kit: Kit, db_url: str) -> None:
    """Another API worker (its own engine and hooks: here a second factory) rolls back; this hub's held watch is
    answered from the notice's patch, with no snapshot reload."""
    rid, stable, _cand = _stable_and_candidate(kit, nodes=2)
    other = session_factory(make_engine(db_url))
    install_generation_hooks(other)

    def roll_back_elsewhere() -> None:
        with other() as s, s.begin():
            rollback(s, rid, actor="op", reason="numerics wrong")

    try:
        reply, reloads, _wakes = asyncio.run(_watch_through(kit, db_url, stable, roll_back_elsewhere))
    finally:
        other.kw["bind"].dispose()
    (d,) = reply.desired
    assert (d.active, d.role) == (stable, "stable")
    assert reloads == 0  # the notice's patch, not a reload


def test_a_rollback_reaches_a_held_watch_as_one_patch_without_a_reload(kit: Kit, db_url: str) -> None:
    rid, stable, _cand = _stable_and_candidate(kit, nodes=2)
    reply, reloads, wakes = asyncio.run(_watch_through(kit, db_url, stable, lambda: _rollback(kit, rid)))
    (d,) = reply.desired
    assert (d.active, d.role, d.trial) == (stable, "stable", None)
    assert reply.generation == generation(kit)
    assert reloads == 0  # the patch, not a reload
    assert sum(w.count("gpu-000") for w in wakes) == 1  # one wake-up
    snap = load_snapshot(kit.factory)
    assert snap.desired(snap.nodes["gpu-000"]) == reply.desired


def test_a_node_marked_stale_and_back_is_a_patch_without_a_reload(kit: Kit, db_url: str) -> None:
    """The leader marking nodes stale and a stale node's heartbeat making it active again declare the node's
    state: the replicas patch it in (a cold start's flapping nodes once cost a reload each, 58-96 per run)."""
    _rid, stable, _cand = _stable_and_candidate(kit, nodes=2)

    def mark_all_stale() -> None:
        with kit.tx() as s:
            mark_stale(s, utcnow() + dt.timedelta(hours=1), 60.0)

    async def run() -> tuple[dict[str, str], str, dict[str, str], int]:
        hub = DesiredHub(kit.factory, db_url, poll_seconds=60)
        await hub.start()
        loads = _count_reloads(hub)
        try:
            await asyncio.sleep(0.3)  # the start's own reload (LISTEN connected) is over
            loads.clear()
            await asyncio.to_thread(mark_all_stale)
            await asyncio.sleep(0.2)
            marked = {n: v.state for n, v in hub.snapshot.nodes.items()}
            _reply, _held, path = await hub.heartbeat(
                wire.HeartbeatRequest(node_name="gpu-001", active=[stable]), heartbeat_seconds=5)
            await asyncio.sleep(0.2)
            return marked, path, {n: v.state for n, v in hub.snapshot.nodes.items()}, len(loads)
        finally:
            await hub.stop()

    marked, path, back, reloads = asyncio.run(run())
    assert marked == {"gpu-000": "stale", "gpu-001": "stale"}
    assert path == "slow" and back == {"gpu-000": "stale", "gpu-001": "active"}  # the full transaction, once
    assert reloads == 0
    snap = load_snapshot(kit.factory)
    assert {n: v.state for n, v in snap.nodes.items()} == back


def _count_reloads(hub: DesiredHub) -> list[int]:
    """The generations of the snapshot reloads ``hub`` makes from now on (a list that grows)."""
    loads: list[int] = []
    load = hub.store._load_if_newer

    def counted(have: int, unknown: bool):  # type: ignore[no-untyped-def]
        snap = load(have, unknown)
        if snap is not None:
            loads.append(snap.generation)
        return snap

    hub.store._load_if_newer = counted  # type: ignore[method-assign]
    return loads


async def _watch_through(kit: Kit, db_url: str, stable: wire.BundleRef, write: Callable[[], None]
                         ) -> tuple[wire.HeartbeatResponse, int, list[list[str]]]:
    """Hold a watch of canary gpu-000 on a hub, run ``write`` in a thread; the watch's reply, the snapshot
    reloads meanwhile and the wake-ups."""
    hub = DesiredHub(kit.factory, db_url, poll_seconds=60)
    await hub.start()
    loads = _count_reloads(hub)
    wakes: list[list[str]] = []
    wake = hub.waiters.wake
    hub.waiters.wake = lambda names: (wakes.append(list(names)), wake(names))[1]  # type: ignore
    try:
        first, _h, _p = await hub.heartbeat(wire.HeartbeatRequest(node_name="gpu-000", active=[stable]),
                                            heartbeat_seconds=5)
        await asyncio.sleep(0.3)  # the start's own reload (LISTEN connected) is over
        loads.clear()
        before = hub.snapshot
        watch = asyncio.create_task(hub.heartbeat(wire.HeartbeatRequest(
            node_name="gpu-000", active=[stable], generation=first.generation, wait_seconds=30),
            heartbeat_seconds=5))
        await asyncio.sleep(0.2)
        assert not watch.done()
        wakes.clear()
        await asyncio.to_thread(write)
        reply, held, _path = await asyncio.wait_for(watch, 10)
        assert held < 5
        assert before.desired(before.nodes["gpu-000"])[0].role == "candidate"  # the old snapshot stands
        return reply, len(loads), wakes
    finally:
        await hub.stop()


def _rollback(kit: Kit, rid: int) -> None:
    with kit.tx() as s:
        rollback(s, rid, actor="op", reason="numerics wrong")
