"""The numeric contract: a candidate that loosens the stable version's tolerances, domain or golden vectors is
refused at ``rollout start`` unless the operator accepts it with a reason (recorded in the changelog)."""

from __future__ import annotations

import pytest

from controller.contract import ContractChange, contract_changes
from controller.db.models import Rollout
from controller.rollouts import promote, start_rollout
from tests.controller.enginekit import Kit


@pytest.fixture
def kit(db_url, tmp_path):
    k = Kit(db_url, tmp_path)
    yield k
    k.close()


def manifest(tol=(1e-3, 2e-3), dims=None, golden="a" * 64) -> dict:
    return {"kernels": [{"op": "swiglu", "tolerances": {"fp16": {"atol": tol[0], "rtol": tol[1]}},
                         "limitations": {"dtypes": ["fp16"], "dims": dims or {"tokens": {"lo": 1, "hi": 64}},
                                         "notes": "prose"}}],
            "golden": [{"op": "swiglu", "dtype": "fp16", "seed": 0, "path": "golden/swiglu/fp16.bin"}],
            "files": {"golden/swiglu/fp16.bin": {"sha256": golden, "size": 1}}}


def test_contract_changes_lists_each_loosening() -> None:
    stable = manifest()
    assert contract_changes(manifest(), stable) == []
    assert contract_changes(manifest(tol=(1e-4, 1e-3)), stable) == []  # tighter is fine
    assert contract_changes(manifest(tol=(2e-3, 2e-3)), stable) == ["swiglu fp16: atol loosened 0.001 -> 0.002"]
    assert contract_changes(manifest(dims={"tokens": {"lo": 1, "hi": 32}}), stable) == ["swiglu: domain changed"]
    assert contract_changes(manifest(golden="b" * 64), stable) == ["swiglu fp16: golden vectors replaced"]
    dropped = {**manifest(), "golden": [], "files": {}}
    assert contract_changes(dropped, stable) == ["swiglu fp16: golden vectors dropped"]
    no_fp16 = manifest()
    no_fp16["kernels"][0]["tolerances"] = {}
    assert contract_changes(no_fp16, stable)[0].startswith("swiglu fp16: tolerance dropped")
    notes = manifest()
    notes["kernels"][0]["limitations"]["notes"] = "other prose"
    assert contract_changes(notes, stable) == []


def test_rollout_start_refuses_a_contract_change_unless_accepted(kit: Kit) -> None:
    kit.nodes(2, arch="sm_90")
    kit.push("1.0.0")
    with kit.tx() as s:
        promote(s, start_rollout(s, "llm-fused@1.0.0", actor="op").id, actor="op", full=True)
    kit.push("1.1.0", tolerances={"fp16": (5e-3, 1e-3)})
    with pytest.raises(ContractChange) as err, kit.tx() as s:
        start_rollout(s, "llm-fused@1.1.0", actor="op")
    assert str(err.value).startswith("llm-fused@1.1.0 changes the numeric contract of llm-fused@1.0.0: "
                                     "bias_gelu fp16: atol loosened 0.001 -> 0.005")
    assert err.value.status_code == 409
    with kit.tx() as s:
        assert s.query(Rollout).count() == 1  # nothing stored
    with kit.tx() as s:
        rid = start_rollout(s, "llm-fused@1.1.0", actor="op", accept_contract_change="new kernel, reviewed").id
    ev = kit.events("rollout.started", rollout_id=rid)[0]
    assert ev.payload["contract_change"] == {
        "accepted": "new kernel, reviewed",
        "changes": {"llm-fused@1.0.0": ["bias_gelu fp16: atol loosened 0.001 -> 0.005"]}}
