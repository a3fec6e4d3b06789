"""The demo's fleet, a real kernelctl fleet on one machine: keys, signed bundles, a controller and agents.

Shared by ``kernelctl demo`` (CPU, agents posing as a heterogeneous fleet through inventory overrides)
and ``scripts/gpu-fleet`` (agents sharing a real GPU). Everything here is the production path: the
controller is ``kernelctl serve`` (uvicorn on loopback), agents are ``kernelctl agent`` processes, bundles
are built, signed, pushed over HTTP and verified by every agent before anything of them runs.
"""

from __future__ import annotations

import datetime as dt
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelctl.opclient import OperatorClient, OperatorError
from kernelctl.procs import ProcessGroup, ServeError, ServeProcess, kernelctl_args, serve_env
from kernelctl.vocab import TERMINAL_STATES

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

BUNDLES_DIR = Path(__file__).resolve().parents[1] / "kernelpack" / "bundles"


@dataclass(frozen=True)
class NodeSpec:
    """One agent process and the hardware it reports (overrides pose a CPU as a GPU node)."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class StratumEvidence:
    """What one stratum's canaries sent for a rollout so far: the trial reports in the changelog."""

    reports: int = 0  # trial reports received
    ok: int = 0  # of which clean (outcome ok): the judge's samples
    last_received: dt.datetime | None = None  # when the controller received the latest one (UTC)
    trial_s: list[float] = field(default_factory=list)  # every trial's duration (the report's), in arrival order

    @property
    def slowest_trial_s(self) -> float:
        return max(self.trial_s, default=0.0)


class FleetError(RuntimeError):
    """The local fleet could not be set up or did not behave (message says what and where the logs are)."""


class LocalFleet:
    """Owns a working directory with the database, keys, bundles, logs and every child process."""

    def __init__(self, workdir: Path, *, db_url: str | None = None, tick_seconds: float = 1.0,
                 heartbeat_seconds: float = 1.0, stale_after_seconds: float = 30.0,
                 extra_env: dict[str, str] | None = None, controller_env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.db_url = db_url or f"sqlite:///{workdir / 'kernelctl.db'}"
        self.keys_dir = workdir / "keys"
        self.trusted_dir = workdir / "trusted"
        self.bundle_dir = workdir / "bundles"
        self.procs = ProcessGroup(workdir / "logs")
        self.tick_seconds = tick_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.stale_after_seconds = stale_after_seconds
        self.extra_env = extra_env or {}
        self.controller_env = controller_env or {}  # only for the controller (e.g. KERNELCTL_NOTIFY_URLS)
        self.tokens = {role: f"kctl_{role}_{secrets.token_urlsafe(24)}" for role in ("operator", "viewer", "agent")}
        self.url = ""
        self._client: OperatorClient | None = None
        self._read_engine: Engine | None = None
        self.controller: ServeProcess | None = None

    # ------------------------------------------------------------------------------------ preparation
    def prepare_database(self) -> None:
        from controller.db import migrate
        from controller.db.engine import make_engine

        engine = make_engine(self.db_url)
        migrate.upgrade(engine)
        engine.dispose()

    def _reader(self) -> Engine:
        """A read-only engine on the changelog (opened once, closed by :meth:`stop`)."""
        if self._read_engine is None:
            from controller.db.engine import make_engine

            self._read_engine = make_engine(self.db_url, read_only=True)
        return self._read_engine

    def evidence(self, rollout_id: int) -> dict[str, StratumEvidence]:
        """The trial reports of ``rollout_id`` so far, per stratum (read from the changelog)."""
        from sqlalchemy import select

        from controller.db.engine import session_factory
        from controller.db.models import Report

        out: dict[str, StratumEvidence] = {}
        with session_factory(self._reader())() as session:
            rows = session.execute(select(Report.stratum, Report.outcome, Report.received_at, Report.detail)
                                   .where(Report.rollout_id == rollout_id).order_by(Report.id)).all()
        for stratum, outcome, received, detail in rows:
            e = out.setdefault(stratum, StratumEvidence())
            e.reports += 1
            e.ok += outcome == "ok"
            received = received if received.tzinfo else received.replace(tzinfo=dt.timezone.utc)
            e.last_received = max(e.last_received or received, received)
            e.trial_s.append(float((detail or {}).get("duration_s") or 0.0))
        return out

    def notification_counts(self) -> dict[str, int]:
        """How many webhook deliveries the controller recorded in the changelog, by outcome."""
        from sqlalchemy import func, select

        from controller.db.engine import make_engine, session_factory
        from controller.db.models import Event
        from controller.notify import DELIVERED, FAILED

        engine = make_engine(self.db_url, read_only=True)
        try:
            with session_factory(engine)() as session:
                rows = session.execute(select(Event.action, func.count()).where(
                    Event.action.in_((DELIVERED, FAILED))).group_by(Event.action)).all()
        finally:
            engine.dispose()
        counts = {a: int(n) for a, n in rows}
        return {"delivered": counts.get(DELIVERED, 0), "failed": counts.get(FAILED, 0)}

    def generate_key(self) -> Path:
        from kernelpack.scaffold import signing_keys

        return signing_keys(self.keys_dir, trusted=self.trusted_dir).pair.private_path

    def build_bundles(self, versions: list[str], key: Path, *, name: str = "llm-fused",
                      on_built: Callable[[str], None] | None = None,
                      aot_archs: list[str] | None = None) -> dict[str, Path]:
        """Build and sign ``versions``; ``aot_archs`` as in ``build_bundle`` (None: every target arch,
        []: source-only, for a fleet that runs kernels through Triton's interpreter)."""
        from kernelpack.build import build_bundle

        self.bundle_dir.mkdir(parents=True, exist_ok=True)
        out: dict[str, Path] = {}
        for version in versions:
            path = self.bundle_dir / f"{name}-{version}.kpack"
            build_bundle(BUNDLES_DIR / name / version, path, key, aot_archs=aot_archs)
            out[version] = path
            if on_built:
                on_built(version)
        return out

    # -------------------------------------------------------------------------------------- processes
    def start_controller(self) -> str:
        tokens_file = self.workdir / "bootstrap-tokens"
        tokens_file.write_text("".join(f"{role} demo-{role} {tok}\n" for role, tok in self.tokens.items()))
        tokens_file.chmod(0o600)
        env = serve_env(self.db_url, heartbeat_seconds=self.heartbeat_seconds,
                        stale_after_seconds=self.stale_after_seconds, tick_seconds=self.tick_seconds,
                        **self.extra_env, **self.controller_env)
        self.controller = ServeProcess(self.workdir / "controller", env, clean_env=False,
                                       log_path=self.procs.log_dir / "controller.log",
                                       args=["--trusted-keys", str(self.trusted_dir),
                                             "--bootstrap-tokens", str(tokens_file)])
        self.procs.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.url = self.controller.start()
        except ServeError as exc:
            raise FleetError(str(exc)) from None
        self.procs.adopt("controller", self.controller.proc)  # type: ignore[arg-type]
        return self.url

    def start_agent(self, node: NodeSpec, *, env: dict[str, str] | None = None) -> None:
        home = self.workdir / "agents" / node.name
        home.mkdir(parents=True, exist_ok=True)
        args = ["agent", "--controller", self.url, "--token", self.tokens["agent"], "--node-name", node.name,
                "--cache-dir", str(home / "cache"), "--runtime-dir", str(home / "runtime"),
                "--trusted-keys", str(self.trusted_dir), "--metrics-port", "0"]
        if node.overrides or node.labels:
            overrides = {**node.overrides, **({"labels": node.labels} if node.labels else {})}
            (home / "inventory.json").write_text(json.dumps(overrides, indent=2))
            args += ["--inventory-overrides", str(home / "inventory.json")]
        self.procs.start(f"agent-{node.name}", kernelctl_args(*args), {
            "KERNELCTL_DATA_DIR": str(home), **self.extra_env, **{k: "" for k in self.controller_env},
            **(env or {})})

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._read_engine is not None:
            self._read_engine.dispose()
            self._read_engine = None
        self.procs.stop_all()

    # ------------------------------------------------------------------------------------------- HTTP
    @property
    def client(self) -> OperatorClient:
        if self._client is None:
            self._client = OperatorClient(self.url, self.tokens["operator"])
        return self._client

    def api(self, method: str, path: str, **kw: Any) -> Any:
        try:
            return self.client.request(method, path, **kw)
        except OperatorError as exc:
            raise FleetError(str(exc)) from None

    def push(self, path: Path) -> dict[str, Any]:
        return self.api("POST", "/v1/bundles", content=path.read_bytes(),
                        headers={"Content-Type": "application/octet-stream"})

    def wait_nodes(self, count: int, timeout: float = 120.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        nodes: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            nodes = [n for n in self.api("GET", "/v1/nodes") if n.get("state") == "active"]
            if len(nodes) >= count:
                return nodes
            self.check_alive()
            time.sleep(0.5)
        raise FleetError(f"only {len(nodes)} of {count} agents registered within {timeout:.0f}s")

    def check_alive(self) -> None:
        """FleetError (with its log tail) when the controller or an agent has exited."""
        dead = [n for n, up in self.procs.alive().items() if not up]
        if dead:
            raise FleetError(f"{dead[0]} exited (log {self.procs.log_dir / dead[0]}.log):\n"
                             f"{self.procs.log_tail(dead[0])}")

    def start_rollout(self, ref: str, plan: dict[str, Any], reason: str) -> dict[str, Any]:
        return self.api("POST", "/v1/rollouts", json={"bundle": ref, "plan": plan, "reason": reason})

    def rollout(self, rollout_id: int) -> dict[str, Any]:
        return self.api("GET", f"/v1/rollouts/{rollout_id}")

    def wait_rollout(self, rollout_id: int, *, timeout: float,
                     on_update: Callable[[dict[str, Any]], None] | None = None,
                     poll: float = 0.5) -> dict[str, Any]:
        """Poll until the rollout is promoted or rolled back (or paused past ``timeout``)."""

        def update(detail: dict[str, Any]) -> None:
            if on_update:
                on_update(detail)
            if detail["state"] not in TERMINAL_STATES:
                self.check_alive()

        try:
            return self.client.wait_rollout(rollout_id, timeout=timeout, poll=poll, on_update=update)
        except OperatorError as exc:
            raise FleetError(str(exc)) from None
