"""Database triggers that make the event log append-only, on SQLite and on PostgreSQL.

Created and dropped by the migrations; nothing in code can bypass them (an UPDATE, DELETE or, on
PostgreSQL, TRUNCATE of ``events`` fails in the database itself).
"""

from __future__ import annotations

APPEND_ONLY_MESSAGE = "events are append-only: UPDATE and DELETE are refused"

SQLITE_CREATE = [
    f"""CREATE TRIGGER events_no_update BEFORE UPDATE ON events
        BEGIN SELECT RAISE(ABORT, '{APPEND_ONLY_MESSAGE}'); END""",
    f"""CREATE TRIGGER events_no_delete BEFORE DELETE ON events
        BEGIN SELECT RAISE(ABORT, '{APPEND_ONLY_MESSAGE}'); END""",
]
SQLITE_DROP = ["DROP TRIGGER IF EXISTS events_no_update", "DROP TRIGGER IF EXISTS events_no_delete"]

POSTGRES_CREATE = [
    f"""CREATE OR REPLACE FUNCTION kernelctl_events_append_only() RETURNS trigger AS $$
        BEGIN RAISE EXCEPTION '{APPEND_ONLY_MESSAGE}' USING ERRCODE = 'insufficient_privilege'; END;
        $$ LANGUAGE plpgsql""",
    """CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
        FOR EACH ROW EXECUTE FUNCTION kernelctl_events_append_only()""",
    """CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
        FOR EACH STATEMENT EXECUTE FUNCTION kernelctl_events_append_only()""",
]
POSTGRES_DROP = [
    "DROP TRIGGER IF EXISTS events_no_truncate ON events",
    "DROP TRIGGER IF EXISTS events_append_only ON events",
    "DROP FUNCTION IF EXISTS kernelctl_events_append_only()",
]


def create_statements(dialect: str) -> list[str]:
    return SQLITE_CREATE if dialect == "sqlite" else POSTGRES_CREATE


def drop_statements(dialect: str) -> list[str]:
    return SQLITE_DROP if dialect == "sqlite" else POSTGRES_DROP
