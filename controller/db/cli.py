"""``kernelctl db``: apply and inspect Alembic migrations of the changelog database."""

from __future__ import annotations

from typing import Annotated

import typer

from controller.db import migrate
from controller.db.engine import check_reachable, make_engine
from kernelctl.console import console, database_errors, print_json
from kernelctl.settings import get_settings

db_app = typer.Typer(help="Changelog database schema (Alembic migrations).", no_args_is_help=True)

DbOption = Annotated[
    str | None, typer.Option("--db", help="Database URL (default: KERNELCTL_DATABASE_URL or embedded SQLite).")
]


def resolve_db(db: str | None) -> str:
    return db or get_settings().database_url


@db_app.command("upgrade")
def upgrade(db: DbOption = None, revision: str = typer.Option("head", help="Target revision.")) -> None:
    """Migrate the database to the newest schema (creates it if missing)."""
    with database_errors():
        engine = make_engine(resolve_db(db))
        check_reachable(engine)
        before = migrate.current_revision(engine)
        migrate.upgrade(engine, revision)
        after = migrate.current_revision(engine)
    console.print(f"database at revision [bold]{after}[/] (was {before or 'empty'})")


@db_app.command("current")
def current(db: DbOption = None, json_out: bool = typer.Option(False, "--json", help="JSON output.")) -> None:
    """Show the database's schema revision and the code's head revision."""
    with database_errors():
        engine = make_engine(resolve_db(db), read_only=True)
        check_reachable(engine)
        rev = migrate.current_revision(engine)
    head = migrate.head_revision()
    if json_out:
        print_json({"current": rev, "head": head, "up_to_date": rev == head})
        return
    state = "up to date" if rev == head else "behind: run `kernelctl db upgrade`"
    console.print(f"current: {rev or 'empty'}  head: {head}  ({state})")


@db_app.command("downgrade")
def downgrade(
    revision: str = typer.Argument(..., help="Target revision (e.g. base)."),
    db: DbOption = None,
) -> None:
    """Migrate the schema down to REVISION (destroys data of the dropped tables)."""
    with database_errors():
        engine = make_engine(resolve_db(db))
        check_reachable(engine)
        migrate.downgrade(engine, revision)
    console.print(f"database at revision {migrate.current_revision(engine) or 'base'}")
