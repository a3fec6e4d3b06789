"""The host-wide per-device timing lock (agents.timing_lock) between real processes, and in a real trial child.

A second process holds the lock (real ``flock``) until the test releases it: a waiter times out after its
timeout and says so, another device's key is free meanwhile, and once released the lock is taken. A real trial
child whose device lock is held by this test process times anyway after its timeout and records the wait in
its phase timings and notes.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents.inventory import collect_inventory
from agents.timing_lock import ENV_DIR, device_key, timing_lock
from agents.trial import TrialConfig, TrialRunner
from agents.trial_protocol import TrafficProfile
from kernelctl.wire import BundleRef, TrialSpec
from tests.agents.bundles import BuiltBundles

HOLDER = """
import sys, time
from pathlib import Path
from agents.timing_lock import timing_lock
d, key = Path(sys.argv[1]), sys.argv[2]
with timing_lock(key, 30.0, d) as w:
    assert w.held
    (d / "held").write_text("1")
    while not (d / "release").exists():
        time.sleep(0.02)
"""


def wait_for(path: Path, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.02)


def test_a_second_process_waits_times_out_and_then_gets_the_lock(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), "gpu-A"], cwd=Path(__file__).parents[2])
    try:
        wait_for(tmp_path / "held")
        with timing_lock("gpu-A", 0.3, tmp_path) as w:
            assert not w.held and w.waited_s >= 0.3  # held elsewhere: timed out, and says how long it waited
        with timing_lock("gpu-B", 0.3, tmp_path) as w:
            assert w.held  # another device is not blocked
        (tmp_path / "release").write_text("1")
        with timing_lock("gpu-A", 60.0, tmp_path) as w:
            assert w.held
    finally:
        (tmp_path / "release").write_text("1")
        holder.wait(timeout=60)
    assert holder.returncode == 0
    with timing_lock("gpu-A", 0, tmp_path) as w:
        assert not w.held and w.waited_s == 0  # 0: no lock
    (tmp_path / "file").write_text("")
    with timing_lock("gpu-A", 1.0, tmp_path / "file" / "sub") as w:  # an unusable directory: no lock, no error
        assert not w.held and w.error


def test_a_trial_records_its_wait_for_the_lock(bundles: BuiltBundles, sm90_overrides: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setenv(ENV_DIR, str(tmp_path / "locks"))
    node = collect_inventory(sm90_overrides)
    profile = TrafficProfile(batch_sizes=[4], prefill_tokens=[], rounds=1, fuzz_shapes=0, dtypes=["fp32"],
                             e2e=False, timing_lock_s=0.5)
    runner = TrialRunner(TrialConfig(node=node, trusted_keys_dir=bundles.trusted_dir,
                                     loader_cache_dir=tmp_path / "loader", work_root=tmp_path / "trials",
                                     timeout_s=300, profile=profile))

    def ref(v: str) -> BundleRef:
        return BundleRef(name="llm-fused", version=v, digest=bundles.digests[v])

    spec = TrialSpec(rollout_id=7, stratum="s", candidate=ref("1.1.0"), stable=ref("1.0.0"), batch_sizes=[4],
                     prefill_tokens=[], rounds=1)
    with timing_lock(device_key(torch.device("cpu")), 1.0, tmp_path / "locks") as mine:
        assert mine.held  # this process holds the node's timing lock for the whole trial
        rep = runner.run(spec, idempotency_key="n1:lock-0001", candidate_path=bundles.paths["1.1.0"],
                         stable_path=bundles.paths["1.0.0"])
    assert rep.outcome == "ok", rep.detail
    assert rep.cells  # it timed anyway
    assert "latency: timed without the timing lock on cpu: not free after" in rep.detail
    waited = re.search(r"latency_lock (\d+\.\d)s", rep.detail)  # the wait, in the phase timings
    assert waited and float(waited.group(1)) >= 0.5, rep.detail
