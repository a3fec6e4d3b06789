"""The replica's snapshot of desired state and each node's generation, owned by the event loop.

Only the event loop changes the store: a snapshot loaded in a worker thread is installed here
(:meth:`DesiredStore.install`), a commit's declared rows are applied here (:meth:`DesiredStore.apply`, through
:meth:`DesiredStore.committed` from any thread) and a node registered through this replica is added here;
each swaps in a new immutable :class:`~controller.desired.snapshot.Snapshot` and wakes the watches of the
nodes whose desired state changed, once.

Reloads: when the generation moves without a complete patch (PostgreSQL ``LISTEN``, a partial patch, a poll
of the counter every ``poll_seconds`` as a safety net, a node the snapshot does not know). They are
coalesced: at most one per ``min_reload_seconds``, and reloading at most a third of the time. They run on
``executor`` (the control lane's threads, ``controller.desired.lanes``): never behind report ingest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import Executor
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from controller.desired.generation import Patch, read_generation
from controller.desired.snapshot import NodeView, Snapshot, load_snapshot, load_unassigned, new_node_view
from controller.desired.waiters import Waiters
from controller.errors import first_line
from controller.group_commit import GroupCommit
from kernelctl import wire

log = logging.getLogger(__name__)
UNKNOWN_RELOAD_SECONDS = 1.0  # a heartbeat from a node the snapshot does not know: reload this soon
NOTIFY_DEFER_SECONDS = 0.05  # a NOTIFY is looked at this much later (this process's own patch lands first)


class DesiredStore:
    def __init__(self, factory: sessionmaker[Session], waiters: Waiters, *, poll_seconds: float = 2.0,
                 min_reload_seconds: float = 0.05, metrics: Any = None, executor: Executor | None = None) -> None:
        self.factory = factory
        self.executor = executor  # None: the event loop's default executor
        self.waiters = waiters
        self.poll_seconds = poll_seconds
        self.min_reload_seconds = min_reload_seconds
        self.metrics = metrics
        self.snapshot = Snapshot(generation=-1)
        self.node_gen: dict[str, int] = {}  # the generation at which the node's desired state last changed here
        self._poke = asyncio.Event()
        self._reloaded = asyncio.Event()
        self._unknown = False
        self._new: dict[str, NodeView] = {}  # added this turn of the loop (add_node, learn)
        self._row_gen: dict[Any, int] = {}  # (node id, bundle) or (rollout id, stratum) -> newest patch applied
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lookups: GroupCommit[str] = GroupCommit("node-lookups", self._read_unassigned, max_queued=16384,
                                                      metrics=metrics, executor=executor)

    # ----------------------------------------------------------------------------- from any thread
    def in_loop(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` in the store's event loop (dropped once the loop is closed)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(fn, *args)

    def committed(self, generation: int, patch: Patch) -> None:
        """A commit of this process at ``generation`` declared ``patch`` (the generation hook calls this)."""
        self.in_loop(self.apply, generation, patch)

    def notified(self, generation: int | None, patch: Patch | None = None) -> None:
        """The generation moved somewhere (a NOTIFY; None: maybe, reload to see). With the commit's ``patch``
        (the notice carried it) it is applied as this process's own commits are; without, looked at a moment
        later: a commit of this process has its patch applied by then, and needs no reload."""
        if generation is not None and patch is not None:
            self.committed(generation, patch)
        else:
            self.in_loop(self._notified, generation)

    def _notified(self, generation: int | None) -> None:
        if self._loop is not None:
            self._loop.call_later(NOTIFY_DEFER_SECONDS, self.poke, generation)

    # ----------------------------------------------------------------------------- in the loop
    def poke(self, generation: int | None = None) -> None:
        if generation is None or generation > self.snapshot.generation:
            self._poke.set()

    def unknown(self) -> None:
        """A heartbeat from a node the snapshot does not know (registered elsewhere since): reload soon."""
        if not self._unknown and self._loop is not None:
            self._unknown = True
            self._loop.call_later(UNKNOWN_RELOAD_SECONDS, self._poke.set)

    def install(self, snap: Snapshot) -> None:
        old = self.snapshot
        if snap.generation < old.generation:
            return
        changed = []
        for name, node in snap.nodes.items():
            prev = old.nodes.get(name)
            if prev is None or prev.key != node.key or prev.state != node.state or name not in self.node_gen:
                self.node_gen[name] = snap.generation
                changed.append(name)
        self._swap(snap, changed)
        self._row_gen = {k: g for k, g in self._row_gen.items() if g > snap.generation}

    def apply(self, generation: int, patch: Patch) -> None:
        """A commit's rows patched in; the whole commit when it came right after this snapshot and declared
        everything it changed, else the reload it asked for brings the rest. Commits of other workers arrive
        by NOTIFY, so patches may come out of order: a row (or a stratum) is only ever replaced by a newer
        commit's, never an older one's."""
        old = self.snapshot
        if old.generation < 0 or generation <= old.generation:
            return  # not loaded yet, or already in (a reload got there first)
        rows = {nid: fresh for nid, mine in patch.rows.items()
                if (fresh := {b: r for b, r in mine.items() if self._row_gen.get((nid, b), -1) < generation})}
        strata = {k: v for k, v in patch.strata.items() if self._row_gen.get(k, -1) < generation}
        states = {nid: s for nid, s in patch.nodes.items() if self._row_gen.get(("node", nid), -1) < generation}
        for nid, mine in rows.items():
            for b in mine:
                self._row_gen[(nid, b)] = generation
        for k in strata:
            self._row_gen[k] = generation
        for nid in states:
            self._row_gen[("node", nid)] = generation
        new = old.patched(generation, Patch(rows=rows, strata=strata, nodes=states, complete=patch.complete))
        changed = []
        for nid in rows.keys() | states.keys():
            name = old.by_id.get(nid)
            if name is not None and (old.nodes[name].key, old.nodes[name].state) != \
                    (new.nodes[name].key, new.nodes[name].state):
                self.node_gen[name] = generation
                changed.append(name)
        self._swap(new, changed)
        if new.generation < generation:
            self._poke.set()

    def add_node(self, node_id: int, name: str, inventory: wire.Inventory) -> None:
        """A node registered through this replica: known before its registration's reply can be answered by a
        heartbeat (its heartbeats need no reload first). The nodes added in one turn of the event loop (a
        group-committed batch: up to 500) are added together, in one copy of the snapshot, before the loop
        reads a socket again: one copy per node made registering 10,000 nodes quadratic (24% of the event
        loop's time and most of its garbage at 10,000 nodes, docs/benchmarks.md issue 28)."""
        if self.snapshot.generation >= 0:
            self._add(new_node_view(node_id, name, inventory, self.snapshot))

    async def learn(self, name: str) -> None:
        """A heartbeat from a node this snapshot does not know: when it registered through another replica (or
        worker process) and has no assignment yet, add it as that replica did, from one batched read for all
        such heartbeats, so it is answered from the snapshot rather than by the full transaction (with two API
        workers and a CPU hog, 2,876 heartbeats took that transaction for this reason, mean 2.8 s). A node with
        assignments waits for the reload as before."""
        if name in self.snapshot.nodes or self.snapshot.generation < 0:
            return
        try:
            view = await self._lookups.submit(name)
        except Exception:  # overloaded, the database down: the full transaction answers (and says what failed)
            return
        if view is not None:
            self._add(view)
            await asyncio.sleep(0)  # the loop adds the batch (call_soon) before this heartbeat reads the snapshot

    def _read_unassigned(self, names: list[str]) -> list[NodeView | None]:
        """(worker thread) :meth:`learn`'s batched read."""
        found = load_unassigned(self.factory, names, self.snapshot)
        return [found.get(n) for n in names]

    def _add(self, view: NodeView) -> None:
        if view.name in self.snapshot.nodes:
            return
        if not self._new and self._loop is not None:
            self._loop.call_soon(self._add_new)
        self._new[view.name] = view
        if self._loop is None:
            self._add_new()

    def _add_new(self) -> None:
        new, self._new = self._new, {}
        snap = self.snapshot
        views = [view for name, view in new.items() if name not in snap.nodes]
        if views and snap.generation >= 0:
            self.snapshot = snap.with_nodes(views)
            for view in views:
                self.node_gen.setdefault(view.name, snap.generation)

    def _swap(self, snap: Snapshot, changed: list[str]) -> None:
        self.snapshot = snap
        self.waiters.wake(changed)
        self._reloaded.set()
        self._reloaded = asyncio.Event()

    async def at_least(self, generation: int, timeout: float) -> bool:
        """Wait (up to ``timeout``) until the snapshot is at ``generation`` or newer."""
        deadline = time.monotonic() + timeout
        while self.snapshot.generation < generation:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._poke.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._reloaded.wait()
        return True

    # ----------------------------------------------------------------------------- reloads
    async def load(self) -> None:
        """The first snapshot (the database may be down at start: the reload loop retries)."""
        self._loop = asyncio.get_running_loop()
        self._lookups.start()
        with contextlib.suppress(Exception):
            self.install(await self._loop.run_in_executor(self.executor, load_snapshot, self.factory))

    async def stop(self) -> None:
        await self._lookups.stop()

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_seconds):
                    await self._poke.wait()
            self._poke.clear()
            started = time.perf_counter()
            unknown, self._unknown = self._unknown, False
            try:
                snap = await asyncio.get_running_loop().run_in_executor(
                    self.executor, self._load_if_newer, self.snapshot.generation, unknown)
            except Exception as exc:  # database down: keep serving the last snapshot, retry on the next poll
                log.warning("desired-state reload failed: %s", first_line(exc))
                snap = None
            spent = time.perf_counter() - started
            if snap is not None:
                self.install(snap)
                if self.metrics is not None:
                    self.metrics.desired_reload.observe(spent)
                await asyncio.sleep(max(self.min_reload_seconds, 2.0 * spent))  # coalesce

    def _load_if_newer(self, have: int, unknown: bool) -> Snapshot | None:
        """(worker thread) The snapshot when the generation moved past ``have`` or a node is unknown."""
        with self.factory() as session:
            gen = read_generation(session)
            session.rollback()
        if gen == have and not unknown:
            return None
        return load_snapshot(self.factory)
