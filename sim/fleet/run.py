"""Orchestration of one simulation: bundles, database, the controller process, the agents, the operator.

The agents run on uvloop when it is installed (it comes with ``uvicorn[standard]``), else on asyncio's loop;
the result's ``simulator`` entry is the simulator's own CPU (``RUSAGE_SELF``: the controller is a child
process) per request, so a run shows whether it measured the controller or itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import resource
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from kernelctl.opclient import AsyncOperatorClient, OperatorError
from kernelctl.procs import ServeError, ServeProcess, serve_env
from sim.fleet import operator
from sim.fleet.agents import Fleet, Stats
from sim.fleet.bundles import SimBundles, default_bundle_cache, prepare_bundles
from sim.fleet.config import BASELINE, FleetConfig, SimError, SimTimeout
from sim.fleet.database import database, stale_marks, stored_report_keys
from sim.fleet.report import pct, summarise

REGISTER_RAMP_PER_S = 400.0  # agents start over nodes / this many seconds (at most one heartbeat period)


def controller(cfg: FleetConfig, db_url: str, work: Path, trusted: Path, tokens: dict[str, str]) -> ServeProcess:
    """The ``kernelctl serve`` process of the run (kernelctl.procs, the one launcher; same port on restart)."""
    tokens_file = work / "tokens.txt"
    tokens_file.write_text(f"operator sim-operator {tokens['operator']}\nagent sim-enroll {tokens['enroll']}\n")
    env = serve_env(db_url, data_dir=work / "data", tick_seconds=cfg.tick_seconds,
                    heartbeat_seconds=cfg.heartbeat_seconds, stale_after_seconds=cfg.stale_after_seconds,
                    trusted_keys_dir=trusted, bootstrap_tokens_file=tokens_file, log_level="WARNING",
                    KERNELCTL_INGEST_PROCESSES=str(cfg.ingest_processes), KERNELCTL_API_WORKERS=str(cfg.api_workers))
    return ServeProcess(work, env, reuse_port=True)


async def _wait(pred, limit: float, what: str, period: float = 0.5) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit
    while not pred():
        if time.monotonic() > deadline:
            raise SimTimeout(f"timed out after {limit:.0f}s waiting for {what}")
        await asyncio.sleep(period)


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop if it is installed (a fraction of asyncio's CPU per socket event), else asyncio's (None)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


@contextlib.contextmanager
def lean_gc() -> Iterator[None]:
    """Less of the cyclic garbage collector while the agents run (restored after).

    What exists before (modules: the CLI imports the controller's whole stack) lives until the end, so it is
    frozen out of the full collections that would scan it again and again; and since every request allocates
    a few short-lived containers, young collections come every 10,000 allocations instead of 700 (the older
    generations' collections follow them). On a 1,000-node run the collector's CPU went from ~0.6 s to ~0.3 s
    (of ~3.6 s for the whole simulator).
    """
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(10_000, old[1], old[2])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class LoopLag:
    """How late the simulator's own event loop runs (a timer every 50 ms, its lateness recorded): the
    simulator measures itself, so that a latency it reports (decision -> stable is when an agent *processed*
    the reply) can be told apart from the simulator's own backlog on a busy machine."""

    PERIOD_S = 0.05

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (monotonic time, lateness in seconds)

    async def run(self) -> None:
        while True:
            due = time.monotonic() + self.PERIOD_S
            await asyncio.sleep(self.PERIOD_S)
            now = time.monotonic()
            self.samples.append((now, max(0.0, now - due)))

    def summary(self, since: float | None = None) -> dict[str, float | None]:
        lags = [lag * 1000 for t, lag in self.samples if since is None or t >= since]
        ms = lambda v: None if v is None else round(v, 1)  # noqa: E731
        return {"p50_ms": ms(pct(lags, 50)), "p99_ms": ms(pct(lags, 99)), "max_ms": ms(max(lags, default=None))}


async def simulate(cfg: FleetConfig, ctl: ServeProcess, bundles: SimBundles, tokens: dict[str, str],
                   db_url: str) -> dict[str, Any]:
    sc = cfg.scenario
    stats = Stats()
    t_start = time.monotonic()
    cpu0 = _cpu_s()
    lag = LoopLag()
    lag_task = asyncio.create_task(lag.run())
    t_roll: float | None = None
    hard_deadline = t_start + cfg.duration_limit
    for v in (BASELINE, sc.candidate):
        await asyncio.to_thread(operator.push, ctl.url, tokens["operator"], bundles.files[v])
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as op_http:
        api = AsyncOperatorClient(op_http, ctl.url, tokens["operator"])
        fleet = Fleet(cfg, tokens, stats, sc.candidate)
        fleet.base_url = ctl.url
        ramp = min(cfg.heartbeat_seconds, cfg.nodes / REGISTER_RAMP_PER_S)
        fleet.started = time.monotonic()
        tasks = [asyncio.create_task(fleet.run_agent(a, random.random() * ramp)) for a in fleet.agents]
        left = lambda: hard_deadline - time.monotonic()  # noqa: E731
        phases: dict[str, float] = {}
        detail: dict[str, Any] = {}
        rolled: set[str] = set()
        back: list[str] = []
        try:
            await _wait(lambda: all(a.token for a in fleet.agents), left(), "every agent to register")
            phases["register_s"] = time.monotonic() - t_start
            await operator.make_baseline_stable(api)
            await _wait(lambda: all(a.active and a.active.version == BASELINE for a in fleet.agents), left(),
                        "the baseline to be active on every agent")
            phases["baseline_s"] = time.monotonic() - t_start - phases["register_s"]
            t_roll = time.monotonic()
            rid = await operator.start_candidate(api, cfg)
            detail = await operator.follow_rollout(cfg, ctl, fleet, api, rid, hard_deadline)
            phases["rollout_s"] = time.monotonic() - t_roll
            # rolled-back strata: wait until every canary there runs the stable version again
            rolled = {s["stratum"] for s in detail.get("strata", []) if s["state"] == "rolled_back"}
            back = [n for n, s in stats.canary_strata.items() if s in rolled and not fleet.agent(n).stopped]
            with contextlib.suppress(SimError):
                await _wait(lambda: all(n in stats.back_to_stable for n in back),
                            max(1.0, min(left(), 30.0)), "canaries to switch back to the stable version")
            if sc.stale_share:  # the stopped agents turn stale within stale_after plus a tick or two
                stopped = {a.name for a in fleet.agents if a.stopped}
                deadline = time.monotonic() + min(left(), cfg.stale_after_seconds + 4 * cfg.tick_seconds + 10)
                while time.monotonic() < deadline:
                    nodes = await api.get_all("/v1/nodes", retry=True)
                    if stopped <= {n["name"] for n in nodes if n.get("state") == "stale"}:
                        break
                    await asyncio.sleep(1.0)
        except (SimError, OperatorError) as exc:
            if not isinstance(exc, SimTimeout):
                raise SimError(str(exc)) from None
            detail = {**detail, "timed_out": True, "aborted": str(exc)}  # measured so far, reported as a timeout
        finally:
            fleet.running = False
            lag_task.cancel()
            for t in tasks:
                t.cancel()
            for a in fleet.agents:
                if a.trial_task is not None:
                    a.trial_task.cancel()
            await asyncio.gather(lag_task, *tasks, *(a.trial_task for a in fleet.agents if a.trial_task),
                                 return_exceptions=True)
        await fleet.final_flush()
        await fleet.aclose()
        metrics_text = (await op_http.get(ctl.url + "/metrics", timeout=30)).text
        nodes = await api.get_all("/v1/nodes", retry=True)
    wall = time.monotonic() - t_start
    cpu = _cpu_s() - cpu0
    stored = await asyncio.to_thread(stored_report_keys, db_url)
    res = summarise(cfg, fleet, stats, detail, rolled, back, metrics_text, nodes, stored, wall, phases,
                    fleet.restart)
    res["stale"]["marked_during_run"] = await asyncio.to_thread(stale_marks, db_url)  # flapping, not only the end
    n = sum(len(v) for v in stats.latency.values())
    res["simulator"] = {"event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
                        "cpu_s": round(cpu, 2), "cpu_share": round(cpu / wall, 3) if wall else None,
                        "requests": n, "cpu_ms_per_request": round(cpu / n * 1000, 3) if n else None,
                        "connections_opened": fleet.http.opened if fleet.http else 0,
                        "retried_after_close": fleet.http.retried if fleet.http else 0,
                        "loop_lag": lag.summary(), "loop_lag_rollout": lag.summary(t_roll) if t_roll else None}
    return res


def run_fleet(cfg: FleetConfig) -> dict[str, Any]:
    """Run one scenario end to end (controller process, database, agents); return the measurements."""
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kctl-sim-fleet-", dir=cfg.work_dir))
    bundles = prepare_bundles(cfg.bundle_cache or default_bundle_cache())
    t_bundles = time.monotonic()
    tokens = {k: f"kctl_sim_{k}_{secrets.token_urlsafe(24)}" for k in ("operator", "enroll")}
    with database(cfg.db_url, cfg.fresh, work) as url:
        t_db = time.monotonic()
        ctl = controller(cfg, url, work, bundles.trusted_dir, tokens)
        try:
            ctl.start()
        except ServeError as exc:
            raise SimError(f"controller not ready: {exc}") from None
        t_ctl = time.monotonic()
        try:
            with lean_gc(), asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                result = runner.run(simulate(cfg, ctl, bundles, tokens, url))
        except SimError as exc:
            raise SimError(f"{exc}\ncontroller log tail:\n{ctl.log_tail()}") from None
        finally:
            ctl.stop()
    result["setup_s"] = {"bundles": round(t_bundles - t0, 2), "database": round(t_db - t_bundles, 2),
                         "controller_start": round(t_ctl - t_db, 2)}
    result["controller_log"] = str(ctl.log_path)
    return result
