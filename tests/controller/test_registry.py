"""Registry: bundle push (verified, idempotent, immutable versions), node registration and heartbeats."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import func, select

from controller import registry
from controller.db.models import Activation, Assignment, Bundle, BundleTarget, Node
from controller.errors import Conflict, Invalid, NotFound
from kernelctl import wire
from kernelpack.signing import generate_keypair
from tests.controller.enginekit import T0, Kit, inventory, make_kpack


@pytest.fixture
def kit(db_url, tmp_path):
    k = Kit(db_url, tmp_path)
    yield k
    k.close()


def test_register_bundle_stores_verified_bytes_targets_and_event(kit: Kit) -> None:
    data = kit.kpack("1.0.0", archs=("sm_80", "sm_90"))
    with kit.tx() as s:
        b = registry.register_bundle(s, data, actor="alice", trusted_keys=kit.trusted)
        bid = b.id
    with kit.tx() as s:
        b = s.get(Bundle, bid)
        assert b.content == data and b.size_bytes == len(data) and b.status == "registered"
        assert b.manifest["traffic"]["decode_batch_sizes"] == [1, 4, 16, 64]
        assert sorted(t.arch for t in s.scalars(select(BundleTarget).where(BundleTarget.bundle_id == bid))) == [
            "sm_80", "sm_90"]
    ev = kit.events("bundle.registered")
    assert len(ev) == 1 and ev[0].bundle == "llm-fused@1.0.0" and ev[0].actor == "alice"


def test_repush_identical_is_idempotent_and_different_bytes_conflict(kit: Kit) -> None:
    data = kit.kpack("1.0.0")
    with kit.tx() as s:
        first = registry.register_bundle(s, data, actor="a", trusted_keys=kit.trusted).id
    with kit.tx() as s:
        assert registry.register_bundle(s, data, actor="a", trusted_keys=kit.trusted).id == first
    other = kit.kpack("1.0.0", batches=(1, 2))
    with pytest.raises(Conflict, match="already registered"), kit.tx() as s:
        registry.register_bundle(s, other, actor="a", trusted_keys=kit.trusted)
    assert len(kit.events("bundle.registered")) == 1


def test_untrusted_or_corrupt_bundle_is_refused_before_storing(kit: Kit, tmp_path) -> None:
    stranger = generate_keypair(tmp_path / "stranger")
    data = make_kpack(stranger.private_path, tmp_path / "x", version="2.0.0")
    with pytest.raises(Invalid, match="bundle refused"), kit.tx() as s:
        registry.register_bundle(s, data, actor="a", trusted_keys=kit.trusted)
    with pytest.raises(Invalid, match="bundle refused"), kit.tx() as s:
        registry.register_bundle(s, b"not a tarball", actor="a", trusted_keys=kit.trusted)
    with kit.tx() as s:
        assert s.scalar(select(func.count()).select_from(Bundle)) == 0
    assert kit.events() == []


def test_register_node_and_inventory_change(kit: Kit) -> None:
    kit.nodes(1)
    with kit.tx() as s:
        registry.register_node(s, "gpu-000", inventory(), actor="enroll")  # same inventory: no event
    with kit.tx() as s:
        registry.register_node(s, "gpu-000", inventory(driver="580.1"), actor="enroll")
    # every registration issues a fresh node token (the earlier one revoked); the node events are these two
    assert [e.action for e in kit.events(node="gpu-000") if not e.action.startswith("token.")] == [
        "node.registered", "node.inventory_changed"]
    assert kit.events("node.inventory_changed")[0].payload["driver_version"]["to"] == "580.1"


def test_heartbeat_unknown_node_is_not_found(kit: Kit) -> None:
    with pytest.raises(NotFound, match="not registered"), kit.tx() as s:
        registry.heartbeat(s, wire.HeartbeatRequest(node_name="ghost"), T0, heartbeat_seconds=5)


def test_heartbeat_records_activation_history(kit: Kit) -> None:
    kit.nodes(1)
    b1, b2 = kit.push("1.0.0"), kit.push("1.1.0")
    r1, r2 = kit.ref(b1), kit.ref(b2)
    t1, t2, t3 = T0, T0 + dt.timedelta(minutes=1), T0 + dt.timedelta(minutes=2)
    for t, active in ((t1, [r1]), (t1 + dt.timedelta(seconds=5), [r1]), (t2, [r2]), (t3, [])):
        with kit.tx() as s:
            resp = registry.heartbeat(s, wire.HeartbeatRequest(node_name="gpu-000", staged=[r1, r2], active=active),
                                      t, heartbeat_seconds=5)
            assert resp.node_name == "gpu-000" and resp.heartbeat_seconds == 5
    with kit.tx() as s:
        node = kit.node(s, "gpu-000")
        acts = list(s.scalars(select(Activation).where(Activation.node_id == node.id).order_by(Activation.id)))
        assert [(a.bundle_id, a.ended_at is not None) for a in acts] == [(b1, True), (b2, True)]
        a = s.scalar(select(Assignment).where(Assignment.node_id == node.id))
        assert a.staged == {"versions": ["1.0.0", "1.1.0"]} and a.active_bundle_id is None
    assert [e.bundle for e in kit.events("assignment.activated")] == ["llm-fused@1.0.0", "llm-fused@1.1.0"]
    assert len(kit.events("assignment.deactivated")) == 1


def test_heartbeat_revives_stale_node_and_ignores_unknown_digest(kit: Kit) -> None:
    kit.nodes(1)
    b1 = kit.push("1.0.0")
    with kit.tx() as s:
        kit.node(s, "gpu-000").state = "stale"
    bogus = wire.BundleRef(name="llm-fused", version="1.0.0", digest="0" * 64)
    with kit.tx() as s:
        registry.heartbeat(s, wire.HeartbeatRequest(node_name="gpu-000", active=[bogus]), T0, heartbeat_seconds=5)
    with kit.tx() as s:
        assert kit.node(s, "gpu-000").state == "active"
        assert s.scalar(select(func.count()).select_from(Activation)) == 0
    assert len(kit.events("node.active")) == 1 and kit.events("assignment.activated") == []
    assert b1


def test_node_state_survives(kit: Kit) -> None:
    kit.nodes(2, labels={"rack": "r1"})
    with kit.tx() as s:
        assert s.scalar(select(func.count()).select_from(Node).where(Node.state == "active")) == 2
