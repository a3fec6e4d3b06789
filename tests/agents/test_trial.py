"""Trials in a real child process with real bundles on the Triton interpreter: each fault fixture surfaces as
its outcome (crash = SIGSEGV, OOM = a real allocation failure under the child's memory limit, drift =
numeric error), a hang is killed at the limit, a bundle that does not verify is a load error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agents.inventory import NodeInventory, collect_inventory
from agents.trial import TrialConfig, TrialRunner
from agents.trial_protocol import TrafficProfile
from kernelctl.wire import BundleRef, TrialReport, TrialSpec
from kernelpack.signing import generate_keypair
from tests.agents.bundles import BuiltBundles

FAST = TrafficProfile(batch_sizes=[1, 64], prefill_tokens=[], rounds=1, fuzz_shapes=1, dtypes=["fp32"], e2e=False)


@pytest.fixture
def node(sm90_overrides: Path) -> NodeInventory:
    return collect_inventory(sm90_overrides)


def ref(b: BuiltBundles, v: str) -> BundleRef:
    return BundleRef(name="llm-fused", version=v, digest=b.digests[v])


def run(b: BuiltBundles, node: NodeInventory, tmp_path: Path, cand: str, *, stable: str | None = "1.0.0",
        profile: TrafficProfile = FAST, timeout: float = 120.0, trusted: Path | None = None) -> TrialReport:
    runner = TrialRunner(TrialConfig(node=node, trusted_keys_dir=trusted or b.trusted_dir,
                                     loader_cache_dir=tmp_path / "loader", work_root=tmp_path / "trials",
                                     timeout_s=timeout, profile=profile))
    spec = TrialSpec(rollout_id=7, stratum="sm_90/drv550/triton3.6.0", candidate=ref(b, cand),
                     stable=ref(b, stable) if stable else None, batch_sizes=[1, 8], prefill_tokens=[128], rounds=2)
    pids: list[int] = []
    rep = runner.run(spec, idempotency_key="n1:0123456789", candidate_path=b.paths[cand],
                     stable_path=b.paths[stable] if stable else None, on_start=pids.append)
    assert rep.idempotency_key == "n1:0123456789" and rep.rollout_id == 7 and rep.candidate == ref(b, cand)
    assert not (tmp_path / "trials").exists() or not any((tmp_path / "trials").iterdir())  # work dir removed
    assert pids and _zombie_or_gone(pids[0])  # the child is gone
    return rep


def _zombie_or_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_good_candidate_is_ok_with_full_evidence(bundles: BuiltBundles, node: NodeInventory, tmp_path: Path) -> None:
    prof = FAST.model_copy(update={"e2e": True})
    rep = run(bundles, node, tmp_path, "1.1.0", profile=prof)
    assert rep.outcome == "ok", rep.detail
    assert {c.op for c in rep.numerics} == {"add_rmsnorm", "bias_gelu"}
    assert all(c.within_tolerance for c in rep.numerics)
    fuzzed = [c for c in rep.numerics if c.vs_stable_within is not None]
    assert fuzzed and all(c.vs_stable_within for c in fuzzed)  # compared with stable on the same inputs
    # issue 25: every cell's calls timed one by one, both arms' n, mean, p50, p99 and window means
    assert {c.op for c in rep.cells} == {"add_rmsnorm", "bias_gelu"} and not rep.latency
    # 6 windows of 2 calls per arm, less any window both arms ran 1.5x slow in (dropped from both: n stays paired)
    assert all(c.stable.n == c.candidate.n == 2 * len(c.stable.windows_s) == 12 - 2 * c.contended_windows >= 10
               for c in rep.cells), rep.cells
    assert all(0 < a.p50_s <= a.p99_s for c in rep.cells for a in (c.stable, c.candidate))
    assert rep.launches_per_call == {"add_rmsnorm": 1, "bias_gelu": 1}
    assert rep.peak_memory_bytes is not None and rep.peak_memory_bytes > 0
    assert rep.e2e_stable_s and rep.e2e_candidate_s and rep.e2e is not None and rep.e2e.candidate.n >= 1
    assert "seed=" in rep.detail  # fresh random inputs each trial, recorded for reproduction


def test_crash_fixture_is_a_crash_with_the_signal(bundles: BuiltBundles, node: NodeInventory, tmp_path: Path) -> None:
    rep = run(bundles, node, tmp_path, "1.2.0-fault.crash")
    assert rep.outcome == "crash"
    assert "SIGSEGV" in rep.detail and "phase golden" in rep.detail


def test_oom_fixture_is_an_oom(bundles: BuiltBundles, node: NodeInventory, tmp_path: Path) -> None:
    rep = run(bundles, node, tmp_path, "1.2.0-fault.oom", stable=None)
    assert rep.outcome == "oom", rep.detail
    assert "can't allocate memory" in rep.detail


def test_drift_fixture_is_a_numeric_error(bundles: BuiltBundles, node: NodeInventory, tmp_path: Path) -> None:
    rep = run(bundles, node, tmp_path, "1.2.0-fault.drift")
    assert rep.outcome == "numeric_error", rep.detail
    bad = [c for c in rep.numerics if not c.within_tolerance]
    assert bad and {c.op for c in bad} == {"add_rmsnorm"}
    assert all(c.shape["hidden"] >= 256 for c in bad)  # the fixture's wide-row bug, nothing else
    assert rep.cells == []  # a hard failure ends the trial


def test_hang_is_killed_at_the_limit(bundles: BuiltBundles, node: NodeInventory, tmp_path: Path) -> None:
    rep = run(bundles, node, tmp_path, "1.1.0", timeout=1.0)
    assert rep.outcome == "hang"
    assert "still running after 1s" in rep.detail
    assert rep.duration_s < 30


def test_untrusted_bundle_is_a_load_error(bundles: BuiltBundles, node: NodeInventory, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    kp = generate_keypair(tmp_path / "k")
    shutil.copy(kp.public_path, other)
    rep = run(bundles, node, tmp_path, "1.1.0", trusted=other)
    assert rep.outcome == "load_error"
    assert "not in the trusted keys" in rep.detail


def test_profile_file_is_validated(tmp_path: Path) -> None:
    from agents.trial_protocol import ProfileError, load_profile

    p = tmp_path / "p.json"
    p.write_text(json.dumps({"batch_sizes": [0, 8]}))
    with pytest.raises(ProfileError, match="batch_sizes"):
        load_profile(p)
    p.write_text(json.dumps({"batch_size": [8]}))
    with pytest.raises(ProfileError, match="batch_size"):
        load_profile(p)
    t = tmp_path / "p.toml"
    t.write_text("batch_sizes = [1, 16]\nrounds = 2\n")
    assert load_profile(t).batch_sizes == [1, 16]
