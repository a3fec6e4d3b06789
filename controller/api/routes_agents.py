"""Agent endpoints: register (enrollment or node token), heartbeat (desired state) and report batches.

A node token acts only for its own node; an enrollment token may only register a *new* node (re-registering
an existing one needs that node's token, or a node token an operator issued with ``kernelctl token create
--role agent --node NAME``). Every registration issues a fresh node token and revokes the node's earlier
ones. Each request is one transaction; a replayed report batch (same idempotency keys) is accepted once;
reports from nodes that are not current canaries of a live rollout are refused one by one (counted).

Heartbeats are served by every replica from its desired-state snapshot (``controller.desired``): a heartbeat
that changes nothing but liveness costs no transaction, and one that carries ``generation`` and
``wait_seconds`` is held until the node's desired state changes (push). Writes (registrations, heartbeats that
change something) and report batches each wait at most ``max_pending_writes`` at once per replica, on their own
threads (``controller.desired.lanes``); more are answered 503 with ``Retry-After`` (agents back off with jitter
and keep their outbox).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import IntegrityError
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_random

from controller import ingest, registry
from controller.api import heartbeat_lane
from controller.api.body import is_json, openapi_body, parse_body, too_many
from controller.api.deps import AppState, CurrentPrincipal, State, bearer_token
from controller.auth import Forbidden, Principal, require_node, require_role
from controller.db.models import utcnow
from controller.enrollment import Registration
from controller.errors import Invalid, Overloaded
from kernelctl import wire

router = APIRouter(prefix=wire.API_PREFIX + "/agents", tags=["agents"])


@router.post("/register", response_model=wire.RegisterResponse)
async def register(req: wire.RegisterRequest, principal: CurrentPrincipal, state: State) -> Any:
    """Register (or re-register) a node; returns a node-bound token the agent uses from then on.

    Registrations arriving together are committed together (``controller.enrollment``, group commit)."""
    require_role(principal, "agent")
    if principal.node is not None and principal.node != req.node_name:
        raise Forbidden(f"this token belongs to node {principal.node!r}, not {req.node_name!r}")
    try:
        done = await state.hub.register(Registration(req, principal.actor, new_only=principal.is_enrollment,
                                                        minted_by=principal.token_id))
    except Overloaded as exc:
        return _overloaded(exc)
    state.forget_node(req.node_name)  # the node's earlier tokens are revoked: no cached principal outlives them
    if done.token_id is not None:  # its first heartbeat needs no token lookup
        state.remember(done.token, Principal(done.token_id, f"node:{req.node_name}"[:128], "agent", req.node_name))
    return wire.RegisterResponse(
        node_name=req.node_name, node_token=done.token, heartbeat_seconds=state.settings.heartbeat_seconds
    )


def _overloaded(exc: Overloaded) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=503,
                        headers={"Retry-After": exc.retry_after_header})


@router.post("/heartbeat", response_model=wire.HeartbeatResponse)
async def heartbeat(req: wire.HeartbeatRequest, request: Request, principal: CurrentPrincipal,
                    state: State) -> Response:
    """Record liveness, staged and active versions; answer with the node's desired state.

    With ``generation`` and ``wait_seconds`` the reply waits until the desired state moves past
    ``generation`` (or the wait ends): the watch through which a rollback reaches the node at once.
    """
    require_node(principal, req.node_name)
    status, body, headers = await heartbeat_lane.answer(state, req, bearer_token(request))
    return Response(body, status_code=status, media_type="application/json",
                    headers={k.decode(): v.decode() for k, v in headers})


@router.post("/reports", response_model=wire.ReportBatchResponse, response_model_exclude_unset=True,
             openapi_extra=openapi_body(wire.ReportBatch))
async def reports(request: Request, principal: CurrentPrincipal, state: State) -> Response:
    """Ingest a batch of trial reports; replayed idempotency keys count once.

    Admitted first (the report lane, ``controller.desired.lanes``: too many waiting is 503 with Retry-After
    before a byte is parsed), then parsed, validated and stored in one worker thread, never in the event loop.
    The body (``wire.ReportBatch``) is validated in one pass from its bytes, with FastAPI's 422 answers
    (``controller.api.body``)."""
    body = await request.body()
    try:
        reply = await state.hub.writers.ingest(_parse_and_ingest, body, is_json(request.headers.get("content-type")),
                                               principal, state)
    except Overloaded as exc:
        return _overloaded(exc)
    return Response(reply.model_dump_json(exclude_unset=True), media_type="application/json")


def _parse_and_ingest(body: bytes, json_type: bool, principal: Principal, state: AppState) -> wire.ReportBatchResponse:
    batch = parse_body(body, json_type, wire.ReportBatch, max_items=("reports", state.settings.max_report_batch))
    require_node(principal, batch.node_name)
    return _reports(batch, state)


def _reports(batch: wire.ReportBatch, state: AppState) -> wire.ReportBatchResponse:
    if len(batch.reports) > state.settings.max_report_batch:  # a body json_body could not count first
        raise Invalid(f"reports: {too_many('reports', len(batch.reports), state.settings.max_report_batch)}")
    try:
        accepted, duplicates, refused = _ingest(state, batch)
    except Exception:
        state.metrics.reports_ingested.labels("rejected").inc(len(batch.reports))
        raise
    if accepted:
        state.metrics.reports_ingested.labels("accepted").inc(accepted)
    if duplicates:
        state.metrics.reports_ingested.labels("duplicate").inc(duplicates)
    for reason, _message in refused.values():
        state.metrics.reports_refused.labels(reason).inc()
    if not refused:  # the common case keeps the historical shape {"accepted", "duplicates"}
        return wire.ReportBatchResponse(accepted=accepted, duplicates=duplicates)
    return wire.ReportBatchResponse(accepted=accepted, duplicates=duplicates,
                                    refused={k: m for k, (_r, m) in refused.items()})


@retry(retry=retry_if_exception_type(IntegrityError), stop=stop_after_attempt(3), wait=wait_random(0, 0.05),
       reraise=True)
def _ingest(state, batch: wire.ReportBatch):  # type: ignore[no-untyped-def]
    # A concurrent replay of the same batch loses the unique-key race: retrying sees the keys as duplicates.
    # a canary verified here (trial before serve) is declared by mark_verified: the node's watch answers at once
    with state.tx() as session:
        node = registry.get_node(session, batch.node_name)
        return ingest.ingest_batch(session, node, batch, utcnow())
