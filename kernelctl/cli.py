"""The root ``kernelctl`` command: mounts each package's Typer sub-app."""

from __future__ import annotations

import typer

from controller.audit_cli import audit
from controller.db.cli import db_app
from kernelctl import __version__
from kernelctl.config_cli import config_app

app = typer.Typer(
    name="kernelctl",
    help="Canary rollouts of GPU kernel bundles: build, sign, roll out, judge, promote or roll back, audit.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(db_app, name="db")
app.add_typer(config_app, name="config")
app.command("audit")(audit)


@app.command("version")
def version() -> None:
    """Print the kernelctl version."""
    typer.echo(__version__)


if __name__ == "__main__":  # pragma: no cover
    app()
