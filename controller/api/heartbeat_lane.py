"""The heartbeat, answered: one function for the FastAPI route and the fast lane (``controller.api.fast_lane``).

:func:`answer` makes the reply to a heartbeat whose node the caller checked; :class:`HeartbeatRoute` is the
lane's common case of ``POST /v1/agents/heartbeat``: a body that validates as ``wire.HeartbeatRequest`` from
the node its cached token belongs to (anything else is the route's).
"""

from __future__ import annotations

import time

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from controller.api.deps import AppState
from controller.api.fast_lane import Reply, detail, overloaded
from controller.auth import AuthError, Principal
from controller.desired.waiters import TooManyWatches
from controller.errors import Overloaded
from kernelctl import wire
from kernelctl.settings import Settings

PATH = wire.API_PREFIX + "/agents/heartbeat"


async def answer(state: AppState, req: wire.HeartbeatRequest, token: str | None) -> Reply:
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
        return overloaded(exc)
    except AuthError as exc:
        return detail(401, str(exc), [(b"www-authenticate", b"Bearer")])
    except TooManyWatches as exc:
        return detail(429, str(exc))
    state.metrics.heartbeat_service.labels(path).observe(max(0.0, time.perf_counter() - started - held))
    return 200, reply.model_dump_json().encode(), []


class HeartbeatRoute:
    """The fast lane's heartbeat: a valid body from the token's own node (``controller.api.fast_lane``)."""

    path = PATH

    def body_limit(self, settings: Settings) -> int:
        return settings.max_request_bytes

    async def answer(self, state: AppState, principal: Principal, token: str, body: bytes) -> Reply | None:
        try:
            req = wire.HeartbeatRequest.model_validate_json(body)
        except (ValidationError, ValueError):
            return None
        if principal.node != req.node_name:
            return None
        return await answer(state, req, token)
