"""Settings of one fleet simulation and the candidate's plan."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.fleet.scenarios import Scenario

BUNDLE = "llm-fused"
BASELINE = "1.0.0"
VERSIONS = ("1.0.0", "1.1.0", "1.2.0-fault.slow", "1.2.0-fault.drift")
NOISE_TICKS = 48  # simulated trials per node before the noise sequence wraps around
DEFAULT_HEARTBEAT_S = 15.0  # the controller's default (kernelctl.settings.Settings.heartbeat_seconds)
REPORTS_PER_S_TARGET = 50.0  # default trial interval: the whole fleet trials at about this rate


class SimError(RuntimeError):
    """The simulation could not run (controller would not start, database unreachable, ...)."""


class SimTimeout(SimError):
    """A wait of the simulation ran out of time (reported as a timeout with what was measured so far)."""


@dataclass
class FleetConfig:
    nodes: int
    db_url: str
    scenario: Scenario
    fresh: bool = False
    duration_limit: float = 600.0
    heartbeat_seconds: float = DEFAULT_HEARTBEAT_S
    tick_seconds: float = 1.0
    connections: int = 64
    margin_pct: float = 2.0
    seed: int = 0
    stale_after: float | None = None
    trial_interval: float | None = None  # seconds between simulated trials on a canary
    work_dir: Path | None = None
    bundle_cache: Path | None = None
    report_kb: tuple[float, float] = (6.0, 46.0)  # report sizes drawn per agent (a real agent's on CPU)
    download_per_agent: bool = True  # every canary downloads the bundle itself (False: once for the fleet)
    lost_reply_share: float = 0.02  # registration replies lost on purpose (the retry must get the same node)
    ingest_processes: int = 0  # the controller's report worker processes (KERNELCTL_INGEST_PROCESSES; 0: threads)
    api_workers: int = 1  # the controller's API worker processes (KERNELCTL_API_WORKERS; PostgreSQL only past 1)

    @property
    def stale_after_seconds(self) -> float:
        return self.stale_after if self.stale_after is not None else max(3.0 * self.heartbeat_seconds, 15.0)

    @property
    def trial_interval_seconds(self) -> float:
        """Default: the heartbeat period, longer on a large fleet so the fleet sends ~50 reports/s at most."""
        if self.trial_interval is not None:
            return self.trial_interval
        return max(self.heartbeat_seconds, self.nodes / REPORTS_PER_S_TARGET)

    def plan(self) -> dict[str, Any]:
        """The candidate's plan: a 25% canary step, then 100%, bakes of a few (at most 5 s) heartbeats."""
        hb = min(self.heartbeat_seconds, 5.0)
        deadline = max(120.0, self.duration_limit)
        return {
            "steps": [
                {"percent": 25, "bake_seconds": 3 * hb, "min_samples": 20, "deadline_seconds": deadline},
                {"percent": 100, "bake_seconds": 2 * hb, "min_samples": 20, "deadline_seconds": deadline},
            ],
            "latency_margin": self.margin_pct / 100.0,
            "max_fleet_share": 1.0,
            "max_label_share": 1.0,
            "trial_interval_seconds": self.trial_interval_seconds,
            "hold_verdict_seconds": 10 * hb,
        }
