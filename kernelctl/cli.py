"""The root ``kernelctl`` command: mounts each package's Typer sub-app."""

from __future__ import annotations

import typer

from agents.cli import agent_command
from controller import cli as controller_cli
from controller.audit_cli import audit
from controller.db.cli import db_app
from controller.judge.cli import sim_app
from controller.sim_fleet import register as register_sim_fleet
from kernelctl import __version__
from kernelctl.config_cli import config_app
from kernelctl.demo import demo
from kernelpack.cli import bundle_app, keys_app
from kernelpack.harness import cli as harness_cli

app = typer.Typer(
    name="kernelctl",
    help="Canary rollouts of GPU kernel bundles: build, sign, roll out, judge, promote or roll back, audit.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.command("demo")(demo)
app.add_typer(db_app, name="db")
app.add_typer(config_app, name="config")
app.add_typer(keys_app, name="keys")
app.add_typer(bundle_app, name="bundle")
register_sim_fleet(sim_app)
app.add_typer(sim_app, name="sim")
app.command("audit")(audit)
app.command("agent")(agent_command)
controller_cli.mount(app, bundle_app=bundle_app)

harness_cli.register(bundle_app)


@app.command("version")
def version() -> None:
    """Print the kernelctl version."""
    typer.echo(__version__)


if __name__ == "__main__":  # pragma: no cover
    app()
