"""Audit queries and the `kernelctl audit` command, on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import subprocess
import sys

import pytest
from sqlalchemy import func, select

from controller.audit import (
    AuditFilters,
    AuditQueryError,
    active_at,
    nodes_that_ran,
    parse_time,
    query_events,
)
from controller.changelog import record_event
from controller.db.engine import make_engine, session_factory, session_scope
from controller.db.models import Activation, Bundle, Event, Node

T0 = dt.datetime(2026, 11, 1, 12, 0, tzinfo=dt.timezone.utc)


def _bundle(version: str) -> Bundle:
    return Bundle(name="llm-fused", version=version, digest=hashlib.sha256(version.encode()).hexdigest(),
                  manifest={}, signer_key_id="k", size_bytes=1, content=b"x", created_by="alice")


def _node(name: str) -> Node:
    return Node(name=name, gpu_name="H100", compute_capability="9.0", arch="sm_90", driver_version="580.1",
                cuda_version="13.0", triton_version="3.6.0", torch_version="2.11", memory_total_mb=81559)


@pytest.fixture
def seeded(db_url: str):
    engine = make_engine(db_url)
    with session_scope(session_factory(engine)) as s:
        b1, b2 = _bundle("1.0.0"), _bundle("1.1.0")
        n1, n2 = _node("gpu-1"), _node("gpu-2")
        s.add_all([b1, b2, n1, n2])
        s.flush()
        # gpu-1 ran 1.0.0 from T0 to T0+1h, then 1.1.0; gpu-2 only ever 1.0.0.
        s.add_all([
            Activation(node_id=n1.id, bundle_id=b1.id, bundle_name="llm-fused", started_at=T0,
                       ended_at=T0 + dt.timedelta(hours=1)),
            Activation(node_id=n1.id, bundle_id=b2.id, bundle_name="llm-fused",
                       started_at=T0 + dt.timedelta(hours=1)),
            Activation(node_id=n2.id, bundle_id=b1.id, bundle_name="llm-fused", started_at=T0),
        ])
        for i, (actor, action, bundle, node) in enumerate([
            ("alice", "bundle.registered", "llm-fused@1.0.0", None),
            ("alice", "bundle.registered", "llm-fused@1.1.0", None),
            ("bob", "rollout.started", "llm-fused@1.1.0", None),
            ("gpu-1", "assignment.activated", "llm-fused@1.1.0", "gpu-1"),
            ("judge", "rollout.rolled_back", "llm-fused@1.1.0", None),
            ("alice", "bundle.registered", "other@2.0.0", None),
        ]):
            ev = record_event(s, actor=actor, action=action, subject=f"s{i}", bundle=bundle, node=node,
                              reason="latency regression" if "rolled" in action else None)
            ev.at = T0 + dt.timedelta(minutes=10 * i)
    yield db_url, engine
    engine.dispose()


def test_filters(seeded) -> None:
    _, engine = seeded
    with session_factory(engine)() as s:
        def q(**kw):
            return [e.action for e in query_events(s, AuditFilters(**kw))]

        assert q(bundle="llm-fused") == ["rollout.rolled_back", "assignment.activated", "rollout.started",
                                         "bundle.registered", "bundle.registered"]
        assert q(bundle="llm-fused@1.0.0") == ["bundle.registered"]
        assert q(actor="judge") == ["rollout.rolled_back"]
        assert q(action="rollout.*") == ["rollout.rolled_back", "rollout.started"]
        assert q(node="gpu-1") == ["assignment.activated"]
        assert len(q(since=T0 + dt.timedelta(minutes=25), until=T0 + dt.timedelta(minutes=45))) == 2
        assert len(q(limit=2)) == 2
        with pytest.raises(AuditQueryError, match="unknown node"):
            q(node="gpu-404")
        with pytest.raises(AuditQueryError, match="limit"):
            q(limit=0)


def test_active_at_and_nodes_that_ran(seeded) -> None:
    _, engine = seeded
    with session_factory(engine)() as s:
        assert [r["version"] for r in active_at(s, "gpu-1", T0 + dt.timedelta(minutes=30))] == ["1.0.0"]
        assert [r["version"] for r in active_at(s, "gpu-1", T0 + dt.timedelta(hours=2))] == ["1.1.0"]
        assert active_at(s, "gpu-1", T0 - dt.timedelta(minutes=1)) == []
        assert [r["node"] for r in nodes_that_ran(s, "llm-fused@1.0.0")] == ["gpu-1", "gpu-2"]
        assert [r["node"] for r in nodes_that_ran(s, "llm-fused@1.1.0")] == ["gpu-1"]


def test_parse_time() -> None:
    assert parse_time("2026-11-01T12:00:00Z") == T0
    assert parse_time("2026-11-01T12:00:00") == T0
    assert dt.datetime.now(dt.timezone.utc) - parse_time("2h") > dt.timedelta(minutes=119)
    with pytest.raises(AuditQueryError, match="cannot parse time"):
        parse_time("last tuesday")


def _cli(*args: str, db: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KERNELCTL_DATABASE_URL": db, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "cli.app", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_cli_formats_and_read_only(seeded) -> None:
    url, engine = seeded
    with engine.connect() as conn:
        before = conn.execute(select(func.count()).select_from(Event)).scalar_one()
    out = _cli("audit", "--bundle", "llm-fused@1.1.0", "--format", "json", db=url)
    assert out.returncode == 0, out.stderr
    assert [e["action"] for e in json.loads(out.stdout)] == ["rollout.rolled_back", "assignment.activated",
                                                            "rollout.started", "bundle.registered"]
    out = _cli("audit", "--actor", "judge", "--format", "csv", db=url)
    assert out.returncode == 0 and out.stdout.splitlines()[0].startswith("id,at,actor,action")
    assert "latency regression" in out.stdout
    out = _cli("audit", "--node", "gpu-1", "--at", "2026-11-01T12:30:00Z", "--format", "json", db=url)
    assert [r["version"] for r in json.loads(out.stdout)] == ["1.0.0"]
    out = _cli("audit", "--action", "rollout.*", db=url)
    assert out.returncode == 0 and "rollout.rolled_back" in out.stdout
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Event)).scalar_one() == before


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["audit", "--node", "nope"], 4, "unknown node 'nope'"),  # not found (EXIT_NOT_FOUND)
        (["audit", "--since", "yesterday"], 2, "cannot parse time"),
        (["audit", "--at", "2026-11-01T00:00:00Z"], 2, "--at needs --node"),
        (["audit", "--format", "xml"], 2, "xml"),
    ],
)
def test_cli_bad_filters(seeded, args: list[str], code: int, message: str) -> None:
    url, _ = seeded
    out = _cli(*args, db=url)
    assert out.returncode == code
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_database_errors(tmp_path, empty_db_url: str) -> None:
    cases = [
        ("postgresql+psycopg://nobody@127.0.0.1:1/none", "cannot reach database"),
        ("mysql://x@y/z", "unsupported database"),
        ("sqlite:///" + str(tmp_path / "missing.db"), "does not exist"),
        (empty_db_url, "run `kernelctl db upgrade`"),
    ]
    for url, message in cases:
        out = _cli("audit", db=url)
        assert out.returncode == 1, (url, out.stderr)
        assert message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    # the read command created nothing
    assert not (tmp_path / "missing.db").exists()


def test_db_upgrade_and_current(empty_db_url: str) -> None:
    out = _cli("db", "current", "--json", db=empty_db_url)
    if out.returncode == 0:  # PostgreSQL: an empty database exists and is behind
        assert json.loads(out.stdout)["up_to_date"] is False
    else:  # SQLite: the file does not exist yet and a read command must not create it
        assert "does not exist" in out.stderr
    out = _cli("db", "upgrade", db=empty_db_url)
    assert out.returncode == 0, out.stderr
    out = _cli("db", "current", "--json", db=empty_db_url)
    assert json.loads(out.stdout)["up_to_date"] is True
