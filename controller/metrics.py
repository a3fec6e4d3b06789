"""Prometheus metrics of the controller, on its own CollectorRegistry (no per-node labels).

Event metrics (counters, histograms) are updated where things happen; fleet gauges (rollouts by state,
nodes by arch/state, canaries per phase, step age) are read from the database at scrape time, so every replica reports the
same truth without a tick having to run.

Several API worker processes (``kernelctl serve --workers N``, controller.server): prometheus-client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set before the workers start): a scrape answered by any worker
shows the replica's sums over its workers (counters and histograms added up, ``kernelctl_leader`` the largest
of the workers', so 1 when one of them leads), and the fleet gauges once, read from the database.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from controller.db.models import Assignment, Node, Rollout, RolloutStratum
from controller.errors import first_line
from kernelctl.vocab import CANARY_PHASES, ROLLOUT_STATES

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ROLLBACK_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)


class _FleetCollector(Collector):
    """Gauges computed from the changelog at scrape time."""

    def __init__(self, factory: Callable[[], sessionmaker[Session] | None]) -> None:
        self._factory = factory

    def describe(self) -> list:  # type: ignore[override]
        return []  # collected lazily: do not query the DB at registration time

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rollouts = GaugeMetricFamily("kernelctl_rollouts", "Rollouts by state.", labels=["state"])
        nodes = GaugeMetricFamily("kernelctl_nodes", "Nodes by architecture and state.", labels=["arch", "state"])
        age = GaugeMetricFamily(
            "kernelctl_rollout_step_age_seconds", "Age of the oldest current step over progressing strata."
        )
        phases = GaugeMetricFamily(
            "kernelctl_canary_nodes", "Canary assignments by phase (trial before serve: staged, verified, serving).",
            labels=["phase"])
        factory = self._factory()
        if factory is None:
            return
        try:
            with factory() as session:
                by_state = dict(session.execute(select(Rollout.state, func.count()).group_by(Rollout.state)).all())
                for state in ROLLOUT_STATES:
                    rollouts.add_metric([state], float(by_state.get(state, 0)))
                for arch, state, n in session.execute(
                    select(Node.arch, Node.state, func.count()).group_by(Node.arch, Node.state)
                ).all():
                    nodes.add_metric([arch, state], float(n))
                by_phase = dict(session.execute(
                    select(Assignment.phase, func.count()).where(Assignment.rollout_id.is_not(None))
                    .group_by(Assignment.phase)).all())
                for phase in CANARY_PHASES:
                    phases.add_metric([phase], float(by_phase.get(phase, 0)))
                oldest = session.scalar(
                    select(func.min(RolloutStratum.step_started_at))
                    .join(Rollout, Rollout.id == RolloutStratum.rollout_id)
                    .where(RolloutStratum.state == "progressing", Rollout.state == "progressing")
                )
        except Exception as exc:  # the DB being down must not break /metrics
            log.warning("fleet metrics unavailable: %s", first_line(exc))
            return
        if oldest is not None:
            if oldest.tzinfo is None:
                oldest = oldest.replace(tzinfo=dt.timezone.utc)
            age.add_metric([], max(0.0, (dt.datetime.now(dt.timezone.utc) - oldest).total_seconds()))
        else:
            age.add_metric([], 0.0)
        yield rollouts
        yield nodes
        yield phases
        yield age


# the judge's rollback gates (controller.gates): hard gates, then memory, launches, latency (per cell and
# aggregate) and end-to-end
ROLLBACK_GATES = ("numeric", "mismatch", "crash", "oom", "hang", "compile", "load", "memory", "launches", "latency",
                  "e2e")


class Metrics:
    """All controller metrics on one registry; ``render()`` gives the Prometheus text."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.leader = Gauge("kernelctl_leader", "1 when this replica is the leader.", registry=r,
                            multiprocess_mode="max")  # one worker of the replica leads
        self.rollbacks = Counter("kernelctl_rollbacks_total", "Rollbacks decided (judge or operator).", registry=r)
        self.verdicts = Counter(
            "kernelctl_verdicts_total", "Judge verdicts by gate and decision.", ["gate", "decision"], registry=r
        )
        for gate in ROLLBACK_GATES:  # every gate's rollback series exists from the start (0 until it fires)
            self.verdicts.labels(gate, "rollback")
        self.time_to_rollback = Histogram(
            "kernelctl_time_to_rollback_seconds",
            "First failing report received -> rollback decision.",
            buckets=ROLLBACK_BUCKETS,
            registry=r,
        )
        self.reports_refused = Counter(
            "kernelctl_reports_refused_total",
            "Trial reports refused because they cannot count: not_canary (the node is not a current canary of "
            "that rollout) or rollout_not_live (the rollout or stratum is not progressing/paused).",
            ["reason"], registry=r,
        )
        self.reports_ingested = Counter(
            "kernelctl_reports_ingested_total",
            "Trial reports received, by ingestion outcome (accepted, duplicate, rejected).",
            ["outcome"],
            registry=r,
        )
        self.tick_duration = Histogram(
            "kernelctl_tick_duration_seconds", "Judge tick duration.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.http_duration = Histogram(
            "kernelctl_http_request_duration_seconds",
            "HTTP request duration by method, route template and status.",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # push of desired state (controller.desired): heartbeat time without the long-poll hold, reloads, batches
        self.heartbeat_service = Histogram(
            "kernelctl_heartbeat_service_seconds",
            "Heartbeat handling time excluding the watch (long-poll) hold, by path (fast: from the snapshot; "
            "slow: a transaction).", ["path"], buckets=LATENCY_BUCKETS, registry=r)
        self.heartbeat_full = Counter(
            "kernelctl_heartbeat_full_total",
            "Heartbeats that took the full transaction, by why the snapshot could not answer them "
            "(kernelctl.vocab.FullHeartbeat).", ["reason"], registry=r)
        self.heartbeat_catch_up = Histogram(
            "kernelctl_heartbeat_catch_up_seconds",
            "A heartbeat carrying a generation newer than this replica's snapshot: the wait for the snapshot to "
            "reach it (a watch's is part of its hold: nothing newer than what the node holds is known here).",
            ["watch"], buckets=LATENCY_BUCKETS, registry=r)
        self.desired_reload = Histogram(
            "kernelctl_desired_reload_seconds", "Reload of the desired-state snapshot after a generation moved.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.liveness_flushed = Counter(
            "kernelctl_liveness_flushed_total", "Heartbeat times written by the batched liveness flush.", registry=r)
        self.overload = Counter(
            "kernelctl_overload_total", "Requests answered 503 with Retry-After because too much work waited.",
            ["what"], registry=r)
        self.group_commit = Histogram(
            "kernelctl_group_commit_seconds", "One group-committed batch of writes (registrations, switches).",
            ["what"], buckets=LATENCY_BUCKETS, registry=r)
        self.group_commit_items = Histogram(
            "kernelctl_group_commit_items", "Requests written per group-committed batch.", ["what"],
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500), registry=r)
        self._factory: sessionmaker[Session] | None = None
        r.register(_FleetCollector(lambda: self._factory))
        self.leader.set(0)

    def bind_database(self, factory: sessionmaker[Session]) -> None:
        """Enable the scrape-time fleet gauges on this session factory."""
        self._factory = factory

    def render(self) -> bytes:
        """The Prometheus text: this process's registry, or with several worker processes (multiprocess mode)
        every worker's metrics merged from their files, plus the fleet gauges."""
        path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not path:
            return generate_latest(self.registry)
        merged = CollectorRegistry(auto_describe=False)
        multiprocess.MultiProcessCollector(merged, path)
        merged.register(_FleetCollector(lambda: self._factory))
        return generate_latest(merged)
