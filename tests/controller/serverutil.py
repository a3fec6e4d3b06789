"""Start a REAL ``kernelctl serve`` subprocess (uvicorn on 127.0.0.1, a free port) for tests, and stop it.

Usage (agent and e2e tests reuse this)::

    from tests.controller.serverutil import ControllerProcess, make_tokens

    tokens = make_tokens()                         # {"operator": ..., "viewer": ..., "enroll": ...}
    with ControllerProcess(db_url, tmp_path, tokens=tokens, trusted_keys_dir=keys) as ctl:
        httpx.get(ctl.url + "/readyz")             # ctl.url = "http://127.0.0.1:PORT"
        ctl.client("operator").post("/v1/rollouts", json=...)
        ctl.kill()                                 # SIGKILL (crash), or ctl.stop() for SIGTERM
        ctl.start()                                # same DB, same tokens, a new free port
    print(ctl.log_text())                          # everything the server wrote (stdout + stderr)

The database must already be migrated (the ``db_url`` fixture is). The server binds port 0 and reports the
bound port through ``--port-file`` (no race for a free port). ``start()`` waits until ``/readyz`` answers
200 (or, with ``wait_leader``, until it says ``leader: true``) and raises with the log tail if the process
dies or does not become ready in time. Output goes to a log file (never a pipe that could fill up).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kernelctl.procs import kernelctl_args
from sim.localctl import (  # re-exported: the tests import them from here
    READY_TIMEOUT,
    LocalController,
    inventory,
    make_tokens,
    ok_report,
    register_node,
)

__all__ = ["READY_TIMEOUT", "ControllerProcess", "TestBundles", "Zygote", "build_test_bundles", "cli_command", "controller_fixtures",
           "inventory", "make_tokens", "ok_report", "register_node", "serve_command"]

REPO_ROOT = Path(__file__).resolve().parents[2]


def serve_command() -> list[str]:
    """``kernelctl serve`` as a command line."""
    return [*cli_command(), "serve"]


def cli_command() -> list[str]:
    """The ``kernelctl`` command line for CLI tests: ``python -m cli.app`` (the root app, cli/app.py)."""
    return kernelctl_args()


ZYGOTE_CODE = r"""
import contextlib, json, os, signal, sys
import cli.app, controller.server, controller.scheduler, controller.tick, controller.ingest  # the slow part

def reap(signum, frame):  # waited for (not SIG_IGN): their CPU time counts in ours, and so in the test's
    with contextlib.suppress(ChildProcessError):  # no child left
        while os.waitpid(-1, os.WNOHANG)[0]:
            continue

signal.signal(signal.SIGCHLD, reap)
sys.stdout.write("ready\n"); sys.stdout.flush()
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1); os.dup2(fd, 2); os.close(fd)
        os.environ.clear(); os.environ.update(req["env"])
        from kernelctl.settings import get_settings
        get_settings.cache_clear()
        try:
            cli.app.app(args=req["argv"], prog_name="kernelctl")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    sys.stdout.write(f"{pid}\n"); sys.stdout.flush()
"""


class Zygote:
    """A process that has imported the controller once and forks ``kernelctl serve`` processes on demand.

    Each forked child runs exactly the ``serve`` command line (same code, same arguments, same env as a
    fresh process); only the Python imports are shared. It makes a restart take ~1 s instead of the import
    time (~2 CPU-s), so crash tests can kill and restart the controller many times, and every test file that
    starts controllers shares one zygote per test process (the ``zygote`` fixture, tests/conftest.py). The
    zygote waits for its children, so their CPU time is part of the test process tree's (``/usr/bin/time``).
    Not for a test that needs the controller's exit status (it is not known here: see ForkedProcess).
    ``stop()`` ends the zygote.
    """

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE_CODE], cwd=REPO_ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"zygote failed to start: {line!r}")

    def spawn(self, argv: list[str], env: dict[str, str], log: Path) -> ForkedProcess:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        return ForkedProcess(int(self.proc.stdout.readline().strip()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class ForkedProcess:
    """The Popen subset ControllerProcess uses, for a child of the zygote (not our own child)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = -1  # gone (reaped by the zygote: the exact status is not known here)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]


class ControllerProcess(LocalController):
    """:class:`sim.localctl.LocalController` with the tests' zygote: ``zygote`` forks restarts from it."""

    def __init__(self, db_url: str, workdir: Path, *, zygote: Zygote | None = None, **kw: Any) -> None:
        super().__init__(db_url, workdir, **kw, **({"spawn": zygote.spawn} if zygote is not None else {}))


# ------------------------------------------------------------------------------------------ test data
TEST_BUNDLE_NAME = "llm-fused"


class TestBundles:
    """Signed test bundles built with kernelpack.build: ``files[version]`` -> .kpack path."""

    __test__ = False  # not a pytest class

    def __init__(self, root: Path, keys_dir: Path, private_key: Path, files: dict[str, Path]) -> None:
        self.root, self.keys_dir, self.private_key, self.files = root, keys_dir, private_key, files

    def ref(self, version: str) -> str:
        return f"{TEST_BUNDLE_NAME}@{version}"


def build_test_bundles(root: Path, versions: tuple[str, ...] = ("1.0.0", "1.1.0"),
                       archs: tuple[str, ...] = ("sm_90",)) -> TestBundles:
    """Build small real bundles (one fused kernel, compiled ahead of time for ``archs``), signed by a fresh key.

    The AOT compile is cached in kernelpack's default cache, so only the first run of a machine is slow.
    """
    from kernelpack.scaffold import build_signed

    made = build_signed(root, TEST_BUNDLE_NAME, versions, kernels={"bias_gelu": "kernelpack.kernels.bias_gelu"},
                        archs=archs, cuda=["12.x", "13.x"], decode_batch_sizes=[1, 8], prefill_tokens=[64],
                        note="controller test bundle")
    return TestBundles(root, made.trusted, made.private_key, made.files)


def controller_fixtures(prefix: str, versions: tuple[str, ...] = ("1.0.0",), **controller: Any) -> tuple[Any, Any]:
    """A test module's module-scoped ``bundles`` (signed test bundles of ``versions``) and ``ctl`` fixtures: a
    ControllerProcess (forked from the session's zygote) trusting them (``controller``: its keyword arguments) on
    a fresh database, once on SQLite and once on PostgreSQL. Usage: ``bundles, ctl = controller_fixtures("auth")`` at module level."""
    import pytest

    from tests import dbutil

    @pytest.fixture(scope="module", name="bundles")
    def bundles(tmp_path_factory: pytest.TempPathFactory) -> TestBundles:
        return build_test_bundles(tmp_path_factory.mktemp("bundles"), versions=versions)

    @pytest.fixture(scope="module", name="ctl",
                    params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
    def ctl(request: pytest.FixtureRequest, bundles: TestBundles, tmp_path_factory: pytest.TempPathFactory,
            zygote: Zygote) -> Iterator[ControllerProcess]:
        tmp = tmp_path_factory.mktemp(f"{prefix}-{request.param}")
        with dbutil.fresh_database(request.param, tmp) as url, \
                ControllerProcess(url, tmp, trusted_keys_dir=bundles.keys_dir, zygote=zygote, **controller) as proc:
            yield proc

    return bundles, ctl
