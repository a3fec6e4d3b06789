"""``kernelctl audit``: query the changelog directly from the database, opened read-only."""

from __future__ import annotations

import csv
import datetime as dt
import sys
from enum import Enum
from typing import Annotated, Any

import typer
from rich.table import Table

from cli.common import DbOption, database_errors, resolve_db
from kernelctl.console import EXIT_NOT_FOUND, EXIT_USAGE, console, fail, print_json, safe

# the columns of each query's rows (an empty answer still prints its own header)
EVENT_COLUMNS = ["id", "at", "actor", "action", "subject", "bundle", "node", "rollout_id", "reason", "payload"]
ACTIVE_AT_COLUMNS = ["node", "bundle", "version", "digest", "active_since", "active_until", "rollout_id",
                     "verified_at"]
RAN_COLUMNS = ["node", "started_at", "ended_at", "rollout_id", "verified_at"]


class OutputFormat(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


def _parse(value: str | None, flag: str) -> Any:
    if value is None:
        return None
    from controller.audit import AuditQueryError, parse_time

    try:
        return parse_time(value)
    except AuditQueryError as exc:
        fail(f"{flag}: {exc}", EXIT_USAGE)


def audit(
    bundle: Annotated[str | None, typer.Option(help="NAME or NAME@VERSION.")] = None,
    node: Annotated[str | None, typer.Option(help="Node name.")] = None,
    actor: Annotated[str | None, typer.Option(help="Who acted (token name, 'judge', ...).")] = None,
    action: Annotated[str | None, typer.Option(help="Action, or a prefix like 'rollout.*'.")] = None,
    since: Annotated[str | None, typer.Option(help="ISO time or age (15m, 2h, 3d).")] = None,
    until: Annotated[str | None, typer.Option(help="ISO time or age.")] = None,
    at: Annotated[str | None, typer.Option(help="With --node: versions active on the node at this time.")] = None,
    ran: Annotated[bool, typer.Option("--ran", help="With --bundle NAME@VERSION: nodes that ever ran it.")] = False,
    limit: Annotated[int, typer.Option(help="Most events to show.")] = 100,
    fmt: Annotated[OutputFormat, typer.Option("--format", help="table, json or csv.")] = OutputFormat.table,
    db: DbOption = None,
) -> None:
    """Query the append-only changelog: who did what to which bundle/node, and what ran where when."""
    from sqlalchemy import select

    from controller.audit import (
        AuditFilters,
        AuditNotFound,
        AuditQueryError,
        active_at,
        event_to_dict,
        nodes_that_ran,
        query_events,
    )
    from controller.db.engine import make_engine, session_factory
    from controller.db.migrate import check_schema_current
    from controller.db.models import Node

    since_t, until_t, at_t = _parse(since, "--since"), _parse(until, "--until"), _parse(at, "--at")
    if at_t is not None and not node:
        fail("--at needs --node (what was active on that node at that time)", EXIT_USAGE)
    if ran and not (bundle and "@" in bundle):
        fail("--ran needs --bundle NAME@VERSION", EXIT_USAGE)
    with database_errors():
        engine = make_engine(resolve_db(db), read_only=True)
        check_schema_current(engine)
        with session_factory(engine)() as session:
            note = ""
            try:
                if at_t is not None:
                    rows = active_at(session, node, at_t)  # type: ignore[arg-type]
                    title, columns = f"active on {node} at {at_t.isoformat()}", ACTIVE_AT_COLUMNS
                    registered = session.scalar(select(Node.registered_at).where(Node.name == node))
                    if registered is not None:
                        registered = registered.replace(tzinfo=registered.tzinfo or dt.timezone.utc)
                        if at_t < registered:
                            note = f"{node} registered at {registered.isoformat()}: nothing ran on it before that"
                elif ran:
                    rows = nodes_that_ran(session, bundle)  # type: ignore[arg-type]
                    title, columns = f"nodes that ran {bundle}", RAN_COLUMNS
                else:
                    filters = AuditFilters(bundle, node, actor, action, since_t, until_t, limit)
                    rows = [event_to_dict(e) for e in query_events(session, filters)]
                    title, columns = "changelog events (newest first)", EVENT_COLUMNS
            except AuditNotFound as exc:
                fail(str(exc), EXIT_NOT_FOUND)
            except AuditQueryError as exc:
                fail(str(exc), EXIT_USAGE)
        engine.dispose()
    _emit(rows, fmt, title, columns, note)


def _emit(rows: list[dict[str, Any]], fmt: OutputFormat, title: str, columns: list[str], note: str) -> None:
    if fmt is OutputFormat.json:
        print_json(rows)
        return
    columns = list(rows[0].keys()) if rows else columns
    if fmt is OutputFormat.csv:
        writer = csv.DictWriter(sys.stdout, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
        return
    shown = [c for c in columns if c not in ("payload", "id")]
    table = Table(title=f"{title}: {len(rows)} row(s)", show_lines=False)
    for col in shown:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*[safe("" if row.get(c) is None else row.get(c)) for c in shown])  # stored text: literal
    console.print(table)
    if note:
        console.print(safe(note))
