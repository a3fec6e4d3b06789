"""A real controller on this machine for simulators, benchmarks and tests: ``kernelctl serve`` through the one
launcher (:class:`kernelctl.procs.ServeProcess`) with bootstrap tokens, and sample wire documents (a node
inventory posing as a GPU, a clean trial report) to drive it over HTTP.

    tokens = make_tokens()                         # {"operator": ..., "viewer": ..., "enroll": ...}
    with LocalController(db_url, workdir, tokens=tokens, trusted_keys_dir=keys) as ctl:
        ctl.client("operator").post("/v1/rollouts", json=...)
        node = register_node(ctl, "node-1")        # an httpx client carrying the node's token
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
from pathlib import Path
from typing import Any

import httpx

from kernelctl.procs import ServeProcess, Spawner, popen_spawner, serve_env

READY_TIMEOUT = 60.0


def make_tokens() -> dict[str, str]:
    """Fresh bootstrap tokens: operator, viewer and an agent enrollment token (``enroll``)."""
    return {k: f"kctl_test_{k}_{secrets.token_urlsafe(24)}" for k in ("operator", "viewer", "enroll")}


class LocalController(ServeProcess):
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
        spawn: Spawner = popen_spawner,
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
                         spawn=spawn)

    def _write_tokens(self) -> None:
        roles = {"operator": "operator", "viewer": "viewer", "enroll": "agent"}
        lines = [f"{roles.get(k, k)} test-{k} {v}" for k, v in self.tokens.items() if k in roles]
        self.tokens_file.write_text("\n".join(lines) + "\n")

    def start(self, *, wait_leader: bool = False, timeout: float = READY_TIMEOUT) -> LocalController:  # type: ignore[override]
        self._write_tokens()
        super().start(timeout=timeout, leader=wait_leader)
        return self

    # -------------------------------------------------------------------------------- helpers
    def client(self, who: str | None = None, *, token: str | None = None, timeout: float = 30.0) -> httpx.Client:
        """An httpx client on the server with the bearer token of ``who`` (a key of ``tokens``) or ``token``."""
        tok = token if token is not None else (self.tokens[who] if who else None)
        headers = {"Authorization": f"Bearer {tok}"} if tok else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)


def inventory(arch: str = "sm_90", *, driver: str = "550.54.15", triton_version: str = "3.6.0",
              torch_version: str = "2.13.0", cuda: str = "12.4", labels: dict[str, str] | None = None) -> dict:
    """A node inventory (``kernelctl.wire.Inventory`` as JSON) posing as a GPU of ``arch``."""
    return {
        "gpu_name": f"test {arch}", "compute_capability": "9.0" if arch == "sm_90" else "8.0", "arch": arch,
        "driver_version": driver, "cuda_version": cuda, "triton_version": triton_version,
        "torch_version": torch_version, "memory_total_mb": 81920, "labels": labels or {},
    }


def register_node(ctl: LocalController, name: str, **inv: Any) -> httpx.Client:
    """Register a node with the enrollment token; return a client carrying its node token."""
    with ctl.client("enroll") as c:
        r = c.post("/v1/agents/register", json={"node_name": name, "inventory": inventory(**inv)})
        r.raise_for_status()
    return ctl.client(token=r.json()["node_token"])


def ok_report(key: str, trial: dict[str, Any], *, ratio: float = 1.0) -> dict[str, Any]:
    """A clean trial report answering a heartbeat's ``trial`` spec (latency ``ratio`` candidate/stable)."""
    return {
        "idempotency_key": key, "rollout_id": trial["rollout_id"], "stratum": trial["stratum"],
        "candidate": trial["candidate"], "stable": trial["stable"], "outcome": "ok",
        "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(), "duration_s": 0.5,
        "latency": [{"op": "bias_gelu", "tokens": 8, "stable_s": 1e-4, "candidate_s": 1e-4 * ratio}],
        "numerics": [{"op": "bias_gelu", "dtype": "fp16", "shape": {"M": 8, "N": 64}, "max_abs_err": 1e-4,
                      "max_rel_err": 1e-3, "within_tolerance": True}],
    }
