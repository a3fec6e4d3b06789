"""Connection-level limits for uvicorn's h11 protocol: a client must finish its request headers in time.

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``) and the header size
(``h11_max_incomplete_event_size``) but not the time a client takes to send its request line and headers: a
connection that trickles a header byte now and then (slowloris) or never sends anything stays open for ever.
:func:`protocol_class` returns an ``H11Protocol`` that closes such a connection after ``header_timeout``
seconds (answering ``408``): armed when the connection opens and again after each response, disarmed as soon
as the request's headers are complete. The body's deadline is enforced in the ASGI app (``controller.api.app``).
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: 51\r\n\r\n" + b'{"detail": "request headers not received in time"}\n')


class HeaderTimeoutH11Protocol(H11Protocol):
    """``H11Protocol`` with a deadline for the request line and headers of every request."""

    header_timeout: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer(self.header_timeout)

    def _arm_header_timer(self, seconds: float) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(seconds, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in: the body has its own deadline
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():  # the next request (keep-alive) gets the same deadline
            self._arm_header_timer(self.timeout_keep_alive + self.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a response is still being written (pipelining): not a slow client
        log.info("closing a connection from %s: request headers not received in %.0fs", self.client,
                 self.header_timeout)
        self.transport.write(TIMEOUT_RESPONSE)
        self.transport.close()


def protocol_class(header_timeout: float) -> type[HeaderTimeoutH11Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` with the given header deadline."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": float(header_timeout)})
