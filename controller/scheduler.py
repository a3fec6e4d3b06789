"""The controller's periodic work on APScheduler 3, done only while this replica is the leader.

Jobs (``max_instances=1``, ``coalesce=True``): ``leadership`` re-checks or takes the advisory lock every
``min(tick_seconds, 2)`` s so a standby takes over quickly; ``tick`` re-checks leadership and then runs
``controller.tick.run_tick`` (stale nodes, pending rollouts, verdicts, steps, deadlines) in one
transaction. A replica that loses leadership stops acting at once: the next job finds ``check()`` false.
Before each tick the replica's buffered liveness is flushed (``controller.desired.liveness``). The
leader keeps the judged evidence between its ticks (``controller.evidence.EvidenceCache``, only new reports are
read), rebuilt from scratch when leadership is (re)taken and after a failed tick; ``KERNELCTL_TICK_INCREMENTAL=0``
reads every report each tick. With ``KERNELCTL_NOTIFY_URLS`` set, a ``controller.notify.Notifier`` delivers webhooks from the changelog on
its own threads, only while leading.
"""

from __future__ import annotations

import datetime as dt
import logging
import time

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

from controller.api.deps import AppState
from controller.db.models import utcnow
from controller.evidence import EvidenceCache
from controller.notify import Notifier, parse_targets
from controller.tick import TickResult, run_tick

log = logging.getLogger(__name__)
LEADERSHIP_PERIOD_MAX = 2.0


def observe_tick(state: AppState, result: TickResult) -> None:
    """Feed one tick's decisions into the metrics (verdicts, rollbacks, time to rollback)."""
    m = state.metrics
    for gate, decision in result.decisions:
        m.verdicts.labels(gate, decision).inc()
    for rb in result.rolled_back:
        m.rollbacks.inc()
        if rb.time_to_rollback_seconds is not None:
            m.time_to_rollback.observe(max(0.0, rb.time_to_rollback_seconds))
    if result.stale_nodes:
        log.warning("%d node(s) marked stale: %s", len(result.stale_nodes), ", ".join(result.stale_nodes[:10]))
    for rb in result.rolled_back:
        log.warning("rollout %s rolled back in %s (gate %s)", rb.rollout_id, rb.stratum, rb.gate)


def _notifier(state: AppState) -> Notifier | None:
    """Webhook notifications from the changelog on their own threads (leader only; controller/notify.py)."""
    s = state.settings
    targets = parse_targets(s.notify_urls)
    if not targets:
        return None
    return Notifier(state.factory, targets, is_leader=lambda: state.elector.is_leader,
                    timeout=s.notify_timeout_seconds, attempts=s.notify_attempts, public_url=s.public_url)


class ControllerScheduler:
    """Leader-only periodic jobs of one controller process."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        s = state.settings
        self.scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(2)},
            job_defaults={"max_instances": 1, "coalesce": True, "misfire_grace_time": None},
            timezone=dt.timezone.utc,
        )
        self.scheduler.add_job(self.leadership, "interval", seconds=min(s.tick_seconds, LEADERSHIP_PERIOD_MAX),
                               id="leadership", next_run_time=dt.datetime.now(dt.timezone.utc))
        self.scheduler.add_job(self.tick, "interval", seconds=s.tick_seconds, id="tick")
        self.notifier = _notifier(state)
        self.evidence = EvidenceCache()
        self._evidence_for: float | None = None  # the leadership the cache was built under

    def start(self) -> None:
        self.scheduler.start()
        if self.notifier is not None:
            self.notifier.start()

    def shutdown(self) -> None:
        if self.notifier is not None:
            self.notifier.stop()
        self.scheduler.shutdown(wait=True)

    def leadership(self) -> None:
        self.state.elector.check()

    def tick(self) -> None:
        """One judge tick, only while leading (leadership re-checked first)."""
        if not self.state.elector.check():
            return
        started = time.perf_counter()
        try:
            self.state.hub.liveness.flush()  # liveness this replica holds reaches the database before staleness
            since = self.state.elector.leading_since
            settled = since is None or time.monotonic() - since >= self.state.settings.stale_after_seconds
            if since is None or since != self._evidence_for:  # a new leadership: nothing read before counts
                self.evidence.reset()
                self._evidence_for = since
            cache = self.evidence if self.state.settings.tick_incremental else None
            with self.state.tx() as session:
                result = run_tick(session, utcnow(), settings=self.state.settings, judge_staleness=settled,
                                  cache=cache)
            observe_tick(self.state, result)
        except Exception:
            self.evidence.reset()  # any doubt: the next tick reads everything again
            log.exception("judge tick failed (will retry next tick)")
        finally:
            self.state.metrics.tick_duration.observe(time.perf_counter() - started)
