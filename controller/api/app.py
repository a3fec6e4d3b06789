"""The FastAPI application: ``create_app(settings)`` wires routes, errors, metrics, body limits and lifespan.

Lifespan: open the database (schema must be at head), hash the bootstrap tokens in, start the leader
elector and the scheduler (which acts only while this replica leads); on shutdown stop both and release
leadership. Every error answers JSON ``{"detail": "..."}`` with the status the API contract names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DataError, IntegrityError, OperationalError
from sqlalchemy.orm.exc import StaleDataError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_random

from controller.api import routes_agents, routes_bundles, routes_fleet, routes_rollouts
from controller.api.deps import AUTH_SWEEP_SECONDS, AppState, parse_bearer, scope_header
from controller.api.fast_lane import FastLane, LaneRoute
from controller.api.heartbeat_lane import HeartbeatRoute
from controller.api.report_lane import ReportRoute
from controller.api.routes_ui import router as ui_router  # the browser UI under /ui
from controller.auth import AuthError, Forbidden, load_bootstrap_tokens
from controller.db.engine import DatabaseError, make_engine, session_factory
from controller.db.migrate import check_schema_current
from controller.desired.hub import DesiredHub
from controller.errors import KernelctlError, first_line
from controller.http_limits import header_block_bytes
from controller.leader import LeaderElector
from controller.metrics import Metrics
from kernelctl import __version__, wire
from kernelctl.settings import Settings

log = logging.getLogger(__name__)
MAX_ERRORS = 20  # field errors listed in one 422

class BodyLimitMiddleware:
    """Bounded request bodies: a size limit per route and a deadline for the whole body.

    Headers: the request line and headers together at most ``max_header_bytes`` (431). Sizes: bundle uploads
    ``max_bundle_bytes``, report batches ``max_report_body_bytes``, every other body
    ``max_request_bytes``; 413 at once from Content-Length, or while streaming without it. Time: the body must
    arrive within ``body_timeout_seconds`` of the first read (408), so a client trickling a body cannot hold a
    worker. (The request headers' deadline is the protocol's: ``controller.http_limits``.)
    """

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    def limit_for(self, method: str, path: str) -> tuple[int, str]:
        path = path.rstrip("/")
        if method == "POST" and path == "/v1/bundles":
            return self.settings.max_bundle_bytes, "bundle"
        if method == "POST" and path == "/v1/agents/reports":
            return self.settings.max_report_body_bytes, "report batch"
        return self.settings.max_request_bytes, "request body"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = header_block_bytes(scope)
        if head > self.settings.max_header_bytes:  # h11 bounds only a header block that arrives in pieces
            await _send_json(send, 431, f"request line and headers of {head} bytes are over the limit of "
                             f"{self.settings.max_header_bytes} bytes")
            return
        limit, what = self.limit_for(scope["method"], scope["path"])
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = -1
                if length > limit:
                    await _send_json(send, 413, f"{what} of {length} bytes is over the limit of {limit} bytes")
                    return
        seen = 0
        timeout = self.settings.body_timeout_seconds
        deadline: float | None = None

        async def limited_receive() -> Message:
            nonlocal seen, deadline
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + timeout
            if deadline == float("inf"):
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):  # no task per receive (wait_for makes one)
                    message = await receive()
            except TimeoutError:
                raise HTTPException(408, f"{what} not received within {timeout:g} seconds",
                                    headers={"Connection": "close"}) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, f"{what} is over the limit of {limit} bytes",
                                        headers={"Connection": "close"})
                if not message.get("more_body", False):
                    deadline = float("inf")  # complete: later receive() calls wait for a disconnect
            return message

        await self.app(scope, limited_receive, send)


class TokenBeforeBody:
    """A request that carries a body (every POST under ``/v1``: register, heartbeat, reports, bundle push,
    rollout start, promote, ...) is authenticated from its headers before a byte of the body is read: a missing,
    malformed, unknown, revoked or expired token is answered 401 at once and the connection closed, so an
    unauthenticated client holds nothing while it sends (or trickles) a body. Roles are still checked by the
    route; a database that cannot be reached is left to the route too (its 503)."""

    def __init__(self, app: ASGIApp, get_state: Callable[[], AppState | None]) -> None:
        self.app = app
        self.get_state = get_state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.get_state() if scope["type"] == "http" and scope["method"] == "POST" \
            and scope["path"].startswith(wire.API_PREFIX + "/") else None
        if state is not None:
            try:
                token = parse_bearer(scope_header(scope, b"authorization"))
                if state.cached_principal(token) is None:
                    await run_in_threadpool(state.authenticate, token)
            except AuthError as exc:
                await _send_json(send, 401, str(exc), [(b"www-authenticate", b"Bearer"), (b"connection", b"close")])
                return
            except Exception:  # e.g. the database is down: the route answers it (503)
                pass
        await self.app(scope, receive, send)


async def _send_json(send: Send, status: int, detail: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    import json

    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class MetricsMiddleware:
    """Record request duration by method, route template and status (never the raw path)."""

    def __init__(self, app: ASGIApp, get_metrics: Callable[[], Metrics | None]) -> None:
        self.app = app
        self.get_metrics = get_metrics  # the metrics live in the app state, built by the lifespan

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        metrics = self.get_metrics() if scope["type"] == "http" else None
        if metrics is None:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            metrics.http_duration.labels(scope["method"], template, str(status["code"])).observe(
                time.perf_counter() - start
            )


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _error(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    if status == 422:  # one shape for every 422, as the OpenAPI schema declares (FastAPI's error list)
        return JSONResponse({"detail": [{"loc": ["body"], "msg": detail, "type": "value_error"}]},
                            status_code=422, headers=headers)
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    from kernelpack.errors import BundleError

    @app.exception_handler(RequestValidationError)
    async def _validation(_r: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's field list without the inputs: a refusal names the field and the rule, it never echoes
        # what was sent (a 4 MiB batch would come back whole); made JSON-safe (a NaN bound in ctx)
        errors = [{k: v for k, v in e.items() if k != "input"} for e in exc.errors()[:MAX_ERRORS]]
        if len(exc.errors()) > MAX_ERRORS:
            more = len(exc.errors()) - MAX_ERRORS
            errors.append({"type": "too_many_errors", "loc": ["body"],
                           "msg": f"and {more} more errors (only the first {MAX_ERRORS} shown)"})
        return JSONResponse({"detail": _json_safe(jsonable_encoder(errors))}, status_code=422)

    @app.exception_handler(AuthError)
    async def _auth(_r: Request, exc: AuthError) -> JSONResponse:
        return _error(401, str(exc), {"WWW-Authenticate": "Bearer"})

    @app.exception_handler(Forbidden)
    async def _forbidden(_r: Request, exc: Forbidden) -> JSONResponse:
        return _error(403, str(exc))

    @app.exception_handler(KernelctlError)
    async def _domain(_r: Request, exc: KernelctlError) -> JSONResponse:
        return _error(exc.status_code, str(exc))

    @app.exception_handler(BundleError)
    async def _bundle(_r: Request, exc: BundleError) -> JSONResponse:
        return _error(422, f"bundle refused: {exc}")

    @app.exception_handler(StaleDataError)
    async def _stale(_r: Request, _exc: StaleDataError) -> JSONResponse:
        return _error(409, "another writer changed this rollout at the same time; nothing was changed, retry")

    @app.exception_handler(IntegrityError)
    async def _integrity(_r: Request, exc: IntegrityError) -> JSONResponse:
        cause = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else "constraint violated"
        return _error(409, f"conflict with existing data: {cause}")

    @app.exception_handler(DataError)
    async def _data(_r: Request, exc: DataError) -> JSONResponse:
        # a value the database refuses (out of range, NUL byte, ...): the request's fault, not the server's.
        # Inputs are bounded at the wire first; this is the backstop, it never answers 5xx.
        cause = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else "value refused"
        log.warning("request value refused by the database: %s", cause)
        return _error(422, f"a request value is out of range for the database: {cause[:200]}")

    @app.exception_handler(OperationalError)
    async def _db(_r: Request, exc: OperationalError) -> JSONResponse:
        cause = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else str(exc)
        log.error("database error: %s", cause)
        return _error(503, f"database unavailable: {cause}", {"Retry-After": "2"})

    @app.exception_handler(DatabaseError)
    async def _db2(_r: Request, exc: DatabaseError) -> JSONResponse:
        return _error(503, str(exc), {"Retry-After": "2"})


def _load_trusted_keys(settings: Settings) -> dict | None:
    if settings.trusted_keys_dir is None:
        return None
    from kernelpack.signing import load_trusted_keys

    return load_trusted_keys(settings.trusted_keys_dir)


@retry(retry=retry_if_exception_type(IntegrityError), stop=stop_after_attempt(3), wait=wait_random(0, 0.2), reraise=True)
def _bootstrap(state: AppState) -> int:
    assert state.settings.bootstrap_tokens_file is not None
    with state.tx() as session:
        return load_bootstrap_tokens(session, state.settings.bootstrap_tokens_file)


def build_state(settings: Settings) -> AppState:
    """The composition root: open the database (schema must be at head), build the replica's parts (metrics,
    leader elector, desired-state hub with its generation hooks on the sessions) and load trusted keys and
    bootstrap tokens. The lifespan starts and stops what runs (the hub, the scheduler)."""
    engine = make_engine(settings.database_url)
    check_schema_current(engine)
    metrics = Metrics()
    factory = session_factory(engine)
    metrics.bind_database(factory)
    elector = LeaderElector(settings.database_url, on_change=lambda lead: metrics.leader.set(1 if lead else 0))
    hub = DesiredHub(factory, settings.database_url, poll_seconds=settings.watch_poll_seconds,
                     liveness_flush_seconds=settings.liveness_flush_seconds,
                     max_pending_writes=settings.max_pending_writes, max_queued_writes=settings.max_queued_writes,
                     queue_deadline_seconds=settings.queue_deadline_seconds,
                     max_watches_per_node=settings.max_watches_per_node, ingest_processes=settings.ingest_processes,
                     max_report_batch=settings.max_report_batch, metrics=metrics)
    state = AppState(
        settings=settings,
        engine=engine,
        factory=factory,
        metrics=metrics,
        elector=elector,
        hub=hub,
        trusted_keys=_load_trusted_keys(settings),
    )
    if settings.bootstrap_tokens_file is not None:
        added = _bootstrap(state)
        log.info("bootstrap tokens: %d added from %s", added, settings.bootstrap_tokens_file)
    return state


async def _sweep_auth(state: AppState) -> None:
    """Every few seconds: drop cached principals of tokens revoked or expired elsewhere (AppState)."""
    while True:
        await asyncio.sleep(AUTH_SWEEP_SECONDS)
        try:
            await asyncio.to_thread(state.sweep_lapsed_tokens)
        except Exception as exc:  # database down: entries lapse after auth_cache_seconds as before
            log.warning("auth cache sweep failed: %s", first_line(exc))


def create_app(settings: Settings, *, state: AppState | None = None, run_scheduler: bool = True) -> FastAPI:
    """The controller's ASGI app. ``state`` may be pre-built (``build_state``) to fail before serving."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from controller.scheduler import ControllerScheduler

        st = state or build_state(settings)
        app.state.kctl = st
        with contextlib.suppress(Exception):  # the database may be down at start: tokens are looked up then
            await asyncio.to_thread(st.warm_auth_cache)
        await st.hub.start()  # desired-state push and batched liveness (controller.desired), every replica
        sweeper = asyncio.create_task(_sweep_auth(st), name="auth-sweep")
        scheduler = ControllerScheduler(st) if run_scheduler else None
        if scheduler is not None:
            scheduler.start()
        try:
            yield
        finally:
            if scheduler is not None:
                scheduler.shutdown()
            sweeper.cancel()
            await st.hub.stop()
            st.elector.release()
            st.metrics.leader.set(0)
            st.engine.dispose()

    app = FastAPI(
        title="kernelctl controller",
        version=__version__,
        description="Canary rollouts of GPU kernel bundles: agents, bundles, rollouts, fleet and audit.",
        lifespan=lifespan,
        # the schema and the interactive docs answer without a token: off unless KERNELCTL_API_DOCS is set
        openapi_url="/openapi.json" if settings.api_docs else None,
        docs_url="/docs" if settings.api_docs else None,
        redoc_url=None,
    )

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    def readyz(request: Request) -> JSONResponse:
        st: AppState = request.app.state.kctl
        try:
            check_schema_current(st.engine)
        except DatabaseError as exc:
            return JSONResponse({"ready": False, "leader": st.elector.is_leader, "detail": str(exc)}, 503)
        # leader: whether the process that answered leads (one of a replica's API workers does)
        return JSONResponse({"ready": True, "leader": st.elector.is_leader, "version": __version__,
                             "pid": os.getpid()})

    @app.get("/metrics", include_in_schema=False)
    def metrics(request: Request) -> Response:
        st: AppState = request.app.state.kctl
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    for module in (routes_agents, routes_bundles, routes_rollouts, routes_fleet):
        app.include_router(module.router)
    app.include_router(ui_router)
    _install_error_handlers(app)

    get_state = lambda: getattr(app.state, "kctl", None)  # noqa: E731 - built by the lifespan
    app.add_middleware(TokenBeforeBody, get_state=get_state)  # innermost: after the header and size checks
    app.add_middleware(BodyLimitMiddleware, settings=settings)
    app.add_middleware(MetricsMiddleware, get_metrics=lambda: getattr(get_state(), "metrics", None))
    lanes: list[LaneRoute] = [*([HeartbeatRoute()] if settings.heartbeat_lane else []),
                              *([ReportRoute()] if settings.report_lane else [])]
    if lanes:
        build = app.build_middleware_stack  # the fast lane goes outside every middleware (controller.api.fast_lane)
        app.build_middleware_stack = lambda: FastLane(build(), get_state, lanes)  # type: ignore[method-assign]
    return app
