"""Push of desired state to agents: the per-replica hub behind ``POST /v1/agents/heartbeat``.

Every replica (leader or not) keeps the latest :class:`~controller.desired_cache.Snapshot` of the fleet's
desired state and serves heartbeats from it:

* **Fast path** (nothing to write but liveness and staged versions): the reply comes from the snapshot
  (memoised per stratum and assignment); the node's liveness and staged versions (informational: desired
  state does not depend on them) go into buffers that one statement each per flush writes
  (``liveness_flush_seconds``): no transaction per heartbeat.
* **Switch path** (the node's only news is another version active, and the canary phase that follows): queued
  for group commit (``controller.group_commit``, ``controller.switches``): one set-based transaction for every
  switch queued meanwhile; at most ``max_queued_writes`` wait, more are answered 503 with ``Retry-After``.
  Registrations are group-committed the same way (``controller.enrollment``).
* **Slow path** (a stale node is back, an inventory, a new assignment to create, a version the snapshot does
  not know, a node the snapshot does not know yet): the full ``registry.heartbeat`` transaction, in a worker
  thread; at most ``max_pending_writes`` of them wait at once, more are answered 503 with ``Retry-After``.
* **Patches**: after a switch batch, or a canary verified by report ingestion, the replica patches the nodes'
  rows into its snapshot (:meth:`DesiredHub.patch`) and moves it to the commit's generation when nothing else
  committed in between: no reload. A rollback decided by this replica's tick skips the reload coalescing.
* **Watch** (long-poll): a heartbeat carrying the ``generation`` it last applied and ``wait_seconds`` is held
  until the node's desired state changes or the wait ends, so a rollback reaches every waiting canary in one
  round trip. The snapshot is reloaded when the generation moves: PostgreSQL ``LISTEN kernelctl_desired``
  (every replica), the commit hook of this process (SQLite, and the local fast path), and a poll of the
  counter every ``watch_poll_seconds`` as a safety net. Reloads are coalesced (at most one per
  ``min_reload_seconds``, reloading at most a third of the time); after each, only the waiters whose
  desired state changed are woken.

A node's per-replica generation is the snapshot generation at which its desired state last changed here; a
request whose ``generation`` is newer than this replica's snapshot waits for the reload first, so an agent
never sees an older desired state after a newer one (no flapping between replicas).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import random
import threading
import time
from dataclasses import replace
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.orm import Session, sessionmaker
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_random

from controller.db.engine import aborted_by_lock_cycle, session_scope
from controller.desired_cache import (
    CHANNEL,
    LAST_GENERATION,
    NodeView,
    Row,
    Snapshot,
    load_snapshot,
    new_node_view,
    read_generation,
)
from controller.enrollment import Registration, register_many
from controller.errors import Overloaded, first_line
from controller.group_commit import GroupCommit
from controller.switches import FULL, Switch, Switched, record_switches
from kernelctl import wire

log = logging.getLogger(__name__)
# a batch the database aborted to break a lock cycle (with the liveness flush, the tick) is written again
GROUP_RETRY = retry(retry=retry_if_exception(aborted_by_lock_cycle), stop=stop_after_attempt(5),
                    wait=wait_random(0.01, 0.1), reraise=True)


PG_STAGED = text(
    "UPDATE assignments SET staged = CAST(v.doc AS json) FROM unnest(CAST(:ids AS bigint[]), CAST(:names AS text[]), "
    "CAST(:docs AS text[])) AS v(id, name, doc) WHERE assignments.node_id = v.id AND assignments.bundle_name = v.name")
SQLITE_STAGED = text("UPDATE assignments SET staged = :doc WHERE node_id = :id AND bundle_name = :name")
PG_LIVENESS = text(
    "UPDATE nodes SET last_heartbeat_at = GREATEST(nodes.last_heartbeat_at, v.at) "
    "FROM unnest(CAST(:ids AS bigint[]), CAST(:ats AS timestamptz[])) AS v(id, at) WHERE nodes.id = v.id")
SQLITE_LIVENESS = text("UPDATE nodes SET last_heartbeat_at = :at WHERE id = :id AND last_heartbeat_at < :at")


class DesiredHub:
    """One replica's snapshot, waiters, liveness buffer and reload loop (see the module docstring)."""

    def __init__(self, factory: sessionmaker[Session], database_url: str, *, poll_seconds: float = 2.0,
                 min_reload_seconds: float = 0.05, liveness_flush_seconds: float = 1.0,
                 max_pending_writes: int = 64, max_queued_writes: int = 16384, metrics: Any = None) -> None:
        self.factory = factory
        self.url = database_url
        self.poll_seconds = poll_seconds
        self.min_reload_seconds = min_reload_seconds
        self.flush_seconds = liveness_flush_seconds
        self.max_pending_writes = max_pending_writes
        self.metrics = metrics
        self.snapshot = Snapshot(generation=-1)
        self.node_gen: dict[str, int] = {}
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._reloaded = asyncio.Event()
        self._poke = asyncio.Event()
        self._urgent = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._liveness: dict[int, dt.datetime] = {}
        self._staged: dict[tuple[int, str], tuple[str, ...]] = {}  # (node id, bundle) -> staged versions to write
        self._staged_written: dict[tuple[int, str], tuple[str, ...]] = {}
        self._pending_writes = 0
        self._unknown = False  # a heartbeat came from a node the snapshot does not know (new since)
        self.unknown_reload_seconds = 1.0
        self._stop = threading.Event()
        self._listener: threading.Thread | None = None
        self._postgres = factory.kw["bind"].dialect.name == "postgresql"
        # group commit (controller.group_commit): registrations, and heartbeats whose news is a version switch
        self.registrations: GroupCommit[Registration] = GroupCommit(
            "registrations", self._write_registrations, max_queued=max_queued_writes, metrics=metrics)
        self.switches: GroupCommit[Switch] = GroupCommit(
            "switches", self._write_switches, max_queued=max_queued_writes, metrics=metrics,
            on_done=self._switched)

    # ------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        with contextlib.suppress(Exception):  # the database may be down at start: the loop retries
            self._install(await asyncio.to_thread(load_snapshot, self.factory))
        self.registrations.start()
        self.switches.start()
        self._tasks = [asyncio.create_task(self._reload_loop(), name="desired-reload"),
                       asyncio.create_task(self._flush_loop(), name="liveness-flush")]
        if self._postgres:
            self._listener = threading.Thread(target=self._listen, name="desired-listen", daemon=True)
            self._listener.start()

    async def stop(self) -> None:
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.registrations.stop()
        await self.switches.stop()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.flush_liveness)
        for events in self._waiters.values():
            for ev in events:
                ev.set()

    def in_loop(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` in the hub's event loop, from any thread (dropped once the loop is closed)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(fn, *args)

    def loop_call(self, fn: Any, delay: float) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_later(delay, fn)

    def urgent(self) -> None:
        """A rollback was committed here: reload now, skipping the coalescing pause (thread-safe)."""
        self.in_loop(self._urgent_now)

    def _urgent_now(self) -> None:
        self._urgent.set()
        self._poke.set()

    def poke(self, generation: int | None = None) -> None:
        """Ask for a reload (thread-safe): a commit here, a NOTIFY, or a request that is ahead of us."""
        if generation is not None and generation <= self.snapshot.generation:
            return
        self.in_loop(self._poke.set)

    # ------------------------------------------------------------------------------- reloads
    async def _reload_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), self.poll_seconds)
            self._poke.clear()
            started = time.perf_counter()
            try:
                snap = await asyncio.to_thread(self._load_if_newer)
            except Exception as exc:  # database down: keep serving the last snapshot, retry on the next poll
                log.warning("desired-state reload failed: %s", first_line(exc))
                snap = None
            spent = time.perf_counter() - started
            if snap is not None:
                self._install(snap)
                if self.metrics is not None:
                    self.metrics.desired_reload.observe(spent)
            # coalesce: at most one reload per min_reload_seconds, and reloading at most a third of the time,
            # unless a rollback was decided here meanwhile (urgent: its canaries must switch back at once)
            if snap is not None and not self._urgent.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), max(self.min_reload_seconds, 2.0 * spent))
            self._urgent.clear()

    def _load_if_newer(self) -> Snapshot | None:
        with self.factory() as session:
            gen = read_generation(session)
            session.rollback()
        unknown, self._unknown = self._unknown, False
        if gen == self.snapshot.generation and not unknown:
            return None
        return load_snapshot(self.factory)

    def _install(self, snap: Snapshot) -> None:
        old = self.snapshot
        if snap.generation < old.generation:
            return
        changed: list[str] = []
        for name, node in snap.nodes.items():
            prev = old.nodes.get(name)
            if prev is None or prev.key != node.key or prev.state != node.state or name not in self.node_gen:
                self.node_gen[name] = snap.generation
                changed.append(name)
        self.snapshot = snap
        for name in changed:
            for ev in self._waiters.get(name, ()):
                ev.set()
        self._reloaded.set()
        self._reloaded = asyncio.Event()

    async def at_least(self, generation: int, timeout: float) -> bool:
        """Wait (up to ``timeout``) until this replica's snapshot is at ``generation`` or newer."""
        deadline = time.monotonic() + timeout
        while self.snapshot.generation < generation:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._poke.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reloaded.wait(), left)
        return True

    def _listen(self) -> None:
        """LISTEN kernelctl_desired on a dedicated connection (PostgreSQL); reconnects with backoff."""
        import psycopg

        from controller.leader import _conninfo

        backoff = 0.5
        while not self._stop.is_set():
            try:
                with psycopg.connect(_conninfo(self.url), autocommit=True, connect_timeout=5,
                                     application_name="kernelctl-watch") as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    backoff = 0.5
                    self.poke()  # anything committed while we were not listening
                    while not self._stop.is_set():
                        for n in conn.notifies(timeout=1.0, stop_after=1):
                            with contextlib.suppress(ValueError):
                                self.poke(int(n.payload))
            except Exception as exc:
                log.warning("desired-state LISTEN connection lost (%s); retrying in %.1fs",
                            first_line(exc), backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def registered(self, node_id: int, name: str, inventory: wire.Inventory) -> None:
        """A node registered through this replica: known at once (its heartbeats need no reload first)."""
        def add() -> None:
            snap = self.snapshot
            if name not in snap.nodes and snap.generation >= 0:
                snap.nodes[name] = new_node_view(node_id, name, inventory, snap)
                self.node_gen.setdefault(name, snap.generation)

        self.in_loop(add)

    # ------------------------------------------------------------------------------- group commits
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

    def _switched(self, items: list[Switch], results: Any) -> None:
        """A committed batch of switches: patch this replica's snapshot so the nodes' next heartbeats are
        served from memory."""
        snap = self.snapshot
        patches: dict[str, dict[str, Row]] = {}
        for it, (res, _g) in zip(items, results, strict=True):
            node = snap.nodes.get(it.node_name)
            if isinstance(res, Switched) and node is not None and node.id == it.node_id:
                patches[it.node_name] = {
                    name: Row(view, active, node.rows[name].staged if name in node.rows else ())
                    for name, (view, active) in res.rows.items()}
        self.patch(next((g for _r, g in results if g is not None), None), patches)

    def verified(self, node_name: str, rollout_ids: list[int], generation: int | None) -> None:
        """Report ingestion verified the node's canary of these rollouts (trial before serve): its desired
        state now serves the candidate. Patched into the snapshot at once (the node's watch answers without
        a reload); thread-safe."""
        self.in_loop(self._verified, node_name, rollout_ids, generation)

    def _verified(self, node_name: str, rollout_ids: list[int], generation: int | None) -> None:
        node = self.snapshot.nodes.get(node_name)
        if node is None or not rollout_ids or generation is None:
            return
        rows = {name: Row(replace(r.view, phase="verified"), r.active_id, r.staged)
                if r.view.rollout_id in rollout_ids and r.view.phase in (None, "staged") else r
                for name, r in node.rows.items()}
        self.patch(generation, {node_name: rows})

    def patch(self, generation: int | None, rows: dict[str, dict[str, Row]]) -> None:
        """Nodes' assignment rows as a commit at ``generation`` left them: patched into this replica's
        snapshot, their watches woken where the desired state changed, and the snapshot moved to
        ``generation`` when nothing else committed in between (else the reload that the commit asked for
        brings the rest)."""
        snap = self.snapshot
        for name, mine in rows.items():
            node = snap.nodes.get(name)
            if node is None:
                continue
            patched = NodeView(node.id, node.name, node.stratum, node.cpu, node.state, mine, node.needs_sync)
            patched.key = (node.stratum, node.cpu, tuple(sorted((r.view for r in mine.values()),
                                                                key=lambda v: v.bundle_name)))
            snap.nodes[name] = patched
            if patched.key != node.key and generation is not None:
                self.node_gen[name] = generation
                for ev in self._waiters.get(name, ()):
                    ev.set()
        if generation is not None and snap.generation == generation - 1:
            snap.generation = generation  # the snapshot plus this commit is the state at its generation

    async def switch(self, node: NodeView, req: wire.HeartbeatRequest, ids: dict[str, int | None],
                     heartbeat_seconds: float) -> tuple[wire.HeartbeatResponse, int] | None:
        """A heartbeat whose news is a version switch, group-committed; None: it needs the full transaction."""
        now = dt.datetime.now(dt.timezone.utc)
        res, gen = await self.switches.submit(Switch(node.id, node.name, ids, now))
        if res is FULL:
            return None
        snap = self.snapshot
        view = snap.nodes.get(node.name, node)
        self.note_alive(node.id, now)
        self.note_staged(node.id, snap.staged_changes(view, req))
        mine = self.node_gen.get(node.name, snap.generation)
        if gen is not None and snap.generation < gen:
            mine = gen  # not yet in this snapshot: the node's next watch waits for the reload
        return wire.HeartbeatResponse.model_construct(
            node_name=req.node_name, desired=snap.desired(view), heartbeat_seconds=heartbeat_seconds, server_time=now,
            generation=mine), mine

    # ------------------------------------------------------------------------------- liveness
    def note_alive(self, node_id: int, at: dt.datetime) -> None:
        self._liveness[node_id] = at

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_seconds)
            try:
                await asyncio.to_thread(self.flush_liveness)
            except Exception as exc:  # kept for the next flush
                log.warning("liveness flush failed (kept): %s", first_line(exc))

    def note_staged(self, node_id: int, changes: dict[str, tuple[str, ...]]) -> None:
        for name, versions in changes.items():
            key = (node_id, name)
            if self._staged_written.get(key) != versions:
                self._staged[key] = versions

    @GROUP_RETRY  # a deadlock with the leader's stale marking: written again at once (else kept for the next)
    def flush_liveness(self) -> int:
        """Write the buffered heartbeat times and staged versions: one statement each (PostgreSQL) or one
        executemany each (SQLite), in one transaction."""
        batch, self._liveness = self._liveness, {}
        staged, self._staged = self._staged, {}
        if not batch and not staged:
            return 0
        docs = {k: json.dumps({"versions": list(v)}) for k, v in staged.items()}
        try:
            with self.factory() as session:
                if self._postgres:
                    if batch:
                        session.execute(PG_LIVENESS, {"ids": list(batch), "ats": list(batch.values())})
                    if staged:
                        session.execute(PG_STAGED, {"ids": [k[0] for k in docs], "names": [k[1] for k in docs],
                                                    "docs": list(docs.values())})
                else:
                    if batch:
                        session.execute(SQLITE_LIVENESS.bindparams(bindparam("at"), bindparam("id")),
                                        [{"id": k, "at": v} for k, v in batch.items()])
                    if staged:
                        session.execute(SQLITE_STAGED, [{"id": k[0], "name": k[1], "doc": d} for k, d in docs.items()])
                session.commit()
        except Exception:
            for k, v in batch.items():  # newer times that arrived meanwhile win
                if k not in self._liveness:
                    self._liveness[k] = v
            for k2, v2 in staged.items():
                self._staged.setdefault(k2, v2)
            raise
        self._staged_written.update(staged)
        if self.metrics is not None:
            self.metrics.liveness_flushed.inc(len(batch))
        return len(batch)

    # ------------------------------------------------------------------------------- heartbeats
    def node(self, name: str) -> NodeView | None:
        return self.snapshot.nodes.get(name)

    def retry_after(self) -> float:
        return round(1.0 + 4.0 * random.random(), 1)

    async def slow(self, fn: Any, *args: Any) -> Any:
        """Run a write in a worker thread, refusing with 503 + Retry-After when too many already wait."""
        if self._pending_writes >= self.max_pending_writes:
            if self.metrics is not None:
                self.metrics.overload.labels("writes").inc()
            raise Overloaded(f"controller busy: {self._pending_writes} writes waiting; retry later",
                             self.retry_after())
        self._pending_writes += 1
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            self._pending_writes -= 1

    async def heartbeat(self, req: wire.HeartbeatRequest, *, heartbeat_seconds: float,
                        slow_path: Any) -> tuple[wire.HeartbeatResponse, float, str]:
        """Answer one heartbeat (see the module docstring); returns the reply, the seconds spent holding it and
        the path ("fast": from the snapshot, "switch": a group-committed version switch, "slow": a transaction).

        ``slow_path(req) -> (HeartbeatResponse, generation)`` runs the full transaction (in a thread).
        """
        if req.generation is not None and req.generation > self.snapshot.generation:
            await self.at_least(req.generation, 5.0)  # another replica is ahead: catch up first
        held = 0.0
        deadline = time.monotonic() + min(req.wait_seconds, 600.0)
        while True:
            snap = self.snapshot
            node = snap.nodes.get(req.node_name)
            if node is None or snap.generation < (req.generation or 0) or not snap.fast_path(node, req):
                if node is None and not self._unknown:  # registered after the snapshot: load it soon
                    self._unknown = True
                    self.loop_call(self._poke.set, delay=self.unknown_reload_seconds)
                try:
                    ids = snap.switch_ids(node, req) if node is not None and snap.generation >= (
                        req.generation or 0) else None
                    done = await self.switch(node, req, ids, heartbeat_seconds) \
                        if node is not None and ids is not None else None
                    path = "switch" if done is not None else "slow"
                    reply, gen = done if done is not None else await self.slow(slow_path, req)
                except Overloaded:
                    if node is not None:  # refused for now, but alive: an overload never makes a node stale
                        self.note_alive(node.id, dt.datetime.now(dt.timezone.utc))
                    raise
                if req.generation is None or gen > req.generation or deadline - time.monotonic() <= 0:
                    return reply.model_copy(update={"generation": gen}), held, path
                mine = gen  # written, but nothing newer for the node: hold it like any watch
            else:
                mine = self.node_gen.get(req.node_name, snap.generation)
            left = deadline - time.monotonic()
            if node is not None and (req.generation is None or req.generation < mine or left <= 0):
                now = dt.datetime.now(dt.timezone.utc)
                self.note_alive(node.id, now)
                self.note_staged(node.id, snap.staged_changes(node, req))
                return wire.HeartbeatResponse.model_construct(
                    node_name=req.node_name, desired=snap.desired(node), heartbeat_seconds=heartbeat_seconds,
                    server_time=now, generation=mine), held, "fast"
            if node is not None:
                self.note_alive(node.id, dt.datetime.now(dt.timezone.utc))  # liveness while it waits
                self.note_staged(node.id, snap.staged_changes(node, req))
            ev = asyncio.Event()
            self._waiters.setdefault(req.node_name, set()).add(ev)
            t0 = time.monotonic()
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):  # no task per held watch (wait_for makes one)
                        await ev.wait()
            finally:
                held += time.monotonic() - t0
                waiters = self._waiters.get(req.node_name)
                if waiters is not None:
                    waiters.discard(ev)
                    if not waiters:
                        del self._waiters[req.node_name]
            if self._stop.is_set():
                deadline = 0.0


def slow_heartbeat(factory: sessionmaker[Session], req: wire.HeartbeatRequest,
                   heartbeat_seconds: float) -> tuple[wire.HeartbeatResponse, int]:
    """``registry.heartbeat`` in one transaction; returns the reply and a generation that covers it."""
    from controller.db.engine import session_scope
    from controller.registry import heartbeat

    with session_scope(factory) as session:
        reply = heartbeat(session, req, dt.datetime.now(dt.timezone.utc), heartbeat_seconds=heartbeat_seconds)
        session.info.pop(LAST_GENERATION, None)
        gen = read_generation(session)  # read last: every commit the reply saw is at or below it
    return reply, max(gen, int(session.info.get(LAST_GENERATION) or 0))
