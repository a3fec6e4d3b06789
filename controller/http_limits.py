"""Connection-level limits for uvicorn's HTTP protocols: a client must finish its request headers in time,
and a header block is bounded while it arrives.

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``) but not the time a client takes to send
its request line and headers: a connection that trickles a header byte now and then (slowloris) or never
sends anything stays open for ever. :func:`protocol_class` returns a protocol that closes such a connection
after ``header_timeout`` seconds (answering ``408``): armed when the connection opens and again after each
response, disarmed as soon as the request's headers are complete. The body's deadline is enforced in the
ASGI app (``controller.api.app``), as is the size of a complete header block (``431``).

Two implementations, the same limits:

* ``httptools`` (the default when installed, with ``uvicorn[standard]``): :class:`HeaderTimeoutHttpToolsProtocol`.
  llhttp parses in C (several times cheaper per request than h11) but sets no bound on a header block still
  arriving: the protocol counts the bytes received while a request's headers are incomplete and answers
  ``431`` (closing) past ``max_header_bytes``.
* ``h11`` (pure Python, the fallback): :class:`HeaderTimeoutH11Protocol`; h11 bounds an incomplete header
  block itself (``h11_max_incomplete_event_size``, answered ``400``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from abc import abstractmethod
from typing import Literal

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: 51\r\n\r\n" + b'{"detail": "request headers not received in time"}\n')
TOO_LARGE_BODY = b'{"detail": "request line and headers are over the size limit"}\n'
TOO_LARGE_RESPONSE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                      b"connection: close\r\ncontent-length: " + str(len(TOO_LARGE_BODY)).encode() + b"\r\n\r\n"
                      + TOO_LARGE_BODY)

HttpImpl = Literal["auto", "httptools", "h11"]


class _HeaderDeadline:
    """The header deadline, shared by both protocols (a mixin over uvicorn's protocol classes)."""

    header_timeout: float = 10.0
    http_impl: str = ""  # "httptools" or "h11": what the server logs
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    timeout_keep_alive: float
    client: tuple[str, int] | None
    _header_timer: asyncio.TimerHandle | None = None  # armed while a request line and headers are awaited

    def _arm_header_timer(self, seconds: float) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(seconds, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    @abstractmethod
    def _awaiting_headers(self) -> bool:
        """True while the connection waits for (the rest of) a request line and headers, and answers none
        (each protocol class reads its own parser's state)."""

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._awaiting_headers():
            return
        log.info("closing a connection from %s: request headers not received in %.0fs", self.client,
                 self.header_timeout)
        self.transport.write(TIMEOUT_RESPONSE)
        self.transport.close()


class HeaderTimeoutH11Protocol(_HeaderDeadline, H11Protocol):
    """``H11Protocol`` with a deadline for the request line and headers of every request."""

    http_impl = "h11"

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer(self.header_timeout)

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

    def _awaiting_headers(self) -> bool:
        if self.conn.their_state is not h11.IDLE:
            return False
        # a response still being written (pipelining) is not a slow client
        return self.cycle is None or self.cycle.response_complete


if importlib.util.find_spec("httptools") is not None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutHttpToolsProtocol(_HeaderDeadline, HttpToolsProtocol):
        """``HttpToolsProtocol`` with a deadline for the request line and headers of every request and a
        bound on a header block still arriving (``max_header_bytes``, answered ``431``)."""

        http_impl = "httptools"
        max_header_bytes: int = 16 * 1024

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._in_headers = True  # waiting for a request line and headers
            self._header_bytes = 0  # received while in headers (an upper bound: a chunk may carry a body too)
            self._message_done = True  # the last request's body was received whole
            self._arm_header_timer(self.header_timeout)

        def data_received(self, data: bytes) -> None:
            if self._in_headers:
                self._header_bytes += len(data)
            super().data_received(data)
            if self._in_headers and self._header_bytes > self.max_header_bytes and not self.transport.is_closing():
                log.info("closing a connection from %s: request headers over %d bytes", self.client,
                         self.max_header_bytes)
                self._disarm_header_timer()
                self.transport.write(TOO_LARGE_RESPONSE)
                self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers, self._header_bytes, self._message_done = True, 0, False

        def on_headers_complete(self) -> None:
            self._in_headers = False  # the body has its own deadline (the app's)
            self._disarm_header_timer()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._message_done = True
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # the next request (keep-alive) gets the same deadline
                # at a message boundary (not in a body the app left unread, nor in a pipelined request)
                if self._message_done and (self.cycle is None or self.cycle.response_complete):
                    self._in_headers, self._header_bytes = True, 0
                self._arm_header_timer(self.timeout_keep_alive + self.header_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _awaiting_headers(self) -> bool:
            if not self._in_headers:
                return False
            return self.cycle is None or self.cycle.response_complete


def protocol_class(header_timeout: float, *, impl: HttpImpl = "auto", max_header_bytes: int = 16 * 1024) -> type:
    """A protocol class for ``uvicorn.Config(http=...)`` with the given header deadline: httptools when
    installed (``auto``) or asked for, else h11. (h11's own header bound is ``Config``'s
    ``h11_max_incomplete_event_size``; httptools' is ``max_header_bytes`` here.)"""
    httptools_ok = "HeaderTimeoutHttpToolsProtocol" in globals()
    if impl == "httptools" and not httptools_ok:
        raise ValueError("http implementation httptools asked for, but httptools is not installed")
    if impl != "h11" and httptools_ok:
        return type("HeaderTimeoutHttpToolsProtocol", (HeaderTimeoutHttpToolsProtocol,),
                    {"header_timeout": float(header_timeout), "max_header_bytes": int(max_header_bytes)})
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": float(header_timeout)})


def header_block_bytes(scope: dict) -> int:
    """The size of an ASGI request's request line and headers (what ``max_header_bytes`` bounds): one count
    for the app's 431 and the heartbeat lane, which must refuse the same requests."""
    return len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + sum(
        len(k) + len(v) + 4 for k, v in scope.get("headers", []))
