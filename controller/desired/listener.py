"""``LISTEN kernelctl_desired`` on a dedicated PostgreSQL connection, in its own thread: every commit that
bumps the generation on any replica wakes this one (``on_generation(value, patch)``, thread-safe; the patch when
the notice carried it, :func:`controller.desired.generation.notice`); reconnects with backoff, and asks for a
reload after each (re)connection (anything committed while it was not listening)."""

from __future__ import annotations

import logging
import threading
import zlib
from collections.abc import Callable

from controller.desired.generation import CHANNEL, Patch, read_notice
from controller.errors import first_line

log = logging.getLogger(__name__)


class Listener:
    def __init__(self, database_url: str, on_generation: Callable[[int | None, Patch | None], None]) -> None:
        self.url = database_url
        self.on_generation = on_generation
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="desired-listen", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import psycopg

        from controller.leader import _conninfo

        backoff = 0.5
        while not self._stop.is_set():
            try:
                with psycopg.connect(_conninfo(self.url), autocommit=True, connect_timeout=5,
                                     application_name="kernelctl-watch") as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    backoff = 0.5
                    self.on_generation(None, None)
                    while not self._stop.is_set():
                        for n in conn.notifies(timeout=1.0, stop_after=1):
                            try:
                                generation, patch = read_notice(n.payload)
                            except (ValueError, KeyError, TypeError, zlib.error) as exc:
                                log.warning("desired-state notice unreadable (%s): reloading", first_line(exc))
                                generation, patch = None, None
                            self.on_generation(generation, patch)
            except Exception as exc:
                log.warning("desired-state LISTEN connection lost (%s); retrying in %.1fs", first_line(exc), backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
