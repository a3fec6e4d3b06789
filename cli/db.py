"""``kernelctl db``: apply and inspect Alembic migrations of the changelog database."""

from __future__ import annotations

import typer

from cli.common import DbOption, database_errors, resolve_db
from kernelctl.console import console, print_json

db_app = typer.Typer(help="Changelog database schema (Alembic migrations).", no_args_is_help=True)

@db_app.command("upgrade")
def upgrade(db: DbOption = None, revision: str = typer.Option("head", help="Target revision.")) -> None:
    """Migrate the database to the newest schema (creates it if missing)."""
    from controller.db import migrate
    from controller.db.engine import check_reachable, make_engine

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
    from controller.db import migrate
    from controller.db.engine import check_reachable, make_engine

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
    from controller.db import migrate
    from controller.db.engine import check_reachable, make_engine

    with database_errors():
        engine = make_engine(resolve_db(db))
        check_reachable(engine)
        migrate.downgrade(engine, revision)
    console.print(f"database at revision {migrate.current_revision(engine) or 'base'}")
