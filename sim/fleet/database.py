"""The simulation's database: a throw-away PostgreSQL database (``--fresh``) or the given one, migrated."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

from sim.fleet.config import SimError


@contextlib.contextmanager
def database(url: str, fresh: bool, work: Path) -> Iterator[str]:
    """Yield a migrated database URL: a fresh one (created and dropped here) or ``url`` itself, migrated."""
    from sqlalchemy.engine import make_url

    from controller.db import migrate
    from controller.db.engine import make_engine

    parsed = make_url(url)
    created: str | None = None
    if fresh and parsed.get_backend_name() == "postgresql":
        import psycopg

        name = f"kctl_sim_{uuid.uuid4().hex[:10]}"
        admin = parsed.set(drivername="postgresql").render_as_string(hide_password=False)
        try:
            with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
                conn.execute(f'CREATE DATABASE "{name}"')
        except psycopg.Error as exc:
            raise SimError(f"cannot create a fresh database on {parsed.render_as_string()}: {exc}") from None
        created, url = name, parsed.set(database=name).render_as_string(hide_password=False)
    elif fresh:
        url = f"sqlite:///{work / 'sim-fleet.db'}"
    engine = make_engine(url)
    try:
        migrate.upgrade(engine)
    finally:
        engine.dispose()
    try:
        yield url
    finally:
        if created is not None:
            import psycopg

            with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{created}" WITH (FORCE)')


def stored_report_keys(url: str) -> set[str]:
    from sqlalchemy import select

    from controller.db.engine import make_engine
    from controller.db.models import Report

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return set(conn.execute(select(Report.idempotency_key)).scalars())
    finally:
        engine.dispose()


def stale_marks(url: str) -> int:
    """How many times the controller marked a node stale during the run (``node.stale`` events)."""
    from sqlalchemy import create_engine, func, select

    from controller.db.models import Event

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.scalar(select(func.count()).select_from(Event).where(Event.action == "node.stale")) or 0)
    finally:
        engine.dispose()
