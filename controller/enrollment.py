"""Node registration, written once: what ``POST /v1/agents/register`` commits, for one request or a batch.

:func:`register_many` registers a batch in one transaction, set-based: the new nodes in one ``INSERT ... ON
CONFLICT DO NOTHING RETURNING`` (a name another replica inserted first is a Conflict for that request only),
the earlier tokens of those names revoked in one ``UPDATE ... RETURNING``, the new tokens in one ``INSERT ...
RETURNING`` and every event in one bulk insert. Re-registrations of nodes that exist (the node's own token,
or a retry that proves it is the same agent, below) are set-based too (:func:`_reregister_many`): one at a
time, in a savepoint each, they took ~40 ms a node on a machine with a core taken, and a registration storm
(agents retrying what timed out) is made of them.
:func:`register_node` is a batch of one. An item refused on its own (its row does not fit the columns, an
enrollment token naming an existing node) gets its exception back; the others commit.

Idempotent retry: an agent generates a random registration key and keeps it on disk before its first attempt;
the node stores its SHA-256. A retry whose reply was lost (the server committed, the agent timed out) sends the
same key with the enrollment token and gets the same node with a fresh token (the lost one is revoked). An
enrollment token without that key still cannot take over an existing node. Each attempt carries the time the
agent sent it (``sent_at_ns``, the agent's clock); the node keeps the latest it took, and an older attempt
answered late (the agent timed out on it and sent another, registered first) is refused with 409 instead of
revoking the token the agent now holds (which sent the agent back to register: a cascade under load).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from controller.auth import TOKEN_PREFIX, hash_token, minted_expiry
from controller.changelog import event_row, record_event
from controller.db.fit import row_problem
from controller.db.models import ApiToken, Event, Node, utcnow
from controller.desired.generation import changed
from controller.errors import Conflict, Invalid
from kernelctl import wire


@dataclass(frozen=True)
class Registration:
    """One register request: who sent it (the API checked that the token may register this node) and whether
    that token registers new nodes only (an enrollment token)."""

    req: wire.RegisterRequest
    actor: str
    new_only: bool
    minted_by: int | None = None  # the id of the token that registers: the node token expires no later

    @property
    def key_hash(self) -> str | None:
        key = self.req.registration_key
        return hashlib.sha256(key.encode()).hexdigest() if key else None


@dataclass(frozen=True)
class Registered:
    node_id: int
    token: str  # plaintext, returned once
    new: bool
    token_id: int | None = None  # the new token's id when known (the API caches its principal at once)


def already_registered(node_name: str) -> Conflict:
    """What an enrollment token gets for a node that exists (it registers new nodes only)."""
    return Conflict(
        f"node {node_name} is already registered: an enrollment token registers new nodes only; re-register "
        f"with the node's own token, or have an operator issue one (kernelctl token create --role agent "
        f"--node {node_name})")


def superseded(node_name: str) -> Conflict:
    """What a registration attempt gets when a later attempt of its agent was taken first (``sent_at_ns``: the
    first attempt timed out at the agent, which sent another, and was answered late): revoking the later one's
    token would lock the agent out, so the late attempt changes nothing."""
    return Conflict(f"registration of {node_name} superseded: a later attempt of this agent was registered "
                    "first; nothing was changed")


def register_node(session: Session, node_name: str, inventory: wire.Inventory, actor: str,
                  *, now: dt.datetime | None = None, new_only: bool = False) -> Node:
    """Register one node (a batch of one); returns it. Raises what the batch would answer for it."""
    (done,) = register_many(session, [Registration(wire.RegisterRequest(node_name=node_name, inventory=inventory),
                                                   actor, new_only)], now)
    if isinstance(done, Exception):
        raise done
    node = session.get(Node, done.node_id, populate_existing=True)  # written by Core statements: read it afresh
    assert node is not None
    return node


_NEW = 2**63  # sorts after every node id


def register_many(session: Session, items: list[Registration], now: dt.datetime | None = None
                  ) -> list[Registered | Exception]:
    """Register every item (see the module docstring); one result per item, in order."""
    now = now or utcnow()
    out: list[Registered | Exception | None] = [None] * len(items)
    names = {it.req.node_name for it in items}
    found = session.execute(select(Node.name, Node.registration_key_hash, Node.id).where(Node.name.in_(names))).all()
    existing = {name: key for name, key, _ in found}
    node_ids = {name: nid for name, _, nid in found}
    fresh: dict[str, int] = {}  # node name -> index of the item that creates it
    again: list[int] = []  # re-registrations of nodes that exist
    for i, it in enumerate(items):
        name = it.req.node_name
        row = _node_row(it, now)
        problem = row_problem(Node.__table__, row)
        if problem is not None:  # what the database would refuse, refused for this item only
            out[i] = Invalid(f"registration of {name} refused: {problem}")
        elif name in existing or name in fresh:
            known = existing[name] if name in existing else items[fresh[name]].key_hash
            if it.new_only and not _same_agent(known, it.key_hash):
                out[i] = already_registered(name)
            else:  # the node's own token, or a retry of the same agent (in this batch or committed before)
                again.append(i)
        else:
            fresh[name] = i
    conn = session.connection()  # a new node is not a change of desired state (no bump)
    if fresh:
        dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
        rows = [_node_row(items[fresh[name]], now) for name in sorted(fresh)]  # inserted in name order
        # executemany with RETURNING (SQLAlchemy's insertmanyvalues): one compiled statement whatever the batch
        ids = {n: nid for nid, n in conn.execute(
            dialect.insert(Node).on_conflict_do_nothing(index_elements=["name"])
            .returning(Node.id, Node.name, sort_by_parameter_order=True), rows) if nid is not None}
        for name, i in fresh.items():
            if name not in ids and items[i].key_hash is not None:
                again.append(i)  # inserted meanwhile by another transaction: its key decides, below
            elif name not in ids:
                out[i] = Conflict(f"node {name} was registered concurrently; nothing was changed")
        created = {name: i for name, i in fresh.items() if name in ids}
        if created:
            _tokens_for(conn, items, created, ids, now, out)
    # existing nodes locked in id order (as every writer of many nodes does: no lock cycle with another
    # replica's batch or the liveness flush); nodes another transaction inserted meanwhile after them, by name
    again.sort(key=lambda i: (node_ids.get(items[i].req.node_name, _NEW), items[i].req.node_name))
    if again:
        _reregister_many(session, items, again, now, out)
    return [r if r is not None else Conflict("registration not processed") for r in out]


def _same_agent(stored: str | None, key_hash: str | None) -> bool:
    """The registration key proves the same agent registered the node (a retry whose reply was lost)."""
    return stored is not None and key_hash is not None and hmac.compare_digest(stored, key_hash)


def _node_row(it: Registration, now: dt.datetime) -> dict[str, Any]:
    return {"name": it.req.node_name, "registered_at": now, "last_heartbeat_at": now, "last_registered_at": now,
            "state": "active", "registration_key_hash": it.key_hash, "registration_sent_ns": it.req.sent_at_ns,
            **it.req.inventory.model_dump()}


INVENTORY = tuple(wire.Inventory.model_fields)  # the node columns an inventory sets


def _reregister_many(session: Session, items: list[Registration], again: list[int], now: dt.datetime,
                     out: list[Registered | Exception | None]) -> None:
    """Existing nodes register again (``again``: item indices, in node id order), set-based: the rows locked in
    one statement, a changed inventory and the state ``active`` written in one, every earlier token revoked and
    a fresh one issued per node (:func:`_tokens_for`). Of several attempts for one node in the batch, the latest
    taken wins and the earlier ones are answered ``superseded`` (their agent timed out on them and sent the
    later one: nobody reads their answer); an older attempt than the node's last is refused (``superseded``)."""
    conn = session.connection()
    names = sorted({items[i].req.node_name for i in again})
    locked = {r.name: r for r in conn.execute(  # in id order, as every writer of many nodes' rows locks them
        select(Node.id, Node.name, Node.state, Node.registration_key_hash, Node.registration_sent_ns,
               *(Node.__table__.c[c] for c in INVENTORY))
        .where(Node.name.in_(names)).order_by(Node.id).with_for_update(key_share=True))}
    sent = {name: row.registration_sent_ns for name, row in locked.items()}
    winner: dict[str, int] = {}
    for i in again:
        it = items[i]
        name, stamp = it.req.node_name, it.req.sent_at_ns
        row = locked.get(name)
        if row is None:
            out[i] = Conflict(f"node {name} was removed concurrently; retry")
        elif it.new_only and not _same_agent(row.registration_key_hash, it.key_hash):
            out[i] = already_registered(name)
        elif stamp is not None and sent[name] is not None and stamp <= sent[name]:
            out[i] = superseded(name)
        else:
            if name in winner:
                out[winner[name]] = superseded(name)
            winner[name] = i
            sent[name] = stamp if stamp is not None else sent[name]
    if not winner:
        return
    events: list[dict[str, Any]] = []
    updates: list[dict[str, Any]] = []
    for name, i in winner.items():
        it, row = items[i], locked[name]
        new = it.req.inventory.model_dump()
        diff = inventory_diff(row._mapping, new)
        if diff:
            events.append(event_row(at=now, actor=it.actor, **inventory_changed_event(name, diff)))
        if row.state != "active":
            events.append(event_row(at=now, actor=it.actor, **active_event(name)))
        if diff:
            changed(session)  # its stratum may move: the replicas reload it
        elif row.state != "active":
            changed(session, nodes={row.id: "active"})
        updates.append({"b_id": row.id, "state": "active", "last_heartbeat_at": now, "last_registered_at": now,
                        "registration_sent_ns": sent[name], **new})
    conn.execute(update(Node).where(Node.id == bindparam("b_id")).values(
        {c: bindparam(c) for c in ("state", "last_heartbeat_at", "last_registered_at", "registration_sent_ns",
                                   *INVENTORY)}), updates)
    if events:
        conn.execute(insert(Event), events)
    _tokens_for(conn, items, winner, {name: locked[name].id for name in winner}, now, out, new=False)


def inventory_changed_event(name: str, diff: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The fields of a ``node.inventory_changed`` event (the ORM and the set-based writers both record it)."""
    return {"action": "node.inventory_changed", "subject": f"node:{name}", "node": name, "payload": diff}


def active_event(name: str) -> dict[str, Any]:
    """The fields of a ``node.active`` event: a node not active (stale, or registering again) is active again."""
    return {"action": "node.active", "subject": f"node:{name}", "node": name, "reason": "heartbeat received"}


def inventory_diff(stored: Mapping[str, Any], new: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What a reported inventory changes of the stored one: ``{column: {"from", "to"}}`` (the event's payload)."""
    return {k: {"from": stored[k], "to": v} for k, v in new.items() if stored[k] != v}


def apply_inventory(session: Session, node: Node, inventory: wire.Inventory, *, actor: str) -> bool:
    """Store a changed inventory (event ``node.inventory_changed``); False when nothing changed."""
    new = inventory.model_dump()
    diff = inventory_diff({k: getattr(node, k) for k in new}, new)
    if not diff:
        return False
    for k in diff:
        setattr(node, k, new[k])
    changed(session)
    record_event(session, actor=actor, **inventory_changed_event(node.name, diff))
    return True


def mark_active(session: Session, node: Node, *, actor: str) -> None:
    if node.state != "active":
        node.state = "active"
        changed(session, nodes={node.id: "active"})
        record_event(session, actor=actor, **active_event(node.name))


def _tokens_for(conn: Any, items: list[Registration], created: dict[str, int], ids: dict[str, int],
                now: dt.datetime, out: list[Registered | Exception | None], *, new: bool = True) -> None:
    """Node tokens for the nodes ``created`` (name -> item index; ``new``: created by this batch, else registered
    again), every earlier token bound to the name revoked, and their events."""
    events = [event_row(at=now, actor=items[i].actor, action="node.registered", subject=f"node:{name}",
                        node=name, payload=items[i].req.inventory.model_dump())
              for name, i in created.items()] if new else []
    revoked: dict[str, list[int]] = {}
    for tid, node, tname, role in conn.execute(
            update(ApiToken).where(ApiToken.node_name.in_(list(created)), ApiToken.revoked_at.is_(None))
            .values(revoked_at=now).returning(ApiToken.id, ApiToken.node_name, ApiToken.name, ApiToken.role)):
        revoked.setdefault(node, []).append(tid)
        events.append(event_row(at=now, actor=items[created[node]].actor, action="token.revoked",
                                subject=f"token:{tid}", node=node, payload={"name": tname, "role": role},
                                reason="superseded by a new node token"))
    plain = {name: TOKEN_PREFIX + secrets.token_urlsafe(32) for name in created}
    expiry = minted_expiry(conn, [items[i].minted_by for i in created.values()])  # never outlives its minter
    expires = {name: expiry[items[i].minted_by] for name, i in created.items()}
    token_rows = [{"name": f"node:{name}"[:128], "role": "agent", "node_name": name, "expires_at": expires[name],
                   "token_hash": hash_token(plain[name]), "created_at": now} for name in created]
    for tid, node in conn.execute(insert(ApiToken).returning(ApiToken.id, ApiToken.node_name,
                                                             sort_by_parameter_order=True), token_rows):
        actor = items[created[node]].actor
        events.append(event_row(at=now, actor=actor, action="token.created", subject=f"token:{tid}", node=node,
                                payload={"name": f"node:{node}"[:128], "role": "agent", "node": node,
                                         "expires_at": expires[node].isoformat() if expires[node] else None}))
        if revoked.get(node):
            events.append(event_row(at=now, actor=actor, action="token.node_reissued", subject=f"token:{tid}",
                                    node=node, payload={"revoked": sorted(revoked[node])}))
        out[created[node]] = Registered(ids[node], plain[node], new=new, token_id=tid)
    conn.execute(insert(Event), events)
