"""``kernelctl keys generate``: an ed25519 bundle-signing key pair."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.bundle import _fail
from kernelpack.errors import BundleError

keys_app = typer.Typer(help="Manage ed25519 bundle-signing keys.", no_args_is_help=True)


@keys_app.command("generate")
def keys_generate(
    directory: Annotated[Path, typer.Argument(help="Where to write <key-id>.key (0600) and <key-id>.pub.")],
) -> None:
    """Generate an ed25519 signing key pair."""
    from kernelpack.signing import generate_keypair  # cryptography: only for this command (cli/bundle.py)

    try:
        kp = generate_keypair(directory)
    except (BundleError, OSError) as exc:
        _fail(exc)
    typer.echo(f"key id {kp.key_id}\nprivate key {kp.private_path}\npublic key {kp.public_path}")
