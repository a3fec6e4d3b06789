"""One timed latency phase at a time per physical GPU, across the agent processes of a host.

Several agents on one GPU (``scripts/gpu-fleet`` runs four on one H100) share it by time slices, so one agent's
timed calls absorbed another's slices (docs/gpu.md, run H: per-cell noise ~17%). The trial child takes an
exclusive ``fcntl.flock`` on a file named after the device (the GPU's UUID, else its PCI bus id; ``cpu`` for
an interpreter node) in a host-wide directory (``KERNELCTL_TIMING_LOCK_DIR``, default
``<tmp>/kernelctl-timing-locks``) around its latency and end-to-end timing phases only: numerics, capacity
and imports still overlap. The lock dies with its process (the kernel drops a dead holder's flock), so a
crashed trial never wedges the others. After ``timeout_s`` without the lock the trial times anyway and says
so (a wedged or very slow neighbour must not starve it); the wait, or the timeout, is in the trial's phase
timings (``<phase>_lock``) and notes. On by default on GPU nodes (``WorkerSpec.timing_lock_s``, the node
profile's ``timing_lock_s``; 0 turns it off); off on CPU nodes unless the profile sets it.
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


@contextmanager
def timing_lock(key: str, timeout_s: float, directory: Path | None = None
                ) -> Iterator[LockWait]:
    """Hold the host-wide lock ``key`` for the block (waiting up to ``timeout_s``); yields the :class:`LockWait`.
    ``timeout_s`` <= 0: no lock at all (``held`` False, nothing waited)."""
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
        t0 = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                wait.held = True
                break
            except BlockingIOError:
                if time.monotonic() - t0 >= timeout_s:
                    break
                time.sleep(POLL_S)
        wait.waited_s = time.monotonic() - t0
        yield wait
    finally:
        os.close(fd)  # releases the lock
