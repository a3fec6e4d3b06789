"""Database engines and sessions for the changelog, with errors that say what is wrong.

SQLite (the embedded default) gets WAL, a busy timeout and foreign keys; read-only opening uses SQLite's
``mode=ro`` URI and PostgreSQL's ``default_transaction_read_only`` so a read command can never write.
Writers on SQLite begin ``IMMEDIATE`` (they take the write lock up front and serialise); readers
(:func:`reader`, the API's list and audit queries) begin deferred and never take it, so a long read cannot
hold back a rollback (WAL: a reader sees the snapshot of its first statement).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, inspect
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_random

# PostgreSQL's "deadlock detected" and "could not serialize access": the server aborted the transaction to
# break a lock cycle with another writer (the tick, a liveness flush); the documented remedy is to re-run it.
RETRYABLE_SQLSTATES = frozenset({"40P01", "40001"})


def aborted_by_lock_cycle(exc: BaseException) -> bool:
    """The database aborted this transaction to break a deadlock or a serialization conflict: re-run it."""
    return isinstance(exc, OperationalError) and getattr(exc.orig, "sqlstate", None) in RETRYABLE_SQLSTATES


retry_lock_cycles = retry(retry=retry_if_exception(aborted_by_lock_cycle), stop=stop_after_attempt(5),
                          wait=wait_random(0.01, 0.1), reraise=True)
"""Decorates a function that runs one whole transaction: re-run it when the database aborted it to break a
lock cycle (group commits, the full heartbeat, report intake, the liveness flush)."""


class DatabaseError(RuntimeError):
    """A database problem explained in one line (bad URL, unreachable, schema out of date)."""


def parse_url(url: str) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise DatabaseError(f"malformed database URL {url!r}: {exc}") from None
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise DatabaseError(
            f"unsupported database {parsed.get_backend_name()!r} in {url!r}: use sqlite:///PATH or "
            "postgresql+psycopg://USER@HOST:PORT/DB"
        )
    if parsed.get_backend_name() == "postgresql" and parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def is_sqlite(engine_or_url: Engine | URL | str) -> bool:
    url = engine_or_url.url if isinstance(engine_or_url, Engine) else engine_or_url
    return make_url(str(url) if not isinstance(url, URL) else url).get_backend_name() == "sqlite"


def make_engine(url: str, *, read_only: bool = False, create_dir: bool = True, pool_size: int = 10) -> Engine:
    """Create an engine; ``read_only`` opens the database so that no statement can write."""
    parsed = parse_url(url)
    if parsed.get_backend_name() == "sqlite":
        db = parsed.database or ""
        if db and db != ":memory:":
            path = Path(db).expanduser()
            if read_only and not path.exists():
                raise DatabaseError(f"database file {path} does not exist (run `kernelctl db upgrade` first)")
            if create_dir and not read_only:
                path.parent.mkdir(parents=True, exist_ok=True)
            if read_only:
                engine = create_engine(
                    f"sqlite:///file:{path}?mode=ro&uri=true",
                    connect_args={"timeout": 30, "check_same_thread": False},
                )
                _sqlite_pragmas(engine, wal=False)
                return engine
        engine = create_engine(parsed, connect_args={"timeout": 30, "check_same_thread": False})
        _sqlite_pragmas(engine, wal=True)
        return engine
    connect_args: dict[str, object] = {"connect_timeout": 5}
    if read_only:
        connect_args["options"] = "-c default_transaction_read_only=on"
    return create_engine(
        parsed, pool_pre_ping=True, pool_size=pool_size, max_overflow=pool_size, connect_args=connect_args
    )


def _sqlite_pragmas(engine: Engine, *, wal: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
        dbapi_conn.isolation_level = None  # let SQLAlchemy emit BEGIN (see "begin" below)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=30000")
        if wal:
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:  # type: ignore[no-untyped-def]
        # IMMEDIATE takes the write lock up front: two writers serialise instead of failing mid-way. A reader
        # (see reader()) begins deferred: it never takes the write lock, so it never holds a writer back.
        immediate = wal and not conn.get_execution_options().get(READ, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


READ = "kernelctl_read"  # execution option of :func:`reader` engines


def reader(engine: Engine) -> Engine:
    """The same engine (same pool) for read-only transactions: deferred on SQLite (no write lock), ``READ
    ONLY`` on PostgreSQL (a statement that writes fails)."""
    if is_sqlite(engine):
        return engine.execution_options(**{READ: True})
    return engine.execution_options(**{READ: True, "postgresql_readonly": True})


def check_reachable(engine: Engine) -> None:
    """Connect once; raise DatabaseError with the cause when the database cannot be reached."""
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except OperationalError as exc:
        cause = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        raise DatabaseError(f"cannot reach database {engine.url.render_as_string(hide_password=True)}: {cause}") from None


def has_table(engine: Engine, name: str) -> bool:
    return inspect(engine).has_table(name)


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One transaction: commit on success, roll back on any error."""
    with factory() as session, session.begin():
        yield session
