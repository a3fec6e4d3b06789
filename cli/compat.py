"""``kernelctl compat``: the compatibility matrix, bundle versions x strata, the state in each cell."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from cli.common import JsonOption, TokenOption, UrlOption, fetch
from kernelctl.console import console, esc, safe

STATE_STYLE = {"stable": "green", "candidate": "yellow", "rolled_back": "red", "revoked": "red",
               "eligible": "cyan", "ineligible": "dim"}


def compat_cmd(ctx: typer.Context, bundle: Annotated[str | None, typer.Option(help="Only this bundle name.")] = None,
               url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """The compatibility matrix: bundle versions x strata, the state in each cell."""
    rows = fetch(ctx, url, token, json_out, "/v1/compat", bundle=bundle)
    strata = sorted({r["stratum"] for r in rows})
    bundles = list(dict.fromkeys(r["bundle"] for r in rows))
    cells = {(r["bundle"], r["stratum"]): r for r in rows}
    table = Table(title="compatibility")
    table.add_column("bundle", overflow="fold")
    for s in strata:
        table.add_column(safe(s), overflow="fold")  # strata are built from node inventories: literal text
    for b in bundles:
        out = []
        for s in strata:
            c = cells.get((b, s))
            if c is None:
                out.append("-")
                continue
            label = esc(c["state"]) + (f" (step {esc(c['step'])})" if c.get("step") is not None else "")
            phases = ", ".join(f"{esc(n)} {esc(p)}" for p, n in (c.get("phases") or {}).items() if n)
            label += f" ({phases})" if phases else ""  # canaries staged / verified / serving
            style = STATE_STYLE.get(c["state"], "white")
            out.append(f"[{style}]{label}[/] {esc(c['eligible_nodes'])}/{esc(c['nodes'])}")
        table.add_row(safe(b), *out)
    console.print(table)
