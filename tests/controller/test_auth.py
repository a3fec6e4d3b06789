"""Tokens: hashed storage, authentication, roles, node binding, bootstrap file (SQLite and PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from controller.auth import (
    AuthError,
    Forbidden,
    Principal,
    authenticate,
    create_token,
    hash_token,
    load_bootstrap_tokens,
    parse_bootstrap_file,
    require_node,
    require_role,
    revoke_token,
)
from controller.db.engine import make_engine, session_factory, session_scope
from controller.db.models import ApiToken, Event


@pytest.fixture
def factory(db_url: str):  # type: ignore[no-untyped-def]
    engine = make_engine(db_url)
    yield session_factory(engine)
    engine.dispose()


def test_token_is_stored_hashed_and_authenticates(factory) -> None:  # type: ignore[no-untyped-def]
    with session_scope(factory) as s:
        token = create_token(s, "operator", "alice")
    with session_scope(factory) as s:
        rows = list(s.scalars(select(ApiToken)))
        assert [r.token_hash for r in rows] == [hash_token(token)]
        assert all(token not in (r.token_hash + r.name) for r in rows)
        events = list(s.scalars(select(Event).where(Event.action == "token.created")))
        assert len(events) == 1 and token not in str(events[0].payload)
        p = authenticate(s, token)
    assert (p.role, p.name, p.node) == ("operator", "alice", None)
    assert p.actor == "operator:alice"


def test_unknown_missing_and_revoked_tokens_are_refused(factory) -> None:  # type: ignore[no-untyped-def]
    with session_scope(factory) as s:
        token = create_token(s, "viewer", "bob")
    with session_scope(factory) as s, pytest.raises(AuthError, match="missing"):
        authenticate(s, None)
    with session_scope(factory) as s, pytest.raises(AuthError, match="unknown"):
        authenticate(s, token + "x")
    with session_scope(factory) as s:
        revoke_token(s, authenticate(s, token).token_id, actor="test", reason="leaked")
    with session_scope(factory) as s, pytest.raises(AuthError, match="revoked"):
        authenticate(s, token)


def test_bad_role_and_node_binding_refused(factory) -> None:  # type: ignore[no-untyped-def]
    with session_scope(factory) as s, pytest.raises(ValueError, match="unknown role"):
        create_token(s, "root", "x")
    with session_scope(factory) as s, pytest.raises(ValueError, match="only agent tokens"):
        create_token(s, "operator", "x", node="gpu-1")
    with session_scope(factory) as s:
        assert s.scalars(select(ApiToken)).first() is None  # nothing written by the refused calls


def test_role_and_node_checks() -> None:
    op = Principal(1, "op", "operator")
    viewer = Principal(2, "v", "viewer")
    enroll = Principal(3, "enroll", "agent")
    node = Principal(4, "node:gpu-1", "agent", node="gpu-1")
    require_role(op, "viewer")  # operator implies viewer
    require_role(viewer, "viewer")
    with pytest.raises(Forbidden, match="role 'viewer'"):
        require_role(viewer, "operator")
    with pytest.raises(Forbidden):
        require_role(node, "viewer")
    require_node(node, "gpu-1")
    with pytest.raises(Forbidden, match="belongs to node 'gpu-1'"):
        require_node(node, "gpu-2")
    with pytest.raises(Forbidden, match="enrollment token may only register"):
        require_node(enroll, "gpu-1")
    with pytest.raises(Forbidden):
        require_node(op, "gpu-1")


def test_bootstrap_file_is_idempotent(factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "tokens"
    f.write_text("# role name token [node]\noperator ops s3cr3t-operator-token-0001\n\n"
                 "agent enroll s3cr3t-enroll-token-00000002\nagent n1 s3cr3t-node-token-0000003 gpu-1\n")
    with session_scope(factory) as s:
        assert load_bootstrap_tokens(s, f) == 3
    with session_scope(factory) as s:
        assert load_bootstrap_tokens(s, f) == 0  # second start: nothing new
        assert len(list(s.scalars(select(ApiToken)))) == 3
        assert authenticate(s, "s3cr3t-node-token-0000003").node == "gpu-1"
        assert authenticate(s, "s3cr3t-enroll-token-00000002").is_enrollment


def test_bootstrap_refuses_changing_a_known_token(factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "tokens"
    f.write_text("viewer v s3cr3t-viewer-token-0001\n")
    with session_scope(factory) as s:
        load_bootstrap_tokens(s, f)
    f.write_text("operator v s3cr3t-viewer-token-0001\n")
    with session_scope(factory) as s, pytest.raises(ValueError, match="refusing to change"):
        load_bootstrap_tokens(s, f)
    with session_scope(factory) as s:
        assert authenticate(s, "s3cr3t-viewer-token-0001").role == "viewer"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("operator alice", "expected `role name token"),
        ("admin alice s3cr3t-token-000000001", "unknown role 'admin'"),
        ("viewer alice short", "at least 16"),
        ("viewer alice s3cr3t-token-000000001 gpu-1", "only agent tokens"),
        ("viewer al!ce s3cr3t-token-000000001", "invalid token name"),
    ],
)
def test_bootstrap_bad_lines_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    f = tmp_path / "tokens"
    f.write_text(f"# header\n{line}\n")
    with pytest.raises(ValueError, match=message) as exc:
        parse_bootstrap_file(f)
    assert f"{f}:2" in str(exc.value)


def test_bootstrap_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read bootstrap tokens file"):
        parse_bootstrap_file(tmp_path / "nope")


def test_auth_cache_is_kept_valid_by_sweeps_and_drops_what_another_replica_revoked(db_url: str) -> None:
    """A cached token stays valid past auth_cache_seconds while sweeps confirm it (no lookup per token); a
    revocation or expiry made elsewhere is dropped by the next sweep."""
    import datetime as dt
    import time

    from controller.api.app import build_state
    from controller.db.models import utcnow
    from kernelctl.settings import Settings

    state = build_state(Settings(database_url=db_url, auth_cache_seconds=0.5))
    try:
        with session_scope(state.factory) as s:
            keep = create_token(s, "agent", "node:a", node="a")
            gone = create_token(s, "agent", "node:b", node="b")
            soon = create_token(s, "viewer", "v", expires_at=utcnow() + dt.timedelta(seconds=1))
        for t in (keep, gone, soon):
            assert state.authenticate(t).name in ("node:a", "node:b", "v")
        with session_scope(state.factory) as s:  # "another replica": straight in the database
            revoke_token(s, s.scalar(select(ApiToken.id).where(ApiToken.name == "node:b")), actor="op")
        time.sleep(1.1)  # past the ttl, and `soon` has expired
        assert state.cached_principal(keep) is None  # no sweep yet: lapsed after the ttl
        assert state.sweep_lapsed_tokens() == 2  # `gone` revoked, `soon` expired: dropped
        assert state.cached_principal(keep).node == "a"  # confirmed by the sweep, without a lookup
        assert state.cached_principal(gone) is None and state.cached_principal(soon) is None
        with pytest.raises(AuthError, match="revoked"):
            state.authenticate(gone)
        with pytest.raises(AuthError, match="expired"):
            state.authenticate(soon)
        fresh = build_state(Settings(database_url=db_url, auth_cache_seconds=60))  # a restarted replica
        try:
            assert fresh.warm_auth_cache() == 1  # only the live token (revoked and expired ones are not cached)
            assert fresh.cached_principal(keep).node == "a" and fresh.cached_principal(gone) is None
        finally:
            fresh.engine.dispose()
    finally:
        state.engine.dispose()
