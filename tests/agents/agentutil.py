"""Run REAL ``kernelctl agent`` subprocesses for tests, and look at what they did."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, select

from agents.trial_spawn import is_trial_child
from controller.db.models import Report
from kernelctl.procs import kill, terminate

REPO_ROOT = Path(__file__).resolve().parents[2]

# CPU-light trials: one dtype, one fuzz shape, one round, no decoder block; decode batch 64 reaches the OOM
# fixture's threshold.
FAST_PROFILE = {"batch_sizes": [1, 64], "prefill_tokens": [], "rounds": 1, "fuzz_shapes": 1,
                "dtypes": ["fp32"], "e2e": False}


def agent_command() -> list[str]:
    """``kernelctl agent`` (the root CLI, cli/app.py)."""
    return [sys.executable, "-m", "cli.app", "agent"]


class AgentProcess:
    def __init__(self, workdir: Path, *, controller_url: str, token: str, trusted_keys: Path, node_name: str,
                 overrides: Path | None = None, profile: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.workdir = Path(workdir) / f"agent-{node_name}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cache_dir = self.workdir / "cache"
        self.runtime_dir = self.workdir / "runtime"
        self.controller_url = controller_url
        self.token = token
        self.trusted_keys = trusted_keys
        self.node_name = node_name
        self.overrides = overrides
        self.profile_path: Path | None = None
        if profile is not None:
            self.profile_path = self.workdir / "profile.json"
            self.profile_path.write_text(json.dumps(profile))
        self.extra_env = env or {}
        self.log_path = self.workdir / "agent.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> AgentProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELCTL_")}
        env.update({"PYTHONUNBUFFERED": "1", "KERNELCTL_AGENT_METRICS_PORT": "0", "KERNELCTL_TRIAL_DUTY_CYCLE": "1",
                    "KERNELCTL_LOG_LEVEL": "INFO", "KERNELCTL_DATA_DIR": str(self.workdir / "data")})
        env.update(self.extra_env)
        cmd = [*agent_command(), "--controller", self.controller_url, "--token", self.token,
               "--node-name", self.node_name, "--cache-dir", str(self.cache_dir),
               "--runtime-dir", str(self.runtime_dir), "--trusted-keys", str(self.trusted_keys)]
        if self.overrides is not None:
            cmd += ["--inventory-overrides", str(self.overrides)]
        if self.profile_path is not None:
            cmd += ["--profile", str(self.profile_path)]
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        log.write(b"\n===== start =====\n")
        log.flush()
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        return self

    def set_controller(self, url: str) -> None:
        self.controller_url = url

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait; returns the exit code (SIGKILL after ``timeout``)."""
        if self.proc is None:
            return None
        rc = terminate(self.proc, timeout)
        self.proc = None
        return rc

    def kill(self) -> None:
        """SIGKILL the agent process only (its trial child, if any, is its own process group)."""
        if self.proc is not None:
            kill(self.proc)
        self.proc = None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def trial_child_pids(self) -> list[int]:
        """Live trial child processes started for this agent (:func:`agents.trial_spawn.is_trial_child`)."""
        work_root = self.cache_dir / "trials"
        return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()
                and is_trial_child(int(d.name), work_root)]

    def __enter__(self) -> AgentProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_for(pred: Callable[[], Any], timeout: float, what: str, *, interval: float = 0.25,
             on_timeout: Callable[[], str] | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            extra = on_timeout() if on_timeout else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{extra}")
        time.sleep(interval)


def push_bundle(client: httpx.Client, path: Path) -> dict[str, Any]:
    r = client.post("/v1/bundles", content=path.read_bytes(),
                    headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    return r.json()


FAST_PLAN = {"steps": [{"nodes": 1, "bake_seconds": 0, "min_samples": 1, "deadline_seconds": 600}],
             "trial_rounds": 1, "trial_interval_seconds": 0}


def start_rollout(client: httpx.Client, ref: str, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    r = client.post("/v1/rollouts", json={"bundle": ref, "plan": plan or FAST_PLAN, "reason": "agent test"})
    assert r.status_code in (200, 201), r.text
    return r.json()


# keeps the canary step open (never enough samples to decide) so the agent keeps running trials
OPEN_PLAN = {"steps": [{"nodes": 1, "bake_seconds": 0, "min_samples": 100000, "deadline_seconds": 3600}],
             "trial_rounds": 1, "trial_interval_seconds": 0}
PROFILE = {**FAST_PROFILE, "batch_sizes": [1, 8]}


def outbox_counts(agent: AgentProcess) -> tuple[int, int, set[str]]:
    """(total, pending, keys) straight from the agent's outbox database."""
    db = sqlite3.connect(f"file:{agent.cache_dir / 'outbox.db'}?mode=ro", uri=True, timeout=10)
    try:
        keys = {r[0] for r in db.execute("SELECT idempotency_key FROM reports")}
        pending = db.execute("SELECT count(*) FROM reports WHERE sent_at IS NULL").fetchone()[0]
    finally:
        db.close()
    return len(keys), pending, keys


def db_keys(url: str, rid: int) -> list[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            return list(c.execute(select(Report.idempotency_key).where(Report.rollout_id == rid)).scalars())
    finally:
        engine.dispose()
