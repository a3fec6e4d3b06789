"""Throw-away databases for tests: a fresh SQLite file or a fresh PostgreSQL database per test.

PostgreSQL is real (127.0.0.1:5432 by default, ``KERNELCTL_TEST_PG_URL`` to change; when nothing answers at the
default, the session runs on a cluster of its own, tests/conftest.py); when it is not reachable the tests fail,
never skip. Each test database is cloned from a migrated template, so every
test starts at the Alembic head in milliseconds; likewise each migrated SQLite database is a copy of a file
migrated once per test process.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

PG_ADMIN_URL = os.environ.get("KERNELCTL_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
BACKENDS = ("sqlite", "postgres")


def _admin_conninfo() -> str:
    url = make_url(PG_ADMIN_URL)
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def pg_url(dbname: str) -> str:
    return make_url(PG_ADMIN_URL).set(database=dbname).render_as_string(hide_password=False)


def pg_admin() -> psycopg.Connection:
    try:
        return psycopg.connect(_admin_conninfo(), autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        raise RuntimeError(
            f"PostgreSQL is required for the database tests and is not reachable at {PG_ADMIN_URL}: {exc}. "
            "Start it, or unset KERNELCTL_TEST_PG_URL to let the tests start a cluster of their own."
        ) from exc


_TEMPLATE: str | None = None


def _pg_template() -> str:
    """A migrated template database, created once per test process."""
    global _TEMPLATE
    if _TEMPLATE is None:
        from controller.db import migrate
        from controller.db.engine import make_engine

        name = f"kctl_tmpl_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        with pg_admin() as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        engine = make_engine(pg_url(name))
        migrate.upgrade(engine)
        engine.dispose()
        _TEMPLATE = name
    return _TEMPLATE


_SQLITE_TEMPLATE: Path | None = None


def _sqlite_template() -> Path:
    """A SQLite file migrated to head, made once per test process (its WAL checkpointed into it on dispose)."""
    global _SQLITE_TEMPLATE
    if _SQLITE_TEMPLATE is None:
        from controller.db import migrate
        from controller.db.engine import make_engine

        path = Path(tempfile.mkdtemp(prefix="kctl-sqlite-tmpl-")) / "template.db"
        engine = make_engine(f"sqlite:///{path}")
        migrate.upgrade(engine)
        engine.dispose()
        _SQLITE_TEMPLATE = path
    return _SQLITE_TEMPLATE


def drop_templates() -> None:
    global _TEMPLATE, _SQLITE_TEMPLATE
    if _SQLITE_TEMPLATE is not None:
        shutil.rmtree(_SQLITE_TEMPLATE.parent, ignore_errors=True)
        _SQLITE_TEMPLATE = None
    if _TEMPLATE is not None:
        with pg_admin() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{_TEMPLATE}" WITH (FORCE)')
        _TEMPLATE = None


@contextmanager
def fresh_database(backend: str, tmp_path: Path, *, migrated: bool = True) -> Iterator[str]:
    """Yield the URL of a new, empty (or migrated-to-head) database; drop it afterwards."""
    if backend == "sqlite":
        path = tmp_path / f"kctl-{uuid.uuid4().hex[:8]}.db"
        if migrated:
            shutil.copyfile(_sqlite_template(), path)
        yield f"sqlite:///{path}"
        return
    name = f"kctl_t_{uuid.uuid4().hex[:12]}"
    with pg_admin() as admin:
        template = f' TEMPLATE "{_pg_template()}"' if migrated else ""
        admin.execute(f'CREATE DATABASE "{name}"{template}')
    try:
        yield pg_url(name)
    finally:
        with pg_admin() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

