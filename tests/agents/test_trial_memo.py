"""Repeat trials on a CPU node (agents.trial_memo) and the early stop of the numerics, in real trial children.

A node that passed a (candidate, stable) pair's golden, edge and production checks does not run them again in
the next paired trial (the interpreter gives the same bits on the same inputs): the second report carries only
the fuzz checks (fresh seed) plus capacity and latency, and says why. Another stable version is another key.
A failing phase ends the numerics: the drift fixture fails its golden vectors and nothing after them runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.inventory import NodeInventory, collect_inventory
from agents.trial import TrialConfig, TrialRunner
from agents.trial_protocol import TrafficProfile
from kernelctl.wire import BundleRef, TrialReport, TrialSpec
from tests.agents.bundles import BuiltBundles

FAST = TrafficProfile(batch_sizes=[4], prefill_tokens=[], rounds=1, fuzz_shapes=1, dtypes=["fp32"], e2e=False)
DETERMINISTIC = {"golden", "stable_golden", "edge", "production"}


@pytest.fixture
def node(sm90_overrides: Path) -> NodeInventory:
    return collect_inventory(sm90_overrides)


def trial(b: BuiltBundles, node: NodeInventory, loader: Path, cand: str, stable: str, key: str) -> TrialReport:
    def ref(v: str) -> BundleRef:
        return BundleRef(name="llm-fused", version=v, digest=b.digests[v])

    runner = TrialRunner(TrialConfig(node=node, trusted_keys_dir=b.trusted_dir, loader_cache_dir=loader,
                                     work_root=loader.parent / "trials", timeout_s=300, profile=FAST))
    spec = TrialSpec(rollout_id=7, stratum="s", candidate=ref(cand), stable=ref(stable), batch_sizes=[4],
                     prefill_tokens=[], rounds=1)
    return runner.run(spec, idempotency_key=key, candidate_path=b.paths[cand], stable_path=b.paths[stable])


def kinds(rep: TrialReport) -> set[str]:
    return {c.kind for c in rep.numerics if c.kind}


def test_repeat_trial_skips_only_the_deterministic_checks(bundles: BuiltBundles, node: NodeInventory,
                                                          tmp_path: Path) -> None:
    loader = tmp_path / "loader"
    first = trial(bundles, node, loader, "1.1.0", "1.0.0", "n1:memo-0001")
    assert first.outcome == "ok", first.detail
    assert kinds(first) == DETERMINISTIC | {"fuzz"}
    assert "not repeated" not in first.detail
    second = trial(bundles, node, loader, "1.1.0", "1.0.0", "n1:memo-0002")
    assert second.outcome == "ok", second.detail
    assert kinds(second) == {"fuzz"}  # fresh random shapes and inputs every trial
    assert "golden, edge and production checks not repeated" in second.detail
    assert second.cells and second.resources  # latency, memory and launches are measured every trial
    # another stable version is another pair: everything runs again
    other = trial(bundles, node, loader, "1.1.0", "1.1.0", "n1:memo-0003")
    assert other.outcome == "ok", other.detail
    assert kinds(other) == DETERMINISTIC | {"fuzz"}
    # another node (its own loader cache) runs everything too
    fresh = trial(bundles, node, tmp_path / "other-node", "1.1.0", "1.0.0", "n2:memo-0004")
    assert kinds(fresh) == DETERMINISTIC | {"fuzz"}


def test_failing_golden_vectors_end_the_numerics(bundles: BuiltBundles, node: NodeInventory, tmp_path: Path) -> None:
    rep = trial(bundles, node, tmp_path / "loader", "1.2.0-fault.drift", "1.0.0", "n1:drift-0001")
    assert rep.outcome == "numeric_error", rep.detail
    assert kinds(rep) <= {"golden", "stable_golden"} and any(not c.within_tolerance for c in rep.numerics)
    assert rep.cells == [] and rep.resources == []
    # a failed pair is never recorded as passed: the next trial checks everything again
    again = trial(bundles, node, tmp_path / "loader", "1.2.0-fault.drift", "1.0.0", "n1:drift-0002")
    assert again.outcome == "numeric_error" and "not repeated" not in again.detail
