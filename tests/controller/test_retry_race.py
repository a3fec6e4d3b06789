"""Operator transitions re-run when the database aborts them to break a lock cycle (deadlock, serialisation
failure), as they do after a lost optimistic-concurrency race; other database errors are not retried."""

from __future__ import annotations

import psycopg.errors
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from controller.api.routes_rollouts import _concurrent
from controller.errors import ConcurrentWrite, Conflict
from tests import dbutil


def _operational(orig: Exception) -> OperationalError:
    return OperationalError("UPDATE nodes ...", {}, orig)


def test_deadlock_and_serialisation_failures_are_retried_other_errors_are_not() -> None:
    assert _concurrent(_operational(psycopg.errors.DeadlockDetected("deadlock detected")))
    assert _concurrent(_operational(psycopg.errors.SerializationFailure("could not serialize access")))
    assert _concurrent(ConcurrentWrite("rollout 1"))
    assert not _concurrent(_operational(psycopg.errors.AdminShutdown("terminating connection")))
    assert not _concurrent(Conflict("rollout 1 is promoted"))


@pytest.mark.postgres
def test_a_real_postgres_deadlock_is_classified_as_retryable(tmp_path) -> None:
    """Two transactions locking two rows in opposite orders: PostgreSQL aborts one with 40P01."""
    import threading

    with dbutil.fresh_database("postgres", tmp_path, migrated=False) as url:
        engine = create_engine(url)
        with engine.begin() as c:
            c.execute(text("CREATE TABLE t (id int PRIMARY KEY, v int)"))
            c.execute(text("INSERT INTO t VALUES (1, 0), (2, 0)"))
        first_locked, errors = threading.Barrier(2), []

        def writer(a: int, b: int) -> None:
            try:
                with engine.begin() as c:
                    c.execute(text("SET LOCAL deadlock_timeout = '100ms'"))
                    c.execute(text("UPDATE t SET v = v + 1 WHERE id = :a"), {"a": a})
                    first_locked.wait(10)
                    c.execute(text("UPDATE t SET v = v + 1 WHERE id = :b"), {"b": b})
            except OperationalError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=ab) for ab in ((1, 2), (2, 1))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        engine.dispose()
    assert len(errors) == 1 and _concurrent(errors[0]), errors
