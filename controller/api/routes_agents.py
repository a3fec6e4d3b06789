"""Agent endpoints: register (enrollment or node token), heartbeat (desired state) and report batches.

A node token acts only for its own node; an enrollment token may only register a *new* node (re-registering
an existing one needs that node's token, or a node token an operator issued with ``kernelctl token create
--role agent --node NAME``). Every registration issues a fresh node token and revokes the node's earlier
ones. Each request is one transaction; a replayed report batch (same idempotency keys) is accepted once;
reports from nodes that are not current canaries of a live rollout are refused one by one (counted).

Heartbeats are served by every replica from its desired-state snapshot (``controller.desired``): a heartbeat
that changes nothing but liveness costs no transaction, and one that carries ``generation`` and
``wait_seconds`` is held until the node's desired state changes (push). Writes (registrations, heartbeats that
change something) are group-committed, at most ``max_queued_writes`` queued per replica; report batches wait at
most ``max_pending_writes`` at once per replica; each on their own threads (``controller.desired.lanes``); more
are answered 503 with ``Retry-After`` (agents back off with jitter and keep their outbox).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from controller.api import heartbeat_lane, report_lane
from controller.api.body import is_json, openapi_body, parse_body
from controller.api.deps import CurrentPrincipal, State, bearer_token
from controller.api.fast_lane import Reply, overloaded
from controller.auth import Forbidden, Principal, require_node, require_role
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
        return _reply(overloaded(exc))
    state.forget_node(req.node_name)  # the node's earlier tokens are revoked: no cached principal outlives them
    if done.token_id is not None:  # its first heartbeat needs no token lookup
        state.remember(done.token, Principal(done.token_id, f"node:{req.node_name}"[:128], "agent", req.node_name))
    return wire.RegisterResponse(
        node_name=req.node_name, node_token=done.token, heartbeat_seconds=state.settings.heartbeat_seconds
    )


def _reply(reply: Reply) -> Response:
    status, body, headers = reply
    return Response(body, status_code=status, media_type="application/json",
                    headers={k.decode(): v.decode() for k, v in headers})


@router.post("/heartbeat", response_model=wire.HeartbeatResponse)
async def heartbeat(req: wire.HeartbeatRequest, request: Request, principal: CurrentPrincipal,
                    state: State) -> Response:
    """Record liveness, staged and active versions; answer with the node's desired state.

    With ``generation`` and ``wait_seconds`` the reply waits until the desired state moves past
    ``generation`` (or the wait ends): the watch through which a rollback reaches the node at once.
    """
    require_node(principal, req.node_name)
    return _reply(await heartbeat_lane.answer(state, req, bearer_token(request)))


@router.post("/reports", response_model=wire.ReportBatchResponse, response_model_exclude_unset=True,
             openapi_extra=openapi_body(wire.ReportBatch))
async def reports(request: Request, principal: CurrentPrincipal, state: State) -> Response:
    """Ingest a batch of trial reports; replayed idempotency keys count once.

    Admitted first (the report lane, ``controller.desired.lanes``, or with ``ingest_processes`` the report group
    commit's queue: too many waiting is 503 with Retry-After before a byte is parsed), then parsed, validated and
    stored off the event loop (``controller.intake``: in a worker thread and the report group commit, or in a
    worker process with the requests waiting with it). The body (``wire.ReportBatch``) is validated
    in one pass from its bytes, with FastAPI's 422 answers (``controller.api.body``)."""
    body = await request.body()
    json_type = is_json(request.headers.get("content-type"))
    try:
        out = await state.hub.writers.ingest(body, json_type, principal)
    except Overloaded as exc:
        return _reply(overloaded(exc))
    if out.invalid:  # FastAPI's exact answer to the body, made here (it raises)
        await run_in_threadpool(parse_body, body, json_type, wire.ReportBatch,
                                ("reports", state.settings.max_report_batch))
        raise Invalid("reports: the body did not validate")  # not reached: the same parse refused it there
    if out.error is not None:
        state.metrics.reports_ingested.labels("rejected").inc(out.reports)
        raise out.error
    return Response(report_lane.accepted(state, out), media_type="application/json")
