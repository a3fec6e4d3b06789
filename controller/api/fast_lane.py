"""The agents' common requests answered outside the framework, every other request handed to it unchanged.

Every node sends a heartbeat every heartbeat period (10,000 nodes: about 700 a second) and, while it is a
canary, its trial reports (5,000 a second at that scale); nearly all of them are the same happy case: a node
token this replica has cached, a valid body, an answer the route would give. :class:`FastLane` (the outermost
ASGI app) serves that case without FastAPI's routing, dependency resolution, exception middleware and the
app's three middlewares (on 16 cores 0.41-0.46 ms of the API process's CPU a report against 0.50-0.52 through
the route, docs/benchmarks.md); each lane route
(:class:`LaneRoute`: ``controller.api.heartbeat_lane``, ``controller.api.report_lane``) computes its answer with
the same functions its FastAPI route calls. Anything else is handed to the route unchanged, its body replayed,
so errors, status codes and the OpenAPI schema stay the route's: a request the lane would not take from its
headers (no declared length or one over the route's body limit, a header block over ``max_header_bytes``, a
content type that is not JSON, a token that is not a cached node token) goes the full way before its body is
read, and one whose body or outcome is not the common case (the lane route answers None, or raises) after.
The lane applies the app's body deadline itself and records the same request metric.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controller.api.body import is_json
from controller.api.deps import AppState, parse_bearer, scope_header
from controller.auth import AuthError, Principal
from controller.errors import Overloaded
from controller.http_limits import header_block_bytes
from kernelctl.settings import Settings

Reply = tuple[int, bytes, list[tuple[bytes, bytes]]]  # status, JSON body, extra headers
JSON = [(b"content-type", b"application/json")]


def detail(status: int, message: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> Reply:
    """``{"detail": message}`` as the app's handlers render it (Starlette's ``JSONResponse``)."""
    body = json.dumps({"detail": message}, ensure_ascii=False, separators=(",", ":")).encode()
    return status, body, list(headers)


def overloaded(exc: Overloaded) -> Reply:
    """Refused for load: 503, and when to come back (``Retry-After``)."""
    return detail(503, str(exc), [(b"retry-after", exc.retry_after_header.encode())])


class LaneRoute(Protocol):
    """One route the lane serves: its path, its body limit, and its answer to the common case."""

    path: str

    def body_limit(self, settings: Settings) -> int:
        """The largest body the route takes (the app's ``BodyLimitMiddleware`` limit for its path)."""
        ...

    async def answer(self, state: AppState, principal: Principal, token: str, body: bytes) -> Reply | None:
        """The reply to a request from ``principal`` (a cached node token) with a JSON ``body``; None (or an
        exception) hands the request to the FastAPI route, which answers it from scratch."""
        ...


class FastLane:
    """The outermost ASGI app: the lane routes' common case served directly, everything else passed to ``app``
    (the FastAPI app with its middlewares)."""

    def __init__(self, app: ASGIApp, get_state: Callable[[], AppState | None], routes: Sequence[LaneRoute]) -> None:
        self.app = app
        self.get_state = get_state
        self.routes = {r.path: r for r in routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        state = self.get_state() if route is not None else None
        taken = _takes(state, route, scope) if state is not None and route is not None else None
        if taken is None:  # chunked, too large, not JSON, not a cached node token, not a lane route
            await self.app(scope, receive, send)
            return
        assert state is not None and route is not None
        principal, token = taken
        started = time.perf_counter()
        chunks: list[bytes] = []
        try:
            async with asyncio.timeout(state.settings.body_timeout_seconds):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client went away: let the route see it
                        await self.app(scope, _replay(chunks, message, receive), send)
                        return
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            reply = detail(408, f"request body not received within {state.settings.body_timeout_seconds:g} seconds",
                           [(b"connection", b"close")])
        else:
            body = b"".join(chunks)
            try:
                answered = await route.answer(state, principal, token, body)
            except Exception:  # e.g. the database is down: the route answers it again, with the app's handlers
                answered = None
            if answered is None:
                await self.app(scope, _replay([body], None, receive), send)
                return
            reply = answered
        status, payload, headers = reply
        await send({"type": "http.response.start", "status": status,
                    "headers": [*JSON, (b"content-length", str(len(payload)).encode()), *headers]})
        await send({"type": "http.response.body", "body": payload})
        state.metrics.http_duration.labels("POST", route.path, str(status)).observe(time.perf_counter() - started)


def _takes(state: AppState, route: LaneRoute, scope: Scope) -> tuple[Principal, str] | None:
    """Before the body is read: the cached node principal and its token when the route's checks would pass
    (a declared length within its limit, header block size, a JSON content type, a cached node token)."""
    length = _declared_length(scope)
    if length is None or length > route.body_limit(state.settings) \
            or header_block_bytes(scope) > state.settings.max_header_bytes \
            or not is_json(scope_header(scope, b"content-type")):
        return None
    try:
        token = parse_bearer(scope_header(scope, b"authorization"))
        principal = state.cached_principal(token)
    except AuthError:
        return None
    if token is None or principal is None or principal.role != "agent" or principal.node is None:
        return None
    return principal, token


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(chunks: list[bytes], last: Message | None, receive: Receive) -> Receive:
    """A receive() that hands the body already read to the route, then goes on with the connection's."""
    pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
    if last is not None:
        pending = [last]

    async def replay() -> Any:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
