"""Child processes of the demo and the GPU fleet script: started in their own process groups, logged to
files, and always stopped (SIGTERM, then SIGKILL) when the parent ends, also on Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class ProcessGroup:
    """A set of named child processes that are stopped together."""

    log_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def alive(self) -> dict[str, bool]:
        return {name: p.poll() is None for name, p in self.procs.items()}

    def stop(self, name: str, *, timeout: float = 10.0) -> int | None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return None
        return _stop(proc, timeout)

    def stop_all(self, *, timeout: float = 10.0) -> None:
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(5)
        self.procs.clear()

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _stop(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    _signal_group(proc, signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        return proc.wait(5)


def kernelctl_args(*args: str) -> list[str]:
    """Run kernelctl with this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "kernelctl.cli", *args]


def wait_port_file(path: Path, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text().strip())
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before listening")
        time.sleep(0.1)
    raise TimeoutError(f"no port written to {path} within {timeout:.0f}s")


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"controller exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"controller at {url} not ready within {timeout:.0f}s")
