"""Fixtures shared by the controller tests that need PostgreSQL whatever backend the run selects (several
processes or replicas on one database, the leader's advisory lock) and the one stable bundle they push."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import dbutil
from tests.controller.serverutil import TestBundles, build_test_bundles


@pytest.fixture
def pg_url(tmp_path: Path) -> Iterator[str]:
    """A fresh PostgreSQL database migrated to head (dropped afterwards)."""
    with dbutil.fresh_database("postgres", tmp_path) as url:
        yield url


@pytest.fixture(scope="module")
def stable_bundle(tmp_path_factory: pytest.TempPathFactory) -> TestBundles:
    """llm-fused 1.0.0, built and signed once per module."""
    return build_test_bundles(tmp_path_factory.mktemp("stable-bundle"), versions=("1.0.0",))
