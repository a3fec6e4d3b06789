"""Shared fixtures: every database test runs on SQLite and on PostgreSQL (real servers, never mocked)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
from sqlalchemy.engine import make_url

from tests import dbutil, provision

if TYPE_CHECKING:
    from tests.controller.serverutil import Zygote

# Kernels run through Triton's interpreter when there is no GPU; it must be set before triton is imported.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass


pytest_plugins = ["tests.reaper"]  # no test leaves a process behind

_SESSION_PG: provision.PgCluster | None = None


def _postgres_answers(url: str) -> bool:
    try:
        psycopg.connect(make_url(url).set(drivername="postgresql").render_as_string(hide_password=False),
                        connect_timeout=5).close()
    except psycopg.OperationalError:
        return False
    return True


def pytest_sessionstart(session: pytest.Session) -> None:
    """Before any test (and, under xdist, before the workers start: they inherit the environment): when nothing
    answers at the default PostgreSQL URL and ``KERNELCTL_TEST_PG_URL`` names no other, the suite starts a cluster
    of its own for the session (tests/provision.py) rather than a server it does not own."""
    global _SESSION_PG
    config = session.config
    if hasattr(config, "workerinput") or "KERNELCTL_TEST_PG_URL" in os.environ:
        return
    default = dbutil.PG_ADMIN_URL
    if not _postgres_answers(default):
        _SESSION_PG = provision.PgCluster("session").start()
        os.environ["KERNELCTL_TEST_PG_URL"] = dbutil.PG_ADMIN_URL = _SESSION_PG.url
        sys.stderr.write(f"PostgreSQL does not answer at {default}: the tests run on a cluster of their own at "
                         f"{_SESSION_PG.url} (removed at the end)\n")


@pytest.fixture(params=[pytest.param("sqlite"), pytest.param("postgres", marks=pytest.mark.postgres)])
def db_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def db_url(db_backend: str, tmp_path: Path) -> Iterator[str]:
    """URL of a fresh database migrated to head, on each backend."""
    with dbutil.fresh_database(db_backend, tmp_path, migrated=True) as url:
        yield url


@pytest.fixture
def empty_db_url(db_backend: str, tmp_path: Path) -> Iterator[str]:
    """URL of a fresh, empty database (no schema), on each backend."""
    with dbutil.fresh_database(db_backend, tmp_path, migrated=False) as url:
        yield url


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    """One :class:`tests.controller.serverutil.Zygote` per test process (started on first use): controllers
    of every test file fork from it instead of importing the controller again (~2 CPU-s a start)."""
    from tests.controller.serverutil import Zygote as _Zygote

    z = _Zygote()
    yield z
    z.stop()


DURATIONS_KEY = "kernelctl/seconds-per-file"
# Seconds per file (setup + call + teardown of its tests) from one full run (--durations=0 of 2026-11-28, issue 28's
# suite pass: 3 workers on the 2-core machine at load 4-6): the order for a checkout whose pytest cache has no
# durations of its own yet.
SEED = Path(__file__).with_name("durations.json")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker more than the cores (at most ``--maxprocesses``). Much of the suite waits on
    real servers, agents and PostgreSQL; on 2 cores, 2 workers kept 145% of the CPU busy (13 min 6 s) and 3
    workers 170% (11 min 17 s), measured on the same machine one after the other."""
    return (os.cpu_count() or 1) + 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first, so that the pytest-xdist workers (``--dist loadfile``, collection order kept)
    do not end on one long file while the other worker idles. A file's length is what it took last time
    (recorded below in pytest's cache), else its figure in tests/durations.json, else a guess: the e2e
    tests first, a file with a ``slow`` test next. A stable sort: the order inside a file does not change. Every worker reads the same
    cache before any run writes it, so every worker collects the same order (xdist requires that)."""
    cache = getattr(config, "cache", None)
    known: dict[str, float] = (cache.get(DURATIONS_KEY, {}) if cache is not None else {}) or {}
    seed = json.loads(SEED.read_text()) if SEED.is_file() else {}
    guess: dict[str, float] = {}
    for item in items:
        f = _file_of(item.nodeid)
        g = 1e6 if f.startswith("tests/e2e/") else (60.0 if item.get_closest_marker("slow") else 1.0)
        guess[f] = float(seed.get(f, max(guess.get(f, 0.0), g)))
    seconds = {f: float(known.get(f, g)) for f, g in guess.items()}
    items.sort(key=lambda item: -seconds[_file_of(item.nodeid)])


_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS[_file_of(report.nodeid)] = _SECONDS.get(_file_of(report.nodeid), 0.0) + report.duration


def _record_durations(session: pytest.Session) -> None:
    """Seconds per file of this run into pytest's cache (the xdist controller or a plain run; never a worker,
    which sees only its own files), merged into what is there so that a run of some files keeps the rest;
    nothing when tests were selected inside files (-k, -m, node ids)."""
    config = session.config
    if getattr(config, "cache", None) is None or hasattr(config, "workerinput") or not _SECONDS:
        return
    whole_files = (not config.option.keyword and config.option.markexpr in ("", "not gpu")
                   and not any("::" in str(a) for a in config.args))
    if not whole_files:  # a selection inside files would record too little for them
        return
    merged = {**(config.cache.get(DURATIONS_KEY, {}) or {}), **{f: round(s, 2) for f, s in _SECONDS.items()}}
    config.cache.set(DURATIONS_KEY, merged)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _SESSION_PG
    _record_durations(session)
    with contextlib.suppress(Exception):  # best-effort cleanup of the migrated template database
        dbutil.drop_templates()
    if _SESSION_PG is not None:
        _SESSION_PG.stop()
        _SESSION_PG = None
