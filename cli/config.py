"""``kernelctl config show``: every KERNELCTL_* setting with its current value and meaning."""

from __future__ import annotations

import contextlib

import typer
from rich.table import Table

from kernelctl.console import console, print_json
from kernelctl.settings import Settings

config_app = typer.Typer(help="Configuration (KERNELCTL_* environment variables).", no_args_is_help=True)

SECRET_FIELDS = {"token", "agent_token"}


def settings_rows(settings: Settings) -> list[dict[str, str]]:
    rows = []
    for name, field in Settings.model_fields.items():
        value = getattr(settings, name)
        if name in SECRET_FIELDS and value:
            value = "***"
        elif name == "notify_urls" and value:
            from controller.notify import redact

            value = ",".join(redact(u) for u in value.split(",") if u.strip())
        elif name == "database_url":
            from sqlalchemy.engine import make_url

            with contextlib.suppress(Exception):
                value = make_url(value).render_as_string(hide_password=True)
        rows.append({"env": f"KERNELCTL_{name.upper()}", "value": "" if value is None else str(value),
                     "description": field.description or ""})
    return rows


def markdown(settings: Settings) -> str:
    lines = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for row in settings_rows(settings):
        lines.append(f"| `{row['env']}` | `{row['value']}` | {row['description']} |")
    return "\n".join(lines) + "\n"


@config_app.command("show")
def show(
    json_out: bool = typer.Option(False, "--json", help="JSON output."),
    md: bool = typer.Option(False, "--markdown", help="Markdown table (docs/configuration.md)."),
) -> None:
    """Show every setting, its environment variable, current value and meaning."""
    settings = Settings()
    if json_out:
        print_json(settings_rows(settings))
        return
    if md:
        typer.echo(markdown(settings), nl=False)
        return
    table = Table(title="kernelctl settings")
    for col in ("env", "value", "description"):
        table.add_column(col, overflow="fold")
    for row in settings_rows(settings):
        table.add_row(row["env"], row["value"], row["description"])
    console.print(table)
