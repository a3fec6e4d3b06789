"""Registration of many nodes in one transaction, set-based: what ``POST /v1/agents/register`` commits.

:func:`register_many` does for a batch what ``registry.register_node`` + ``auth.issue_node_token`` do for one
registration, with the same rows and changelog events, in a handful of statements for the whole batch: the
new nodes in one ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` (a name another replica inserted first is a
Conflict for that request only), the earlier tokens of those names revoked in one ``UPDATE ... RETURNING``,
the new tokens in one ``INSERT ... RETURNING`` and every event in one bulk insert. Re-registrations of nodes
that exist (a node token) take the one-by-one path in a savepoint each. An item refused on its own gets its
exception back; the others commit. Called through :class:`controller.group_commit.GroupCommit`.
"""

from __future__ import annotations

import datetime as dt
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from controller.auth import TOKEN_PREFIX, Principal, hash_token, issue_node_token, minted_expiry
from controller.changelog import event_row
from controller.db.models import ApiToken, Event, Node, utcnow
from controller.errors import Conflict
from controller.registry import already_registered, register_node
from kernelctl import wire


@dataclass(frozen=True)
class Registration:
    """One register request and who sent it (the API checked that the token may register this node)."""

    req: wire.RegisterRequest
    principal: Principal


@dataclass(frozen=True)
class Registered:
    node_id: int
    token: str  # plaintext, returned once
    new: bool
    token_id: int | None = None  # the new token's id when known (the API caches its principal at once)


def register_many(session: Session, items: list[Registration], now: dt.datetime | None = None
                  ) -> list[Registered | Exception]:
    """Register every item (see the module docstring); one result per item, in order."""
    now = now or utcnow()
    out: list[Registered | Exception | None] = [None] * len(items)
    names = {it.req.node_name for it in items}
    existing = set(session.scalars(select(Node.name).where(Node.name.in_(names))))
    fresh: dict[str, int] = {}  # node name -> index of the item that creates it
    one_by_one: list[int] = []
    for i, it in enumerate(items):
        name = it.req.node_name
        if name in existing or name in fresh:
            if it.principal.is_enrollment:
                out[i] = already_registered(name)
            else:
                one_by_one.append(i)
        else:
            fresh[name] = i
    conn = session.connection()  # Core statements: a new node is not a change of desired state (no bump)
    if fresh:
        dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
        rows = [{"name": name, "registered_at": now, "last_heartbeat_at": now, "state": "active",
                 **items[i].req.inventory.model_dump()} for name, i in fresh.items()]
        # executemany with RETURNING (SQLAlchemy's insertmanyvalues): one compiled statement whatever the batch
        ids = {n: nid for nid, n in conn.execute(
            dialect.insert(Node).on_conflict_do_nothing(index_elements=["name"])
            .returning(Node.id, Node.name, sort_by_parameter_order=True), rows) if nid is not None}
        for name, i in fresh.items():
            if name not in ids:
                out[i] = Conflict(f"node {name} was registered concurrently; nothing was changed")
        created = {name: i for name, i in fresh.items() if name in ids}
        if created:
            _tokens_for(conn, items, created, ids, now, out)
    for i in one_by_one:
        it = items[i]
        try:
            with session.begin_nested():
                node = register_node(session, it.req.node_name, it.req.inventory, actor=it.principal.actor,
                                     now=now)
                token = issue_node_token(session, it.req.node_name, actor=it.principal.actor,
                                         minted_by=it.principal.token_id)
                out[i] = Registered(node.id, token, new=False)
        except Exception as exc:  # this request only: its savepoint is rolled back, the batch goes on
            out[i] = exc
    return [r if r is not None else Conflict("registration not processed") for r in out]


def _tokens_for(conn: Any, items: list[Registration], created: dict[str, int], ids: dict[str, int],
                now: dt.datetime, out: list[Registered | Exception | None]) -> None:
    """Node tokens for newly created nodes (earlier tokens bound to the name revoked), and their events."""
    events = [event_row(at=now, actor=items[i].principal.actor, action="node.registered", subject=f"node:{name}",
                        node=name, payload=items[i].req.inventory.model_dump()) for name, i in created.items()]
    revoked: dict[str, list[int]] = {}
    for tid, node, tname, role in conn.execute(
            update(ApiToken).where(ApiToken.node_name.in_(list(created)), ApiToken.revoked_at.is_(None))
            .values(revoked_at=now).returning(ApiToken.id, ApiToken.node_name, ApiToken.name, ApiToken.role)):
        revoked.setdefault(node, []).append(tid)
        events.append(event_row(at=now, actor=items[created[node]].principal.actor, action="token.revoked",
                                subject=f"token:{tid}", node=node, payload={"name": tname, "role": role},
                                reason="superseded by a new node token"))
    plain = {name: TOKEN_PREFIX + secrets.token_urlsafe(32) for name in created}
    expiry = minted_expiry(conn, [items[i].principal.token_id for i in created.values()])  # never outlives its minter
    expires = {name: expiry[items[i].principal.token_id] for name, i in created.items()}
    token_rows = [{"name": f"node:{name}"[:128], "role": "agent", "node_name": name, "expires_at": expires[name],
                   "token_hash": hash_token(plain[name]), "created_at": now} for name in created]
    for tid, node in conn.execute(insert(ApiToken).returning(ApiToken.id, ApiToken.node_name,
                                                             sort_by_parameter_order=True), token_rows):
        actor = items[created[node]].principal.actor
        events.append(event_row(at=now, actor=actor, action="token.created", subject=f"token:{tid}", node=node,
                                payload={"name": f"node:{node}"[:128], "role": "agent", "node": node,
                                         "expires_at": expires[node].isoformat() if expires[node] else None}))
        if revoked.get(node):
            events.append(event_row(at=now, actor=actor, action="token.node_reissued", subject=f"token:{tid}",
                                    node=node, payload={"revoked": sorted(revoked[node])}))
        out[created[node]] = Registered(ids[node], plain[node], new=True, token_id=tid)
    conn.execute(insert(Event), events)
