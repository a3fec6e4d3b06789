"""Where a heartbeat's time goes at the replica (issue 28, 10,000 nodes), on SQLite and PostgreSQL.

* A watch whose version switch leaves its desired state as it is (``Effects.desired_unchanged``) is held while
  the switch commits: it is written (activation, active version), answered at the end of its hold with the
  generation it holds, and reported as the switch it was; a write that fails ends the hold with its error.
* Heartbeats that need the full transaction (nodes marked stale coming back at once) are queued, not refused: a
  burst far past ``max_pending_writes`` is answered.
* A held watch never writes its body again when it wakes: a newer heartbeat of the node (an agent reporting a
  version it staged meanwhile) is not undone by the stale body.
* A watch carrying a generation newer than the snapshot waits for the snapshot as part of its hold, measured
  apart (``kernelctl_heartbeat_catch_up_seconds``).
* Every full transaction is counted with why the snapshot could not answer it
  (``kernelctl_heartbeat_full_total{reason}``).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import select, text, update

from controller.db.models import Activation, Assignment, Bundle, Node
from controller.desired.effects import RowFacts, heartbeat_effects
from controller.desired.hub import DesiredHub
from controller.errors import Overloaded
from controller.metrics import Metrics
from controller.rollouts import promote, start_rollout
from kernelctl import wire
from kernelctl.vocab import FullHeartbeat
from tests.controller.enginekit import T0, Kit, generation, generation_kit, inventory


@pytest.fixture
def kit(db_url, tmp_path):
    yield from generation_kit(db_url, tmp_path)


def _stable(kit: Kit, nodes: int) -> wire.BundleRef:
    kit.nodes(nodes)
    bid = kit.push("1.0.0")
    with kit.tx() as s:
        rid = start_rollout(s, "llm-fused@1.0.0", actor="op").id
        promote(s, rid, actor="op", full=True)
    return kit.ref(bid)


def test_the_rule_says_which_switches_leave_desired_state_alone() -> None:
    plain = RowFacts("k", active_id=None, desired_id=1, stable_id=1, rollout_id=None, phase=None)
    assert heartbeat_effects({"k": plain}, {"k": 1}, T0).desired_unchanged  # a stable version now active
    verified = RowFacts("k", 1, 2, 1, 7, "verified", T0)
    assert not heartbeat_effects({"k": verified}, {"k": 2}, T0).desired_unchanged  # verified -> serving


def test_a_watch_is_held_while_its_switch_commits(kit: Kit, db_url: str) -> None:
    stable = _stable(kit, 1)

    async def run() -> tuple[wire.HeartbeatResponse, float, str, float, int]:
        hub = DesiredHub(kit.factory, db_url, poll_seconds=60)
        await hub.start()
        try:
            first, _h, path = await hub.heartbeat(wire.HeartbeatRequest(node_name="gpu-000"), heartbeat_seconds=5)
            assert path == "fast" and first.desired[0].active == stable
            t0 = time.monotonic()
            reply, held, path = await hub.heartbeat(wire.HeartbeatRequest(
                node_name="gpu-000", active=[stable], generation=first.generation, wait_seconds=1.0),
                heartbeat_seconds=5)
            return reply, held, path, time.monotonic() - t0, first.generation
        finally:
            await hub.stop()

    reply, held, path, took, g = asyncio.run(run())
    assert path == "switch"
    assert took >= 0.95 and held >= 0.95 * took  # held to the end of the watch: nothing newer for the node
    assert reply.generation == g and reply.desired[0].active == stable
    assert generation(kit) > g  # the switch was committed meanwhile
    with kit.tx() as s:
        assert s.scalar(select(Assignment.active_bundle_id)) == s.scalar(select(Activation.bundle_id))
        assert s.scalar(select(Assignment.active_bundle_id)) is not None


def test_a_held_watch_never_writes_its_body_over_a_newer_heartbeat(kit: Kit, db_url: str) -> None:
    """An agent reports a version it staged while its watch is held (a heartbeat without a wait, after a download):
    the held watch, whose body still says nothing is active, does not switch the node back when it ends."""
    stable = _stable(kit, 1)

    async def run() -> tuple[wire.HeartbeatResponse, str]:
        hub = DesiredHub(kit.factory, db_url, poll_seconds=60)
        await hub.start()
        try:
            first, _h, _p = await hub.heartbeat(wire.HeartbeatRequest(node_name="gpu-000"), heartbeat_seconds=5)
            watch = asyncio.ensure_future(hub.heartbeat(wire.HeartbeatRequest(
                node_name="gpu-000", generation=first.generation, wait_seconds=1.0), heartbeat_seconds=5))
            await asyncio.sleep(0.2)
            _r, _h, now_path = await hub.heartbeat(wire.HeartbeatRequest(
                node_name="gpu-000", active=[stable], staged=[stable], generation=first.generation),
                heartbeat_seconds=5)
            reply, _h, _p = await watch
            await asyncio.sleep(0.1)
            return reply, now_path
        finally:
            await hub.stop()

    reply, now_path = asyncio.run(run())
    assert now_path == "switch" and reply.desired[0].active == stable
    with kit.tx() as s:
        assert s.scalar(select(Assignment.active_bundle_id)) is not None  # not switched back by the stale body
        assert [a.ended_at for a in s.scalars(select(Activation))] == [None]  # one activation, still open


def test_a_failed_write_ends_the_hold_with_its_error(kit: Kit, db_url: str) -> None:
    stable = _stable(kit, 1)

    async def run() -> float:
        hub = DesiredHub(kit.factory, db_url, poll_seconds=60)
        await hub.start()
        try:
            first, _h, _p = await hub.heartbeat(wire.HeartbeatRequest(node_name="gpu-000"), heartbeat_seconds=5)
            hub.writers.switches.max_queued = 0  # every switch refused: Overloaded
            t0 = time.monotonic()
            with pytest.raises(Overloaded):
                await hub.heartbeat(wire.HeartbeatRequest(node_name="gpu-000", active=[stable],
                                                          generation=first.generation, wait_seconds=30),
                                    heartbeat_seconds=5)
            return time.monotonic() - t0
        finally:
            await hub.stop()

    assert asyncio.run(run()) < 5  # not the 30 s of the watch
    with kit.tx() as s:
        assert s.scalar(select(Assignment.active_bundle_id)) is None  # nothing was written


def test_a_burst_of_full_transactions_is_answered_none_refused(kit: Kit, db_url: str) -> None:
    stable = _stable(kit, 40)
    with kit.tx() as s:
        s.execute(update(Node).values(state="stale"))  # every node marked stale, all back at once
    g0 = generation(kit)

    metrics = Metrics()

    async def run() -> list[tuple[wire.HeartbeatResponse, float, str]]:
        hub = DesiredHub(kit.factory, db_url, poll_seconds=60, max_pending_writes=1, metrics=metrics)
        await hub.start()
        try:
            return await asyncio.gather(*(hub.heartbeat(wire.HeartbeatRequest(
                node_name=f"gpu-{i:03d}", active=[stable]), heartbeat_seconds=5) for i in range(40)))
        finally:
            await hub.stop()

    replies = asyncio.run(run())
    assert [p for _r, _h, p in replies] == ["slow"] * 40
    assert all(r.node_name == f"gpu-{i:03d}" and r.desired[0].active == stable for i, (r, _h, _p) in enumerate(replies))
    with kit.tx() as s:
        assert set(s.scalars(select(Node.state))) == {"active"}
        assert s.scalar(select(Assignment.active_bundle_id).distinct()) is not None
    assert generation(kit) > g0  # each back to active: desired state
    assert metrics.registry.get_sample_value("kernelctl_heartbeat_full_total", {"reason": "not_active"}) == 40


def test_a_watch_waits_for_the_snapshot_as_part_of_its_hold(kit: Kit, db_url: str) -> None:
    _stable(kit, 1)
    metrics = Metrics()

    async def run() -> tuple[wire.HeartbeatResponse, float, str, float, int]:
        hub = DesiredHub(kit.factory, db_url, poll_seconds=60, metrics=metrics)
        await hub.start()
        try:
            first, _h, _p = await hub.heartbeat(wire.HeartbeatRequest(node_name="gpu-000"), heartbeat_seconds=5)
            with kit.tx() as s:  # the generation moves without this replica hearing of it (no patch, no NOTIFY)
                s.execute(text("UPDATE desired_generation SET value = value + 1 WHERE id = 1"))
            t0 = time.monotonic()
            reply, held, path = await hub.heartbeat(wire.HeartbeatRequest(
                node_name="gpu-000", generation=first.generation + 1, wait_seconds=0.5), heartbeat_seconds=5)
            assert hub.snapshot.generation == first.generation + 1  # caught up
            return reply, held, path, time.monotonic() - t0, first.generation
        finally:
            await hub.stop()

    reply, held, path, took, g = asyncio.run(run())
    assert path == "fast" and reply.generation == g  # the node's desired state did not move
    assert took >= 0.5 and took - held < 0.25  # the catch-up and the watch: both held
    assert metrics.registry.get_sample_value("kernelctl_heartbeat_catch_up_seconds_count", {"watch": "true"}) == 1


def test_each_full_transaction_is_counted_with_its_reason(kit: Kit, db_url: str) -> None:
    """And a node registered through another replica after this one loaded its snapshot is learned from one
    read (no full transaction) while it has no assignment; one with an assignment still takes the transaction."""
    stable = _stable(kit, 2)
    metrics = Metrics()

    async def run() -> tuple[list[str], bool]:
        hub = DesiredHub(kit.factory, db_url, poll_seconds=60, metrics=metrics)
        await hub.start()
        try:
            # registered elsewhere after this replica loaded its snapshot, in a stratum with no stable version yet
            # (in one with a stable version a new node's first heartbeat writes its assignment: needs_sync)
            kit.nodes(2, prefix="late", arch="sm_80")
            with kit.tx() as s:  # late-001 already has an assignment this replica was not told of
                nid = s.scalar(select(Node.id).where(Node.name == "late-001"))
                bid = s.scalar(select(Bundle.id).where(Bundle.version == "1.0.0"))
                s.add(Assignment(node_id=nid, bundle_name="llm-fused", desired_bundle_id=bid, stable_bundle_id=bid,
                                 staged={"versions": []}))
            paths = []
            # (the full transactions last: one may move the generation, and the reload would bring both late nodes)
            for req in (wire.HeartbeatRequest(node_name="gpu-000", active=[stable]),  # the snapshot judges it
                        wire.HeartbeatRequest(node_name="late-000"),
                        wire.HeartbeatRequest(node_name="late-001"),
                        wire.HeartbeatRequest(node_name="gpu-001", active=[stable], inventory=inventory())):
                paths.append((await hub.heartbeat(req, heartbeat_seconds=5))[2])
            return paths, "late-000" in hub.snapshot.nodes
        finally:
            await hub.stop()

    paths, learned = asyncio.run(run())
    assert paths == ["switch", "fast", "slow", "slow"] and learned  # the first: its active version recorded
    counted = {r.value: metrics.registry.get_sample_value("kernelctl_heartbeat_full_total", {"reason": r.value})
               for r in FullHeartbeat}
    assert {k: v for k, v in counted.items() if v} == {"inventory": 1.0, "unknown_node": 1.0}
