"""Fleet endpoints: nodes (inventory, liveness, versions), the compatibility matrix, and the audit log.

Each is a list served a page at a time (``limit``, ``cursor``, a ``Link rel="next"`` header:
``controller.api.pages``) in a read-only transaction (``AppState.read``: never SQLite's write lock)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from sqlalchemy import select

from controller.api.deps import State, Viewer
from controller.api.pages import Cursor, Limit, cursor_error, keyset_page, link_next, page_limit, query_error
from controller.api.schemas import NodeOut
from controller.audit import AuditFilters, AuditQueryError, event_to_dict, events_page, parse_time
from controller.compat import compat_page, node_stratum
from controller.db.models import Assignment, Bundle, Node
from controller.errors import Invalid
from controller.paging import PAGE_MAX, PageError, decode_cursor, encode_cursor
from kernelctl import wire
from kernelctl.vocab import NodeState

router = APIRouter(prefix=wire.API_PREFIX, tags=["fleet"])




# Query strings are bounded before they reach the database: printable ASCII, short (a fresh Query per
# parameter: FastAPI must not share one FieldInfo between parameters).
def Text() -> Any:
    return Query(None, max_length=256, pattern=r"^[ -~]*$")


def TimeText() -> Any:
    return Query(None, max_length=64, pattern=r"^[ -~]*$",
                 description="ISO 8601 time or an age (15m, 2h, 3d; at most 100 years).")


@router.get("/nodes", response_model=list[NodeOut])
def nodes(_p: Viewer, state: State, request: Request, response: Response,
          state_filter: NodeState | None = Query(None, alias="state"),
          limit: int = Limit(PAGE_MAX), cursor: str | None = Cursor()) -> list[NodeOut]:
    """Nodes by name, a page at a time: stratum, liveness, and active/desired versions and canary phase per
    bundle."""
    stmt = select(Node)
    if state_filter:
        stmt = stmt.where(Node.state == state_filter)
    with state.read() as session:
        page = keyset_page(session, stmt, "nodes", (Node.name,), cursor=cursor, limit=limit, request=request,
                           response=response)
        refs = {b_id: version for b_id, version in session.execute(select(Bundle.id, Bundle.version))}
        active: dict[int, dict[str, str]] = defaultdict(dict)
        desired: dict[int, dict[str, str]] = defaultdict(dict)
        phases: dict[int, dict[str, str]] = defaultdict(dict)
        for node_id, name, a, d, phase in session.execute(
            select(Assignment.node_id, Assignment.bundle_name, Assignment.active_bundle_id,
                   Assignment.desired_bundle_id, Assignment.phase)
            .where(Assignment.node_id.in_([n.id for n in page]))
        ):
            if a in refs:
                active[node_id][name] = refs[a]
            if d in refs:
                desired[node_id][name] = refs[d]
            if phase:
                phases[node_id][name] = phase
        return [
            NodeOut(name=n.name, state=n.state, stratum=node_stratum(n), gpu_name=n.gpu_name, arch=n.arch,
                    driver_version=n.driver_version, triton_version=n.triton_version,
                    torch_version=n.torch_version, last_heartbeat_at=n.last_heartbeat_at,
                    active=active.get(n.id, {}), desired=desired.get(n.id, {}), phases=phases.get(n.id, {}))
            for n in page
        ]


@router.get("/compat")
def compat(_p: Viewer, state: State, request: Request, response: Response, bundle: str | None = Text(),
           limit: int = Limit(100), cursor: str | None = Cursor()) -> list[dict[str, Any]]:
    """The compatibility matrix: each bundle version's state in each stratum; ``limit`` counts bundle
    versions (each with one row per stratum)."""
    page_limit(limit)
    try:
        key = decode_cursor("compat", cursor, str, int) if cursor is not None else None
    except PageError as exc:
        raise cursor_error(exc) from None
    with state.read() as session:
        rows, last = compat_page(session, bundle_name=bundle, after_key=key, limit=limit)
    link_next(request, response, encode_cursor("compat", *last) if last is not None else None)
    return [row.as_dict() for row in rows]


def _time(value: str | None, name: str):  # type: ignore[no-untyped-def]
    if value is None:
        return None
    try:
        return parse_time(value)
    except AuditQueryError as exc:
        raise query_error(name, str(exc)) from None


@router.get("/audit")
def audit(
    _p: Viewer,
    state: State,
    request: Request,
    response: Response,
    bundle: str | None = Text(),
    node: str | None = Text(),
    actor: str | None = Text(),
    action: str | None = Text(),
    since: str | None = TimeText(),
    until: str | None = TimeText(),
    limit: int = Limit(100),
    cursor: str | None = Cursor(),
) -> list[dict[str, Any]]:
    """Changelog events matching every filter, newest first, a page at a time."""
    filters = AuditFilters(bundle=bundle, node=node, actor=actor, action=action, since=_time(since, "since"),
                           until=_time(until, "until"), limit=page_limit(limit))
    with state.read() as session:
        try:
            page, nxt = events_page(session, filters, cursor)
        except AuditQueryError as exc:
            raise Invalid(str(exc)) from None
        link_next(request, response, nxt)
        return [event_to_dict(e) for e in page]
