"""``kernelctl notify test``: send one test notification to every configured webhook."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.common import JsonOption
from kernelctl.console import EXIT_ERROR, EXIT_USAGE, console, fail, print_json

notify_app = typer.Typer(help="Webhook notifications (KERNELCTL_NOTIFY_URLS).", no_args_is_help=True)


@notify_app.command("test")
def notify_test(
    url: Annotated[list[str] | None, typer.Option("--url", help="Send to this URL instead of "
                                                  "KERNELCTL_NOTIFY_URLS (repeatable).", show_default=False)] = None,
    json_out: JsonOption = False,
) -> None:
    """Send one test notification to every configured webhook; exit 1 if any delivery failed."""
    from controller.notify import NotifyConfigError, parse_targets, send_test
    from kernelctl.settings import Settings

    try:
        settings = Settings()
        targets = parse_targets(",".join(url) if url else settings.notify_urls)
    except NotifyConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    if not targets:
        fail("no webhook configured: set KERNELCTL_NOTIFY_URLS or pass --url", EXIT_USAGE)
    results = send_test(targets, timeout=settings.notify_timeout_seconds)
    rows = [{"target": t.shown, "ok": o.ok, "status": o.status, "attempts": o.attempts, "error": o.error,
             "seconds": o.seconds} for t, o in results]
    if json_out:
        print_json(rows)
    else:
        for r in rows:
            console.print(f"{r['target']}: " + (f"[green]delivered[/] (HTTP {r['status']}, {r['seconds']}s)"
                          if r["ok"] else f"[red]failed[/] after {r['attempts']} attempt(s): {r['error']}"))
    if not all(r["ok"] for r in rows):
        raise typer.Exit(EXIT_ERROR)
