"""``kernelctl nodes``: the fleet as the controller sees it (stratum, liveness, versions, canary phase)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from cli.common import JsonOption, TokenOption, UrlOption, fetch
from kernelctl.console import EXIT_USAGE, console, fail, safe
from kernelctl.vocab import NODE_STATES


def nodes_cmd(ctx: typer.Context, state: Annotated[str | None, typer.Option(help="active or stale.")] = None,
              url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """List nodes: stratum, liveness, active versions, a canary's phase (staged, verified, serving)."""
    if state is not None and state not in NODE_STATES:
        fail(f"--state {state!r}: expected one of {', '.join(NODE_STATES)}", EXIT_USAGE)
    rows = fetch(ctx, url, token, json_out, "/v1/nodes", state=state)
    table = Table()
    for col in ("node", "state", "stratum", "gpu", "last heartbeat", "active", "desired", "phase"):
        table.add_column(col, overflow="fold")  # a narrow terminal folds versions, never cuts them
    for n in rows:  # every cell is node-supplied or stored text: printed literally, never as markup
        table.add_row(safe(n["name"]), safe(n["state"]), safe(n["stratum"]), safe(n["gpu_name"]),
                      safe(str(n["last_heartbeat_at"])[:19]),
                      safe(", ".join(f"{k}@{v}" for k, v in n["active"].items())),
                      safe(", ".join(f"{k}@{v}" for k, v in n["desired"].items())),
                      safe(", ".join(f"{k}: {v}" for k, v in n.get("phases", {}).items()) or "-"))
    console.print(table)
