"""Writes declare what they change in desired state, and replicas apply it as a patch (issue 28), on SQLite and
PostgreSQL.

* A change declared inside a savepoint (the tick handles each rollout in one) bumps the generation at the outer
  commit; one declared in a savepoint that is rolled back leaves a partial patch (reload), never its rows.
* A rollback is a patch like a switch: a held watch of a canary is answered with the stable version at once,
  with one wake-up and no snapshot reload; the snapshot it replaced is unchanged (copy-on-write).
"""

from __future__ import annotations

import asyncio

import pytest

from controller.desired.generation import PATCH, changed
from controller.desired.hub import DesiredHub
from controller.desired.snapshot import load_snapshot
from controller.rollouts import rollback
from kernelctl import wire
from tests.controller.enginekit import Kit, generation, generation_kit
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


def test_a_rollback_reaches_a_held_watch_as_one_patch_without_a_reload(kit: Kit, db_url: str) -> None:
    rid, stable, _cand = _stable_and_candidate(kit, nodes=2)

    async def run() -> tuple[wire.HeartbeatResponse, int, list[list[str]]]:
        hub = DesiredHub(kit.factory, db_url, poll_seconds=60)
        await hub.start()
        loads: list[int] = []
        load = hub.store._load_if_newer
        def counted(have: int, unknown: bool):  # type: ignore[no-untyped-def]
            snap = load(have, unknown)
            if snap is not None:
                loads.append(snap.generation)
            return snap

        hub.store._load_if_newer = counted  # type: ignore[method-assign]
        wakes: list[list[str]] = []
        wake = hub.waiters.wake
        hub.waiters.wake = lambda names: (wakes.append(list(names)), wake(names))[1]  # type: ignore
        try:
            first, _h, _p = await hub.heartbeat(wire.HeartbeatRequest(node_name="gpu-000", active=[stable]),
                                                heartbeat_seconds=5)
            before = hub.snapshot
            watch = asyncio.create_task(hub.heartbeat(wire.HeartbeatRequest(
                node_name="gpu-000", active=[stable], generation=first.generation, wait_seconds=30),
                heartbeat_seconds=5))
            await asyncio.sleep(0.2)
            assert not watch.done()
            wakes.clear()
            await asyncio.to_thread(_rollback, kit, rid)
            reply, held, _path = await asyncio.wait_for(watch, 10)
            assert held < 5
            assert before.desired(before.nodes["gpu-000"])[0].role == "candidate"  # the old snapshot stands
            return reply, len(loads), wakes
        finally:
            await hub.stop()

    reply, reloads, wakes = asyncio.run(run())
    (d,) = reply.desired
    assert (d.active, d.role, d.trial) == (stable, "stable", None)
    assert reply.generation == generation(kit)
    assert reloads == 0  # the patch, not a reload
    assert sum(w.count("gpu-000") for w in wakes) == 1  # one wake-up
    snap = load_snapshot(kit.factory)
    assert snap.desired(snap.nodes["gpu-000"]) == reply.desired


def _rollback(kit: Kit, rid: int) -> None:
    with kit.tx() as s:
        rollback(s, rid, actor="op", reason="numerics wrong")
