"""``kernelctl serve``: run the controller (HTTP API and the leader-only scheduler) until SIGTERM."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import database_errors
from kernelctl.console import EXIT_USAGE, fail


def serve_cmd(
    host: Annotated[str | None, typer.Option(help="Listen address (default: KERNELCTL_LISTEN_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port, 0 for any free (default: KERNELCTL_LISTEN_PORT).")] = None,
    db: Annotated[str | None, typer.Option("--db", help="Database URL (default: KERNELCTL_DATABASE_URL).")] = None,
    trusted_keys: Annotated[Path | None, typer.Option(help="Directory of trusted *.pub keys.")] = None,
    bootstrap_tokens: Annotated[Path | None, typer.Option(help="File of `role name token [node]` lines.")] = None,
    tick_seconds: Annotated[float | None, typer.Option(help="Judge tick period.")] = None,
    port_file: Annotated[Path | None, typer.Option(help="Write the bound port here once listening.")] = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", help="API worker processes on the one socket, PostgreSQL only (default: KERNELCTL_API_WORKERS, 1).",
        show_default=False)] = None,
) -> None:
    """Run the controller (HTTP API + leader-only scheduler) until SIGTERM."""
    from pydantic import ValidationError

    from controller.server import WorkersRefused, serve
    from kernelctl.settings import Settings

    overrides = {
        k: v
        for k, v in {
            "listen_host": host, "listen_port": port, "database_url": db, "trusted_keys_dir": trusted_keys,
            "bootstrap_tokens_file": bootstrap_tokens, "tick_seconds": tick_seconds, "api_workers": workers,
        }.items()
        if v is not None
    }
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        e = exc.errors()[0]
        fail(f"invalid setting {'.'.join(str(x) for x in e['loc'])}: {e['msg']}", EXIT_USAGE)
    with database_errors():
        try:
            serve(settings, port_file=port_file)
        except WorkersRefused as exc:  # a usage error: the flags (or settings) ask for what cannot run
            fail(str(exc), EXIT_USAGE)
        except (OSError, ValueError) as exc:
            fail(str(exc))
        except Exception as exc:  # kernelpack key errors and the like: one line
            fail(f"{type(exc).__name__}: {exc}")
