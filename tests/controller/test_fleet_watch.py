"""Desired state pushed (issue 16): the generation, the per-generation snapshot, the watch, liveness, overload.

On SQLite and PostgreSQL: the generation moves with every commit that changes desired state and not with
liveness; the snapshot answers exactly what the database path answers and says when a heartbeat would write;
over real HTTP a watch is held until the desired state changes and then answers at once, liveness reaches the
database in batches, and an overloaded controller answers 503 with Retry-After that the agent client honours.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import threading
import time

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy import select, update
from sqlalchemy.pool import NullPool

from agents.client import ControllerClient
from controller import registry
from controller.assignments import desired_state
from controller.db.models import Node
from controller.desired.snapshot import load_snapshot
from controller.ingest import ingest_reports
from kernelctl import wire
from tests.controller.enginekit import T0, Kit, generation, generation_kit
from tests.controller.serverutil import (
    ControllerProcess,
    Zygote,
    build_test_bundles,
    inventory,
    register_node,
)
from tests.controller.test_serve_phase import _stable_and_candidate


@pytest.fixture
def kit(db_url, tmp_path):
    yield from generation_kit(db_url, tmp_path)


def _db_desired(kit: Kit, name: str) -> list[wire.DesiredBundle]:
    with kit.factory() as s:
        out = desired_state(s, kit.node(s, name), now=T0)
        s.rollback()
    return out


def test_generation_moves_with_desired_state_not_with_liveness(kit: Kit) -> None:
    g0 = generation(kit)
    kit.nodes(3)
    g1 = generation(kit)
    assert g1 == g0  # new nodes: not a change of desired state (the hub loads unknown nodes on its own)
    with kit.tx() as s:  # liveness only: the batched flush's kind of write
        s.execute(update(Node).values(last_heartbeat_at=T0 + dt.timedelta(seconds=5)))
    assert generation(kit) == g1
    _rid, stable, cand = _stable_and_candidate(kit, nodes=0)
    g2 = generation(kit)
    assert g2 > g1  # promotion of the baseline, the candidate's canaries
    with kit.tx() as s:  # a node reports the candidate staged: stored, the generation moves
        registry.heartbeat(s, wire.HeartbeatRequest(node_name="gpu-000", staged=[stable, cand], active=[stable]),
                           T0, heartbeat_seconds=5)
    assert generation(kit) > g2
    g3 = generation(kit)
    with kit.factory() as s:  # a transaction rolled back moves nothing
        s.execute(update(Node).values(state="stale"))
        s.rollback()
    assert generation(kit) == g3


def test_snapshot_answers_like_the_database_and_knows_when_a_heartbeat_writes(kit: Kit) -> None:
    kit.nodes(3)
    rid, stable, cand = _stable_and_candidate(kit, nodes=0)
    # gpu-000: staged candidate reported; gpu-001: its ok report accepted (verified); gpu-002: says nothing yet
    with kit.tx() as s:
        for name in ("gpu-000", "gpu-001"):
            registry.heartbeat(s, wire.HeartbeatRequest(node_name=name, staged=[stable, cand], active=[stable]),
                               T0, heartbeat_seconds=5)
    with kit.tx() as s:
        n = kit.node(s, "gpu-001")
        ingest_reports(s, n, wire.ReportBatch(node_name="gpu-001", reports=[kit.report(n, rid, cand, stable)]), T0)
    snap = load_snapshot(kit.factory)
    assert snap.generation == generation(kit)
    for name in ("gpu-000", "gpu-001", "gpu-002"):
        assert snap.desired(snap.nodes[name]) == _db_desired(kit, name), name
    (d1,) = snap.desired(snap.nodes["gpu-001"])
    assert d1.active == cand and d1.phase == "verified"  # the verified canary may serve
    (d0,) = snap.desired(snap.nodes["gpu-000"])
    assert d0.active == stable and d0.trial is not None and d0.phase == "staged"
    same = wire.HeartbeatRequest(node_name="gpu-000", staged=[stable, cand], active=[stable])
    assert snap.fast_path(snap.nodes["gpu-000"], same)  # nothing to write but liveness
    assert snap.staged_changes(snap.nodes["gpu-000"], same) == {}
    fewer = wire.HeartbeatRequest(node_name="gpu-000", active=[stable])  # staged versions are written in batches
    assert snap.fast_path(snap.nodes["gpu-000"], fewer)
    assert snap.staged_changes(snap.nodes["gpu-000"], fewer) == {"llm-fused": ()}
    # gpu-001 switching to the candidate must be recorded (activation, phase serving): not the fast path
    switched = wire.HeartbeatRequest(node_name="gpu-001", staged=[stable, cand], active=[cand])
    assert not snap.fast_path(snap.nodes["gpu-001"], switched)
    assert snap.fast_path(snap.nodes["gpu-002"], wire.HeartbeatRequest(node_name="gpu-002"))  # as stored: nothing
    assert snap.staged_changes(snap.nodes["gpu-002"], wire.HeartbeatRequest(node_name="gpu-002", staged=[stable])) \
        == {"llm-fused": (stable.version,)}
    with kit.tx() as s:
        registry.heartbeat(s, switched, T0, heartbeat_seconds=5)
    snap = load_snapshot(kit.factory)
    assert snap.fast_path(snap.nodes["gpu-001"], switched)
    assert snap.nodes["gpu-001"].rows["llm-fused"].view.phase == "serving"
    with kit.tx() as s:  # a stale node is never answered from memory (it must be marked active, with an event)
        s.execute(update(Node).where(Node.name == "gpu-001").values(state="stale"))
    snap = load_snapshot(kit.factory)
    assert not snap.fast_path(snap.nodes["gpu-001"], switched)


# ------------------------------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory):
    return build_test_bundles(tmp_path_factory.mktemp("watch-bundles"), versions=("1.0.0",))


def _heartbeat(c: httpx.Client, **kw) -> dict:
    r = c.post("/v1/agents/heartbeat", json={"node_name": "n1", **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_watch_is_held_until_the_desired_state_changes(db_url: str, tmp_path, bundles, zygote: Zygote) -> None:
    with ControllerProcess(db_url, tmp_path, trusted_keys_dir=bundles.keys_dir, tick_seconds=0.5,
                           zygote=zygote) as ctl:
        node = register_node(ctl, "n1")
        first = _heartbeat(node)
        gen = first["generation"]
        assert isinstance(gen, int) and first["desired"] == []
        # nothing changes: the watch answers after its wait, same generation, nothing desired
        t = time.monotonic()
        idle = _heartbeat(node, generation=gen, wait_seconds=1.5)
        assert 1.3 <= time.monotonic() - t < 10 and idle["generation"] == gen and idle["desired"] == []
        # a watch is held while the operator makes 1.0.0 stable, and answers with it at once
        box: dict = {}

        def watch() -> None:
            box["reply"] = _heartbeat(node, generation=gen, wait_seconds=30)
            box["at"] = time.monotonic()

        th = threading.Thread(target=watch)
        th.start()
        time.sleep(1.0)
        assert th.is_alive()  # held: nothing changed yet
        with ctl.client("operator") as op:
            assert op.post("/v1/bundles", content=bundles.files["1.0.0"].read_bytes()).status_code in (200, 201)
            ro = op.post("/v1/rollouts", json={"bundle": "llm-fused@1.0.0", "reason": "baseline", "plan": {
                "steps": [{"percent": 100, "bake_seconds": 0, "min_samples": 1}]}}).json()
            r = op.post(f"/v1/rollouts/{ro['id']}/promote", json={"full": True, "reason": "baseline"})
            assert r.status_code == 200, r.text
            promoted = time.monotonic()
        th.join(40)
        assert not th.is_alive()
        reply = box["reply"]
        assert reply["generation"] > gen
        # the controller's tick may begin the pending rollout before the promote (a change of its own): the
        # watch then answers that first, and the next watch the promotion
        while [d["active"] and d["active"]["version"] for d in reply["desired"]] != ["1.0.0"]:
            assert time.monotonic() - promoted < 5.0, reply
            reply = _heartbeat(node, generation=reply["generation"], wait_seconds=10)
            box["at"] = time.monotonic()
        assert box["at"] - promoted < 5.0, "the promotion did not reach the waiting node at once"
        # liveness of answered-from-memory heartbeats reaches the database in batches
        with ctl.client("operator") as op:
            before = {n["name"]: n for n in op.get("/v1/nodes").json()}["n1"]["last_heartbeat_at"]
            time.sleep(1.1)
            _heartbeat(node, generation=reply["generation"], wait_seconds=0)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                after = {n["name"]: n for n in op.get("/v1/nodes").json()}["n1"]["last_heartbeat_at"]
                if after != before:
                    break
                time.sleep(0.3)
        assert after > before
        text = httpx.get(ctl.url + "/metrics").text
        assert 'kernelctl_heartbeat_service_seconds_count{path="fast"}' in text
        assert "kernelctl_liveness_flushed_total" in text
        node.close()
        assert "tick failed" not in ctl.log_text()  # the generation hook works inside the leader's tick too


def test_overload_answers_503_with_retry_after_and_agents_back_off(db_url: str, tmp_path, zygote: Zygote) -> None:
    with ControllerProcess(db_url, tmp_path, extra_env={"KERNELCTL_MAX_PENDING_WRITES": "1",
                                                         "KERNELCTL_MAX_QUEUED_WRITES": "1"}, zygote=zygote) as ctl:

        def raw(i: int) -> httpx.Response:
            with ctl.client("enroll") as c:
                return c.post("/v1/agents/register", json={"node_name": f"raw-{i}", "inventory": inventory()})

        # the database held from outside (SQLite's write lock, PostgreSQL's lock on nodes): the first
        # registration's commit waits, the next queues, the rest must be refused at admission, whatever the
        # machine's speed; released as soon as a refusal was seen
        with sa.create_engine(db_url, poolclass=NullPool).connect() as held, cf.ThreadPoolExecutor(16) as pool:
            held.exec_driver_sql("BEGIN IMMEDIATE" if db_url.startswith("sqlite") else "BEGIN")
            if not db_url.startswith("sqlite"):
                held.exec_driver_sql("LOCK TABLE nodes IN EXCLUSIVE MODE")
            futures = [pool.submit(raw, i) for i in range(32)]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not any(f.done() and f.result().status_code == 503
                                                          for f in futures):
                time.sleep(0.05)
            held.rollback()
            answers = [f.result() for f in futures]
        busy = [r for r in answers if r.status_code == 503]
        assert busy, [r.status_code for r in answers]
        assert all(1 <= int(r.headers["retry-after"]) <= 5 for r in busy)
        assert all(r.status_code in (200, 503) for r in answers)
        # the agent client retries after Retry-After (with jitter): every registration gets through
        def agent(i: int) -> str:
            client = ControllerClient(ctl.url, ctl.tokens["enroll"], max_attempts=20, max_retry_seconds=120,
                                      backoff_max=2.0)
            try:
                return client.register(wire.RegisterRequest(node_name=f"agent-{i}",
                                                            inventory=wire.Inventory(**inventory()))).node_name
            finally:
                client.close()

        with cf.ThreadPoolExecutor(16) as pool:
            names = list(pool.map(agent, range(24)))
        assert names == [f"agent-{i}" for i in range(24)]
        with ctl.client("operator") as op:
            listed = {n["name"] for n in op.get("/v1/nodes").json()}
        assert {f"agent-{i}" for i in range(24)} <= listed
        assert {r.json()["node_name"] for r in answers if r.status_code == 200} <= listed


def test_no_node_unknown_to_the_snapshot_is_refused(kit: Kit) -> None:
    """A node registered after the snapshot was loaded is simply not in it (the route takes the slow path)."""
    snap = load_snapshot(kit.factory)
    kit.nodes(1, prefix="late")
    assert "late-000" not in snap.nodes
    assert "late-000" in load_snapshot(kit.factory).nodes
    with kit.tx() as s:
        assert s.scalar(select(Node.state).where(Node.name == "late-000")) == "active"


def test_liveness_and_staged_versions_are_written_in_one_batch(kit: Kit, db_url: str) -> None:
    from controller.db.models import Assignment
    from controller.desired.liveness import LivenessBuffer

    kit.nodes(2)
    _rid, stable, cand = _stable_and_candidate(kit, nodes=0)
    buffer = LivenessBuffer(kit.factory)
    snap = load_snapshot(kit.factory)
    g = generation(kit)
    later = T0 + dt.timedelta(minutes=5)
    for name in ("gpu-000", "gpu-001"):
        node = snap.nodes[name]
        req = wire.HeartbeatRequest(node_name=name, staged=[stable, cand], active=[stable])
        buffer.note(node.id, later, snap.staged_changes(node, req))
    assert buffer.flush() == 2
    with kit.tx() as s:
        rows = s.execute(select(Node.name, Node.last_heartbeat_at, Assignment.staged)
                         .join(Assignment, Assignment.node_id == Node.id)).all()
    assert {r[0] for r in rows} == {"gpu-000", "gpu-001"}
    assert all(r[1].replace(tzinfo=dt.timezone.utc) == later for r in rows)
    assert all(r[2] == {"versions": sorted([stable.version, cand.version])} for r in rows)
    assert generation(kit) == g  # liveness and staged versions are not desired state
    assert buffer.flush() == 0  # nothing new: nothing written
    buffer.note(snap.nodes["gpu-000"].id, later, {"llm-fused": (stable.version, cand.version)})
    assert buffer.flush() == 1  # the time only: the staged versions were already written by this replica


def _row_locked(kit: Kit, column: sa.ColumnElement[int], nid: int) -> bool:
    """Whether another transaction holds the row(s) whose ``column`` is ``nid`` (PostgreSQL ``NOWAIT`` probe)."""
    from sqlalchemy.exc import OperationalError

    with kit.factory() as probe:
        try:
            probe.execute(select(column).where(column == nid).with_for_update(nowait=True))
        except OperationalError:
            return True
        finally:
            probe.rollback()
        return False


@pytest.mark.parametrize("db_backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_writers_of_many_nodes_lock_them_in_id_order(kit: Kit) -> None:
    """The liveness flush (every API worker and replica has one) and the leader's stale sweep take node rows in
    ascending id order whatever order the heartbeats came in, so two of them never lock in a cycle (with two API
    workers such deadlocks aborted whole batches). Shown by holding a middle row: the writer waits there having
    locked every lower id and no higher one."""

    from controller.desired.liveness import LivenessBuffer
    from controller.tick import mark_stale

    kit.nodes(6)
    with kit.tx() as s:
        ids = sorted(s.scalars(select(Node.id)).all())
        # the two lowest ids rewritten: their rows now lie last in the table, so a scan's order is not id order
        s.execute(update(Node).where(Node.id.in_(ids[:2])).values(last_heartbeat_at=T0))

    def locked(nid: int) -> bool:
        return _row_locked(kit, Node.id, nid)

    def stale_sweep() -> list[str]:
        with kit.tx() as s:
            return mark_stale(s, T0 + dt.timedelta(hours=1), 45.0)

    buffer = LivenessBuffer(kit.factory)
    for nid in reversed(ids):  # heartbeats noted in descending id order
        buffer.note(nid, T0 + dt.timedelta(seconds=10))
    for write, expect in ((buffer.flush, 6), (stale_sweep, 6)):
        pool = cf.ThreadPoolExecutor(1)
        with kit.factory() as holder:
            holder.execute(select(Node.id).where(Node.id == ids[3]).with_for_update())  # another transaction
            fut = pool.submit(write)
            try:
                deadline = time.monotonic() + 10
                while not locked(ids[0]):
                    assert time.monotonic() < deadline, f"{write}: the lowest id was not locked first"
                    time.sleep(0.05)
                assert locked(ids[2]) and not locked(ids[4]) and not locked(ids[5]), write
            finally:
                holder.rollback()  # the writer goes on, however the test ends
                pool.shutdown(wait=True)
            got = fut.result(timeout=20)
        assert (got if isinstance(got, int) else len(got)) == expect


@pytest.mark.parametrize("db_backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_a_rollback_of_one_stratum_locks_every_canary_of_the_rollout_in_id_order(kit: Kit) -> None:
    """The tick rolls strata back one call at a time in one transaction; locking only each stratum's rows (in
    order) took the rollout's rows out of order overall, and deadlocked with the liveness flush three times in one
    10,000-node run. A rollback locks every canary row of the rollout in (node id, bundle) order first: held at a
    row of another stratum, it waits there, having locked the lower ids and none of its own stratum's higher ones."""

    from controller.assignments import revert_to_stable, rollout_canaries
    from controller.db.models import Assignment, Bundle

    rid, stable, cand = _stable_and_candidate(kit, nodes=3)  # gpu-000..002: canaries in the sm_90 stratum
    kit.nodes(3, prefix="b", arch="sm_80")  # higher ids, another stratum
    with kit.tx() as s:
        b_ids = sorted(s.scalars(select(Node.id).where(Node.name.like("b-%"))).all())
        sid, cid = (s.scalar(select(Bundle.id).where(Bundle.digest == ref.digest)) for ref in (stable, cand))
        s.add_all(Assignment(node_id=n, bundle_name="llm-fused", desired_bundle_id=cid, stable_bundle_id=sid,
                             rollout_id=rid, phase="staged", staged={"versions": []}) for n in b_ids)
    with kit.tx() as s:
        canaries = rollout_canaries(s, rid)
    a_ids = sorted(n for n, st in canaries.items() if st.startswith("sm_90"))
    b_stratum = canaries[b_ids[0]]
    assert len(a_ids) == 3 and all(canaries[n] == b_stratum for n in b_ids) and max(a_ids) < min(b_ids)

    def locked(nid: int) -> bool:
        return _row_locked(kit, Assignment.node_id, nid)

    def rollback_b() -> int:
        with kit.tx() as s:
            return revert_to_stable(s, rid, {b_stratum}, now=T0)

    pool = cf.ThreadPoolExecutor(1)
    with kit.factory() as holder:
        holder.execute(select(Assignment.node_id).where(Assignment.node_id == a_ids[1]).with_for_update())
        fut = pool.submit(rollback_b)
        try:
            deadline = time.monotonic() + 10
            while not locked(a_ids[0]):
                assert time.monotonic() < deadline, "the rollback did not lock the rollout's lowest id first"
                assert not fut.done(), "the rollback took only its own stratum's rows"
                time.sleep(0.05)
            assert not fut.done() and not any(locked(n) for n in b_ids)
        finally:
            holder.rollback()
            pool.shutdown(wait=True)
    assert fut.result(timeout=20) == 3
