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
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kernelctl.procs import ServeProcess, kernelctl_args, popen_spawner, serve_env

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 60.0


def make_tokens() -> dict[str, str]:
    """Fresh bootstrap tokens: operator, viewer and an agent enrollment token (``enroll``)."""
    return {k: f"kctl_test_{k}_{secrets.token_urlsafe(24)}" for k in ("operator", "viewer", "enroll")}


def serve_command() -> list[str]:
    """``kernelctl serve`` as a command line."""
    return [*cli_command(), "serve"]


def cli_command() -> list[str]:
    """The ``kernelctl`` command line for CLI tests: ``python -m cli.app`` (the root app, cli/app.py)."""
    return kernelctl_args()


ZYGOTE_CODE = r"""
import json, os, signal, sys
import cli.app, controller.server, controller.scheduler, controller.tick, controller.ingest  # the slow part
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped automatically
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
    time, so crash tests can kill and restart the controller many times. ``stop()`` ends the zygote.
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


class ControllerProcess(ServeProcess):
    """One ``kernelctl serve`` process on a database (kernelctl.procs.ServeProcess, the one launcher), with
    the test settings and bootstrap tokens; restartable (each start gets a fresh free port)."""

    def __init__(
        self,
        db_url: str,
        workdir: Path,
        *,
        tokens: dict[str, str] | None = None,
        trusted_keys_dir: Path | None = None,
        tick_seconds: float = 0.5,
        stale_after_seconds: float = 600.0,
        heartbeat_seconds: float = 1.0,
        max_bundle_bytes: int | None = None,
        extra_env: dict[str, str] | None = None,
        name: str = "ctl",
        zygote: Zygote | None = None,
    ) -> None:
        self.db_url = db_url
        workdir = Path(workdir) / f"controller-{name}"
        self.tokens = tokens if tokens is not None else make_tokens()
        self.tokens_file = workdir / "tokens.txt"
        env = serve_env(db_url, data_dir=workdir / "data", tick_seconds=tick_seconds,
                        stale_after_seconds=stale_after_seconds, heartbeat_seconds=heartbeat_seconds,
                        trusted_keys_dir=trusted_keys_dir, bootstrap_tokens_file=self.tokens_file, log_level="INFO",
                        TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
        if max_bundle_bytes is not None:
            env["KERNELCTL_MAX_BUNDLE_BYTES"] = str(max_bundle_bytes)
        super().__init__(workdir, {**env, **(extra_env or {})}, log_path=workdir / "server.log",
                         spawn=zygote.spawn if zygote is not None else popen_spawner)

    def _write_tokens(self) -> None:
        roles = {"operator": "operator", "viewer": "viewer", "enroll": "agent"}
        lines = [f"{roles.get(k, k)} test-{k} {v}" for k, v in self.tokens.items() if k in roles]
        self.tokens_file.write_text("\n".join(lines) + "\n")

    def start(self, *, wait_leader: bool = False, timeout: float = READY_TIMEOUT) -> ControllerProcess:  # type: ignore[override]
        self._write_tokens()
        super().start(timeout=timeout, leader=wait_leader)
        return self

    # -------------------------------------------------------------------------------- helpers
    def client(self, who: str | None = None, *, token: str | None = None, timeout: float = 30.0) -> httpx.Client:
        """An httpx client on the server with the bearer token of ``who`` (a key of ``tokens``) or ``token``."""
        tok = token if token is not None else (self.tokens[who] if who else None)
        headers = {"Authorization": f"Bearer {tok}"} if tok else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)


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


def inventory(arch: str = "sm_90", *, driver: str = "550.54.15", triton_version: str = "3.6.0",
              torch_version: str = "2.13.0", cuda: str = "12.4", labels: dict[str, str] | None = None) -> dict:
    """A node inventory (wire.Inventory as JSON) posing as a GPU of ``arch``."""
    return {
        "gpu_name": f"test {arch}", "compute_capability": "9.0" if arch == "sm_90" else "8.0", "arch": arch,
        "driver_version": driver, "cuda_version": cuda, "triton_version": triton_version,
        "torch_version": torch_version, "memory_total_mb": 81920, "labels": labels or {},
    }


def register_node(ctl: ControllerProcess, name: str, **inv: Any) -> httpx.Client:
    """Register a node with the enrollment token; return a client carrying its node token."""
    with ctl.client("enroll") as c:
        r = c.post("/v1/agents/register", json={"node_name": name, "inventory": inventory(**inv)})
        r.raise_for_status()
    return ctl.client(token=r.json()["node_token"])


def ok_report(key: str, trial: dict[str, Any], *, ratio: float = 1.0) -> dict[str, Any]:
    """A clean trial report answering a heartbeat's ``trial`` spec (latency ``ratio`` candidate/stable)."""
    import datetime as dt

    return {
        "idempotency_key": key, "rollout_id": trial["rollout_id"], "stratum": trial["stratum"],
        "candidate": trial["candidate"], "stable": trial["stable"], "outcome": "ok",
        "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(), "duration_s": 0.5,
        "latency": [{"op": "bias_gelu", "tokens": 8, "stable_s": 1e-4, "candidate_s": 1e-4 * ratio}],
        "numerics": [{"op": "bias_gelu", "dtype": "fp16", "shape": {"M": 8, "N": 64}, "max_abs_err": 1e-4,
                      "max_rel_err": 1e-3, "within_tolerance": True}],
    }
