"""The heartbeat, answered: shared by the FastAPI route and a lane that skips the framework for the common case.

Every node of the fleet sends ``POST /v1/agents/heartbeat`` every heartbeat period (10,000 nodes: about 700
a second), and nearly all of them are the same happy case: a node token this replica has cached, a valid
body, a reply from the desired-state snapshot. :class:`HeartbeatLane` (an ASGI middleware) serves exactly that
case without FastAPI's routing, dependency resolution and exception middleware: the body is validated by the
same pydantic model (``wire.HeartbeatRequest``), the caller by the same auth cache and node check, and the
answer comes from :func:`answer`, which the route uses too. Anything else (no or unknown token, another
node's token, a body that does not validate) is handed to the route unchanged, its body replayed, so errors,
status codes and the OpenAPI schema stay the route's. The lane wraps the whole app (it is outside FastAPI's
middlewares) and applies their body size and deadline limits and request metric itself; it takes only a
request the route would take as it is (a JSON content type, a header block within ``max_header_bytes``, a
token it has cached, checked before the body is read): any other input goes the full way, so the lane and the
route give the same answer for every input.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controller.api.body import is_json
from controller.api.deps import AppState, parse_bearer, scope_header
from controller.auth import AuthError
from controller.desired.waiters import TooManyWatches
from controller.errors import Overloaded
from controller.http_limits import header_block_bytes
from kernelctl import wire

PATH = wire.API_PREFIX + "/agents/heartbeat"
JSON = [(b"content-type", b"application/json")]


async def answer(state: AppState, req: wire.HeartbeatRequest,
                 token: str | None) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """Status, body and extra headers of the reply to a heartbeat its node sent (the caller checked that with
    ``token``; a watch that waited checks it again before answering: a revoked token gets 401)."""
    started = time.perf_counter()

    async def recheck() -> None:
        if state.cached_principal(token) is None:  # dropped from the cache (revoked, expired) or aged out
            await run_in_threadpool(state.authenticate, token)

    try:
        reply, held, path = await state.hub.heartbeat(req, heartbeat_seconds=state.settings.heartbeat_seconds,
                                                      recheck=recheck)
    except Overloaded as exc:
        return 503, json.dumps({"detail": str(exc)}).encode(), [
            (b"retry-after", exc.retry_after_header.encode())]
    except AuthError as exc:
        return 401, json.dumps({"detail": str(exc)}).encode(), [(b"www-authenticate", b"Bearer")]
    except TooManyWatches as exc:
        return 429, json.dumps({"detail": str(exc)}).encode(), []
    state.metrics.heartbeat_service.labels(path).observe(max(0.0, time.perf_counter() - started - held))
    return 200, reply.model_dump_json().encode(), []


class HeartbeatLane:
    """The outermost ASGI app: the common heartbeat served directly, everything else passed to ``app`` (the
    FastAPI app with its middlewares). The lane applies the same limits itself (a declared body within
    ``max_request_bytes``, received within ``body_timeout_seconds``; anything else goes the full way) and
    records the same request metric."""

    def __init__(self, app: ASGIApp, get_state: Callable[[], AppState | None]) -> None:
        self.app = app
        self.get_state = get_state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.get_state() if scope["type"] == "http" and scope["method"] == "POST" \
            and scope["path"] == PATH else None
        length = _declared_length(scope) if state is not None else None
        if state is None or length is None or length > state.settings.max_request_bytes \
                or not _route_would_take(state, scope):
            await self.app(scope, receive, send)  # chunked, too large, not a heartbeat: the full stack answers
            return
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
            status = 408
            detail = f"request body not received within {state.settings.body_timeout_seconds:g} seconds"
            await _send(send, status, json.dumps({"detail": detail}).encode(), [(b"connection", b"close")])
        else:
            body = b"".join(chunks)
            req, token = _common_case(state, scope, body)
            if req is None:
                await self.app(scope, _replay([body], None, receive), send)
                return
            try:
                status, payload, headers = await answer(state, req, token)
            except Exception:  # e.g. the database is down: the route answers it again, with the app's handlers
                await self.app(scope, _replay([body], None, receive), send)
                return
            await _send(send, status, payload, headers)
        state.metrics.http_duration.labels("POST", PATH, str(status)).observe(time.perf_counter() - started)


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send(send: Send, status: int, payload: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*JSON, (b"content-length", str(len(payload)).encode()), *headers]})
    await send({"type": "http.response.body", "body": payload})


def _route_would_take(state: AppState, scope: Scope) -> bool:
    """Before the body is read: headers the route's checks pass (size, JSON content type, a cached token)."""
    if header_block_bytes(scope) > state.settings.max_header_bytes or not is_json(scope_header(scope, b"content-type")):
        return False
    try:
        return state.cached_principal(parse_bearer(scope_header(scope, b"authorization"))) is not None
    except AuthError:
        return False


def _common_case(state: AppState, scope: Scope, body: bytes) -> tuple[wire.HeartbeatRequest | None, str | None]:
    """The request and its token when it is the lane's case (cached token of this very node, valid body), else
    (None, None)."""
    try:
        token = parse_bearer(scope_header(scope, b"authorization"))
        principal = state.cached_principal(token)
        req = wire.HeartbeatRequest.model_validate_json(body) if principal is not None else None
    except (AuthError, ValidationError, ValueError):
        return None, None
    if req is None or principal is None or principal.role != "agent" or principal.node != req.node_name:
        return None, None
    return req, token


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
