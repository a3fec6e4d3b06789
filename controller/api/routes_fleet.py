"""Fleet endpoints: nodes (inventory, liveness, versions), the compatibility matrix, and the audit log."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from fastapi import APIRouter, Query
from fastapi.exceptions import RequestValidationError
from sqlalchemy import select

from controller.api.deps import State, Viewer
from controller.api.schemas import NodeOut
from controller.audit import AuditFilters, AuditQueryError, event_to_dict, parse_time, query_events
from controller.compat import compat_matrix, node_stratum
from controller.db.models import Assignment, Bundle, Node
from controller.errors import Invalid
from kernelctl import wire

router = APIRouter(prefix=wire.API_PREFIX, tags=["fleet"])




# Query strings are bounded before they reach the database: printable ASCII, short (a fresh Query per
# parameter: FastAPI must not share one FieldInfo between parameters).
def Text() -> Any:
    return Query(None, max_length=256, pattern=r"^[ -~]*$")


def TimeText() -> Any:
    return Query(None, max_length=64, pattern=r"^[ -~]*$",
                 description="ISO 8601 time or an age (15m, 2h, 3d; at most 100 years).")


@router.get("/nodes", response_model=list[NodeOut])
def nodes(_p: Viewer, state: State, state_filter: str | None = Query(None, alias="state", max_length=32,
                                                                 pattern=r"^[a-z_]+$")) -> list[NodeOut]:
    """Every node with its stratum, liveness, and active/desired versions and canary phase per bundle."""
    with state.tx() as session:
        refs = {b_id: version for b_id, version in session.execute(select(Bundle.id, Bundle.version))}
        active: dict[int, dict[str, str]] = defaultdict(dict)
        desired: dict[int, dict[str, str]] = defaultdict(dict)
        phases: dict[int, dict[str, str]] = defaultdict(dict)
        for node_id, name, a, d, phase in session.execute(
            select(Assignment.node_id, Assignment.bundle_name, Assignment.active_bundle_id,
                   Assignment.desired_bundle_id, Assignment.phase)
        ):
            if a in refs:
                active[node_id][name] = refs[a]
            if d in refs:
                desired[node_id][name] = refs[d]
            if phase:
                phases[node_id][name] = phase
        stmt = select(Node).order_by(Node.name)
        if state_filter:
            stmt = stmt.where(Node.state == state_filter)
        return [
            NodeOut(name=n.name, state=n.state, stratum=node_stratum(n), gpu_name=n.gpu_name, arch=n.arch,
                    driver_version=n.driver_version, triton_version=n.triton_version,
                    torch_version=n.torch_version, last_heartbeat_at=n.last_heartbeat_at,
                    active=active.get(n.id, {}), desired=desired.get(n.id, {}), phases=phases.get(n.id, {}))
            for n in session.scalars(stmt)
        ]


@router.get("/compat")
def compat(_p: Viewer, state: State, bundle: str | None = Text()) -> list[dict[str, Any]]:
    """The compatibility matrix: each bundle version's state in each stratum."""
    with state.tx() as session:
        return [row.as_dict() for row in compat_matrix(session, bundle_name=bundle)]


def _time(value: str | None, name: str):  # type: ignore[no-untyped-def]
    if value is None:
        return None
    try:
        return parse_time(value)
    except AuditQueryError as exc:
        raise query_error(name, str(exc)) from None


def query_error(name: str, msg: str) -> RequestValidationError:
    """A 422 naming the query parameter (FastAPI's error shape)."""
    return RequestValidationError([{"loc": ("query", name), "msg": msg, "type": "value_error"}])



@router.get("/audit")
def audit(
    _p: Viewer,
    state: State,
    bundle: str | None = Text(),
    node: str | None = Text(),
    actor: str | None = Text(),
    action: str | None = Text(),
    since: str | None = TimeText(),
    until: str | None = TimeText(),
    limit: int = Query(100, ge=1, le=100_000),
) -> list[dict[str, Any]]:
    """Changelog events matching every filter, newest first."""
    filters = AuditFilters(bundle=bundle, node=node, actor=actor, action=action, since=_time(since, "since"),
                           until=_time(until, "until"), limit=limit)
    with state.tx() as session:
        try:
            return [event_to_dict(e) for e in query_events(session, filters)]
        except AuditQueryError as exc:
            raise Invalid(str(exc)) from None
