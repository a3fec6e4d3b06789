"""Canary selection and desired state: determinism, stale exclusion, blast radius across rollouts, trial specs."""

from __future__ import annotations

import pytest
from sqlalchemy import select, update

from controller import registry, rollouts
from controller.assignments import canary_rank, desired_state
from controller.db.models import Assignment, Node
from controller.plan import PlanSpec, StepSpec
from controller.rollouts import get_rollout, promote, start_rollout
from kernelctl import wire
from tests.controller.enginekit import T0, Kit, make_kpack


@pytest.fixture
def kit(db_url, tmp_path):
    k = Kit(db_url, tmp_path)
    yield k
    k.close()


def plan(percent: float = 100, **kw) -> PlanSpec:
    return PlanSpec(steps=[StepSpec(percent=percent, bake_seconds=0, min_samples=1, deadline_seconds=60)], **kw)


def begin(kit: Kit, ref: str, p: PlanSpec) -> tuple[int, dict]:
    with kit.tx() as s:
        rid = start_rollout(s, ref, actor="op", plan=p).id
    with kit.tx() as s:
        sized = rollouts.begin(s, get_rollout(s, rid), actor="controller", now=T0)
    return rid, sized


def canary_names(kit: Kit, rid: int) -> list[str]:
    with kit.tx() as s:
        return sorted(s.scalars(select(Node.name).join(Assignment, Assignment.node_id == Node.id)
                                .where(Assignment.rollout_id == rid)))


def test_canaries_are_deterministic_and_skip_stale_nodes(kit: Kit) -> None:
    names = kit.nodes(10)
    kit.push("1.0.0")
    with kit.tx() as s:
        s.execute(update(Node).where(Node.name == "gpu-003").values(state="stale"))
    rid, sized = begin(kit, "llm-fused@1.0.0", plan(30, max_fleet_share=1.0))
    live = [n for n in names if n != "gpu-003"]
    expected = sorted(sorted(live, key=lambda n: canary_rank(rid, n))[:3])
    assert canary_names(kit, rid) == expected
    (a,) = sized.values()
    assert (a.eligible, a.requested, a.assigned, a.clamp) == (9, 3, 3, None)


def test_label_share_clamp(kit: Kit) -> None:
    kit.nodes(4, prefix="r1", labels={"rack": "r1", "cluster": "c"})
    kit.nodes(4, prefix="r2", labels={"rack": "r2", "cluster": "c"})
    kit.push("1.0.0")
    rid, sized = begin(kit, "llm-fused@1.0.0", plan(100, max_fleet_share=1.0, max_label_share=0.5,
                                                      blast_radius_labels=["rack"]))
    got = canary_names(kit, rid)
    assert len(got) == 4 and sum(n.startswith("r1") for n in got) == 2
    (a,) = sized.values()
    assert a.clamp["requested"] == 8 and a.clamp["assigned"] == 4
    assert any("rack=r" in why for why in a.clamp["limited_by"])


def test_fleet_share_counts_all_active_rollouts(kit: Kit) -> None:
    kit.nodes(10)
    kit.push("1.0.0")
    data = make_kpack(kit.keypair.private_path, kit.tmp, name="attn-fused", version="1.0.0", ops=("flash_attn",))
    with kit.tx() as s:
        registry.register_bundle(s, data, actor="op", trusted_keys=kit.trusted)
    rid1, _ = begin(kit, "llm-fused@1.0.0", plan(30, max_fleet_share=0.5))
    rid2, sized = begin(kit, "attn-fused@1.0.0", plan(100, max_fleet_share=0.5))
    one, two = canary_names(kit, rid1), canary_names(kit, rid2)
    assert len(one) == 3 and len(set(one) | set(two)) == 5  # 50% of 10 nodes run a candidate at most
    (a,) = sized.values()
    assert "max_fleet_share" in a.clamp["limited_by"][0]


def test_desired_state_trial_from_manifest_and_cpu_cap(kit: Kit) -> None:
    kit.nodes(1, prefix="gpu")
    kit.nodes(1, prefix="cpu", cuda="none", gpu="cpu (Triton interpreter)")
    kit.push("1.0.0", batches=(1, 4, 16, 64), prefill=(64, 512, 2048))
    with kit.tx() as s:
        rid = start_rollout(s, "llm-fused@1.0.0", actor="op").id
        promote(s, rid, actor="op", full=True)
    kit.push("1.1.0", batches=(1, 4, 16, 64), prefill=(64, 512, 2048))
    p = plan(100, max_fleet_share=1.0, cpu_max_batch=4, cpu_max_prefill=64, trial_rounds=7)
    rid, _ = begin(kit, "llm-fused@1.1.0", p)
    with kit.tx() as s:
        (g,) = desired_state(s, kit.node(s, "gpu-000"), now=T0)
        (c,) = desired_state(s, kit.node(s, "cpu-000"), now=T0)
    # trial before serve: the candidate is staged and trialled, the stable version stays active
    assert (g.role, g.active.version, g.stable.version, g.phase) == ("candidate", "1.0.0", "1.0.0", "staged")
    assert g.trial.candidate.version == "1.1.0"
    assert (g.trial.rollout_id, g.trial.batch_sizes, g.trial.prefill_tokens, g.trial.rounds) == (
        rid, [1, 4, 16, 64], [64, 512, 2048], 7)
    assert (c.trial.batch_sizes, c.trial.prefill_tokens) == ([1, 4], [64])
    with kit.tx() as s:  # the heartbeat reply carries the same desired state
        resp = registry.heartbeat(s, wire.HeartbeatRequest(node_name="gpu-000"), T0, heartbeat_seconds=5)
    assert resp.desired == [g]


def test_new_node_gets_stratum_stable_version(kit: Kit) -> None:
    kit.nodes(2)
    kit.push("1.0.0")
    with kit.tx() as s:
        rid = start_rollout(s, "llm-fused@1.0.0", actor="op").id
        promote(s, rid, actor="op", full=True)
    kit.nodes(1, prefix="late")
    kit.nodes(1, prefix="oldtorch", torch="2.5.0")
    with kit.tx() as s:
        (d,) = desired_state(s, kit.node(s, "late-000"), now=T0)
        assert (d.role, d.active.version, d.stable.version, d.trial) == ("stable", "1.0.0", "1.0.0", None)
        assert desired_state(s, kit.node(s, "oldtorch-000"), now=T0) == []
