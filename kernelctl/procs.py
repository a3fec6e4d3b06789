"""Child processes: the one launcher of ``kernelctl serve`` (:class:`ServeProcess`, used by the demo, the
simulators and the tests) and :class:`ProcessGroup` (agents of the demo and the GPU fleet script). Children
start in their own process groups, log to files, and are always stopped (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

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

    def adopt(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        """Stop ``proc`` (started elsewhere, e.g. a :class:`ServeProcess`) with the group, and watch it."""
        self.procs[name] = proc

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


CLI_MODULE = "cli.app"  # the root ``kernelctl`` Typer app (the console script's target)


def terminate(proc: subprocess.Popen[bytes] | ProcLike, timeout: float = 30.0) -> int | None:
    """SIGTERM ``proc`` (not its group) and wait; SIGKILL after ``timeout``. Its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def kill(proc: subprocess.Popen[bytes] | ProcLike) -> int | None:
    """SIGKILL ``proc`` (not its group) unless it already ended, and reap it. Its exit code."""
    if proc.poll() is None:
        proc.kill()
    return proc.wait(10)


def kernelctl_args(*args: str) -> list[str]:
    """Run kernelctl with this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", CLI_MODULE, *args]


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



# ------------------------------------------------------------------------------------------ kernelctl serve
class ServeError(RuntimeError):
    """``kernelctl serve`` exited or did not become ready; the message ends with its log tail."""


class ProcLike(Protocol):
    """What :class:`ServeProcess` needs of a child: a ``subprocess.Popen`` or a test zygote's forked child."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


Spawner = Callable[[list[str], dict[str, str], Path], ProcLike]


def popen_spawner(argv: list[str], env: dict[str, str], log_path: Path) -> ProcLike:
    """Start ``kernelctl ARGV`` in its own session, output appended to ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(kernelctl_args(*argv), env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def serve_env(db_url: str, *, data_dir: Path | None = None, tick_seconds: float | None = None,
              heartbeat_seconds: float | None = None, stale_after_seconds: float | None = None,
              trusted_keys_dir: Path | None = None, bootstrap_tokens_file: Path | None = None,
              log_level: str | None = None, **extra: str) -> dict[str, str]:
    """The ``KERNELCTL_*`` environment of a controller (only the given settings; ``extra`` verbatim)."""
    named = {"DATABASE_URL": db_url, "DATA_DIR": data_dir, "TICK_SECONDS": tick_seconds,
             "HEARTBEAT_SECONDS": heartbeat_seconds, "STALE_AFTER_SECONDS": stale_after_seconds,
             "TRUSTED_KEYS_DIR": trusted_keys_dir, "BOOTSTRAP_TOKENS_FILE": bootstrap_tokens_file,
             "LOG_LEVEL": log_level}
    return {**{f"KERNELCTL_{k}": str(v) for k, v in named.items() if v is not None}, **extra}


class ServeProcess:
    """One ``kernelctl serve`` process on loopback, restartable: ``start()`` binds a free port (or, with
    ``reuse_port``, the one of the previous start) reported through ``--port-file``, then waits for
    ``/readyz`` (``leader=True``: until it says ``leader: true``). ``stop()`` is SIGTERM then SIGKILL,
    ``kill()`` is SIGKILL (a crash). The environment is ``os.environ`` less every ``KERNELCTL_*`` variable
    (``clean_env=False`` keeps them) plus ``env``; output is appended to ``log_path``.
    """

    def __init__(self, workdir: Path, env: Mapping[str, str], *, args: Sequence[str] = (),
                 log_path: Path | None = None, clean_env: bool = True, reuse_port: bool = False,
                 spawn: Spawner = popen_spawner) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.extra_env, self.args, self.clean_env, self.reuse_port = dict(env), list(args), clean_env, reuse_port
        self.log_path = log_path or self.workdir / "controller.log"
        self.port_file = self.workdir / "port"
        self.spawn = spawn
        self.proc: ProcLike | None = None
        self.port: int | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        if self.port is None:
            raise ServeError("controller is not running")
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def env(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not (self.clean_env and k.startswith("KERNELCTL_"))}
        return {**base, "PYTHONUNBUFFERED": "1", **self.extra_env}

    def start(self, *, timeout: float = 60.0, leader: bool = False) -> str:
        """Start and wait until ready; the URL. ServeError (with the log tail) when it dies or is too slow."""
        if self.running:
            raise ServeError("controller already running")
        self.port_file.unlink(missing_ok=True)
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start #{self.starts} =====\n".encode())
        port = self.port if self.reuse_port and self.port else 0
        argv = ["serve", "--host", "127.0.0.1", "--port", str(port), "--port-file", str(self.port_file),
                *self.args]
        self.port = None
        self.proc = self.spawn(argv, self.env(), self.log_path)
        deadline = time.monotonic() + timeout
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            if self.proc.poll() is not None:
                raise ServeError(f"controller exited with {self.proc.returncode} before listening:\n"
                                 f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise ServeError(f"controller did not start listening in {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.05)
        self.port = int(self.port_file.read_text().strip())
        try:
            self.wait_ready(max(1.0, deadline - time.monotonic()), leader=leader)
        except ServeError:
            self.kill()
            raise
        return self.url

    def readyz(self) -> dict[str, Any] | None:
        """``/readyz`` as JSON when it answers 200, else None."""
        try:
            r = httpx.get(self.url + "/readyz", timeout=2.0)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    def wait_ready(self, timeout: float = 60.0, *, leader: bool = False) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise ServeError(f"controller exited with {code} while waiting for /readyz:\n{self.log_tail()}")
            body = self.readyz()
            if body is not None and (body.get("leader") or not leader):
                return body
            if time.monotonic() > deadline:
                raise ServeError(f"controller not ready (leader={leader}) in {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful) and wait; SIGKILL if it does not exit in ``timeout``. Its exit code."""
        rc = None if self.proc is None else terminate(self.proc, timeout)
        self._ended()
        return rc

    def kill(self) -> None:
        """SIGKILL (a crash at an arbitrary instant)."""
        if self.proc is not None:
            kill(self.proc)
        self._ended()

    def _ended(self) -> None:
        self.proc = None
        if not self.reuse_port:
            self.port = None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def __enter__(self) -> ServeProcess:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
