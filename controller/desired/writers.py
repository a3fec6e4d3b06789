"""The replica's writes for agents, admitted and batched: group-committed registrations and version switches,
and the one-transaction heartbeat, each bounded (more waiting: 503 with ``Retry-After``).

* registrations: ``controller.enrollment.register_many`` per batch (``controller.group_commit``);
* switches: ``controller.switches.record_switches`` per batch (heartbeats whose news is a version switch);
* the full heartbeat transaction (``registry.heartbeat``): :meth:`Writers.slow`, at most ``max_pending_writes``
  at once;
* report batches: :meth:`Writers.ingest`, on their own lane (``controller.desired.lanes``), at most
  ``max_pending_writes`` at once.

Everything but report ingest runs on the control lane's threads.

A batch the database aborted to break a lock cycle (with the liveness flush, the tick) is written again.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.orm import Session, sessionmaker
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_random

from controller.db.engine import aborted_by_lock_cycle, session_scope
from controller.desired.generation import LAST_GENERATION, read_generation
from controller.desired.lanes import CONTROL_THREADS, INGEST_THREADS, Lane
from controller.enrollment import Registration, register_many
from controller.group_commit import GroupCommit
from controller.registry import heartbeat
from controller.switches import Switch, Switched, record_switches
from kernelctl import wire

GROUP_RETRY = retry(retry=retry_if_exception(aborted_by_lock_cycle), stop=stop_after_attempt(5),
                    wait=wait_random(0.01, 0.1), reraise=True)
T = TypeVar("T")


class Writers:
    """The replica's agent writes and its two lanes of worker threads (``control`` is shared with the hub's
    reloads and liveness flushes)."""

    def __init__(self, factory: sessionmaker[Session], *, max_pending_writes: int = 64,
                 max_queued_writes: int = 16384, metrics: Any = None) -> None:
        self.factory = factory
        self.max_pending_writes = max_pending_writes
        self.metrics = metrics
        self.control = Lane("writes", CONTROL_THREADS, max_pending_writes, metrics)
        self.reports = Lane("reports", INGEST_THREADS, max_pending_writes, metrics)
        self.registrations: GroupCommit[Registration] = GroupCommit(
            "registrations", self._write_registrations, max_queued=max_queued_writes, metrics=metrics,
            executor=self.control.executor)
        self.switches: GroupCommit[Switch] = GroupCommit(
            "switches", self._write_switches, max_queued=max_queued_writes, metrics=metrics,
            executor=self.control.executor)

    def start(self) -> None:
        self.registrations.start()
        self.switches.start()

    async def stop(self) -> None:
        await self.registrations.stop()
        await self.switches.stop()
        self.reports.shutdown()

    def close(self) -> None:
        """After :meth:`stop` and the hub's last flush: the control lane's threads end."""
        self.control.shutdown()

    @GROUP_RETRY
    def _write_registrations(self, items: list[Registration]) -> list[Any]:
        with session_scope(self.factory) as session:
            return register_many(session, items)

    @GROUP_RETRY
    def _write_switches(self, items: list[Switch]) -> list[tuple[Any, int | None]]:
        with session_scope(self.factory) as session:
            results = record_switches(session, items)
        gen = session.info.get(LAST_GENERATION) if any(isinstance(r, Switched) and r.changed for r in results) \
            else None
        return [(r, gen) for r in results]

    async def slow(self, fn: Callable[..., T], *args: Any) -> T:
        """A write on the control lane, refused with 503 + Retry-After when too many already wait."""
        return await self.control.run(fn, *args)

    async def ingest(self, fn: Callable[..., T], *args: Any) -> T:
        """Report work (parse, validate, store) on the report lane, refused with 503 + Retry-After when too many
        already wait: admission comes before the body is parsed."""
        return await self.reports.run(fn, *args)

    def heartbeat(self, req: wire.HeartbeatRequest, heartbeat_seconds: float) -> tuple[wire.HeartbeatResponse, int]:
        """(worker thread) ``registry.heartbeat`` in one transaction; the reply and a generation covering it."""
        with session_scope(self.factory) as session:
            reply = heartbeat(session, req, dt.datetime.now(dt.timezone.utc), heartbeat_seconds=heartbeat_seconds)
            session.info.pop(LAST_GENERATION, None)
            gen = read_generation(session)  # read last: every commit the reply saw is at or below it
        return reply, max(gen, int(session.info.get(LAST_GENERATION) or 0))
