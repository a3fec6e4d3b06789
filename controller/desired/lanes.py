"""The replica's worker threads, by lane: the control plane never waits behind report ingest.

Blocking work leaves the event loop for a worker thread. With one shared pool (asyncio's default executor:
``min(32, cores + 4)`` threads, six on two cores) the up to 64 report transactions admitted at once queued in
front of the group commit of the heartbeats' version switches and the snapshot reloads that watches wait for:
at 1,000 nodes a switch heartbeat took 1.4 s on average at the server, a report waited 0.2 s (p50) to 1 s (p99)
for a thread (docs/benchmarks.md, issue 28). Two lanes, each its own pool:

* ``control``: group commits (registrations, switches), heartbeats that need the full transaction (admitted
  up to ``max_queued_writes``, like the group commits' queues), snapshot reloads and liveness flushes;
* ``reports``: report batches' parse and validation (their transaction is the report group commit's), few
  threads (they are CPU work under one GIL: more threads only take turns); with report worker processes
  they are parsed there instead (``controller.intake``) and this lane is idle.

A lane's :meth:`Lane.run` (report batches) admits at most ``max_pending`` calls at once (running or waiting for a thread); one more is refused with
:class:`~controller.errors.Overloaded` (503 and Retry-After; agents back off with jitter and keep what they
sent).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

from controller.errors import Overloaded

T = TypeVar("T")
CONTROL_THREADS = 8  # group commits (2), a reload, a liveness flush, and full heartbeat transactions
INGEST_THREADS = 2  # report batches: parsing and ORM work hold the GIL, so more threads only queue for it


class Lane:
    """One pool of worker threads with admission (see the module docstring)."""

    def __init__(self, name: str, threads: int, max_pending: int, metrics: Any = None,
                 executor: Executor | None = None) -> None:
        self.name = name
        self.max_pending = max_pending
        self.metrics = metrics
        self.executor = executor or ThreadPoolExecutor(threads, thread_name_prefix=f"kctl-{name}")
        self.pending = 0  # admitted calls, running or waiting for a thread (changed only in the event loop)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in one of the lane's threads; :class:`Overloaded` when ``max_pending`` already wait."""
        if self.pending >= self.max_pending:
            if self.metrics is not None:
                self.metrics.overload.labels(self.name).inc()
            raise Overloaded.busy(f"controller busy: {self.pending} {self.name} calls waiting; retry later")
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))
        finally:
            self.pending -= 1

    def shutdown(self, wait: bool = False) -> None:
        """Stop taking work; calls not started yet are cancelled, running ones finish (``wait``: and the
        threads or worker processes have ended when this returns)."""
        self.executor.shutdown(wait=wait, cancel_futures=True)
