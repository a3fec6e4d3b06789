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
* report batches: :meth:`Writers.ingest` (``controller.intake``), group-committed too (``report_commits``, up to
  ``max_pending_writes`` waiting): parsed on their own lane of threads (``controller.desired.lanes``, at most
  ``max_pending_writes`` at once) and stored by one commit thread, or with ``ingest_processes = N`` parsed and
  stored in worker processes, the requests waiting together sent as one group to a worker, N groups at once
  (a worker that died: the pool recreated, its group answered 503).

Everything but report ingest runs on the control lane's threads.

A batch the database aborted to break a lock cycle (with the liveness flush, the tick) is written again.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import threading
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
        self.reports = Lane("reports", INGEST_THREADS, max_pending_writes, metrics)
        self.report_commits: GroupCommit[Any]
        if not ingest_processes:  # parsed on the report lane, stored by one group commit (intake.store_many)
            self.report_commits = GroupCommit(
                "reports", functools.partial(intake.store_many, factory), max_batch=256, max_queued=max_pending_writes,
                metrics=metrics, executor=ThreadPoolExecutor(1, thread_name_prefix="kctl-report-commit"))
        else:  # a group of requests to each worker process: parsed and stored there (intake.take_many_in_worker)
            self._workers = self._pool()
            self._workers_lock = threading.Lock()
            # groups of at most max_pending_writes / N: the N groups in the workers hold no more than the queue may
            self.report_commits = GroupCommit(
                "reports", self._take_in_workers, max_batch=max(1, max_pending_writes // ingest_processes),
                max_queued=max_pending_writes, metrics=metrics,
                executor=ThreadPoolExecutor(ingest_processes, thread_name_prefix="kctl-report-commit"),
                concurrency=ingest_processes)
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
        self.reports.shutdown()
        if self._processes:  # the worker processes have ended when this returns
            await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(self._workers.shutdown, wait=True, cancel_futures=True))

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

    def _pool(self) -> ProcessPoolExecutor:
        pool = intake.worker_pool(self._processes, self._database_url, self.max_report_batch)
        intake.warm(pool, self._processes)
        return pool

    def _take_in_workers(self, requests: list[intake.Request]) -> list[intake.Outcome | Exception]:
        """(report commit thread) a group of report requests to one worker process (``intake.take_many_in_worker``:
        parsed and stored there in one transaction); the patches its commits declared are told to this process's
        store before the requests are answered. A worker that died (killed, out of memory) breaks the pool:
        it is recreated once and the group answered 503 busy (nothing of it was answered)."""
        pool = self._workers
        try:
            outs, patches = pool.submit(intake.take_many_in_worker, requests).result()
        except BrokenProcessPool:
            with self._workers_lock:
                if self._workers is pool:
                    self._workers = self._pool()
            return [Overloaded.busy("report worker process restarted; retry later") for _ in requests]
        if self.on_commit is not None:
            for generation, patch in patches:
                self.on_commit(generation, patch)
        return outs

    async def ingest(self, body: bytes, json_type: bool, principal: Principal) -> intake.Outcome:
        """A report request (``controller.intake``), refused with 503 + Retry-After when too many already wait:
        admission comes before the body is parsed. Without worker processes it is parsed on the report lane
        (at most ``max_pending_writes`` at once), then stored by the group commit (as many more waiting);
        with them the group commit sends the requests waiting together to a worker process (``max_pending_writes``
        waiting, a group of at most ``max_pending_writes / N`` per worker process at once)."""
        if self._processes:  # parsed and stored in a worker process, the requests waiting together in one group
            return await self.report_commits.submit((body, json_type, principal))  # type: ignore[no-any-return]
        batch = await self.reports.run(intake.parse, body, json_type, principal, self.max_report_batch)
        if isinstance(batch, intake.Outcome):
            return batch
        try:
            return await self.report_commits.submit(batch)  # type: ignore[no-any-return]
        except Overloaded:
            raise
        except Exception as exc:  # the database failed it: answered where the reply is made, counted rejected
            return intake.Outcome(reports=len(batch.reports), error=exc)

    @retry_lock_cycles
    def heartbeat(self, req: wire.HeartbeatRequest, heartbeat_seconds: float) -> tuple[wire.HeartbeatResponse, int]:
        """(worker thread) ``registry.heartbeat`` in one transaction; the reply and a generation covering it."""
        with session_scope(self.factory) as session:
            reply = heartbeat(session, req, dt.datetime.now(dt.timezone.utc), heartbeat_seconds=heartbeat_seconds)
            session.info.pop(LAST_GENERATION, None)
            gen = read_generation(session)  # read last: every commit the reply saw is at or below it
        return reply, max(gen, int(session.info.get(LAST_GENERATION) or 0))
