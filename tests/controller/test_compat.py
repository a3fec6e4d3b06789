"""Compatibility matrix: arch, driver major, Triton, torch range and CUDA against bundle targets; strata."""

from __future__ import annotations

import pytest

from controller.compat import (
    TargetInfo,
    compat_matrix,
    driver_major,
    node_rejection,
    stratum_key,
    target_rejects,
)
from controller.rollouts import rollback, start_rollout
from tests.controller.enginekit import Kit

T = TargetInfo(arch="sm_90", min_driver="535", cuda="12.x", triton="3.6.0", torch=">=2.9,<2.15")


def test_stratum_and_driver_major() -> None:
    assert stratum_key("sm_90", "580.65.06", "3.6.0") == "sm_90/drv580/triton3.6.0"
    assert driver_major("550.54.15") == 550 and driver_major("garbage") == -1


@pytest.mark.parametrize(("inv", "why"), [
    (("sm_90", "550.1", "12.4", "3.6.0", "2.11.0"), None),
    (("sm_90", "535", "12.2", "3.6.0", "2.13.0+cpu"), None),
    (("sm_90", "580.1", "none", "3.6.0", "2.10.0"), None),  # CPU/interpreter node: no CUDA to check
    (("sm_80", "550.1", "12.4", "3.6.0", "2.11.0"), "arch sm_80 is not sm_90"),
    (("sm_90", "525.1", "12.4", "3.6.0", "2.11.0"), "driver 525.1 is older"),
    (("sm_90", "550.1", "12.4", "3.5.1", "2.11.0"), "Triton 3.5.1 is not 3.6.0"),
    (("sm_90", "550.1", "12.4", "3.6.0", "2.15.0"), "torch 2.15.0 is outside"),
    (("sm_90", "550.1", "11.8", "3.6.0", "2.11.0"), "CUDA 11.8"),
])
def test_target_rules(inv: tuple[str, ...], why: str | None) -> None:
    got = target_rejects(T, *inv)
    assert (got is None) if why is None else (got is not None and why in got)


def test_node_rejection_prefers_same_arch_reason() -> None:
    class N:
        arch, driver_version, cuda_version, triton_version, torch_version = "sm_90", "550", "12.4", "3.5.0", "2.11"

    other = TargetInfo(arch="sm_80", min_driver="535", cuda="12.x", triton="3.6.0", torch=">=2.9")
    assert "Triton" in node_rejection([other, T], N())


@pytest.fixture
def kit(db_url, tmp_path):
    k = Kit(db_url, tmp_path)
    yield k
    k.close()


def test_compat_matrix_states(kit: Kit) -> None:
    kit.nodes(2, prefix="h100", arch="sm_90")
    kit.nodes(1, prefix="a100", arch="sm_80")
    kit.nodes(1, prefix="old", arch="sm_90", driver="470.1")
    kit.push("1.0.0", archs=("sm_90", "sm_80"))
    kit.push("1.1.0", archs=("sm_90",))
    with kit.tx() as s:
        rows = {(r.bundle, r.stratum): r for r in compat_matrix(s)}
    assert rows[("llm-fused@1.0.0", "sm_80/drv550/triton3.6.0")].state == "eligible"
    assert rows[("llm-fused@1.1.0", "sm_80/drv550/triton3.6.0")].state == "ineligible"
    old = rows[("llm-fused@1.0.0", "sm_90/drv470/triton3.6.0")]
    assert old.state == "ineligible" and "driver 470.1 is older" in old.reason
    with kit.tx() as s:
        rid = start_rollout(s, "llm-fused@1.1.0", actor="op").id
    with kit.tx() as s:
        rows = {(r.bundle, r.stratum): r for r in compat_matrix(s, bundle_name="llm-fused")}
    cand = rows[("llm-fused@1.1.0", "sm_90/drv550/triton3.6.0")]
    assert (cand.state, cand.rollout_id, cand.step, cand.nodes, cand.eligible_nodes) == ("candidate", rid, 1, 2, 2)  # steps from 1
    with kit.tx() as s:
        rollback(s, rid, actor="op", reason="bad", strata=["sm_90/drv550/triton3.6.0"])
    with kit.tx() as s:
        rows = {(r.bundle, r.stratum): r for r in compat_matrix(s)}
    assert rows[("llm-fused@1.1.0", "sm_90/drv550/triton3.6.0")].state == "rolled_back"
    assert rows[("llm-fused@1.1.0", "sm_90/drv470/triton3.6.0")].state == "revoked"
