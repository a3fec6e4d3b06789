"""Agent endpoints: register (enrollment or node token), heartbeat (desired state) and report batches.

A node token acts only for its own node; an enrollment token may only register a *new* node (re-registering
an existing one needs that node's token, or a node token an operator issued with ``kernelctl token create
--role agent --node NAME``). Every registration issues a fresh node token and revokes the node's earlier
ones. Each request is one transaction; a replayed report batch (same idempotency keys) is accepted once;
reports from nodes that are not current canaries of a live rollout are refused one by one (counted).

Heartbeats are served by every replica from its desired-state snapshot (``controller.watch``): a heartbeat
that changes nothing but liveness costs no transaction, and one that carries ``generation`` and
``wait_seconds`` is held until the node's desired state changes (push). Writes (registrations, heartbeats that
change something, report batches) wait at most ``max_pending_writes`` at once per replica; more are answered
503 with ``Retry-After`` (agents back off with jitter and keep their outbox).
"""

from __future__ import annotations

import math
import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import IntegrityError
from starlette.concurrency import run_in_threadpool
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_random

from controller import ingest, registry
from controller.api.deps import AppState, CurrentPrincipal, State
from controller.auth import Forbidden, Principal, issue_node_token, require_node, require_role
from controller.db.models import utcnow
from controller.errors import Invalid
from controller.watch import Overloaded, slow_heartbeat
from kernelctl import wire

router = APIRouter(prefix=wire.API_PREFIX + "/agents", tags=["agents"])


async def _write(state: AppState, fn: Any, *args: Any) -> Any:
    """A write in a worker thread, through the hub's admission (503 + Retry-After when too many wait)."""
    hub = getattr(state, "hub", None)
    if hub is None:
        return await run_in_threadpool(fn, *args)
    return await hub.slow(fn, *args)


@router.post("/register", response_model=wire.RegisterResponse)
async def register(req: wire.RegisterRequest, principal: CurrentPrincipal, state: State) -> Any:
    """Register (or re-register) a node; returns a node-bound token the agent uses from then on."""
    require_role(principal, "agent")
    try:
        return await _write(state, _register, req, principal, state)
    except Overloaded as exc:
        return _overloaded(exc)


def _register(req: wire.RegisterRequest, principal: Principal, state: AppState) -> wire.RegisterResponse:
    if principal.node is not None and principal.node != req.node_name:
        raise Forbidden(f"this token belongs to node {principal.node!r}, not {req.node_name!r}")
    with state.tx() as session:
        node = registry.register_node(session, req.node_name, req.inventory, actor=principal.actor,
                                      new_only=principal.is_enrollment)
        token = issue_node_token(session, req.node_name, actor=principal.actor)
        node_id = node.id
    state.forget_node(req.node_name)  # the node's earlier tokens are revoked: no cached principal outlives them
    hub = getattr(state, "hub", None)
    if hub is not None and principal.is_enrollment:  # a new node: this replica knows it before its next reload
        hub.registered(node_id, req.node_name, req.inventory)
    return wire.RegisterResponse(
        node_name=req.node_name, node_token=token, heartbeat_seconds=state.settings.heartbeat_seconds
    )


def _overloaded(exc: Overloaded) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=503,
                        headers={"Retry-After": str(max(1, math.ceil(exc.retry_after)))})


@router.post("/heartbeat", response_model=wire.HeartbeatResponse)
async def heartbeat(req: wire.HeartbeatRequest, principal: CurrentPrincipal, state: State) -> Response:
    """Record liveness, staged and active versions; answer with the node's desired state.

    With ``generation`` and ``wait_seconds`` the reply waits until the desired state moves past
    ``generation`` (or the wait ends): the watch through which a rollback reaches the node at once.
    """
    require_node(principal, req.node_name)
    hb = state.settings.heartbeat_seconds
    hub = getattr(state, "hub", None)
    started = time.perf_counter()
    try:
        if hub is None:  # no hub (an app built without its lifespan): one transaction per heartbeat
            reply, _gen = await run_in_threadpool(slow_heartbeat, state.factory, req, hb)
            held, path = 0.0, "slow"
        else:
            reply, held, path = await hub.heartbeat(req, heartbeat_seconds=hb,
                                                    slow_path=lambda r: slow_heartbeat(state.factory, r, hb))
    except Overloaded as exc:
        return _overloaded(exc)
    state.metrics.heartbeat_service.labels(path).observe(max(0.0, time.perf_counter() - started - held))
    return Response(reply.model_dump_json(), media_type="application/json")


@router.post("/reports", response_model=wire.ReportBatchResponse, response_model_exclude_unset=True)
async def reports(batch: wire.ReportBatch, principal: CurrentPrincipal, state: State) -> Any:
    """Ingest a batch of trial reports; replayed idempotency keys count once."""
    require_node(principal, batch.node_name)
    try:
        return await _write(state, _reports, batch, state)
    except Overloaded as exc:
        return _overloaded(exc)


def _reports(batch: wire.ReportBatch, state: AppState) -> wire.ReportBatchResponse:
    if len(batch.reports) > state.settings.max_report_batch:
        raise Invalid(
            f"reports: {len(batch.reports)} reports in one batch is over the limit of "
            f"{state.settings.max_report_batch}; split the batch"
        )
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
    with state.tx() as session:
        node = registry.get_node(session, batch.node_name)
        keep, refused = ingest.screen_reports(session, node, batch)
        if not keep:
            return 0, 0, refused
        if len(keep) < len(batch.reports):
            batch = wire.ReportBatch.model_construct(node_name=batch.node_name, reports=keep)
        accepted, duplicates = ingest.ingest_reports(session, node, batch, utcnow())
        return accepted, duplicates, refused
