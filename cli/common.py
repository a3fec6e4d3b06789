"""What the verb modules share: the ``--url``/``--token``/``--json``/``--db`` options, the operator client
as the CLI uses it (every failure one line on stderr and the exit code of ``kernelctl.console``), database
errors as one line, and ``NAME@VERSION`` parsing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, NoReturn

import typer

from kernelctl.console import EXIT_AUTH, EXIT_USAGE, exit_code, fail, print_json
from kernelctl.opclient import ApiError, OperatorClient, OperatorError

UrlOption = Annotated[str | None, typer.Option("--url", help="Controller URL (default: KERNELCTL_URL).")]
TokenOption = Annotated[
    str | None, typer.Option("--token", help="Bearer token (default: KERNELCTL_TOKEN).", show_default=False)
]
JsonOption = Annotated[bool, typer.Option("--json", help="JSON output.")]
# a rollout id is a positive integer: anything else is a usage error (exit 2) before any request
RolloutIdArg = Annotated[int, typer.Argument(min=1, max=2**63 - 1, help="Rollout id.", show_default=False)]
DbOption = Annotated[
    str | None, typer.Option("--db", help="Database URL (default: KERNELCTL_DATABASE_URL or embedded SQLite).")
]


def remote_callback(ctx: typer.Context, url: UrlOption = None, token: TokenOption = None) -> None:
    """Root options shared by the remote commands."""
    ctx.ensure_object(dict)
    if url:
        ctx.obj["url"] = url
    if token:
        ctx.obj["token"] = token


def fail_operator(exc: OperatorError) -> NoReturn:
    """One line for a failed operator call: ``STATUS detail`` for an HTTP error, the reason otherwise."""
    fail(f"{exc.status} {exc.detail}" if isinstance(exc, ApiError) else str(exc), exit_code(exc))


class Remote(OperatorClient):
    """The operator client of the CLI: settings from flags, root flags or ``KERNELCTL_URL``/``KERNELCTL_TOKEN``;
    a failed call prints one line and exits with the CLI's exit code."""

    @classmethod
    def from_ctx(cls, ctx: typer.Context | None, url: str | None, token: str | None) -> Remote:
        from pydantic import ValidationError

        from kernelctl.settings import Settings

        obj = {}
        if ctx is not None:
            root = ctx.find_root()
            obj = root.obj if isinstance(root.obj, dict) else {}
        try:
            settings = Settings()
        except ValidationError as exc:
            e = exc.errors()[0]
            fail(f"invalid KERNELCTL_{str(e['loc'][0]).upper()}: {e['msg']}", EXIT_USAGE)
        url = url or obj.get("url") or settings.url
        token = token or obj.get("token") or settings.token
        if not url.startswith(("http://", "https://")):
            fail(f"invalid controller URL {url!r}: expected http(s)://HOST:PORT", EXIT_USAGE)
        if not token:
            fail("no token: pass --token or set KERNELCTL_TOKEN", EXIT_AUTH)
        return cls(url, token)

    def request(self, method: str, path: str, **kw: Any) -> Any:
        try:
            return super().request(method, path, **kw)
        except OperatorError as exc:
            fail_operator(exc)

    def get_all(self, path: str, params: dict[str, Any] | None = None) -> Any:
        try:
            return super().get_all(path, params)
        except OperatorError as exc:
            fail_operator(exc)


def remote(ctx: typer.Context, url: str | None, token: str | None) -> Remote:
    return Remote.from_ctx(ctx, url, token)


def fetch(ctx: typer.Context, url: str | None, token: str | None, json_out: bool, path: str, **params: Any) -> Any:
    """GET ``path`` (empty filters left out; a list: every page, following its cursors); with ``--json`` print
    the answer and exit 0, else return it."""
    data = remote(ctx, url, token).get_all(path, params={k: v for k, v in params.items() if v} or None)
    if json_out:
        print_json(data)
        raise typer.Exit(0)
    return data


def split_ref(ref: str) -> tuple[str, str]:
    """``NAME@VERSION`` -> (name, version); a usage error otherwise."""
    name, sep, version = ref.partition("@")
    if not sep or not name or not version:
        fail(f"bad bundle reference {ref!r}: expected NAME@VERSION", EXIT_USAGE)
    return name, version


def resolve_db(db: str | None) -> str:
    from kernelctl.settings import get_settings

    return db or get_settings().database_url


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
