"""The open watches of one replica: per node, the events a held heartbeat waits on, and a cap per node.

Loop-owned: every method runs in the replica's event loop. A node may hold at most ``per_node`` watches at
once (one agent holds one; a token that opens more is refused with 429 instead of holding thousands of
connections).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable

from controller.errors import KernelctlError


class TooManyWatches(KernelctlError):
    status_code = 429


class Waiters:
    def __init__(self, per_node: int = 4) -> None:
        self.per_node = per_node
        self._by_node: dict[str, set[asyncio.Event]] = {}

    def wake(self, names: Iterable[str]) -> None:
        for name in names:
            for ev in self._by_node.get(name, ()):
                ev.set()

    def wake_all(self) -> None:
        self.wake(list(self._by_node))

    def open(self, name: str) -> int:
        return len(self._by_node.get(name, ()))

    @contextlib.asynccontextmanager
    async def held(self, name: str) -> AsyncIterator[asyncio.Event]:
        """An event set when ``name``'s desired state changes (TooManyWatches past the cap)."""
        mine = self._by_node.setdefault(name, set())
        if len(mine) >= self.per_node:
            raise TooManyWatches(f"node {name} already holds {len(mine)} open watches (limit {self.per_node}); "
                                 "one agent holds one: close the others")
        ev = asyncio.Event()
        mine.add(ev)
        try:
            yield ev
        finally:
            mine.discard(ev)
            if not mine:
                self._by_node.pop(name, None)
