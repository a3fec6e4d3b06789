"""Bundle bytes off the control plane's critical path: a per-replica cache by content digest, ranged reads.

A bundle's bytes never change for its digest, so a replica reads them from the database once and serves every
later download from memory (:class:`BundleBytes`, least recently used first out, bounded in bytes), answering
in a worker thread, never on the event loop. :func:`byte_range` reads an HTTP ``Range: bytes=a-b`` header, so
an agent whose download was cut short resumes it, and the digest is the strong ``ETag`` (a cache or a proxy in
front of the controller may keep the bytes: ``Cache-Control: immutable``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable


class BundleBytes:
    def __init__(self, max_bytes: int = 512 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._by_digest: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self.hits = 0
        self.misses = 0

    def get(self, digest: str, load: Callable[[], bytes]) -> bytes:
        """The bytes of ``digest``: from memory, else ``load()`` (read from the database) and kept."""
        with self._lock:
            data = self._by_digest.get(digest)
            if data is not None:
                self._by_digest.move_to_end(digest)
                self.hits += 1
                return data
        data = load()
        with self._lock:
            self.misses += 1
            if digest not in self._by_digest and len(data) <= self.max_bytes:
                self._by_digest[digest] = data
                self._size += len(data)
                while self._size > self.max_bytes:
                    _old, dropped = self._by_digest.popitem(last=False)
                    self._size -= len(dropped)
        return data


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end inclusive) of a single ``bytes=`` range within ``size``; None: the whole body. ValueError: a
    range that cannot be satisfied (416)."""
    if not header:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None  # another unit or several ranges: the whole body (allowed by RFC 9110)
    first, _, last = spec.strip().partition("-")
    try:
        if first == "":  # the last N bytes
            n = int(last)
            if n <= 0:
                raise ValueError
            return max(0, size - n), size - 1
        start = int(first)
        end = int(last) if last else size - 1
    except ValueError:
        raise ValueError(f"malformed range {header!r}") from None
    if start >= size or start < 0 or end < start:
        raise ValueError(f"range {header!r} is outside the {size} bytes of the bundle")
    return start, min(end, size - 1)
