"""The operator's side of a simulation, through :class:`kernelctl.opclient.AsyncOperatorClient`: push the
bundles, make the baseline stable everywhere, roll out the candidate, follow it to the end and inject the
scenario's faults (agents that stop heartbeating, a controller SIGKILLed and restarted) on the way."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import httpx

from kernelctl.opclient import AsyncOperatorClient, Conflict, OperatorClient, OperatorError
from kernelctl.procs import ServeProcess
from kernelctl.vocab import TERMINAL_STATES
from sim.fleet.agents import Fleet
from sim.fleet.config import BASELINE, BUNDLE, FleetConfig, SimError


def push(url: str, token: str, path: Path) -> None:
    """Register a bundle (already registered with the same bytes is fine)."""
    try:
        with OperatorClient(url, token, timeout=120) as api:
            api.push_bundle(path)
    except Conflict:
        pass
    except OperatorError as exc:
        raise SimError(f"pushing {path.name} failed: {exc}") from None


async def make_baseline_stable(api: AsyncOperatorClient) -> int:
    """Roll out the baseline and promote it on the whole fleet at once (the operator's ``promote --full``)."""
    base = await api.request("POST", "/v1/rollouts", retry=True, json={
        "bundle": f"{BUNDLE}@{BASELINE}", "reason": "fleet simulator baseline",
        "plan": {"steps": [{"percent": 100, "bake_seconds": 0, "min_samples": 1}], "max_fleet_share": 1.0,
                 "max_label_share": 1.0}})
    await api.request("POST", f"/v1/rollouts/{base['id']}/promote", retry=True,
                      json={"full": True, "reason": "fleet simulator baseline"})
    return int(base["id"])


async def start_candidate(api: AsyncOperatorClient, cfg: FleetConfig) -> int:
    sc = cfg.scenario
    ro = await api.request("POST", "/v1/rollouts", retry=True, json={
        "bundle": f"{BUNDLE}@{sc.candidate}", "plan": cfg.plan(), "reason": f"fleet simulator: {sc.name}"})
    return int(ro["id"])


async def follow_rollout(cfg: FleetConfig, ctl: ServeProcess, fleet: Fleet, api: AsyncOperatorClient, rid: int,
                         hard_deadline: float) -> dict[str, Any]:
    """Poll the rollout until every stratum is terminal; inject the scenario's faults on the way."""
    sc = cfg.scenario
    restarted = stopped = False
    t0 = time.monotonic()
    detail: dict[str, Any] = {}
    while True:
        if time.monotonic() > hard_deadline:
            detail["timed_out"] = True
            return detail
        t = time.perf_counter()
        try:
            detail = await api.request("GET", f"/v1/rollouts/{rid}", timeout=30)
            fleet.stats.observe("rollout_status", time.perf_counter() - t, 200)
        except (OperatorError, httpx.HTTPError) as exc:
            fleet.stats.observe("rollout_status", time.perf_counter() - t, type(exc).__name__)
        strata = detail.get("strata", [])
        if strata and all(s["state"] in TERMINAL_STATES for s in strata):
            return detail
        if sc.stale_share and not stopped and fleet.stats.accepted > 0:
            stopped = True
            rng = random.Random(cfg.seed)
            canaries = sorted(fleet.stats.canary_strata)
            victims = set(rng.sample(canaries, max(1, len(canaries) // 10))) if canaries else set()
            others = [a.name for a in fleet.agents if a.name not in victims]
            victims |= set(rng.sample(others, max(0, int(sc.stale_share * len(fleet.agents)) - len(victims))))
            for name in victims:
                fleet.agent(name).stopped = True
            detail["stale_injected_at_s"] = round(time.monotonic() - t0, 2)
        if sc.restart_controller and not restarted and fleet.stats.accepted >= max(10, len(strata) * 5):
            restarted = True
            t_kill = time.monotonic()
            await asyncio.to_thread(ctl.kill)
            await asyncio.sleep(min(cfg.heartbeat_seconds, 5.0))  # agents hit a dead controller meanwhile
            await asyncio.to_thread(ctl.start)
            fleet.restart = {"killed_at_s": round(t_kill - t0, 2), "down_s": round(time.monotonic() - t_kill, 2)}
        await asyncio.sleep(1.0)
