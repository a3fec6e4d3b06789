"""The event log is append-only in the database itself: raw UPDATE/DELETE fail on both backends."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import DBAPIError

from controller.changelog import record_event
from controller.db.engine import make_engine, session_factory, session_scope
from controller.db.models import Event


@pytest.fixture
def engine_with_event(db_url: str):
    engine = make_engine(db_url)
    with session_scope(session_factory(engine)) as session:
        record_event(session, actor="alice", action="bundle.registered", subject="bundle:x@1.0.0",
                     bundle="x@1.0.0", payload={"k": 1})
    yield engine
    engine.dispose()


@pytest.mark.parametrize(
    "statement",
    ["UPDATE events SET actor = 'mallory'", "UPDATE events SET reason = 'rewritten' WHERE id = 1",
     "DELETE FROM events", "DELETE FROM events WHERE id = 1"],
)
def test_raw_update_and_delete_are_refused(engine_with_event, statement: str) -> None:
    with pytest.raises(DBAPIError, match="append-only"), engine_with_event.begin() as conn:
        conn.execute(text(statement))
    with engine_with_event.connect() as conn:
        row = conn.execute(select(Event.actor, Event.reason)).one()
    assert row == ("alice", None)


@pytest.mark.postgres
def test_truncate_refused_on_postgres(tmp_path) -> None:
    """SQLite has no TRUNCATE; on PostgreSQL a statement-level trigger refuses it."""
    from tests.dbutil import fresh_database

    with fresh_database("postgres", tmp_path) as url:
        engine = make_engine(url)
        with session_scope(session_factory(engine)) as session:
            record_event(session, actor="alice", action="x.y", subject="s")
        with pytest.raises(DBAPIError, match="append-only"), engine.begin() as conn:
            conn.execute(text("TRUNCATE events"))
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(Event)).scalar_one() == 1
        engine.dispose()


def test_insert_still_works(engine_with_event) -> None:
    with session_scope(session_factory(engine_with_event)) as session:
        record_event(session, actor="bob", action="rollout.started", subject="rollout:1", rollout_id=1)
    with engine_with_event.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Event)).scalar_one() == 2
