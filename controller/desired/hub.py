"""One replica's push of desired state: the hub behind ``POST /v1/agents/heartbeat``, built from small parts.

* :class:`~controller.desired.store.DesiredStore` (``store.py``): the immutable snapshot and each node's
  generation, changed only in the event loop (reloads, patches declared by commits, new nodes);
* :class:`~controller.desired.listener.Listener` (``listener.py``): ``LISTEN kernelctl_desired`` (PostgreSQL),
  so a commit on any replica wakes this one;
* :class:`~controller.desired.waiters.Waiters` (``waiters.py``): the open watches, capped per node;
* :class:`~controller.desired.liveness.LivenessBuffer` (``liveness.py``): heartbeat times and staged versions
  of the heartbeats answered from memory, one lock, written in batches;
* :class:`~controller.desired.writers.Writers` (``writers.py``): group-committed registrations and switches,
  the full heartbeat transaction (queued, not refused, up to ``max_queued_writes``) and report ingest, on two lanes of worker threads (``lanes.py``).

A heartbeat (:meth:`DesiredHub.heartbeat`) is answered from the snapshot when its effects
(:func:`controller.desired.effects.heartbeat_effects`) are liveness only; a version switch is group-committed;
anything else (an inventory, a stale node back, a version or node the snapshot does not know) takes the full
transaction. A heartbeat carrying the ``generation`` it last applied and ``wait_seconds`` is a watch: held until
the node's desired state changes (a commit's declared rows patched in, or a reload) or the wait ends, so a
rollback reaches every waiting canary in one round trip. When a held watch wakes its caller's token is checked
again (``recheck``): a revoked node's watch is never answered with desired state.

A node's per-replica generation is the snapshot generation at which its desired state last changed here; a
request whose ``generation`` is newer than this replica's snapshot waits for the reload first, so an agent
never sees an older desired state after a newer one (no flapping between replicas).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from controller.desired.generation import install_generation_hooks
from controller.desired.listener import Listener
from controller.desired.liveness import LivenessBuffer
from controller.desired.snapshot import NodeView, Snapshot
from controller.desired.store import DesiredStore
from controller.desired.waiters import Waiters
from controller.desired.writers import Writers
from controller.enrollment import Registered, Registration
from controller.errors import Overloaded, first_line
from controller.switches import FULL, Switch
from kernelctl import wire
from kernelctl.vocab import FullHeartbeat

log = logging.getLogger(__name__)
Recheck = Callable[[], Awaitable[None]]


class DesiredHub:
    """One replica's desired-state push (see the module docstring). Built once, by the app's composition root
    (``controller.api.app.build_state``), which also installs the generation hooks on its sessions."""

    def __init__(self, factory: sessionmaker[Session], database_url: str, *, poll_seconds: float = 2.0,
                 min_reload_seconds: float = 0.05, liveness_flush_seconds: float = 1.0,
                 max_pending_writes: int = 64, max_queued_writes: int = 16384,
                 queue_deadline_seconds: float | None = None, max_watches_per_node: int = 4,
                 ingest_processes: int = 0, max_report_batch: int = 1000, metrics: Any = None) -> None:
        self.flush_seconds = liveness_flush_seconds
        self.metrics = metrics
        self.waiters = Waiters(max_watches_per_node)
        self.writers = Writers(factory, max_pending_writes=max_pending_writes, max_queued_writes=max_queued_writes,
                               queue_deadline_seconds=queue_deadline_seconds, metrics=metrics,
                               ingest_processes=ingest_processes, database_url=database_url,
                               max_report_batch=max_report_batch,
                               on_commit=lambda generation, patch: self.store.committed(generation, patch))
        self.control = self.writers.control.executor  # reloads and flushes: never behind report ingest
        self.store = DesiredStore(factory, self.waiters, poll_seconds=poll_seconds,
                                  min_reload_seconds=min_reload_seconds, metrics=metrics, executor=self.control)
        self.liveness = LivenessBuffer(factory, metrics)
        postgres = factory.kw["bind"].dialect.name == "postgresql"
        self.listener = Listener(database_url, self.store.notified) if postgres else None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        install_generation_hooks(factory, on_commit=self.store.committed)

    @property
    def snapshot(self) -> Snapshot:
        return self.store.snapshot

    # ------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await self.store.load()
        self.writers.start()
        self._tasks = [asyncio.create_task(self.store.run(), name="desired-reload"),
                       asyncio.create_task(self._flush_loop(), name="liveness-flush")]
        if self.listener is not None:
            self.listener.start()

    async def stop(self) -> None:
        self._stopping = True
        if self.listener is not None:
            self.listener.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.store.stop()
        await self.writers.stop()
        with contextlib.suppress(Exception):
            await asyncio.get_running_loop().run_in_executor(self.control, self.liveness.flush)
        self.writers.close()
        self.waiters.wake_all()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_seconds)
            try:
                await asyncio.get_running_loop().run_in_executor(self.control, self.liveness.flush)
            except Exception as exc:  # kept for the next flush
                log.warning("liveness flush failed (kept): %s", first_line(exc))

    # ------------------------------------------------------------------------------- registrations
    async def register(self, item: Registration) -> Registered:
        """A registration, group-committed; a new node is known to this replica at once."""
        done: Registered = await self.writers.registrations.submit(item)
        if done.new:
            self.store.add_node(done.node_id, item.req.node_name, item.req.inventory)
        return done

    # ------------------------------------------------------------------------------- heartbeats
    async def heartbeat(self, req: wire.HeartbeatRequest, *, heartbeat_seconds: float,
                        recheck: Recheck | None = None) -> tuple[wire.HeartbeatResponse, float, str]:
        """Answer one heartbeat (see the module docstring); returns the reply, the seconds spent holding it and
        the path ("fast": from the snapshot, "switch": a group-committed version switch, "slow": a transaction;
        a heartbeat that wrote is reported by its write's path even when it was then held as a watch).

        Held time (not the replica's service time): a watch's wait for this replica to catch up with the
        generation the node holds (nothing newer is known here), and a watch whose version switch leaves its
        desired state as it is (:attr:`~controller.desired.effects.Effects.desired_unchanged`: the reply does
        not depend on the write) is held while the write commits; a failed write ends the hold with its error.
        """
        store = self.store
        watch = req.generation is not None and req.wait_seconds > 0
        have = req.generation or 0  # the generation the node holds
        held = 0.0
        if req.generation is not None and req.generation > store.snapshot.generation:
            t0 = time.monotonic()
            await store.at_least(req.generation, 5.0)  # another replica or a transaction is ahead: catch up first
            waited = time.monotonic() - t0
            if self.metrics is not None:
                self.metrics.heartbeat_catch_up.labels(str(watch).lower()).observe(waited)
            held += waited if watch else 0.0
        if req.node_name not in store.snapshot.nodes:
            await store.learn(req.node_name)  # registered through another replica: one batched read, no transaction
        path = "fast"
        deadline = time.monotonic() + min(req.wait_seconds, 600.0)
        woken = False  # the body's effects were judged (and written) at arrival: a held watch never writes again
        while True:
            snap = store.snapshot
            node = snap.nodes.get(req.node_name)
            behind = snap.generation < (req.generation or 0)
            if node is None:
                store.unknown()
            now = dt.datetime.now(dt.timezone.utc)
            effects = snap.effects(node, req, now) if node is not None and not behind else None
            mine = store.node_gen.get(req.node_name, snap.generation)
            if woken and node is not None and not behind and (effects is None or not effects.liveness_only):
                # what is stored moved away from this body while it was held: a newer heartbeat of the node (an
                # agent's report after a download, a restarted agent) wrote since. Its stale body is not written
                # again; it is answered at once and the node's next heartbeat reports what it has now.
                return wire.HeartbeatResponse.model_construct(
                    node_name=req.node_name, desired=snap.desired(node), heartbeat_seconds=heartbeat_seconds,
                    server_time=now, generation=mine), held, path
            overlap = watch and effects is not None and not effects.liveness_only and effects.desired_unchanged \
                and have >= mine and deadline > time.monotonic()
            if node is not None and effects is not None and effects.liveness_only:
                self.liveness.note(node.id, now, snap.staged_changes(node, req))
            elif not overlap:
                reply, gen, path = await self._write(node, snap, req, heartbeat_seconds, behind)
                if not watch or gen > have or deadline - time.monotonic() <= 0:
                    return reply.model_copy(update={"generation": gen}), held, path
                mine = gen  # written, but nothing newer for the node: hold it like any watch
            left = deadline - time.monotonic()
            if node is not None and not overlap and (not watch or have < mine or left <= 0):
                return wire.HeartbeatResponse.model_construct(
                    node_name=req.node_name, desired=snap.desired(node), heartbeat_seconds=heartbeat_seconds,
                    server_time=now, generation=mine), held, path
            pending: asyncio.Future[tuple[wire.HeartbeatResponse, int, str]] | None = None
            async with self.waiters.held(req.node_name) as ev:
                if overlap:
                    pending = asyncio.ensure_future(self._write(node, snap, req, heartbeat_seconds, False))
                    pending.add_done_callback(lambda f: ev.set() if _ends_hold(f, have) else None)
                t0 = time.monotonic()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(left, 0.0)):  # no task per held watch (wait_for makes one)
                        await ev.wait()
                held += time.monotonic() - t0
            if pending is not None:
                reply, gen, path = await pending  # its error (503, ...) is the answer
                if gen > have or deadline - time.monotonic() <= 0:
                    return reply.model_copy(update={"generation": gen}), held, path
            woken = True
            if recheck is not None:
                await recheck()  # its token may have been revoked while it waited
            if self._stopping:
                deadline = 0.0

    async def _write(self, node: NodeView | None, snap: Snapshot, req: wire.HeartbeatRequest, hb: float,
                     behind: bool) -> tuple[wire.HeartbeatResponse, int, str]:
        """A heartbeat that writes: a group-committed switch when the snapshot can judge it, else the full
        transaction. An overload never makes a node stale: it is noted alive before the 503."""
        judged = FullHeartbeat.UNKNOWN_NODE if node is None else FullHeartbeat.BEHIND if behind \
            else snap.judge(node, req)
        reported = None if isinstance(judged, FullHeartbeat) else judged
        try:
            if node is not None and reported is not None:
                now = dt.datetime.now(dt.timezone.utc)
                res, gen = await self.writers.switches.submit(Switch(node.id, node.name, reported, now))
                if res is not FULL:
                    snap = self.store.snapshot  # the batch's rows are patched in
                    view = snap.nodes.get(node.name, node)
                    self.liveness.note(node.id, now, snap.staged_changes(view, req))
                    mine = self.store.node_gen.get(node.name, snap.generation)
                    if gen is not None and snap.generation < gen:
                        mine = max(mine, gen)  # not all in this snapshot yet: the next watch waits for the reload
                    return wire.HeartbeatResponse.model_construct(
                        node_name=req.node_name, desired=snap.desired(view), heartbeat_seconds=hb, server_time=now,
                        generation=mine), mine, "switch"
            if self.metrics is not None:
                why = judged if isinstance(judged, FullHeartbeat) else FullHeartbeat.SWITCH_FULL
                self.metrics.heartbeat_full.labels(why.value).inc()
            reply, gen = await self.writers.slow(self.writers.heartbeat, req, hb)
            return reply, gen, "slow"
        except Overloaded:
            if node is not None:
                self.liveness.note(node.id, dt.datetime.now(dt.timezone.utc))
            raise


def _ends_hold(write: asyncio.Future[tuple[wire.HeartbeatResponse, int, str]], have: int) -> bool:
    """A write overlapped with a watch's hold ends it when it failed or brought the node something newer."""
    return write.cancelled() or write.exception() is not None or write.result()[1] > have
