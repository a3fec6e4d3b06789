"""Shared fixtures: every database test runs on SQLite and on PostgreSQL (real servers, never mocked)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import dbutil

# Kernels run through Triton's interpreter when there is no GPU; it must be set before triton is imported.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass


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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    with contextlib.suppress(Exception):  # best-effort cleanup of the migrated template database
        dbutil.drop_templates()
