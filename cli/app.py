"""The root ``kernelctl`` command (the console script): mounts every verb module of :mod:`cli`.

Each verb lives in one module of this package (README, "Layout"); the simulators' sub-apps come from
:mod:`sim`. ``python -m cli.app`` is the same command as ``kernelctl``.
"""

from __future__ import annotations

import typer

from cli import bundle_bench, bundle_registry
from cli.agent import agent_command
from cli.audit import audit
from cli.bundle import bundle_app
from cli.common import remote_callback
from cli.compat import compat_cmd
from cli.config import config_app
from cli.db import db_app
from cli.demo import demo
from cli.keys import keys_app
from cli.nodes import nodes_cmd
from cli.notify import notify_app
from cli.rollout import rollout_app
from cli.serve import serve_cmd
from cli.token import token_app
from cli.transition import pause_cmd, promote_cmd, resume_cmd, rollback_cmd
from kernelctl import __version__
from sim.fleet.cli import fleet_command
from sim.judge.cli import sim_app

app = typer.Typer(
    name="kernelctl",
    help="Canary rollouts of GPU kernel bundles: build, sign, roll out, judge, promote or roll back, audit.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.callback()(remote_callback)
app.command("demo")(demo)
app.add_typer(db_app, name="db")
app.add_typer(config_app, name="config")
app.add_typer(keys_app, name="keys")
app.add_typer(bundle_app, name="bundle")
bundle_registry.register(bundle_app)
bundle_bench.register(bundle_app)
app.add_typer(sim_app, name="sim")
sim_app.command("fleet")(fleet_command)
app.command("audit")(audit)
app.command("agent")(agent_command)
app.command("serve")(serve_cmd)
app.add_typer(token_app, name="token")
app.add_typer(rollout_app, name="rollout")
app.add_typer(notify_app, name="notify")
app.command("promote")(promote_cmd)
app.command("rollback")(rollback_cmd)
app.command("pause")(pause_cmd)
app.command("resume")(resume_cmd)
app.command("nodes")(nodes_cmd)
app.command("compat")(compat_cmd)


@app.command("version")
def version() -> None:
    """Print the kernelctl version."""
    typer.echo(__version__)


if __name__ == "__main__":  # pragma: no cover
    app()
