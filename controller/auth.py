"""API tokens: creation (plaintext shown once, SHA-256 stored), authentication, roles, bootstrap file.

Roles: ``agent`` (an enrollment token with no node may only register *new* nodes; a node token acts only for
its node), ``operator`` (push, start, promote, rollback, pause, resume; also reads), ``viewer`` (read, audit).
The plaintext of a token is never stored and never logged. Lifecycle: a token may carry an expiry
(``expires_at``); issuing a node token (:func:`issue_node_token`) revokes every earlier token of that node;
a node token never outlives the token that minted it (:func:`minted_expiry`: registering with an enrollment
token that expires in 10 minutes gives a node token that expires then too, and so does every re-registration
with that node token); :func:`revoke_token` / :func:`list_tokens` back ``kernelctl token revoke | list``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Connection, select
from sqlalchemy.orm import Session

from controller.changelog import record_event
from controller.db.models import ApiToken, as_utc, utcnow

ROLES = ("agent", "operator", "viewer")
TOKEN_PREFIX = "kctl_"
MIN_TOKEN_LENGTH = 16
_TOKEN_RE = re.compile(r"^[A-Za-z0-9._~+/=-]+$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


class AuthError(Exception):
    """Authentication failed (HTTP 401): no token, or an unknown/revoked one."""


class Forbidden(Exception):
    """Authenticated but not allowed (HTTP 403): wrong role or another node."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's id, name, role and (agent node tokens) node."""

    token_id: int
    name: str
    role: str
    node: str | None = None

    @property
    def actor(self) -> str:
        """The actor string written into changelog events."""
        return f"{self.role}:{self.name}"

    @property
    def is_enrollment(self) -> bool:
        return self.role == "agent" and self.node is None


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")


def _check_name(name: str) -> None:
    if not _NAME_RE.match(name):
        raise ValueError(
            f"invalid token name {name!r}: 1-128 characters, letters, digits and . _ : @ - "
            "(starting with a letter or digit)"
        )


def _add_token(session: Session, role: str, name: str, node: str | None, token: str, actor: str,
               expires_at: dt.datetime | None = None) -> ApiToken:
    _check_role(role)
    _check_name(name)
    if node is not None and role != "agent":
        raise ValueError(f"only agent tokens can be bound to a node (got role {role!r} with node {node!r})")
    row = ApiToken(name=name, role=role, node_name=node, token_hash=hash_token(token), expires_at=expires_at)
    session.add(row)
    session.flush()
    record_event(
        session,
        actor=actor,
        action="token.created",
        subject=f"token:{row.id}",
        payload={"name": name, "role": role, "node": node,
                 "expires_at": expires_at.isoformat() if expires_at else None},
        node=node,
    )
    return row


def create_token(session: Session, role: str, name: str, node: str | None = None, *, actor: str = "cli",
                 expires_at: dt.datetime | None = None) -> str:
    """Create a token and return its plaintext (the only time it exists); the DB keeps its SHA-256.

    A token bound to a node is a node token: creating one revokes the node's earlier tokens
    (:func:`issue_node_token`), so at most one node token per node is valid at any time.
    """
    if node is not None:
        _check_role(role)
        if role != "agent":
            raise ValueError(f"only agent tokens can be bound to a node (got role {role!r} with node {node!r})")
        return issue_node_token(session, node, actor=actor, name=name, expires_at=expires_at)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    _add_token(session, role, name, node, token, actor, expires_at)
    return token


def issue_node_token(session: Session, node: str, *, actor: str, name: str | None = None,
                     expires_at: dt.datetime | None = None, minted_by: int | None = None) -> str:
    """A fresh token for ``node``; every earlier unrevoked token of that node is revoked in the same transaction.

    ``minted_by``: the id of the token that asked for it (a registration): the new token expires no later
    than that one (:func:`minted_expiry`). Returns the plaintext. Callers that authenticate through a cache
    must also drop the node's cached principals (the API does; other replicas see the revocation within the
    auth cache time).
    """
    if minted_by is not None:
        expires_at = minted_expiry(session, [minted_by], expires_at)[minted_by]
    revoked = revoke_node_tokens(session, node, actor=actor, reason="superseded by a new node token")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = _add_token(session, "agent", name or f"node:{node}"[:128], node, token, actor, expires_at)
    if revoked:
        record_event(session, actor=actor, action="token.node_reissued", subject=f"token:{row.id}", node=node,
                     payload={"revoked": revoked})
    return token


def minted_expiry(session: Session | Connection, minted_by: list[int], expires_at: dt.datetime | None = None
                  ) -> dict[int, dt.datetime | None]:
    """When a token minted by each of the tokens ``minted_by`` (ids) expires: the earlier of ``expires_at``
    and the minting token's own expiry (read from the database, not from a cached principal), so no token
    outlives what minted it. One query for the whole list."""
    own = dict(session.execute(select(ApiToken.id, ApiToken.expires_at).where(ApiToken.id.in_(set(minted_by)))).all())
    out: dict[int, dt.datetime | None] = {}
    for tid in minted_by:
        limits = [as_utc(t) for t in (own.get(tid), expires_at) if t is not None]
        out[tid] = min(limits) if limits else None
    return out


def revoke_node_tokens(session: Session, node: str, *, actor: str, reason: str) -> list[int]:
    """Revoke every unrevoked token bound to ``node``; returns their ids."""
    rows = list(session.scalars(select(ApiToken).where(ApiToken.node_name == node, ApiToken.revoked_at.is_(None))
                                .order_by(ApiToken.id).with_for_update(key_share=True)))
    for row in rows:
        revoke_token(session, row.id, actor=actor, reason=reason)
    return [r.id for r in rows]


def list_tokens(session: Session, *, include_revoked: bool = False) -> list[dict[str, object]]:
    """Every token (without its hash): id, name, role, node, created, expires, revoked, state."""
    now = utcnow()
    stmt = select(ApiToken).order_by(ApiToken.id)
    if not include_revoked:
        stmt = stmt.where(ApiToken.revoked_at.is_(None))
    out: list[dict[str, object]] = []
    for t in session.scalars(stmt):
        expired = t.expires_at is not None and as_utc(t.expires_at) <= now
        out.append({"id": t.id, "name": t.name, "role": t.role, "node": t.node_name,
                    "created_at": t.created_at, "expires_at": t.expires_at, "revoked_at": t.revoked_at,
                    "state": "revoked" if t.revoked_at else "expired" if expired else "valid"})
    return out


def authenticate(session: Session, token: str | None) -> Principal:
    """Return the principal of a bearer token; AuthError when missing, unknown or revoked."""
    if not token:
        raise AuthError("missing bearer token (send `Authorization: Bearer <token>`)")
    digest = hash_token(token)
    row = session.scalars(select(ApiToken).where(ApiToken.token_hash == digest)).first()
    if row is None or not hmac.compare_digest(row.token_hash, digest):
        raise AuthError("unknown token")
    if row.revoked_at is not None:
        raise AuthError("token has been revoked")
    if row.expires_at is not None and as_utc(row.expires_at) <= utcnow():
        raise AuthError("token has expired")
    return Principal(token_id=row.id, name=row.name, role=row.role, node=row.node_name)


def lapsed_tokens(session: Session, since: dt.datetime, now: dt.datetime) -> list[str]:
    """Hashes of the tokens revoked at or after ``since``, or expired in (``since``, ``now``]: what an
    authentication cache must drop (a handful of rows however many tokens are cached)."""
    return list(session.scalars(select(ApiToken.token_hash).where(
        (ApiToken.revoked_at >= since) | ((ApiToken.expires_at > since) & (ApiToken.expires_at <= now)))))


def require_role(principal: Principal, *roles: str) -> None:
    """Raise Forbidden unless the principal has one of ``roles`` (operator implies viewer)."""
    allowed = set(roles)
    if "viewer" in allowed:
        allowed.add("operator")
    if principal.role not in allowed:
        raise Forbidden(f"role {principal.role!r} may not do this (needs {' or '.join(sorted(set(roles)))})")


def require_node(principal: Principal, node_name: str) -> None:
    """An agent acts only for its own node; an enrollment token may only register."""
    require_role(principal, "agent")
    if principal.node is None:
        raise Forbidden("an enrollment token may only register; use the node token returned by register")
    if principal.node != node_name:
        raise Forbidden(f"this token belongs to node {principal.node!r}, not {node_name!r}")


def parse_bootstrap_file(path: Path) -> list[tuple[str, str, str, str | None]]:
    """Parse ``role name token [node]`` lines (``#`` comments, blank lines ignored); ValueError names the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read bootstrap tokens file {path}: {exc.strerror or exc}") from None
    entries: list[tuple[str, str, str, str | None]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"{path}:{lineno}"
        if len(parts) not in (3, 4):
            raise ValueError(f"{where}: expected `role name token [node]`, got {len(parts)} fields")
        role, name, token = parts[:3]
        node = parts[3] if len(parts) == 4 else None
        try:
            _check_role(role)
            _check_name(name)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if len(token) < MIN_TOKEN_LENGTH or not _TOKEN_RE.match(token):
            raise ValueError(f"{where}: token must be at least {MIN_TOKEN_LENGTH} URL-safe characters")
        if node is not None and role != "agent":
            raise ValueError(f"{where}: only agent tokens can be bound to a node")
        entries.append((role, name, token, node))
    return entries


def load_bootstrap_tokens(session: Session, path: Path) -> int:
    """Hash the tokens of a bootstrap file into the DB (idempotent: known tokens are skipped). Returns #added."""
    entries = parse_bootstrap_file(path)
    added = 0
    for role, name, token, node in entries:
        existing = session.scalars(select(ApiToken).where(ApiToken.token_hash == hash_token(token))).first()
        if existing is not None:
            if existing.role != role or existing.node_name != node:
                raise ValueError(
                    f"{path}: token {name!r} is already registered with role {existing.role!r}"
                    f" (node {existing.node_name!r}); refusing to change it"
                )
            continue
        _add_token(session, role, name, node, token, actor="bootstrap")
        added += 1
    return added


def revoke_token(session: Session, token_id: int, *, actor: str, reason: str | None = None) -> bool:
    """Revoke a token by id (idempotent: False when it already was); LookupError for an unknown id."""

    row = session.get(ApiToken, token_id)
    if row is None:
        raise LookupError(f"no token with id {token_id}")
    if row.revoked_at is not None:
        return False
    row.revoked_at = utcnow()
    record_event(session, actor=actor, action="token.revoked", subject=f"token:{row.id}", reason=reason,
                 node=row.node_name, payload={"name": row.name, "role": row.role})
    return True
