"""The replica's writes for agents, admitted and batched: group-committed registrations and version switches,
and the one-transaction heartbeat, each bounded (more waiting: 503 with ``Retry-After``).

* registrations: ``controller.enrollment.register_many`` per batch (``controller.group_commit``);
* switches: ``controller.switches.record_switches`` per batch (heartbeats whose news is a version switch);
* the full heartbeat transaction (``registry.heartbeat``) and report batches: :meth:`Writers.slow`, in a worker
  thread, at most ``max_pending_writes`` at once.

A batch the database aborted to break a lock cycle (with the liveness flush, the tick) is written again.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import random
from typing import Any

from sqlalchemy.orm import Session, sessionmaker
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_random

from controller.db.engine import aborted_by_lock_cycle, session_scope
from controller.desired.generation import LAST_GENERATION, read_generation
from controller.enrollment import Registration, register_many
from controller.errors import Overloaded
from controller.group_commit import GroupCommit
from controller.registry import heartbeat
from controller.switches import Switch, Switched, record_switches
from kernelctl import wire

GROUP_RETRY = retry(retry=retry_if_exception(aborted_by_lock_cycle), stop=stop_after_attempt(5),
                    wait=wait_random(0.01, 0.1), reraise=True)


def retry_after() -> float:
    return round(1.0 + 4.0 * random.random(), 1)


class Writers:
    def __init__(self, factory: sessionmaker[Session], *, max_pending_writes: int = 64,
                 max_queued_writes: int = 16384, metrics: Any = None) -> None:
        self.factory = factory
        self.max_pending_writes = max_pending_writes
        self.metrics = metrics
        self._pending = 0
        self.registrations: GroupCommit[Registration] = GroupCommit(
            "registrations", self._write_registrations, max_queued=max_queued_writes, metrics=metrics)
        self.switches: GroupCommit[Switch] = GroupCommit(
            "switches", self._write_switches, max_queued=max_queued_writes, metrics=metrics)

    def start(self) -> None:
        self.registrations.start()
        self.switches.start()

    async def stop(self) -> None:
        await self.registrations.stop()
        await self.switches.stop()

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

    async def slow(self, fn: Any, *args: Any) -> Any:
        """Run a write in a worker thread, refusing with 503 + Retry-After when too many already wait."""
        if self._pending >= self.max_pending_writes:
            if self.metrics is not None:
                self.metrics.overload.labels("writes").inc()
            raise Overloaded(f"controller busy: {self._pending} writes waiting; retry later", retry_after())
        self._pending += 1
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            self._pending -= 1

    def heartbeat(self, req: wire.HeartbeatRequest, heartbeat_seconds: float) -> tuple[wire.HeartbeatResponse, int]:
        """(worker thread) ``registry.heartbeat`` in one transaction; the reply and a generation covering it."""
        with session_scope(self.factory) as session:
            reply = heartbeat(session, req, dt.datetime.now(dt.timezone.utc), heartbeat_seconds=heartbeat_seconds)
            session.info.pop(LAST_GENERATION, None)
            gen = read_generation(session)  # read last: every commit the reply saw is at or below it
        return reply, max(gen, int(session.info.get(LAST_GENERATION) or 0))
