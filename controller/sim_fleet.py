"""Fleet simulator (``kernelctl sim fleet``): thousands of simulated agents against a REAL controller.

It starts ``kernelctl serve`` as a subprocess on the given database (``--fresh``: a throw-away PostgreSQL
database created and dropped here), pushes signed bundles built with :mod:`kernelpack.build` (built once and
cached on disk), and runs N lightweight agents in one asyncio process over one pooled ``httpx.AsyncClient``.
Each agent speaks the real protocol of :mod:`kernelctl.wire`: register with the enrollment token, heartbeat
every ``heartbeat_seconds``, switch its active version the instant the heartbeat reply says so (and confirm
it with an immediate heartbeat), run a simulated trial when the reply carries a trial spec and send the
report batch with idempotency keys (kept in an in-memory outbox until acknowledged). Latencies come from
:mod:`controller.judge.noise`. A baseline (``llm-fused@1.0.0``) is made stable first; then the scenario's
candidate is rolled out and the run ends when every stratum is promoted or rolled back.

Measured: report throughput, client-side HTTP latency per endpoint, the judge tick time (scraped from
``/metrics``), false rollbacks, reports lost (acknowledged keys missing from the ``reports`` table) and the
time to rollback (first offending report sent -> the canary's heartbeat reports the stable version active
again), p50/p99/max over the canary nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import typer

from controller.sim_fleet_scenarios import (
    FLEET_KINDS,
    SCENARIOS,
    TRITON_VERSION,
    Scenario,
    get_scenario,
    stratum_of,
)
from kernelctl.procs import wait_port_file, wait_ready

BUNDLE = "llm-fused"
BASELINE = "1.0.0"
VERSIONS = ("1.0.0", "1.1.0", "1.2.0-fault.slow", "1.2.0-fault.drift")
REPO_ROOT = Path(__file__).resolve().parents[1]
NOISE_TICKS = 48  # simulated trials per node before the noise sequence wraps around
MAX_TRIALS_PER_ROUND = 8  # simulated trials an agent may run between two heartbeats


class SimError(RuntimeError):
    """The simulation could not run (controller would not start, database unreachable, ...)."""


# ------------------------------------------------------------------------------------------ config
@dataclass
class FleetConfig:
    nodes: int
    db_url: str
    scenario: Scenario
    fresh: bool = False
    duration_limit: float = 600.0
    heartbeat_seconds: float = 5.0
    tick_seconds: float = 1.0
    connections: int = 64
    margin_pct: float = 2.0
    seed: int = 0
    stale_after: float | None = None
    trial_interval: float | None = None  # seconds between simulated trials on a canary (default: heartbeat)
    work_dir: Path | None = None
    bundle_cache: Path | None = None

    @property
    def stale_after_seconds(self) -> float:
        return self.stale_after if self.stale_after is not None else max(3.0 * self.heartbeat_seconds, 15.0)

    def plan(self) -> dict[str, Any]:
        """The candidate's plan: a 25% canary step, then 100%, bakes of a few heartbeats."""
        hb = self.heartbeat_seconds
        deadline = max(120.0, self.duration_limit)
        return {
            "steps": [
                {"percent": 25, "bake_seconds": 3 * hb, "min_samples": 20, "deadline_seconds": deadline},
                {"percent": 100, "bake_seconds": 2 * hb, "min_samples": 20, "deadline_seconds": deadline},
            ],
            "latency_margin": self.margin_pct / 100.0,
            "max_fleet_share": 1.0,
            "max_label_share": 1.0,
            "trial_interval_seconds": self.trial_interval if self.trial_interval is not None else hb,
            "hold_verdict_seconds": 10 * hb,
        }


# ------------------------------------------------------------------------------------------ bundles
@dataclass
class SimBundles:
    trusted_dir: Path
    files: dict[str, Path]

    def digest(self, version: str) -> str:
        return hashlib.sha256(self.files[version].read_bytes()).hexdigest()


def default_bundle_cache() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("kernelctl")) / "sim-fleet-bundles"


def prepare_bundles(cache: Path) -> SimBundles:
    """Signed ``llm-fused`` bundles for the simulation, built once with kernelpack.build and cached.

    The simulated agents never run kernels, so each bundle holds one fused op (bias_gelu, compiled ahead of
    time for sm_80 and sm_90): same format, signature and verification as a full bundle, seconds to build.
    """
    from importlib.metadata import version as dist_version

    cache = Path(cache) / f"triton{dist_version('triton')}"
    trusted = cache / "trusted"
    files = {v: cache / f"{BUNDLE}-{v}.kpack" for v in VERSIONS}
    if trusted.is_dir() and all(f.exists() for f in files.values()):
        return SimBundles(trusted, files)
    import triton

    from kernelpack.build import build_bundle
    from kernelpack.signing import generate_keypair

    cache.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix="sim-bundles-", dir=cache))
    key = generate_keypair(stage / "keys")
    (stage / "trusted").mkdir()
    (stage / "trusted" / key.public_path.name).write_bytes(key.public_path.read_bytes())
    for v in VERSIONS:
        src = stage / f"src-{v}"
        src.mkdir()
        (src / "bundle.toml").write_text(
            f'schema_version = 1\nname = "{BUNDLE}"\nversion = "{v}"\nnote = "fleet simulator bundle {v}"\n\n'
            f'[targets]\narchs = ["sm_80", "sm_90"]\nmin_driver = "535"\ncuda = ["12.x", "13.x"]\n'
            f'triton = "{triton.__version__}"\ntorch = ">=2.9,<2.15"\n\n'
            '[traffic]\ndecode_batch_sizes = [1, 8]\nprefill_tokens = [64]\n\n'
            '[[kernels]]\nop = "bias_gelu"\nsource = "kernelpack.kernels.bias_gelu"\n')
        build_bundle(src, stage / files[v].name, key.private_path)
    # publish atomically-enough: files first, the trusted dir last (its presence marks a complete cache)
    for v in VERSIONS:
        os.replace(stage / files[v].name, files[v])
    if trusted.exists():
        import shutil

        shutil.rmtree(trusted)
    os.replace(stage / "trusted", trusted)
    return SimBundles(trusted, files)


# ------------------------------------------------------------------------------------------ database
@contextlib.contextmanager
def database(url: str, fresh: bool, work: Path):  # type: ignore[no-untyped-def]
    """Yield a migrated database URL: a fresh one (created and dropped here) or ``url`` itself, migrated."""
    from sqlalchemy.engine import make_url

    from controller.db import migrate
    from controller.db.engine import make_engine

    parsed = make_url(url)
    created: str | None = None
    if fresh and parsed.get_backend_name() == "postgresql":
        import psycopg

        name = f"kctl_sim_{uuid.uuid4().hex[:10]}"
        admin = parsed.set(drivername="postgresql").render_as_string(hide_password=False)
        try:
            with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
                conn.execute(f'CREATE DATABASE "{name}"')
        except psycopg.Error as exc:
            raise SimError(f"cannot create a fresh database on {parsed.render_as_string()}: {exc}") from None
        created, url = name, parsed.set(database=name).render_as_string(hide_password=False)
    elif fresh:
        url = f"sqlite:///{work / 'sim-fleet.db'}"
    engine = make_engine(url)
    try:
        migrate.upgrade(engine)
    finally:
        engine.dispose()
    try:
        yield url
    finally:
        if created is not None:
            import psycopg

            with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{created}" WITH (FORCE)')


def stored_report_keys(url: str) -> set[str]:
    from sqlalchemy import select

    from controller.db.engine import make_engine
    from controller.db.models import Report

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return set(conn.execute(select(Report.idempotency_key)).scalars())
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------------------ controller
def serve_command() -> list[str]:
    """``kernelctl serve`` (the root CLI when it mounts serve, else the controller's own CLI module)."""
    try:
        from kernelctl.cli import app

        names = {c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands}
        module = "kernelctl.cli" if "serve" in names else "controller.cli"
    except Exception:  # root CLI broken: fall back to the controller's own
        module = "controller.cli"
    return [sys.executable, "-m", module, "serve"]


class Controller:
    """One ``kernelctl serve`` subprocess; ``kill()`` is SIGKILL, ``start()`` again reuses the same port."""

    def __init__(self, db_url: str, work: Path, cfg: FleetConfig, trusted: Path, tokens: dict[str, str]) -> None:
        self.db_url, self.work, self.cfg, self.trusted, self.tokens = db_url, work, cfg, trusted, tokens
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log_path = work / "controller.log"
        self.tokens_file = work / "tokens.txt"
        self.tokens_file.write_text("".join(f"{role} sim-{k} {tok}\n" for k, (role, tok) in {
            "operator": ("operator", tokens["operator"]), "enroll": ("agent", tokens["enroll"])}.items()))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELCTL_")}
        env.update({
            "KERNELCTL_DATABASE_URL": self.db_url, "KERNELCTL_DATA_DIR": str(self.work / "data"),
            "KERNELCTL_TICK_SECONDS": str(self.cfg.tick_seconds),
            "KERNELCTL_HEARTBEAT_SECONDS": str(self.cfg.heartbeat_seconds),
            "KERNELCTL_STALE_AFTER_SECONDS": str(self.cfg.stale_after_seconds),
            "KERNELCTL_TRUSTED_KEYS_DIR": str(self.trusted),
            "KERNELCTL_BOOTSTRAP_TOKENS_FILE": str(self.tokens_file),
            "KERNELCTL_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
        })
        port_file = self.work / "port"
        port_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*serve_command(), "--host", "127.0.0.1", "--port", str(self.port), "--port-file", str(port_file)],
                cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        try:
            self.port = wait_port_file(port_file, self.proc, timeout)
            wait_ready(self.url, self.proc, timeout)
        except (RuntimeError, TimeoutError) as exc:
            self.kill()
            raise SimError(f"controller not ready: {exc}:\n{self.log_tail()}") from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log_tail(self, n: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-n:])


# ------------------------------------------------------------------------------------------ statistics
def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


class Stats:
    """Client-side measurements shared by all simulated agents."""

    def __init__(self) -> None:
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.acked: set[str] = set()  # report keys acknowledged with 200 (accepted or duplicate)
        self.refused: set[str] = set()  # keys answered 200 but refused (the node was no longer a canary, ...)
        self.sent_keys: set[str] = set()
        self.accepted = 0
        self.duplicates = 0
        self.first_report_at: float | None = None
        self.last_report_at: float | None = None
        self.first_offending: dict[str, float] = {}  # stratum -> monotonic time the first offending report was sent
        self.back_to_stable: dict[str, float] = {}  # node -> monotonic time its heartbeat reported stable again
        self.canary_strata: dict[str, str] = {}  # node -> stratum, every node that ever ran the candidate

    def observe(self, endpoint: str, seconds: float, status: int | str) -> None:
        self.latency[endpoint].append(seconds)
        if not (isinstance(status, int) and status < 400):
            self.errors[endpoint][str(status)] += 1


# ------------------------------------------------------------------------------------------ agents
@dataclass
class Agent:
    index: int
    name: str
    kind: tuple[str, str, str, str]
    token: str | None = None
    active: dict[str, Any] | None = None  # BundleRef as JSON
    staged: dict[str, dict[str, Any]] = field(default_factory=dict)
    outbox: list[dict[str, Any]] = field(default_factory=list)
    trials: int = 0
    next_trial_at: float = 0.0
    stopped: bool = False
    confirm: bool = False

    @property
    def stratum(self) -> str:
        return stratum_of(self.kind)

    def inventory(self) -> dict[str, Any]:
        arch, cc, driver, gpu = self.kind
        return {"gpu_name": gpu, "compute_capability": cc, "arch": arch, "driver_version": driver,
                "cuda_version": "12.4", "triton_version": TRITON_VERSION, "torch_version": "2.13.0",
                "memory_total_mb": 81920, "labels": {"cluster": f"sim-{self.index % 4}"}}


class Fleet:
    """The simulated agents and the loop that drives them."""

    def __init__(self, cfg: FleetConfig, client: httpx.AsyncClient, tokens: dict[str, str], stats: Stats,
                 candidate: str) -> None:
        self.cfg, self.client, self.tokens, self.stats, self.candidate = cfg, client, tokens, stats, candidate
        self.rng = np.random.default_rng(cfg.seed)
        self.agents = [Agent(i, f"sim-{i:05d}", FLEET_KINDS[i % len(FLEET_KINDS)]) for i in range(cfg.nodes)]
        from controller.judge.noise import simulate_reports

        noise = simulate_reports(self.rng, runs=1, ticks=NOISE_TICKS, nodes=cfg.nodes, log_effect=0.0)
        self.ratio = noise.ratio[0]  # (ticks, nodes) ln(candidate/stable) without the candidate's true effect
        self.stable = noise.stable[0]
        self.running = True
        self.gate = asyncio.Semaphore(cfg.connections)
        self.restart: dict[str, float] | None = None  # controller-restart scenario: when and how long
        self.fetched: set[str] = set()
        self.base_url = ""

    async def request(self, endpoint: str, method: str, path: str, token: str, **kw: Any) -> httpx.Response | None:
        """One agent request; its latency includes the wait for a pooled connection (what an agent sees)."""
        t0 = time.perf_counter()
        # At most ``connections`` requests enter httpx at once: its pool scans every waiter on each release,
        # which turns thousands of queued agents into quadratic CPU in the simulator (an asyncio.Semaphore
        # queue is O(1)).
        async with self.gate:
            try:
                r = await self.client.request(method, self.base_url + path,
                                              headers={"Authorization": f"Bearer {token}"}, **kw)
            except httpx.HTTPError as exc:
                self.stats.observe(endpoint, time.perf_counter() - t0, type(exc).__name__)
                return None
        self.stats.observe(endpoint, time.perf_counter() - t0, r.status_code)
        return r

    # ------------------------------------------------------------------------------ one agent
    async def run_agent(self, a: Agent, start_delay: float) -> None:
        await asyncio.sleep(start_delay)
        hb = self.cfg.heartbeat_seconds
        while self.running and a.token is None:
            r = await self.request("register", "POST", "/v1/agents/register", self.tokens["enroll"],
                                   json={"node_name": a.name, "inventory": a.inventory()})
            if r is not None and r.status_code == 200:
                a.token = r.json()["node_token"]
            else:
                await asyncio.sleep(hb * (0.5 + random.random()))
        while self.running and not a.stopped:
            started = time.monotonic()
            await self.heartbeat_round(a)
            if a.confirm and self.running and not a.stopped:  # switched: report the new active version now
                a.confirm = False
                await self.heartbeat_round(a)
            delay = hb - (time.monotonic() - started)
            await asyncio.sleep(max(0.05 * hb, delay))

    async def heartbeat_round(self, a: Agent) -> None:
        assert a.token is not None
        body = {"node_name": a.name, "staged": list(a.staged.values()), "active": [a.active] if a.active else []}
        r = await self.request("heartbeat", "POST", "/v1/agents/heartbeat", a.token, json=body)
        now = time.monotonic()
        if r is not None and r.status_code == 200:
            if a.active is not None and a.active["version"] != self.candidate and a.name in self.stats.canary_strata \
                    and a.name not in self.stats.back_to_stable:
                self.stats.back_to_stable[a.name] = now  # this heartbeat reported the stable version active
            for d in r.json().get("desired", []):
                if d["name"] == BUNDLE:
                    await self.apply(a, d)
        await self.flush(a)

    async def apply(self, a: Agent, desired: dict[str, Any]) -> None:
        want = desired["active"]  # None: a first version before its pre-serve trial passed (serve none)
        for ref in (want, desired.get("stable"), (desired.get("trial") or {}).get("candidate")):
            if ref is not None and ref["version"] not in a.staged:
                await self.fetch_once(a, ref)
                a.staged[ref["version"]] = ref
        if want is not None and (a.active is None or a.active["digest"] != want["digest"]):
            a.active = want  # both staged: switching is instant
            a.confirm = True
            if want["version"] == self.candidate and desired["role"] == "candidate":
                self.stats.canary_strata.setdefault(a.name, a.stratum)
        trial = desired.get("trial")
        if trial is not None and desired["role"] == "candidate":
            # one simulated trial per trial interval since the last one (at most MAX_TRIALS_PER_ROUND)
            interval = max(float(trial.get("interval_seconds") or 0), 0.05)
            now = time.monotonic()
            if a.next_trial_at == 0.0:
                a.next_trial_at = now
            n = 0
            while a.next_trial_at <= now and n < MAX_TRIALS_PER_ROUND:
                a.outbox.append(self.trial_report(a, trial))
                a.next_trial_at += interval
                n += 1
            if a.next_trial_at <= now:
                a.next_trial_at = now + interval

    async def fetch_once(self, a: Agent, ref: dict[str, Any]) -> None:
        """Download a version's bundle once for the whole simulated fleet (digest checked)."""
        if ref["version"] in self.fetched:
            return
        self.fetched.add(ref["version"])
        r = await self.request("bundle_content", "GET", f"/v1/bundles/{ref['name']}/{ref['version']}/content",
                               a.token or "")
        if r is None or r.status_code != 200 or hashlib.sha256(r.content).hexdigest() != ref["digest"]:
            self.fetched.discard(ref["version"])

    def trial_report(self, a: Agent, trial: dict[str, Any]) -> dict[str, Any]:
        import datetime as dt

        sc = self.cfg.scenario
        t = a.trials % NOISE_TICKS
        a.trials += 1
        faulty = trial["candidate"]["version"] == self.candidate  # the baseline's own trials are clean
        numeric_bad = faulty and a.stratum in sc.numeric_error_strata
        ratio = float(self.ratio[t, a.index]) + (sc.log_effect if faulty else 0.0)
        stable_s = 1e-4 * float(self.stable[t, a.index])
        offending = numeric_bad or (faulty and sc.log_effect > 0)
        key = f"sim-{a.name}-{a.trials}-{secrets.token_hex(4)}"
        report = {
            "idempotency_key": key, "rollout_id": trial["rollout_id"], "stratum": trial["stratum"],
            "candidate": trial["candidate"], "stable": trial["stable"],
            "outcome": "numeric_error" if numeric_bad else "ok",
            "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(), "duration_s": 0.5,
            "latency": [{"op": "bias_gelu", "tokens": 8, "stable_s": stable_s,
                         "candidate_s": stable_s * math.exp(ratio)}],
            "numerics": [{"op": "bias_gelu", "dtype": "fp16", "shape": {"M": 8, "N": 4096},
                          "max_abs_err": 0.5 if numeric_bad else 2e-4, "max_rel_err": 0.3 if numeric_bad else 1e-3,
                          "within_tolerance": not numeric_bad}],
            "detail": "simulated trial" + (" (numeric drift)" if numeric_bad else ""),
        }
        report["_offending"] = offending
        return report

    async def flush(self, a: Agent) -> None:
        if not a.outbox or a.token is None:
            return
        batch = [{k: v for k, v in r.items() if not k.startswith("_")} for r in a.outbox]
        now = time.monotonic()
        for r in a.outbox:
            self.stats.sent_keys.add(r["idempotency_key"])
            if r["_offending"]:
                self.stats.first_offending.setdefault(a.stratum, now)
        resp = await self.request("reports", "POST", "/v1/agents/reports", a.token,
                                  json={"node_name": a.name, "reports": batch})
        if resp is None or resp.status_code >= 500:
            return  # kept in the outbox: resent (same keys) with the next heartbeat
        if resp.status_code == 200:
            body = resp.json()
            self.stats.accepted += body["accepted"]
            self.stats.duplicates += body["duplicates"]
            refused = body.get("refused", {})  # late reports (not a canary any more, rollout over): not stored
            self.stats.refused.update(refused)
            self.stats.acked.update(r["idempotency_key"] for r in batch if r["idempotency_key"] not in refused)
            t = time.monotonic()
            self.stats.first_report_at = self.stats.first_report_at or t
            self.stats.last_report_at = t
        a.outbox.clear()  # 4xx: refused for good (counted as an error of the endpoint), never resent

    async def final_flush(self) -> None:
        await asyncio.gather(*(self.flush(a) for a in self.agents if a.outbox and not a.stopped))


# ------------------------------------------------------------------------------------------ orchestration
def _metric_histogram(text: str, name: str, must: str = "") -> dict[str, Any]:
    """count, sum and bucket counts of a Prometheus histogram (label sets containing ``must``, summed)."""
    count = total = 0.0
    buckets: dict[float, float] = defaultdict(float)
    for line in text.splitlines():
        if must and must not in line:
            continue
        if line.startswith(name + "_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[math.inf if le == "+Inf" else float(le)] += float(line.rsplit(" ", 1)[1])
    return {"count": count, "sum": total, "buckets": dict(sorted(buckets.items()))}


def _hist_quantile(h: dict[str, Any], q: float) -> float | None:
    if not h["count"]:
        return None
    target = q * h["count"]
    for le, c in h["buckets"].items():
        if c >= target:
            return le
    return None


class _Retryable(SimError):
    """409 (a concurrent writer, e.g. the tick) or 503: the operator call is retried."""


async def _op(client: httpx.AsyncClient, url: str, token: str, method: str, path: str, **kw: Any) -> Any:
    """An operator call; 409 conflicts and 503s are retried a few times (tenacity), other errors raise."""
    from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

    async for attempt in AsyncRetrying(retry=retry_if_exception_type(_Retryable), stop=stop_after_attempt(8),
                                       wait=wait_random_exponential(0.2, max=3), reraise=True):
        with attempt:
            r = await client.request(method, url + path, headers={"Authorization": f"Bearer {token}"}, timeout=60,
                                     **kw)
            if r.status_code in (409, 503):
                raise _Retryable(f"{method} {path} -> {r.status_code}: {r.text[:500]}")
            if r.status_code >= 400:
                raise SimError(f"{method} {path} -> {r.status_code}: {r.text[:500]}")
            return r.json()
    raise AssertionError("unreachable")  # pragma: no cover


async def _wait(pred, limit: float, what: str, period: float = 0.5) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit
    while not pred():
        if time.monotonic() > deadline:
            raise SimError(f"timed out after {limit:.0f}s waiting for {what}")
        await asyncio.sleep(period)


async def simulate(cfg: FleetConfig, ctl: Controller, bundles: SimBundles, tokens: dict[str, str],
                   db_url: str) -> dict[str, Any]:
    sc = cfg.scenario
    op = tokens["operator"]
    stats = Stats()
    t_start = time.monotonic()
    hard_deadline = t_start + cfg.duration_limit
    limits = httpx.Limits(max_connections=cfg.connections, max_keepalive_connections=cfg.connections)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(30.0, pool=60.0)) as client:
        for v in (BASELINE, sc.candidate):
            await _push(client, ctl.url, op, bundles.files[v])
        fleet = Fleet(cfg, client, tokens, stats, sc.candidate)
        fleet.base_url = ctl.url
        ramp = min(cfg.heartbeat_seconds, cfg.nodes / 400.0)
        tasks = [asyncio.create_task(fleet.run_agent(a, random.random() * ramp)) for a in fleet.agents]
        left = lambda: hard_deadline - time.monotonic()  # noqa: E731
        phases: dict[str, float] = {}
        detail: dict[str, Any] = {}
        rolled: set[str] = set()
        back: list[str] = []
        try:
            await _wait(lambda: all(a.token for a in fleet.agents), left(), "every agent to register")
            phases["register_s"] = time.monotonic() - t_start
            # baseline: 1.0.0 stable everywhere (operator promotes the whole fleet at once)
            base = await _op(client, ctl.url, op, "POST", "/v1/rollouts", json={
                "bundle": f"{BUNDLE}@{BASELINE}", "reason": "fleet simulator baseline",
                "plan": {"steps": [{"percent": 100, "bake_seconds": 0, "min_samples": 1}], "max_fleet_share": 1.0,
                         "max_label_share": 1.0}})
            await _op(client, ctl.url, op, "POST", f"/v1/rollouts/{base['id']}/promote",
                      json={"full": True, "reason": "fleet simulator baseline"})
            await _wait(lambda: all(a.active and a.active["version"] == BASELINE for a in fleet.agents), left(),
                        "the baseline to be active on every agent")
            phases["baseline_s"] = time.monotonic() - t_start - phases["register_s"]
            # the candidate
            t_roll = time.monotonic()
            ro = await _op(client, ctl.url, op, "POST", "/v1/rollouts", json={
                "bundle": f"{BUNDLE}@{sc.candidate}", "plan": cfg.plan(), "reason": f"fleet simulator: {sc.name}"})
            detail = await _run_rollout(cfg, ctl, fleet, client, op, ro["id"], hard_deadline)
            phases["rollout_s"] = time.monotonic() - t_roll
            # rolled-back strata: wait until every canary there reports the stable version again
            rolled = {s["stratum"] for s in detail.get("strata", []) if s["state"] == "rolled_back"}
            back = [n for n, s in stats.canary_strata.items() if s in rolled and not _agent(fleet, n).stopped]
            with contextlib.suppress(SimError):
                await _wait(lambda: all(n in stats.back_to_stable for n in back),
                            max(1.0, min(left(), 6 * cfg.heartbeat_seconds)), "canaries to report the stable version")
        except SimError as exc:
            if "timed out" not in str(exc):
                raise
            detail = {**detail, "timed_out": True, "aborted": str(exc)}  # measured so far, reported as a timeout
        finally:
            fleet.running = False
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await fleet.final_flush()
        metrics_text = (await client.get(ctl.url + "/metrics", timeout=30)).text
        nodes = await _op(client, ctl.url, op, "GET", "/v1/nodes")
    wall = time.monotonic() - t_start
    return _summarise(cfg, fleet, stats, detail, rolled, back, metrics_text, nodes, db_url, wall, phases)


async def _push(client: httpx.AsyncClient, url: str, token: str, path: Path) -> None:
    r = await client.post(url + "/v1/bundles", content=path.read_bytes(), timeout=120,
                          headers={"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"})
    if r.status_code not in (200, 201, 409):
        raise SimError(f"pushing {path.name} failed: {r.status_code} {r.text[:300]}")


def _agent(fleet: Fleet, name: str) -> Agent:
    return fleet.agents[int(name.rsplit("-", 1)[1])]


async def _run_rollout(cfg: FleetConfig, ctl: Controller, fleet: Fleet, client: httpx.AsyncClient, op: str,
                       rid: int, hard_deadline: float) -> dict[str, Any]:
    """Poll the rollout until every stratum is terminal; inject the scenario's faults on the way."""
    sc = cfg.scenario
    restarted = stopped = False
    t0 = time.monotonic()
    detail: dict[str, Any] = {}
    while True:
        if time.monotonic() > hard_deadline:
            detail["timed_out"] = True
            return detail
        try:
            t = time.perf_counter()
            r = await client.get(f"{ctl.url}/v1/rollouts/{rid}", headers={"Authorization": f"Bearer {op}"},
                                 timeout=30)
            fleet.stats.observe("rollout_status", time.perf_counter() - t, r.status_code)
            if r.status_code == 200:
                detail = r.json()
        except httpx.HTTPError:
            pass
        strata = detail.get("strata", [])
        if strata and all(s["state"] in ("promoted", "rolled_back") for s in strata):
            return detail
        reported = fleet.stats.accepted > 0
        if sc.stale_share and not stopped and reported:
            stopped = True
            rng = random.Random(cfg.seed)
            canaries = sorted(fleet.stats.canary_strata)
            victims = set(rng.sample(canaries, max(1, len(canaries) // 10))) if canaries else set()
            others = [a.name for a in fleet.agents if a.name not in victims]
            victims |= set(rng.sample(others, max(0, int(sc.stale_share * len(fleet.agents)) - len(victims))))
            for name in victims:
                _agent(fleet, name).stopped = True
            detail["stale_injected_at_s"] = round(time.monotonic() - t0, 2)
        if sc.restart_controller and not restarted and fleet.stats.accepted >= max(10, len(strata) * 5):
            restarted = True
            t_kill = time.monotonic()
            await asyncio.to_thread(ctl.kill)
            await asyncio.sleep(cfg.heartbeat_seconds)  # agents hit a dead controller for a whole heartbeat
            await asyncio.to_thread(ctl.start)
            fleet.restart = {"killed_at_s": round(t_kill - t0, 2), "down_s": round(time.monotonic() - t_kill, 2)}
        await asyncio.sleep(1.0)


def _summarise(cfg: FleetConfig, fleet: Fleet, stats: Stats, detail: dict[str, Any], rolled: set[str],
               back: list[str], metrics_text: str, nodes: list[dict[str, Any]], db_url: str, wall: float,
               phases: dict[str, float]) -> dict[str, Any]:
    sc = cfg.scenario
    stored = stored_report_keys(db_url)
    lost = sorted(stats.acked - stored)
    unacked = sorted(stats.sent_keys - stats.acked - stats.refused)
    strata = {s["stratum"]: s["state"] for s in detail.get("strata", [])}
    false_rb = sorted(s for s, st in strata.items() if st == "rolled_back" and sc.expected_state(s) != "rolled_back")
    ttr = [stats.back_to_stable[n] - stats.first_offending[s] for n, s in stats.canary_strata.items()
           if s in rolled and n in stats.back_to_stable and s in stats.first_offending]
    span = (stats.last_report_at or 0) - (stats.first_report_at or 0)
    tick = _metric_histogram(metrics_text, "kernelctl_tick_duration_seconds")
    http = {ep: {"count": len(v), "p50_ms": round(pct(v, 50) * 1000, 2), "p99_ms": round(pct(v, 99) * 1000, 2),
                 "errors": dict(stats.errors.get(ep, {}))} for ep, v in sorted(stats.latency.items()) if v}
    for ep, route in (("heartbeat", "/v1/agents/heartbeat"), ("reports", "/v1/agents/reports"),
                      ("register", "/v1/agents/register")):
        h = _metric_histogram(metrics_text, "kernelctl_http_request_duration_seconds", f'route="{route}"')
        if ep in http and h["count"]:
            http[ep]["server_mean_ms"] = round(h["sum"] / h["count"] * 1000, 2)
            q = _hist_quantile(h, 0.99)
            http[ep]["server_p99_le_ms"] = None if q is None else q * 1000
    stale_nodes = sum(1 for n in nodes if n.get("state") == "stale")
    stopped = sum(1 for a in fleet.agents if a.stopped)
    checks = {
        "finished": not detail.get("timed_out") and bool(strata),
        "strata_as_expected": bool(strata) and all(st == sc.expected_state(s) for s, st in strata.items()),
        "no_false_rollback": not false_rb,
        "no_report_lost": not lost,
        "rolled_back_canaries_back_on_stable": all(n in stats.back_to_stable for n in back),
    }
    if sc.stale_share:
        checks["stopped_agents_marked_stale"] = stale_nodes >= stopped > 0
    out: dict[str, Any] = {
        "scenario": sc.name, "nodes": cfg.nodes, "candidate": f"{BUNDLE}@{sc.candidate}",
        "heartbeat_seconds": cfg.heartbeat_seconds, "tick_seconds": cfg.tick_seconds,
        "connections": cfg.connections, "cpus": os.cpu_count(), "wall_s": round(wall, 2),
        "phases_s": {k: round(v, 2) for k, v in phases.items()},
        "rollout": {"id": detail.get("id"), "state": detail.get("state"), "strata": strata},
        "outcome": "timeout" if detail.get("timed_out") else detail.get("state"),
        "aborted": detail.get("aborted"),
        "false_rollbacks": false_rb,
        "reports": {"sent": len(stats.sent_keys), "acknowledged": len(stats.acked), "accepted": stats.accepted,
                    "duplicates": stats.duplicates, "stored": len(stored & stats.sent_keys),
                    "refused": len(stats.refused - stored), "lost": len(lost),
                    "lost_keys": lost[:20], "unacknowledged": len(unacked),
                    "throughput_per_s": round(stats.accepted / span, 1) if span > 0 else None},
        "http": http,
        "heartbeats_per_s": {"intended": round(cfg.nodes / cfg.heartbeat_seconds, 1),
                             "achieved": round(len(stats.latency.get("heartbeat", [])) / wall, 1) if wall else None},
        "tick": {"count": int(tick["count"]),
                 "mean_ms": round(tick["sum"] / tick["count"] * 1000, 2) if tick["count"] else None,
                 "p99_le_ms": (lambda q: None if q is None else q * 1000)(_hist_quantile(tick, 0.99))},
        "time_to_rollback_s": {"canaries": len(ttr), "p50": _r(pct(ttr, 50)), "p99": _r(pct(ttr, 99)),
                               "max": _r(max(ttr) if ttr else None)},
        "stale": {"agents_stopped": stopped, "nodes_stale": stale_nodes},
        "registered": sum(1 for a in fleet.agents if a.token),
        "checks": checks, "passed": all(checks.values()),
    }
    if fleet.restart is not None:
        out["controller_restart"] = fleet.restart
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def run_fleet(cfg: FleetConfig) -> dict[str, Any]:
    """Run one scenario end to end (controller process, database, agents); return the measurements."""
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kctl-sim-fleet-", dir=cfg.work_dir))
    bundles = prepare_bundles(cfg.bundle_cache or default_bundle_cache())
    t_bundles = time.monotonic()
    tokens = {k: f"kctl_sim_{k}_{secrets.token_urlsafe(24)}" for k in ("operator", "enroll")}
    with database(cfg.db_url, cfg.fresh, work) as url:
        t_db = time.monotonic()
        ctl = Controller(url, work, cfg, bundles.trusted_dir, tokens)
        ctl.start()
        t_ctl = time.monotonic()
        try:
            result = asyncio.run(simulate(cfg, ctl, bundles, tokens, url))
        except SimError as exc:
            raise SimError(f"{exc}\ncontroller log tail:\n{ctl.log_tail()}") from None
        finally:
            ctl.stop()
    result["setup_s"] = {"bundles": round(t_bundles - t0, 2), "database": round(t_db - t_bundles, 2),
                         "controller_start": round(t_ctl - t_db, 2)}
    result["controller_log"] = str(ctl.log_path)
    return result


# ------------------------------------------------------------------------------------------ CLI
def print_table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"fleet simulation: {res['scenario']} ({res['nodes']} nodes, heartbeat "
                    f"{res['heartbeat_seconds']:g}s, {res['cpus']} CPUs)")
    t.add_column("measure")
    t.add_column("value", justify="right")
    rep, ttr = res["reports"], res["time_to_rollback_s"]
    rows = [
        ("outcome", f"{res['outcome']}  {res['rollout']['strata']}"),
        ("checks", "PASS" if res["passed"] else "FAIL " + ", ".join(k for k, v in res["checks"].items() if not v)),
        ("false rollbacks", str(len(res["false_rollbacks"]))),
        ("reports sent / stored / lost", f"{rep['sent']} / {rep['stored']} / {rep['lost']}"),
        ("report throughput", f"{rep['throughput_per_s']} reports/s accepted"),
        ("judge tick (mean, p99 bucket)", f"{res['tick']['mean_ms']} ms, <= {res['tick']['p99_le_ms']} ms"),
        ("time to rollback p50/p99/max", f"{ttr['p50']} / {ttr['p99']} / {ttr['max']} s ({ttr['canaries']} canaries)"),
        ("wall", f"{res['wall_s']} s {res['phases_s']}"),
    ]
    for ep, h in res["http"].items():
        rows.append((f"HTTP {ep} p50/p99", f"{h['p50_ms']} / {h['p99_ms']} ms  n={h['count']} errors={h['errors']}"))
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)


def fleet_command(
    nodes: int = typer.Option(1000, "--nodes", min=1, max=100_000, help="Simulated agents."),
    db: str = typer.Option(..., "--db", help="Database URL (PostgreSQL: postgresql+psycopg://user@host:5432/db)."),
    scenario: str = typer.Option("healthy", "--scenario", help=f"One of: {', '.join(SCENARIOS)}."),
    fresh: bool = typer.Option(False, "--fresh", help="Create a throw-away database next to --db and drop it after."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    duration_limit: float = typer.Option(600.0, "--duration-limit", min=10, help="Give up after this many seconds."),
    heartbeat_seconds: float = typer.Option(5.0, "--heartbeat-seconds", min=0.2, help="Agent heartbeat period."),
    tick_seconds: float = typer.Option(1.0, "--tick-seconds", min=0.1, help="Controller judge tick period."),
    connections: int = typer.Option(64, "--connections", min=1, max=1024, help="HTTP connection pool size."),
    margin_pct: float = typer.Option(2.0, "--margin-pct", min=0.1, max=50, help="Allowed latency slow-down in %."),
    seed: int = typer.Option(0, "--seed", help="Random seed of the noise model."),
    stale_after: float | None = typer.Option(None, "--stale-after", min=1,
                                             help="Seconds without heartbeat before a node is stale "
                                                  "(default: max(3 heartbeats, 15 s))."),
    trial_interval: float | None = typer.Option(None, "--trial-interval", min=0.05,
                                                help="Seconds between simulated trials on a canary (default: the "
                                                     "heartbeat period; reports still go out once per heartbeat)."),
    bundle_cache: Path | None = typer.Option(None, "--bundle-cache",
                                             help="Where the signed simulation bundles are built once "
                                                  "(default: the user cache dir)."),
) -> None:
    """Drive N simulated agents against a real controller and database; print throughput, latency, TTR."""
    try:
        sc = get_scenario(scenario)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--scenario") from None
    if not db.startswith(("postgresql", "sqlite")):
        raise typer.BadParameter(f"unsupported database URL {db!r}: expected postgresql+psycopg://... or sqlite:///...",
                                 param_hint="--db")
    cfg = FleetConfig(nodes=nodes, db_url=db, scenario=sc, fresh=fresh, duration_limit=duration_limit,
                      heartbeat_seconds=heartbeat_seconds, tick_seconds=tick_seconds, connections=connections,
                      margin_pct=margin_pct, seed=seed, stale_after=stale_after,
                      bundle_cache=bundle_cache, trial_interval=trial_interval)
    try:
        res = run_fleet(cfg)
    except SimError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(res, indent=2))
    else:
        print_table(res)
    if not res["passed"]:
        raise typer.Exit(1)


def register(sim_app: typer.Typer) -> None:
    """Add ``fleet`` to the ``kernelctl sim`` sub-app."""
    sim_app.command("fleet")(fleet_command)


if __name__ == "__main__":  # pragma: no cover - ``python -m controller.sim_fleet fleet ...``
    _app = typer.Typer(no_args_is_help=True)

    @_app.callback()
    def _root() -> None:
        """Fleet simulator."""

    register(_app)
    _app()
