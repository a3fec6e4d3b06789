"""Several bundles on one node, one per op: a rollout whose ops another active bundle provides is refused at
start; bundles with disjoint ops roll out independently."""

from __future__ import annotations

import pytest

from controller.db.models import Rollout
from controller.errors import Conflict
from controller.rollouts import promote, rollback, start_rollout
from tests.controller.enginekit import Kit


@pytest.fixture
def kit(db_url, tmp_path):
    k = Kit(db_url, tmp_path)
    yield k
    k.close()


def test_a_second_bundle_for_the_same_op_is_refused_at_start(kit: Kit) -> None:
    kit.nodes(2, arch="sm_90")
    kit.push("1.0.0", name="norms", ops=("add_rmsnorm", "add_layernorm"))
    with kit.tx() as s:
        promote(s, start_rollout(s, "norms@1.0.0", actor="op").id, actor="op", full=True)
    # an attention bundle: other ops, rolled out independently, and a new version of the norm bundle itself
    kit.push("1.0.0", name="attention", ops=("flash_attn",))
    kit.push("1.1.0", name="norms", ops=("add_rmsnorm", "add_layernorm"))
    with kit.tx() as s:
        attn = start_rollout(s, "attention@1.0.0", actor="op").id
        start_rollout(s, "norms@1.1.0", actor="op")
    # a bundle that also ships add_rmsnorm (stable norms) and flash_attn (attention, rolling out): refused
    kit.push("2.0.0", name="fused", ops=("add_rmsnorm", "flash_attn", "swiglu"))
    with pytest.raises(Conflict) as err, kit.tx() as s:
        start_rollout(s, "fused@2.0.0", actor="op")
    msg = str(err.value)
    assert err.value.status_code == 409
    assert msg.startswith("fused@2.0.0 would be a second active bundle for the same ops: ")
    assert "norms@1.0.0 provides add_rmsnorm on " in msg and "(stable)" in msg
    assert "attention@1.0.0 provides flash_attn on " in msg and "(rolling out)" in msg
    with kit.tx() as s:
        assert s.query(Rollout).count() == 3  # nothing stored
    # once the attention rollout is rolled back, only the stable norm bundle still clashes
    with kit.tx() as s:
        rollback(s, attn, actor="op", reason="test")
    with pytest.raises(Conflict, match=r"norms@1\.0\.0 provides add_rmsnorm") as err, kit.tx() as s:
        start_rollout(s, "fused@2.0.0", actor="op")
    assert "attention" not in str(err.value)
    # a bundle whose ops nobody else provides starts
    kit.push("2.0.1", name="fused", ops=("swiglu",))
    with kit.tx() as s:
        assert start_rollout(s, "fused@2.0.1", actor="op").state == "pending"
