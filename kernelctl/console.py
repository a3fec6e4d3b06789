"""Shared CLI plumbing: Rich consoles, one-line errors with meaningful exit codes, JSON output."""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import typer
from rich.console import Console

console = Console()
err_console = Console(stderr=True)

# Exit codes shared by every kernelctl command.
EXIT_OK = 0
EXIT_ERROR = 1  # server/database/other failure
EXIT_USAGE = 2  # bad flags or filter values
EXIT_REFUSED = 3  # verification failed, invalid transition, conflict
EXIT_NOT_FOUND = 4
EXIT_AUTH = 5


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    """Print one clear line on stderr and exit with ``code`` (never a traceback)."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _default(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=_default) + "\n")


@contextmanager
def database_errors() -> Iterator[None]:
    """Turn database failures into one line on stderr and exit code 1."""
    from sqlalchemy.exc import OperationalError, ProgrammingError

    from controller.db.engine import DatabaseError

    try:
        yield
    except DatabaseError as exc:
        fail(str(exc))
    except (OperationalError, ProgrammingError) as exc:
        cause = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else str(exc)
        fail(f"database error: {cause}")
