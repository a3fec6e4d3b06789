"""The GPU to itself while a trial times: a host-wide readers-writer lock per physical device.

Several agents on one GPU (``scripts/gpu-fleet`` runs four on one H100) share it by time slices. A lock around
the timed phases alone (the first version of this module) was not enough: while one agent timed, the others'
numeric checks ran kernels on the same GPU, and a 5 us kernel measured p50 5 us but mean 53 us and p99 444 us
(docs/gpu.md, run S: the per-report mean of an identical candidate moved by +-20-30% in small cells). So every
trial child holds the device **shared** while it uses the GPU for checks (:func:`gpu_share`: numerics and
capacity) and **exclusively** while it times (:func:`timing_lock`: latency and end-to-end); checks overlap each
other, nothing overlaps a timed phase. The checks take their shared hold per unit of work (:class:`CheckHolds`:
one op and dtype, one shape), not for all of them at once: a timer then waits for the units running now, not for
every check of every other trial (run AP on an H200: a held-for-all-checks share made timers wait 19-66 s and
trials take 83 s median with four agents on one GPU).

Both are ``fcntl.flock`` on ``<key>.lock`` in a host-wide directory (``KERNELCTL_TIMING_LOCK_DIR``, default
``<tmp>/kernelctl-timing-locks``), the key named after the device (the GPU's UUID, else its PCI bus id; ``cpu``
for an interpreter node). A turnstile (``<key>.gate``) keeps a waiting timer from being starved by checks that
keep starting: a timer holds the gate while it waits for the checks running now to finish and while it times;
a check passes the gate (takes and drops it) before it takes its shared hold. Locks die with their process (the
kernel drops a dead holder's flock), so a crashed trial never wedges the others. After ``timeout_s`` without the
lock a phase runs anyway and says so (a wedged or very slow neighbour must not starve it); the wait, or the
timeout, is in the trial's phase timings (``<phase>_lock``, ``share_lock``) and notes. On by default on GPU
nodes (``WorkerSpec.timing_lock_s``, the node profile's ``timing_lock_s``; 0 turns it off); off on CPU nodes
unless the profile sets it.
"""

from __future__ import annotations

import fcntl
import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

ENV_DIR = "KERNELCTL_TIMING_LOCK_DIR"
POLL_S = 0.05


@dataclass
class LockWait:
    """How the timing lock went: the key, seconds waited, and whether it was held (False: timed out)."""

    key: str
    waited_s: float = 0.0
    held: bool = False
    error: str | None = None  # the lock file could not be opened (the phase times without it)


def lock_dir() -> Path:
    return Path(os.environ.get(ENV_DIR) or Path(tempfile.gettempdir()) / "kernelctl-timing-locks")


def device_key(device: torch.device) -> str:
    """A host-wide name of the physical device: ``gpu-<uuid>``, ``gpu-pci-<bus id>`` or ``cpu``."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)  # torch's CUDA properties; absent in old builds
    if uuid:
        raw = f"gpu-{uuid}"
    else:
        raw = (f"gpu-pci-{getattr(props, 'pci_domain_id', 0):04x}-{getattr(props, 'pci_bus_id', 0):02x}-"
               f"{getattr(props, 'pci_device_id', 0):02x}")
    return re.sub(r"[^A-Za-z0-9._-]", "_", raw)


def _acquire(fd: int, op: int, deadline: float) -> bool:
    """``flock(fd, op)`` polled until ``deadline`` (monotonic); whether it was taken."""
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)


@contextmanager
def _device_lock(key: str, timeout_s: float, directory: Path | None, *, exclusive: bool) -> Iterator[LockWait]:
    wait = LockWait(key)
    if timeout_s <= 0:
        yield wait
        return
    d = directory or lock_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:  # an unusable lock directory must not fail the trial
        wait.error = f"{d}: {exc.strerror or exc}"
        yield wait
        return
    try:
        gate = os.open(d / f"{key}.gate", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        os.close(fd)
        wait.error = f"{d}: {exc.strerror or exc}"
        yield wait
        return
    try:
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        if _acquire(gate, fcntl.LOCK_EX, deadline):
            wait.held = _acquire(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, deadline)
            if not exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)  # a check only passes the turnstile
        wait.waited_s = time.monotonic() - t0
        yield wait
    finally:
        os.close(fd)  # releases the lock
        os.close(gate)


class CheckHolds:
    """The checks' shared holds on one device, one per unit of check work, with one wait budget for the trial.

    Each :meth:`hold` takes the device shared for one unit (between two units a timer waiting at the turnstile
    gets the device). Their waits together are bounded by ``timeout_s``: once the trial has waited that long in
    all, further units run without the lock (a wedged neighbour must not make every unit wait). ``timeout_s`` <=
    0: no lock at all. :meth:`summary` is the :class:`LockWait` of the checks as a whole."""

    def __init__(self, key: str, timeout_s: float, directory: Path | None = None) -> None:
        self.key, self.timeout_s, self.directory = key, timeout_s, directory
        self.waited_s = 0.0
        self.units = 0
        self.missed = 0  # units that ran without the lock
        self.error: str | None = None

    @contextmanager
    def hold(self) -> Iterator[None]:
        if self.timeout_s <= 0:
            yield
            return
        budget = 0.0 if self.error is not None else max(self.timeout_s - self.waited_s, 0.0)
        with _device_lock(self.key, budget, self.directory, exclusive=False) as wait:
            self.units += 1
            self.waited_s += wait.waited_s
            self.error = self.error or wait.error
            self.missed += not wait.held
            yield

    def summary(self) -> LockWait:
        return LockWait(self.key, waited_s=self.waited_s, held=self.missed == 0, error=self.error)


@contextmanager
def timing_lock(key: str, timeout_s: float, directory: Path | None = None) -> Iterator[LockWait]:
    """Hold device ``key`` exclusively for the block (a timed phase), waiting up to ``timeout_s`` for the checks
    and timings running now; yields the :class:`LockWait`. ``timeout_s`` <= 0: no lock (``held`` False)."""
    with _device_lock(key, timeout_s, directory, exclusive=True) as wait:
        yield wait


@contextmanager
def gpu_share(key: str, timeout_s: float, directory: Path | None = None) -> Iterator[LockWait]:
    """Hold device ``key`` shared for the block (GPU work that is not timed: other checks may run beside it,
    no timed phase may), waiting up to ``timeout_s`` for a timed phase running or waiting now."""
    with _device_lock(key, timeout_s, directory, exclusive=False) as wait:
        yield wait
