"""Shared request plumbing: the app state, one-transaction sessions, bearer authentication, role checks."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from controller.auth import AuthError, Principal, authenticate, hash_token, lapsed_tokens, require_role
from controller.bundle_bytes import BundleBytes
from controller.db.engine import reader, session_factory, session_scope
from controller.db.models import ApiToken, utcnow
from controller.desired.hub import DesiredHub
from controller.leader import LeaderElector
from controller.metrics import Metrics
from kernelctl.settings import Settings

AUTH_CACHE_MAX = 50_000  # cached principals (the cache is emptied when it grows past this)
AUTH_SWEEP_SECONDS = 5.0  # how often the cache drops tokens revoked or expired elsewhere
SWEEP_LOOKBACK_SECONDS = 60.0  # a revocation whose transaction committed this much after its timestamp is seen


@dataclass
class AppState:
    """Everything a request needs; built once by ``create_app``."""

    settings: Settings
    engine: Engine
    factory: sessionmaker[Session]
    metrics: Metrics
    elector: LeaderElector
    hub: DesiredHub  # desired-state push, batched liveness and agent writes (controller.desired), every replica
    trusted_keys: dict | None = None
    bundle_bytes: BundleBytes = field(default_factory=BundleBytes)  # bundle downloads, cached by digest
    _auth_cache: dict[str, tuple[float, Principal]] = field(default_factory=dict)
    _auth_by_node: dict[str, set[str]] = field(default_factory=dict)  # node -> its cached token hashes
    _swept_at: float = float("-inf")  # monotonic start of the last successful sweep_lapsed_tokens
    _auth_lock: threading.Lock = field(default_factory=threading.Lock)

    @contextmanager
    def tx(self) -> Iterator[Session]:
        """One transaction: committed when the block ends, rolled back on any error."""
        with session_scope(self.factory) as session:
            yield session

    @cached_property
    def _read_factory(self) -> sessionmaker[Session]:
        return session_factory(reader(self.engine))

    @contextmanager
    def read(self) -> Iterator[Session]:
        """One read-only transaction (lists, audit): it never takes SQLite's write lock, so a writer (a
        rollback) is never queued behind it; on PostgreSQL a statement that writes fails."""
        with self._read_factory() as session, session.begin():
            yield session

    def cached_principal(self, token: str | None) -> Principal | None:
        """The cached principal of a bearer token, without touching the database (None: not cached or
        expired). Malformed or missing tokens raise AuthError."""
        if not token:
            raise AuthError("missing bearer token (send `Authorization: Bearer <token>`)")
        if len(token) > 512:
            raise AuthError("malformed bearer token (over 512 characters)")
        ttl = self.settings.auth_cache_seconds
        with self._auth_lock:
            hit = self._auth_cache.get(hash_token(token))
        # valid for ttl after it was cached, or after the last sweep that would have dropped it
        return hit[1] if hit is not None and time.monotonic() - max(hit[0], self._swept_at) < ttl else None

    def sweep_lapsed_tokens(self) -> int:
        """Drop cached principals of tokens revoked or expired lately (by any replica or the CLI): one query
        for the whole cache, so the cache stays valid without a lookup per token and ``ttl`` (run every few
        seconds: a revocation elsewhere takes effect within that time). Returns the entries dropped."""
        ttl = self.settings.auth_cache_seconds
        started = time.monotonic()
        now = utcnow()
        with self._read_factory() as session:  # a read: never the write lock
            lapsed = lapsed_tokens(session, now - dt.timedelta(seconds=ttl + SWEEP_LOOKBACK_SECONDS), now)
        dropped = 0
        with self._auth_lock:
            for key in lapsed:
                hit = self._auth_cache.pop(key, None)
                if hit is not None:
                    dropped += 1
                    if hit[1].node is not None:
                        self._auth_by_node.get(hit[1].node, set()).discard(key)
            self._swept_at = started
        return dropped

    def authenticate(self, token: str | None) -> Principal:
        """Authenticate a bearer token (cached ``auth_cache_seconds``: a revocation or expiry made elsewhere
        takes effect within that time; one made through this replica at once)."""
        hit = self.cached_principal(token)
        if hit is not None:
            return hit
        with self._read_factory() as session:  # a read: never the write lock
            principal = authenticate(session, token)
        self.remember(token, principal)  # type: ignore[arg-type]
        return principal

    def warm_auth_cache(self) -> int:
        """Cache every live token's principal (one query; at start, so a restarted replica does not look up
        each of the fleet's tokens as its agents reconnect at once). Returns the tokens cached."""
        now = utcnow()
        with self._read_factory() as session:  # a read: never the write lock
            rows = session.execute(select(ApiToken.id, ApiToken.name, ApiToken.role, ApiToken.node_name,
                                          ApiToken.token_hash)
                                   .where(ApiToken.revoked_at.is_(None),
                                          ApiToken.expires_at.is_(None) | (ApiToken.expires_at > now))
                                   .order_by(ApiToken.id.desc()).limit(AUTH_CACHE_MAX)).all()
        at = time.monotonic()
        with self._auth_lock:
            for tid, name, role, node, key in rows:
                self._auth_cache[key] = (at, Principal(token_id=tid, name=name, role=role, node=node))
                if node is not None:
                    self._auth_by_node.setdefault(node, set()).add(key)
        return len(rows)

    def remember(self, token: str, principal: Principal) -> None:
        """Cache ``principal`` for ``token`` (also a token this replica just issued: no lookup on first use)."""
        key = hash_token(token)
        with self._auth_lock:
            if len(self._auth_cache) > AUTH_CACHE_MAX:
                self._auth_cache.clear()
                self._auth_by_node.clear()
            self._auth_cache[key] = (time.monotonic(), principal)
            if principal.node is not None:
                self._auth_by_node.setdefault(principal.node, set()).add(key)

    def forget_node(self, node: str) -> None:
        """Drop the cached principals of ``node`` (its tokens were just revoked or replaced)."""
        with self._auth_lock:
            for key in self._auth_by_node.pop(node, ()):
                self._auth_cache.pop(key, None)

    def forget_token(self, token_id: int) -> None:
        with self._auth_lock:
            for key in [k for k, (_t, p) in self._auth_cache.items() if p.token_id == token_id]:
                del self._auth_cache[key]


async def get_state(request: Request) -> AppState:
    """The app's state; a coroutine because FastAPI runs a plain-function dependency in its thread pool (a thread
    hop on every request)."""
    return request.app.state.kctl


State = Annotated[AppState, Depends(get_state)]


def bearer_token(request: Request) -> str | None:
    return parse_bearer(request.headers.get("authorization"))


def scope_header(scope: dict, name: bytes) -> str | None:
    """A request header straight from the ASGI scope (for the middlewares that run before a Request exists)."""
    return next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == name), None)


def parse_bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (None when absent; AuthError when malformed)."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise AuthError("malformed Authorization header (expected `Bearer <token>`)")
    return value.strip()


async def get_principal(request: Request, state: State) -> Principal:
    """The caller: from the cache in the event loop (every heartbeat of a fleet), else looked up in a thread."""
    token = bearer_token(request)
    hit = state.cached_principal(token)
    if hit is not None:
        return hit
    return await run_in_threadpool(state.authenticate, token)


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]


async def viewer(principal: CurrentPrincipal) -> Principal:
    require_role(principal, "viewer")
    return principal


async def operator(principal: CurrentPrincipal) -> Principal:
    require_role(principal, "operator")
    return principal


Viewer = Annotated[Principal, Depends(viewer)]
Operator = Annotated[Principal, Depends(operator)]
