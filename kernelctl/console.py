"""Shared CLI plumbing: Rich consoles, one-line errors with meaningful exit codes, JSON output, and escaping.

Text that came from elsewhere (node inventories, labels, reasons, anything the controller stored) is never
printed as Rich markup or raw: :func:`safe` gives a ``Text`` (no markup) with control characters shown as
``\\xNN`` escapes, :func:`esc` the same as a markup-escaped string for use inside a markup template. So a
node calling its GPU ``[link=...]`` or ``\\x1b]0;title\\x07`` prints exactly that, visibly, in a terminal.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape as _escape_markup
from rich.text import Text

console = Console()
err_console = Console(stderr=True)

# Exit codes shared by every kernelctl command.
EXIT_OK = 0
EXIT_ERROR = 1  # server/database/other failure
EXIT_USAGE = 2  # bad flags or filter values
EXIT_REFUSED = 3  # verification failed, invalid transition, conflict
EXIT_NOT_FOUND = 4
EXIT_AUTH = 5
# An operator call's HTTP error status -> the CLI's exit code (anything else: EXIT_ERROR).
STATUS_EXIT = {400: EXIT_USAGE, 401: EXIT_AUTH, 403: EXIT_AUTH, 404: EXIT_NOT_FOUND, 409: EXIT_REFUSED,
               413: EXIT_REFUSED, 422: EXIT_REFUSED}


# C0/C1 controls, DEL, and the invisible/bidirectional formatting characters that reorder or hide text.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def clean(value: object) -> str:
    """``str(value)`` with every control or invisible formatting character shown as an escape (``\\x1b``)."""
    text = "" if value is None else str(value)
    return _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256
                       else f"\\u{ord(m.group()):04x}", text)


def safe(value: object) -> Text:
    """Untrusted text as a Rich ``Text`` cell: printed literally (no markup, no escape sequences)."""
    return Text(clean(value))


def esc(value: object) -> str:
    """Untrusted text for interpolation into a markup string: control characters escaped, markup escaped."""
    return _escape_markup(clean(value))


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    """Print one clear line on stderr and exit with ``code`` (never a traceback); the message is escaped."""
    err_console.print(f"[bold red]error:[/] {esc(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def exit_code(exc: BaseException) -> int:
    """The exit code of a failure: an HTTP error's status through :data:`STATUS_EXIT`, else EXIT_ERROR."""
    from kernelctl.opclient import ApiError  # httpx: imported when a command failed, not at every start

    return STATUS_EXIT.get(exc.status, EXIT_ERROR) if isinstance(exc, ApiError) else EXIT_ERROR


def _default(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=_default) + "\n")
