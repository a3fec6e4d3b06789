"""Group commit: many requests' writes in one transaction, batched by arrival, never by waiting.

:class:`GroupCommit` queues items from request handlers (each with a future) and runs ``write(items)`` in a
worker thread for everything queued so far: while one batch is being written the next one accumulates, so a
quiet controller writes each request at once and a loaded one writes hundreds per transaction (set-based
statements: ``controller.enrollment``, ``controller.switches``). ``write`` returns one result per item, an
exception instance for an item refused on its own (the others still commit). When ``write`` raises for a
batch (nothing was committed) because the database refused something in it, each item is written again on its
own, so a row the database refuses fails only its own request; a database that is down (``OperationalError``)
fails the batch alike (:func:`write_isolated`). More than ``max_queued`` items waiting raise
:class:`~controller.errors.Overloaded` (503 + Retry-After) at once instead of queueing without bound.

Deadline (``deadline_seconds``): an item still queued that long is answered ``Overloaded`` instead of written,
and while the oldest queued item is older than that, new ones are refused at once. A request that waited past
its client's timeout (an agent's is 10 s) is work for nobody: its client has given up and retries, so a
controller that wrote everything it queued spent its capacity on abandoned requests and fell further behind
the more it was asked (10,000 agents registering on a machine with a core taken: 37,291 registrations written
for 6,988 nodes in 418 s, docs/benchmarks.md). Shedding by age keeps the queue as short as the writer can
serve within the deadline, and the clients back off on the Retry-After.

Batches run on ``executor`` (the replica's control-plane threads: ``controller.desired.lanes``), never behind
the report ingest's work. One batch is written at a time unless ``concurrency`` says more: up to that many
run at once, each taking everything queued when a writer came free (the report worker processes: one batch
per process, ``controller.intake``); a quiet queue then still writes each item at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, Generic, TypeVar

from sqlalchemy.exc import OperationalError

from controller.errors import Overloaded

Item = TypeVar("Item")


class GroupCommit(Generic[Item]):
    """One queue and its writer task (see the module docstring); start it inside the running event loop."""

    def __init__(self, name: str, write: Callable[[list[Item]], Sequence[Any]], *, max_batch: int = 500,
                 max_queued: int = 5000, deadline_seconds: float | None = None, metrics: Any = None,
                 executor: Executor | None = None, concurrency: int = 1) -> None:
        self.name = name
        self.concurrency = concurrency  # batches written at once (each takes what queued while the others ran)
        self.executor = executor  # None: the event loop's default executor
        self.write = write
        self.max_batch = max_batch
        self.max_queued = max_queued
        self.deadline_seconds = deadline_seconds
        self.metrics = metrics
        self._queue: list[tuple[Item, asyncio.Future[Any], float]] = []  # item, its answer, when it was queued
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"group-commit-{self.name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for _item, fut, _at in self._queue:
            if not fut.done():
                fut.set_exception(Overloaded("controller stopping; retry", retry_after=1.0))
        self._queue.clear()

    async def submit(self, item: Item) -> Any:
        """Queue ``item`` and wait for its result (raises the item's own exception, or the batch's)."""
        if self._task is None:  # before start or after stop: nothing would write it
            raise Overloaded(f"controller not accepting {self.name} writes (starting or stopping); retry later",
                             retry_after=1.0)
        now = time.monotonic()
        if len(self._queue) >= self.max_queued:
            self._refused()
            raise Overloaded.busy(f"controller busy: {len(self._queue)} {self.name} writes queued; retry later")
        if self.deadline_seconds is not None and self._queue and now - self._queue[0][2] > self.deadline_seconds:
            self._refused()
            raise Overloaded.busy(f"controller busy: {self.name} writes wait more than {self.deadline_seconds:g} s; "
                                  "retry later")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((item, fut, now))
        self._wake.set()
        return await fut

    def _refused(self) -> None:
        if self.metrics is not None:
            self.metrics.overload.labels(self.name).inc()

    def _take(self) -> list[tuple[Item, asyncio.Future[Any]]]:
        """The next batch: up to ``max_batch`` queued items whose request still waits; those queued longer than
        the deadline are answered ``Overloaded`` instead (see the module docstring)."""
        batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
        expired = time.monotonic() - self.deadline_seconds if self.deadline_seconds is not None else None
        live = []
        for item, fut, at in batch:
            if fut.done():  # its request was cancelled (the client went away)
                continue
            if expired is not None and at < expired:
                self._refused()
                fut.set_exception(Overloaded.busy(f"controller busy: this {self.name} write waited more than "
                                                  f"{self.deadline_seconds:g} s; retry later"))
                continue
            live.append((item, fut))
        return live

    def _write_isolated(self, items: list[Item]) -> Sequence[Any]:
        """(worker thread) :func:`write_isolated` of ``write``."""
        return write_isolated(self.write, items)

    async def _run(self) -> None:
        running: set[asyncio.Task[None]] = set()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue and len(running) < self.concurrency:
                live = self._take()
                if not live:
                    continue
                task = asyncio.create_task(self._write_batch(live))
                running.add(task)
                task.add_done_callback(lambda t: (running.discard(t), self._wake.set()))

    async def _write_batch(self, live: list[tuple[Item, asyncio.Future[Any]]]) -> None:
        started = time.perf_counter()
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self.executor, self._write_isolated, [item for item, _ in live])
        except asyncio.CancelledError:  # stopping: the requests still waiting are told to retry
            for _item, fut in live:
                if not fut.done():
                    fut.set_exception(Overloaded("controller stopping; retry", retry_after=1.0))
            raise
        except Exception as exc:  # the executor refused it (shut down): each request fails, the writer goes on
            results = [exc] * len(live)
        if self.metrics is not None:
            self.metrics.group_commit.labels(self.name).observe(time.perf_counter() - started)
            self.metrics.group_commit_items.labels(self.name).observe(len(live))
        for (_item, fut), result in zip(live, results, strict=True):
            if fut.done():
                continue
            if isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)


def write_isolated(write: Callable[[list[Item]], Sequence[Any]], items: list[Item]) -> Sequence[Any]:
    """``write(items)``; when the database refuses the batch, each item on its own (see the module docstring):
    one result per item, an exception instance for an item refused."""
    try:
        return write(items)
    except OperationalError as exc:  # the database is unavailable: every request fails alike
        return [exc] * len(items)
    except Exception as exc:
        if len(items) == 1:
            return [exc]
    out: list[Any] = []
    for item in items:
        try:
            out.extend(write([item]))
        except Exception as exc:  # this item's own refusal
            out.append(exc)
    return out
