"""Agent endpoints: register (enrollment or node token), heartbeat (desired state) and report batches.

A node token acts only for its own node; an enrollment token may only register a *new* node (re-registering
an existing one needs that node's token, or a node token an operator issued with ``kernelctl token create
--role agent --node NAME``). Every registration issues a fresh node token and revokes the node's earlier
ones. Each request is one transaction; a replayed report batch (same idempotency keys) is accepted once;
reports from nodes that are not current canaries of a live rollout are refused one by one (counted).
"""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy.exc import IntegrityError
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_random

from controller import ingest, registry
from controller.api.deps import CurrentPrincipal, State
from controller.auth import Forbidden, issue_node_token, require_node, require_role
from controller.db.models import utcnow
from controller.errors import Invalid
from kernelctl import wire

router = APIRouter(prefix=wire.API_PREFIX + "/agents", tags=["agents"])


@router.post("/register", response_model=wire.RegisterResponse)
def register(req: wire.RegisterRequest, principal: CurrentPrincipal, state: State) -> wire.RegisterResponse:
    """Register (or re-register) a node; returns a node-bound token the agent uses from then on."""
    require_role(principal, "agent")
    if principal.node is not None and principal.node != req.node_name:
        raise Forbidden(f"this token belongs to node {principal.node!r}, not {req.node_name!r}")
    with state.tx() as session:
        registry.register_node(session, req.node_name, req.inventory, actor=principal.actor,
                               new_only=principal.is_enrollment)
        token = issue_node_token(session, req.node_name, actor=principal.actor)
    state.forget_node(req.node_name)  # the node's earlier tokens are revoked: no cached principal outlives them
    return wire.RegisterResponse(
        node_name=req.node_name, node_token=token, heartbeat_seconds=state.settings.heartbeat_seconds
    )


@router.post("/heartbeat", response_model=wire.HeartbeatResponse)
def heartbeat(req: wire.HeartbeatRequest, principal: CurrentPrincipal, state: State) -> wire.HeartbeatResponse:
    """Record liveness, staged and active versions; answer with the node's desired state."""
    require_node(principal, req.node_name)
    with state.tx() as session:
        return registry.heartbeat(session, req, utcnow(), heartbeat_seconds=state.settings.heartbeat_seconds)


@router.post("/reports", response_model=wire.ReportBatchResponse, response_model_exclude_unset=True)
def reports(batch: wire.ReportBatch, principal: CurrentPrincipal, state: State) -> wire.ReportBatchResponse:
    """Ingest a batch of trial reports; replayed idempotency keys count once."""
    require_node(principal, batch.node_name)
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
