"""The host-wide per-device timing lock (agents.timing_lock) between real processes, and in a real trial child.

A second process holds the lock (real ``flock``) until the test releases it: a waiter times out after its
timeout and says so, another device's key is free meanwhile, and once released the lock is taken. Checks share
the device with checks but never with a timed phase, and a timer waiting for running checks keeps new checks
out (the turnstile); a trial's checks hold the device per unit of work, so a timer gets it between two units,
and their waits share one budget. A real trial child whose device lock is held by this test process checks and times anyway
after its timeouts and records the waits in its phase timings and notes.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents.inventory import collect_inventory
from agents.timing_lock import ENV_DIR, CheckHolds, device_key, gpu_share, timing_lock
from agents.trial import TrialConfig, TrialRunner
from agents.trial_protocol import TrafficProfile
from kernelctl.wire import BundleRef, TrialSpec
from tests.agents.bundles import BuiltBundles

HOLDER = """
import sys, time
from pathlib import Path
from agents.timing_lock import gpu_share, timing_lock
d, key = Path(sys.argv[1]), sys.argv[2]
mode = sys.argv[3] if len(sys.argv) > 3 else "timed"
tag = sys.argv[4] if len(sys.argv) > 4 else ""
with (timing_lock if mode == "timed" else gpu_share)(key, 60.0, d) as w:
    assert w.held
    (d / f"held{tag}").write_text("1")
    while not (d / f"release{tag}").exists():
        time.sleep(0.02)
"""


def hold(tmp_path: Path, key: str, mode: str, tag: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), key, mode, tag],
                            cwd=Path(__file__).parents[2])


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


def gate_taken(gate: Path, timeout: float = 60.0) -> None:
    """Wait until another process holds the turnstile ``gate`` (a timer waiting for the device)."""
    end = time.monotonic() + timeout
    while True:
        fd = os.open(gate, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        finally:
            os.close(fd)
        assert time.monotonic() < end, "the timer never took the turnstile"
        time.sleep(0.02)


def test_checks_share_the_device_but_never_with_a_timed_phase(tmp_path: Path) -> None:
    checks = hold(tmp_path, "gpu-A", "share", "1")
    procs = [checks]
    try:
        wait_for(tmp_path / "held1")
        with gpu_share("gpu-A", 0.3, tmp_path) as w:
            assert w.held  # another trial's checks run beside these
        with timing_lock("gpu-A", 0.3, tmp_path) as w:
            assert not w.held  # no timed phase while checks use the GPU
        timer = hold(tmp_path, "gpu-A", "timed", "2")  # waits for the running checks, holding the turnstile
        procs.append(timer)
        gate_taken(tmp_path / "gpu-A.gate")
        assert not (tmp_path / "held2").exists()
        with gpu_share("gpu-A", 0.3, tmp_path) as w:
            assert not w.held  # a waiting timer keeps new checks out: it is not starved
        (tmp_path / "release1").write_text("1")
        wait_for(tmp_path / "held2")  # the checks ended: the timer has the device
        with gpu_share("gpu-A", 0.3, tmp_path) as w:
            assert not w.held  # nor do checks start while it times
        (tmp_path / "release2").write_text("1")
        with gpu_share("gpu-A", 60.0, tmp_path) as w:
            assert w.held
    finally:
        for tag in ("1", "2"):
            (tmp_path / f"release{tag}").write_text("1")
        for p in procs:
            p.wait(timeout=60)
    assert [p.returncode for p in procs] == [0, 0]


def test_a_timer_gets_the_device_between_two_units_of_checks(tmp_path: Path) -> None:
    holds = CheckHolds("gpu-A", 60.0, tmp_path)
    timer = None
    try:
        with holds.hold():  # the first unit of this trial's checks
            timer = hold(tmp_path, "gpu-A", "timed", "1")  # another trial's timer waits for it
            gate_taken(tmp_path / "gpu-A.gate")
            assert not (tmp_path / "held1").exists()
        wait_for(tmp_path / "held1")  # the unit ended: the timer has the device, not after all of the checks
        t0 = time.monotonic()
        (tmp_path / "release1").write_text("1")  # (it times, then lets go)
        with holds.hold():  # the next unit waits for it
            pass
        assert holds.units == 2 and holds.missed == 0 and holds.summary().held
        assert holds.waited_s <= time.monotonic() - t0 + 1.0
    finally:
        (tmp_path / "release1").write_text("1")
        if timer is not None:
            timer.wait(timeout=60)
    assert timer.returncode == 0


def test_the_checks_waits_share_one_budget(tmp_path: Path) -> None:
    timer = hold(tmp_path, "gpu-A", "timed", "1")  # a wedged neighbour holding the device
    try:
        wait_for(tmp_path / "held1")
        holds = CheckHolds("gpu-A", 0.4, tmp_path)
        t0 = time.monotonic()
        for _ in range(5):
            with holds.hold():
                pass
        assert time.monotonic() - t0 < 1.5  # the first unit waited the budget, the others not again
        assert holds.units == 5 and holds.missed == 5 and 0.4 <= holds.waited_s < 1.0
        assert not holds.summary().held
    finally:
        (tmp_path / "release1").write_text("1")
        timer.wait(timeout=60)


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
    assert "checks: ran without the device lock on cpu: not free after" in rep.detail
    assert "latency: timed without the device lock on cpu: not free after" in rep.detail
    waited = re.search(r"latency_lock (\d+\.\d)s", rep.detail)  # the wait, in the phase timings
    assert waited and float(waited.group(1)) >= 0.5, rep.detail
