"""The replica's writes for agents, admitted and batched: group-committed registrations and version switches,
and the one-transaction heartbeat, each bounded (more waiting: 503 with ``Retry-After``).

* registrations: ``controller.enrollment.register_many`` per batch (``controller.group_commit``);
* switches: ``controller.switches.record_switches`` per batch (heartbeats whose news is a version switch);
* heartbeats that need the full transaction (``registry.heartbeat``: an inventory, a stale node back, a
  version or node the snapshot does not know): :meth:`Writers.slow`, one transaction each on the control lane's
  threads, queued up to ``max_queued_writes`` like the group commits instead of refused past
  ``max_pending_writes`` (at 10,000 nodes with a CPU hog 2,116 heartbeats of nodes marked stale coming back at
  once were answered 503 that way; group-committing them instead serialised them: 3 s per batch of 100, mean
  42 s; docs/benchmarks.md, issue 28);
* report batches: :meth:`Writers.ingest` (``controller.intake``), on their own lane (``controller.desired.lanes``)
  of threads or worker processes, at most ``max_pending_writes`` at once.

Everything but report ingest runs on the control lane's threads.

A batch the database aborted to break a lock cycle (with the liveness flush, the tick) is written again.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from sqlalchemy.orm import Session, sessionmaker

from controller import intake
from controller.auth import Principal
from controller.db.engine import retry_lock_cycles, session_scope
from controller.desired.generation import LAST_GENERATION, Patch, read_generation
from controller.desired.lanes import CONTROL_THREADS, INGEST_THREADS, Lane
from controller.enrollment import Registration, register_many
from controller.errors import Overloaded
from controller.group_commit import GroupCommit
from controller.registry import heartbeat
from controller.switches import Switch, Switched, record_switches
from kernelctl import wire

T = TypeVar("T")


class Writers:
    """The replica's agent writes and its two lanes of worker threads (``control`` is shared with the hub's
    reloads and liveness flushes)."""

    def __init__(self, factory: sessionmaker[Session], *, max_pending_writes: int = 64,
                 max_queued_writes: int = 16384, queue_deadline_seconds: float | None = None, metrics: Any = None,
                 ingest_processes: int = 0,
                 database_url: str = "", max_report_batch: int = 1000,
                 on_commit: Callable[[int, Patch], None] | None = None) -> None:
        self.factory = factory
        self.max_pending_writes = max_pending_writes
        self.metrics = metrics
        self.max_report_batch = max_report_batch
        self.on_commit = on_commit  # a report worker process's commits, told to this process's store
        self.control = Lane("writes", CONTROL_THREADS, max_queued_writes, metrics)  # full heartbeats
        self._processes = ingest_processes
        self._database_url = database_url
        self.reports = Lane("reports", INGEST_THREADS, max_pending_writes, metrics, executor=self._pool())
        # report batches parsed on the report lane are stored by one group commit (controller.intake.store_many)
        self.report_commits: GroupCommit[wire.ReportBatch] = GroupCommit(
            "reports", functools.partial(intake.store_many, factory), max_batch=256, max_queued=max_pending_writes,
            metrics=metrics, executor=ThreadPoolExecutor(1, thread_name_prefix="kctl-report-commit"))
        self.registrations: GroupCommit[Registration] = GroupCommit(
            "registrations", self._write_registrations, max_queued=max_queued_writes,
            deadline_seconds=queue_deadline_seconds, metrics=metrics, executor=self.control.executor)
        self.switches: GroupCommit[Switch] = GroupCommit(
            "switches", self._write_switches, max_queued=max_queued_writes,
            deadline_seconds=queue_deadline_seconds, metrics=metrics, executor=self.control.executor)

    def start(self) -> None:
        self.registrations.start()
        self.switches.start()
        self.report_commits.start()

    async def stop(self) -> None:
        await self.registrations.stop()
        await self.switches.stop()
        await self.report_commits.stop()
        self.report_commits.executor.shutdown(wait=False)  # type: ignore[union-attr]
        await asyncio.get_running_loop().run_in_executor(None, self.reports.shutdown, True)  # workers ended

    def close(self) -> None:
        """After :meth:`stop` and the hub's last flush: the control lane's threads end."""
        self.control.shutdown()

    @retry_lock_cycles
    def _write_registrations(self, items: list[Registration]) -> list[Any]:
        with session_scope(self.factory) as session:
            return register_many(session, items)

    @retry_lock_cycles
    def _write_switches(self, items: list[Switch]) -> list[tuple[Any, int | None]]:
        with session_scope(self.factory) as session:
            results = record_switches(session, items)
        gen = session.info.get(LAST_GENERATION) if any(isinstance(r, Switched) and r.changed for r in results) \
            else None
        return [(r, gen) for r in results]

    async def slow(self, fn: Callable[..., T], *args: Any) -> T:
        """A full heartbeat transaction on the control lane, refused with 503 + Retry-After only when
        ``max_queued_writes`` already wait."""
        return await self.control.run(fn, *args)

    def _pool(self) -> ProcessPoolExecutor | None:
        if not self._processes:
            return None
        pool = intake.worker_pool(self._processes, self._database_url, self.max_report_batch)
        intake.warm(pool, self._processes)
        return pool

    async def ingest(self, body: bytes, json_type: bool, principal: Principal) -> intake.Outcome:
        """A report request (``controller.intake.take``) on the report lane, refused with 503 + Retry-After when
        too many already wait: admission comes before the body is parsed."""
        if not self._processes:  # parsed on the report lane, stored by the group commit
            batch = await self.reports.run(intake.parse, body, json_type, principal, self.max_report_batch)
            if isinstance(batch, intake.Outcome):
                return batch
            try:
                return await self.report_commits.submit(batch)
            except Overloaded:
                raise
            except Exception as exc:  # the database failed it: answered where the reply is made, counted rejected
                return intake.Outcome(reports=len(batch.reports), error=exc)
        try:
            out = await self.reports.run(intake.take_in_worker, body, json_type, principal)
        except BrokenProcessPool:  # a worker died (killed, out of memory): nothing of this request was answered
            self.reports.executor = self._pool() or self.reports.executor
            raise Overloaded.busy("report worker process restarted; retry later") from None
        for generation, patch in out.patches:
            if self.on_commit is not None:
                self.on_commit(generation, patch)
        return out

    @retry_lock_cycles
    def heartbeat(self, req: wire.HeartbeatRequest, heartbeat_seconds: float) -> tuple[wire.HeartbeatResponse, int]:
        """(worker thread) ``registry.heartbeat`` in one transaction; the reply and a generation covering it."""
        with session_scope(self.factory) as session:
            reply = heartbeat(session, req, dt.datetime.now(dt.timezone.utc), heartbeat_seconds=heartbeat_seconds)
            session.info.pop(LAST_GENERATION, None)
            gen = read_generation(session)  # read last: every commit the reply saw is at or below it
        return reply, max(gen, int(session.info.get(LAST_GENERATION) or 0))
