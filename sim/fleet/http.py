"""The simulated agents' HTTP/1.1 client: ``h11`` over an asyncio ``Protocol``, persistent connections per agent.

Why not httpx: at thousands of agents the simulator spent about 1 ms of CPU per request inside httpx/httpcore
and, CPU-bound, could not re-issue the watches in time, so it measured itself instead of the controller. This
client does the least per request: one ``h11.Connection`` per TCP connection (h11 does the HTTP/1.1
framing), one ``transport.write`` per request, the response assembled in ``data_received``, one timer per
request for its deadline, no task and no pool scan.

Connections are kept per *lane* (a hashable key: an agent and the kind of traffic, e.g. its watch or its
writes), as a real agent keeps its own: a request takes an idle connection of its lane or opens one, and gives
it back when the response is complete and the server keeps it alive. A connection idle for
:data:`IDLE_EXPIRY` seconds is closed by a sweeper before the controller's keep-alive timeout (5 s) would
close it under a request. If a reused connection turns out closed by the server before a byte of the request
could be written, or closes without a byte of response (the keep-alive race, where the server dropped it
before reading the request; or a controller that went away, where the retry then fails to connect), the
request is retried once on a new connection (counted in :attr:`Client.retried`; a report batch sent twice so is
absorbed by its idempotency key); any other failure raises an :class:`HTTPError` subclass named like httpx's
(``ConnectError``, ``ReadTimeout``, ``ReadError``, ``RemoteProtocolError``), whose class name the caller
counts.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

import h11

IDLE_EXPIRY = 4.0  # seconds: below the controller's keep-alive timeout (5 s)
SWEEP_PERIOD = 0.5  # an idle connection is closed after IDLE_EXPIRY - SWEEP_PERIOD to IDLE_EXPIRY seconds


class HTTPError(Exception):
    """A request that got no complete response (the class name is what the simulator's stats count)."""


class ConnectError(HTTPError):
    """The TCP connection could not be opened (controller down, refused)."""


class ConnectTimeout(HTTPError):
    """The TCP connection was not open before the request's deadline."""


class ReadTimeout(HTTPError):
    """No complete response before the request's deadline (the connection is dropped)."""


class ReadError(HTTPError):
    """The connection was closed or reset in the middle of the response."""


class RemoteProtocolError(HTTPError):
    """The server closed the connection without a response, or answered something that is not HTTP/1.1."""


class _Stale(HTTPError):
    """A reused connection the server had closed; nothing of the request was processed: retry on a new one."""


class Response:
    """Status, headers (lower-case names) and body of one response."""

    __slots__ = ("_headers", "_raw", "content", "status_code")

    def __init__(self, status_code: int, raw_headers: list[tuple[bytes, bytes]], content: bytes) -> None:
        self.status_code = status_code
        self.content = content
        self._raw = raw_headers
        self._headers: dict[str, str] | None = None

    @property
    def headers(self) -> dict[str, str]:
        if self._headers is None:
            self._headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in self._raw}
        return self._headers


class _Connection(asyncio.Protocol):
    """One TCP connection and its h11 state; at most one request in flight."""

    __slots__ = ("body", "client", "dead", "h11", "idle_since", "lane", "raw_headers", "received", "status",
                 "timer", "transport", "used", "waiter")

    def __init__(self, client: Client, lane: object) -> None:
        self.client, self.lane = client, lane
        self.h11 = h11.Connection(h11.CLIENT)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Response] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.received = False  # a byte of the current response arrived
        self.used = 0  # responses completed on this connection
        self.idle_since = 0.0
        self.dead = False

    # ------------------------------------------------------------------ asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.client.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # nothing asked (e.g. a 408 before the server closes): not reusable
            self.close()
            return
        self.received = True
        try:
            self.h11.receive_data(data)
            self._pump()
        except h11.RemoteProtocolError as exc:
            self._fail(RemoteProtocolError(str(exc)))

    def eof_received(self) -> bool:
        if self.waiter is not None:
            with contextlib.suppress(h11.RemoteProtocolError):  # a response cut short: failed just below
                self.h11.receive_data(b"")
                self._pump()  # completes a response delimited by the close
            if self.waiter is not None:
                self._fail(self._closed_error())
        self.dead = True
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.dead = True
        if self.waiter is not None:
            self._fail(self._closed_error())
        self.client._forget(self)

    # ------------------------------------------------------------------ one request
    def start(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes | None,
              timeout: float) -> asyncio.Future[Response]:
        """Write one request; the future resolves to its response (or raises an :class:`HTTPError`)."""
        tr = self.transport
        if self.dead or tr is None or tr.is_closing():
            self.close()
            raise _Stale("connection closed before the request was written")
        h = self.h11
        data = h.send(h11.Request(method=method, target=target, headers=headers))
        if body:
            data += h.send(h11.Data(data=body))
        data += h.send(h11.EndOfMessage())
        loop = self.client.loop
        self.waiter = fut = loop.create_future()
        self.received = False
        self.body = []
        tr.write(data)
        self.timer = loop.call_later(timeout, self._timed_out)
        return fut

    def _pump(self) -> None:
        h = self.h11
        while True:
            ev = h.next_event()
            t = type(ev)
            if t is h11.Data:
                self.body.append(ev.data)  # type: ignore[union-attr]
            elif t is h11.Response:
                self.status = ev.status_code  # type: ignore[union-attr]
                self.raw_headers = ev.headers  # type: ignore[union-attr,assignment]
            elif t is h11.EndOfMessage:
                self._complete()
                return
            elif t is h11.ConnectionClosed:
                self._fail(self._closed_error())
                return
            elif t is h11.InformationalResponse:
                continue
            else:  # NEED_DATA (or PAUSED)
                return

    def _complete(self) -> None:
        resp = Response(self.status, self.raw_headers, b"".join(self.body))
        self.body = []
        self.used += 1
        h = self.h11
        if h.our_state is h11.DONE and h.their_state is h11.DONE:
            h.start_next_cycle()
        else:  # Connection: close (or HTTP/1.0): not reusable
            self.dead = True
            if self.transport is not None:
                self.transport.close()
        self._settle(resp, None)

    def _closed_error(self) -> HTTPError:
        if self.received:
            return ReadError("connection closed in the middle of the response")
        if self.used:
            return _Stale("reused connection closed by the server without a response")
        return RemoteProtocolError("server disconnected without sending a response")

    def _timed_out(self) -> None:
        self.timer = None
        self._fail(ReadTimeout("no complete response in time"))

    def _fail(self, exc: HTTPError) -> None:
        self.dead = True
        if self.transport is not None:
            self.transport.abort()
        self._settle(None, exc)

    def _settle(self, resp: Response | None, exc: HTTPError | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        fut, self.waiter = self.waiter, None
        if fut is None or fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(resp)  # type: ignore[arg-type]

    def close(self) -> None:
        self.dead = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class Client:
    """Persistent HTTP/1.1 connections to one server, kept per lane; create it inside the running loop."""

    def __init__(self, base_url: str, *, idle_expiry: float = IDLE_EXPIRY) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"only http://host:port URLs are supported, not {base_url!r}")
        self.host, self.port = u.hostname, u.port or 80
        self.host_header = u.netloc.encode()
        self.prefix = u.path.rstrip("/").encode()
        self.idle_expiry = idle_expiry
        self.loop = asyncio.get_running_loop()
        self.lanes: dict[object, list[_Connection]] = {}  # lane -> its idle connections
        self.idle: dict[_Connection, None] = {}  # every idle connection, oldest first
        self.connections: set[_Connection] = set()  # every open one
        self.sweeper: asyncio.Task[None] | None = None
        self.closed = False
        self.retried = 0  # requests retried on a new connection after a reused one turned out closed
        self.opened = 0  # connections opened

    async def request(self, lane: object, method: str, path: str, headers: list[tuple[bytes, bytes]],
                      body: bytes | None = None, *, timeout: float = 30.0) -> Response:
        """One request on a connection of ``lane`` (``headers`` without Host and Content-Length)."""
        if self.sweeper is None:
            self.sweeper = self.loop.create_task(self._sweep())
        deadline = self.loop.time() + timeout
        hdrs = [(b"host", self.host_header), *headers]
        if body:
            hdrs.append((b"content-length", str(len(body)).encode()))
        m, target = method.encode(), self.prefix + path.encode()
        for attempt in (0, 1):
            conn = self._take(lane) if attempt == 0 else None  # the retry: on a new connection
            if conn is None:
                conn = await self._connect(lane, deadline)
            try:
                resp = await conn.start(m, target, hdrs, body, max(0.001, deadline - self.loop.time()))
            except _Stale:
                if attempt:
                    raise RemoteProtocolError("server disconnected without sending a response") from None
                self.retried += 1
                continue
            except BaseException:  # timed out, reset, cancelled: the connection's state is unknown
                conn.close()
                raise
            if conn.dead:
                conn.close()
            else:
                self._give_back(conn)
            return resp
        raise AssertionError("unreachable")

    def _take(self, lane: object) -> _Connection | None:
        idle = self.lanes.get(lane)
        while idle:
            conn = idle.pop()
            self.idle.pop(conn, None)
            if not conn.dead and self.loop.time() - conn.idle_since < self.idle_expiry:
                return conn
            conn.close()
        return None

    def _give_back(self, conn: _Connection) -> None:
        conn.idle_since = self.loop.time()
        self.lanes.setdefault(conn.lane, []).append(conn)
        self.idle[conn] = None

    def _forget(self, conn: _Connection) -> None:
        self.connections.discard(conn)
        if conn in self.idle:  # closed by the server while idle
            del self.idle[conn]
            self.lanes[conn.lane].remove(conn)

    async def _connect(self, lane: object, deadline: float) -> _Connection:
        if self.closed:
            raise ConnectError("client closed")
        conn = _Connection(self, lane)
        try:
            await asyncio.wait_for(self.loop.create_connection(lambda: conn, self.host, self.port),
                                   max(0.001, deadline - self.loop.time()))
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {self.host}:{self.port} in time") from None
        except OSError as exc:
            raise ConnectError(f"{self.host}:{self.port}: {exc}") from None
        self.opened += 1
        return conn

    async def _sweep(self) -> None:
        """Close connections idle for ``idle_expiry`` seconds (oldest first, so it stops at the first young one)."""
        while True:
            await asyncio.sleep(SWEEP_PERIOD)
            cutoff = self.loop.time() - self.idle_expiry + SWEEP_PERIOD
            old = []
            for conn in self.idle:
                if conn.idle_since > cutoff:
                    break
                old.append(conn)
            for conn in old:
                self.idle.pop(conn, None)
                self.lanes[conn.lane].remove(conn)
                conn.close()

    async def aclose(self) -> None:
        """Close every connection (requests in flight fail) and stop the sweeper."""
        self.closed = True
        if self.sweeper is not None:
            self.sweeper.cancel()
            await asyncio.gather(self.sweeper, return_exceptions=True)
        for conn in list(self.connections):
            conn.close()
        self.lanes.clear()
        self.idle.clear()
        await asyncio.sleep(0)  # let the transports deliver connection_lost
