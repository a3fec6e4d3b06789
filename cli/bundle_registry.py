"""``kernelctl bundle push|list|show``: bundles on the controller (over HTTP, verified there)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from cli.common import JsonOption, TokenOption, UrlOption, fetch, remote, split_ref
from kernelctl.console import EXIT_USAGE, console, esc, fail, print_json, safe


def bundle_push(ctx: typer.Context, file: Annotated[Path, typer.Argument(help="The .kpack file.")],
                url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """Upload a signed bundle to the controller (verified there with its trusted keys)."""
    try:
        data = file.read_bytes()
    except OSError as exc:
        fail(f"cannot read {file}: {exc.strerror or exc}", EXIT_USAGE)
    out = remote(ctx, url, token).request(
        "POST", "/v1/bundles", content=data, headers={"Content-Type": "application/octet-stream"}
    )
    if json_out:
        print_json(out)
    else:
        console.print(f"registered [bold]{esc(out['ref'])}[/] digest {esc(out['digest'][:16])}… signed by "
                      f"{esc(out['signer_key_id'])}")


def bundle_list(ctx: typer.Context, name: Annotated[str | None, typer.Option(help="Only this bundle name.")] = None,
                url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """List registered bundle versions."""
    rows = fetch(ctx, url, token, json_out, "/v1/bundles", name=name)
    table = Table("bundle", "status", "digest", "signer", "size", "created", "by")
    for b in rows:
        table.add_row(safe(b["ref"]), safe(b["status"]), safe(b["digest"][:12]), safe(b["signer_key_id"]),
                      str(b["size_bytes"]), safe(b["created_at"][:19]), safe(b["created_by"]))
    console.print(table)


def bundle_show(ctx: typer.Context, ref: Annotated[str, typer.Argument(help="NAME@VERSION")],
                url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """Show one bundle version (targets, digest, manifest)."""
    name, version = split_ref(ref)
    b = fetch(ctx, url, token, json_out, f"/v1/bundles/{name}/{version}")
    console.print(f"[bold]{esc(b['ref'])}[/] {esc(b['status'])}  digest {esc(b['digest'])}  signer "
                  f"{esc(b['signer_key_id'])}")
    for t in b["targets"]:
        console.print(safe(f"  target {t['arch']} driver>={t['min_driver']} cuda {t['cuda']} triton {t['triton']} "
                           f"torch {t['torch']}"))


def register(bundle_app: typer.Typer) -> None:
    """Add ``push``, ``list`` and ``show`` to the ``kernelctl bundle`` sub-app."""
    bundle_app.command("push")(bundle_push)
    bundle_app.command("list")(bundle_list)
    bundle_app.command("show")(bundle_show)
