"""The GPU nodes' numerics memo (``fingerprint`` mode, agents.trial_memo), shown on the CPU in real trial children.

On a GPU the production-shape checks are the expensive part of a trial and a racy kernel may pass once, so a
repeat trial of a (candidate, stable) pair skips a production shape's check only while the candidate's output
bits on the same inputs equal those of the run that passed it; golden, fuzz and edge checks run every trial.
The node profile's ``numerics_memo = "fingerprint"`` selects the mode on a CPU node, so the same code is run
here: reuse on identical bits, a full check again when the recorded bits differ, another candidate digest
starts over, and a kernel whose second run on the same inputs is wrong (the race fixture) fails its first
trial because the checking trial runs the candidate twice.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agents.inventory import NodeInventory, collect_inventory
from agents.trial import TrialConfig, TrialRunner
from agents.trial_protocol import TrafficProfile
from kernelctl.vocab import NumericsMemoMode
from kernelctl.wire import BundleRef, TrialReport, TrialSpec
from tests.agents.bundles import BuiltBundles, build_test_bundles

# 1100 rows: the production shape reaches past row 1000 (where the race fixture goes wrong)
GPU_MODE = TrafficProfile(batch_sizes=[4], prefill_tokens=[1100], rounds=1, fuzz_shapes=1, dtypes=["fp32"],
                          e2e=False, numerics_memo=NumericsMemoMode.FINGERPRINT)


@pytest.fixture(scope="module")
def swiglu(tmp_path_factory: pytest.TempPathFactory) -> BuiltBundles:
    return build_test_bundles(tmp_path_factory.mktemp("memo-gpu"), ("1.1.0", "1.1.1", "1.2.0-fault.race"),
                              ops=("swiglu",))


@pytest.fixture
def node(sm90_overrides: Path) -> NodeInventory:
    return collect_inventory(sm90_overrides)


def trial(b: BuiltBundles, node: NodeInventory, loader: Path, cand: str, key: str,
          profile: TrafficProfile = GPU_MODE) -> TrialReport:
    def ref(v: str) -> BundleRef:
        return BundleRef(name="llm-fused", version=v, digest=b.digests[v])

    runner = TrialRunner(TrialConfig(node=node, trusted_keys_dir=b.trusted_dir, loader_cache_dir=loader,
                                     work_root=loader.parent / "trials", timeout_s=300, profile=profile))
    spec = TrialSpec(rollout_id=7, stratum="s", candidate=ref(cand), stable=ref("1.1.0"), batch_sizes=[4],
                     prefill_tokens=[1100], rounds=1)
    return runner.run(spec, idempotency_key=key, candidate_path=b.paths[cand], stable_path=b.paths["1.1.0"])


def kinds(rep: TrialReport) -> set[str]:
    return {c.kind for c in rep.numerics if c.kind}


def memo_files(loader: Path) -> list[Path]:
    return sorted((loader / "trial-memo").glob("*.json"))


def test_fingerprint_memo_reuses_only_bit_identical_production_runs(swiglu: BuiltBundles, node: NodeInventory,
                                                                     tmp_path: Path) -> None:
    loader = tmp_path / "loader"
    first = trial(swiglu, node, loader, "1.1.1", "n1:fp-0001")
    assert first.outcome == "ok", first.detail
    assert kinds(first) == {"golden", "stable_golden", "fuzz", "edge", "production"}
    (memo,) = memo_files(loader)
    prints = json.loads(memo.read_text())["production"]
    assert list(prints) == ['swiglu|fp32|{"hidden": 40, "tokens": 1100}'], prints
    # the repeat: production skipped on identical bits; golden, fuzz and edge run again (they are cheap)
    second = trial(swiglu, node, loader, "1.1.1", "n1:fp-0002")
    assert second.outcome == "ok", second.detail
    assert kinds(second) == {"golden", "stable_golden", "fuzz", "edge"}
    assert "production checks not repeated at 1 shape(s)" in second.detail
    # recorded bits that the candidate no longer produces: the shape is checked again, in full
    doc = json.loads(memo.read_text())
    doc["production"] = {k: [v[0][:-4] + "0000"] for k, v in doc["production"].items()}
    memo.write_text(json.dumps(doc))
    third = trial(swiglu, node, loader, "1.1.1", "n1:fp-0003")
    assert third.outcome == "ok", third.detail
    assert "production" in kinds(third) and "output bits differ from the checked run's" in third.detail
    # another candidate digest is another key: everything is checked
    other = trial(swiglu, node, loader, "1.1.0", "n1:fp-0004")
    assert "production" in kinds(other) and "not repeated" not in other.detail
    assert len(memo_files(loader)) == 2


def test_a_kernel_wrong_on_its_second_run_fails_the_checking_trial(swiglu: BuiltBundles, node: NodeInventory,
                                                                   tmp_path: Path) -> None:
    rep = trial(swiglu, node, tmp_path / "loader", "1.2.0-fault.race", "n1:race-0001")
    assert rep.outcome == "numeric_error", rep.detail
    bad = [c for c in rep.numerics if not c.within_tolerance]
    assert bad and {c.kind for c in bad} == {"production"} and bad[0].op == "swiglu"
    assert "output bits differed between 2 runs" in rep.detail
    assert memo_files(tmp_path / "loader") == []  # a failed pair is never recorded
