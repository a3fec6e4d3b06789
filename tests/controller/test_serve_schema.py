"""`kernelctl serve` and the schema: the embedded SQLite default creates or upgrades its own schema; PostgreSQL
keeps the explicit `kernelctl db upgrade` and refuses to serve with that hint (real processes, real servers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.db import migrate
from controller.db.engine import make_engine
from tests.controller.serverutil import ControllerProcess


def test_serve_on_an_empty_sqlite_file_creates_the_schema(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh' / 'kernelctl.db'}"  # neither the file nor its directory exists
    with ControllerProcess(url, tmp_path) as ctl:
        r = ctl.client("viewer").get("/v1/rollouts")
        assert r.status_code == 200, r.text
        assert "schema empty ->" in ctl.log_text()
        ctl.stop()
        ctl.start()  # already at head: no upgrade the second time
        assert ctl.log_text().count("schema empty ->") == 1
    engine = make_engine(url)
    assert migrate.current_revision(engine) == migrate.head_revision()
    engine.dispose()


def test_serve_upgrades_an_older_sqlite_schema(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = make_engine(url)
    revisions = [r.revision for r in migrate.ScriptDirectory.from_config(migrate.alembic_config()).walk_revisions()]
    oldest = revisions[-1]
    migrate.upgrade(engine, oldest)
    with ControllerProcess(url, tmp_path) as ctl:
        assert ctl.client("viewer").get("/v1/rollouts").status_code == 200
        if oldest != migrate.head_revision():
            assert f"schema {oldest} -> {migrate.head_revision()}" in ctl.log_text()
    assert migrate.current_revision(engine) == migrate.head_revision()
    engine.dispose()


@pytest.mark.postgres
def test_serve_refuses_an_empty_postgres_with_the_upgrade_hint(tmp_path: Path) -> None:
    from tests import dbutil

    with dbutil.fresh_database("postgres", tmp_path, migrated=False) as url:
        ctl = ControllerProcess(url, tmp_path)
        with pytest.raises(RuntimeError, match="controller exited") as info:
            ctl.start(timeout=60)
        assert "run `kernelctl db upgrade`" in str(info.value)
        engine = make_engine(url)
        assert migrate.current_revision(engine) is None  # nothing was created
        engine.dispose()
