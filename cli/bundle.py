"""``kernelctl bundle build|verify|inspect``: kernel bundles on this machine (the ``bundle`` Typer sub-app).

The root app (cli/app.py) mounts ``bundle_app`` as ``bundle`` and adds ``push|list|show``
(cli/bundle_registry.py) and ``bench`` (cli/bundle_bench.py) to it. Exit codes (``kernelctl.console``):
0 ok, 2 usage, 3 verification failure, 1 other error. Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from kernelctl.console import EXIT_ERROR, EXIT_REFUSED, fail
from kernelpack.errors import BundleError, ManifestError, VerificationError

if TYPE_CHECKING:
    from kernelpack.archive import Limits
    from kernelpack.manifest import Manifest

# kernelpack's format modules (pydantic manifests, signatures, archives) are imported by the commands that use
# them: every kernelctl start imports this module (cli/app.py mounts it), most of them for other verbs

bundle_app = typer.Typer(help="Build, verify and inspect kernel bundles (.kpack).", no_args_is_help=True)



def _fail(exc: Exception) -> NoReturn:
    """One line on stderr; exit 3 for a bundle that fails verification, 1 for anything else."""
    fail(str(exc), EXIT_REFUSED if isinstance(exc, VerificationError | ManifestError) else EXIT_ERROR)


def _limits(max_member_mib: int | None, max_total_mib: int | None) -> Limits:
    from kernelpack.archive import DEFAULT_LIMITS, Limits

    mib = 1024 * 1024
    return Limits(
        max_member_bytes=(max_member_mib * mib) if max_member_mib else DEFAULT_LIMITS.max_member_bytes,
        max_total_bytes=(max_total_mib * mib) if max_total_mib else DEFAULT_LIMITS.max_total_bytes,
        max_members=DEFAULT_LIMITS.max_members,
        max_archive_bytes=(max_total_mib * mib) if max_total_mib else DEFAULT_LIMITS.max_archive_bytes,
    )


@bundle_app.command("build")
def bundle_build(
    src: Annotated[Path, typer.Argument(help="Bundle source directory (holds bundle.toml).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="The .kpack file to write.")],
    key: Annotated[Path, typer.Option("--key", help="Private signing key (PEM).")],
    cache_dir: Annotated[
        Path | None, typer.Option("--cache-dir", help="Ahead-of-time compile cache (default: user cache).")
    ] = None,
    aot_arch: Annotated[
        list[str] | None,
        typer.Option("--aot-arch", help="Compile ahead of time only for this target arch (repeatable; "
                     "default: every target arch)."),
    ] = None,
    no_aot: Annotated[
        bool, typer.Option("--no-aot", help="Source-only bundle: no ahead-of-time artifacts (nodes JIT).")
    ] = False,
) -> None:
    """Validate, compile ahead of time for every target arch, sign and write a bundle."""
    from kernelpack.build import build_bundle  # imports triton's compiler; keep other commands light

    archs = [] if no_aot else (aot_arch or None)
    try:
        res = build_bundle(src, output, key, cache_dir=cache_dir, aot_archs=archs)
    except (BundleError, OSError) as exc:
        _fail(exc)
    m = res.manifest
    typer.echo(
        f"built {m.name}@{m.version} -> {res.path} ({res.size} bytes, {len(m.artifacts)} artifacts)\n"
        f"digest sha256:{res.digest}"
    )


@bundle_app.command("verify")
def bundle_verify(
    file: Annotated[Path, typer.Argument(help="A .kpack file or an extracted bundle directory.")],
    trusted_keys: Annotated[Path, typer.Option("--trusted-keys", help="Directory of trusted *.pub keys.")],
    max_member_mib: Annotated[int | None, typer.Option(help="Per-file size limit (MiB).", min=1)] = None,
    max_total_mib: Annotated[int | None, typer.Option(help="Total size limit (MiB).", min=1)] = None,
) -> None:
    """Verify digests, file list, archive safety and the signature against trusted keys."""
    from kernelpack.verify import verify_path

    try:
        vb = verify_path(file, trusted_keys, limits=_limits(max_member_mib, max_total_mib))
    except (BundleError, OSError) as exc:
        _fail(exc)
    typer.echo(
        f"ok: {vb.name}@{vb.version} signed by {vb.key_id}, {len(vb.manifest.files)} files verified, "
        f"digest sha256:{vb.digest}"
    )


def _read_unverified(file: Path) -> tuple[Manifest, str, str | None]:
    from kernelpack.archive import read_archive, read_directory
    from kernelpack.manifest import MANIFEST_NAME, SIGNATURE_NAME, parse_manifest
    from kernelpack.signing import parse_signature
    from kernelpack.verify import sha256_hex

    if file.is_dir():
        members = read_directory(file)
        digest = sha256_hex(members.get(MANIFEST_NAME, b""))
    else:
        blob = file.read_bytes()
        members, digest = read_archive(blob), sha256_hex(blob)
    if MANIFEST_NAME not in members:
        raise ManifestError(f"{file}: no {MANIFEST_NAME}")
    key_id = parse_signature(members[SIGNATURE_NAME]).key_id if SIGNATURE_NAME in members else None
    return parse_manifest(members[MANIFEST_NAME]), digest, key_id


@bundle_app.command("inspect")
def bundle_inspect(
    file: Annotated[Path, typer.Argument(help="A .kpack file or an extracted bundle directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
    trusted_keys: Annotated[
        Path | None, typer.Option("--trusted-keys", help="Also verify against these keys.")
    ] = None,
) -> None:
    """Show a bundle's manifest: targets, kernels, launch configs, artifacts (verifies with --trusted-keys)."""
    from kernelpack.verify import verify_path

    try:
        if trusted_keys is not None:
            vb = verify_path(file, trusted_keys)
            manifest, digest, key_id, verified = vb.manifest, vb.digest, vb.key_id, True
        else:
            manifest, digest, key_id = _read_unverified(file)
            verified = False
    except (BundleError, OSError) as exc:
        _fail(exc)
    if as_json:
        doc = {"digest": digest, "key_id": key_id, "verified": verified,
               "manifest": manifest.model_dump(mode="json")}
        typer.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    console = Console()
    head = Table(show_header=False, title=f"{manifest.name} {manifest.version}", title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    rows = [
        ("parent", manifest.parent or "-"),
        ("note", manifest.note),
        ("FAULT FIXTURE", manifest.fault_fixture) if manifest.fault_fixture else None,
        ("digest", f"sha256:{digest}"),
        ("signed by", f"{key_id or 'UNSIGNED'} ({'verified' if verified else 'not verified'})"),
        ("archs", ", ".join(manifest.targets.archs)),
        ("driver", f">= {manifest.targets.min_driver}"),
        ("CUDA", ", ".join(manifest.targets.cuda)),
        ("Triton", manifest.targets.triton),
        ("torch", manifest.targets.torch),
        ("decode batch", ", ".join(map(str, manifest.traffic.decode_batch_sizes))),
        ("prefill tokens", ", ".join(map(str, manifest.traffic.prefill_tokens))),
        ("files", f"{len(manifest.files)} ({sum(f.size for f in manifest.files.values())} bytes)"),
    ]
    for r in rows:
        if r:
            head.add_row(*r)
    console.print(head)
    per = Counter((a.op, a.arch) for a in manifest.artifacts)
    kt = Table(title="kernels", title_justify="left")
    for col in ("op", "source", "dtypes", "launch configs", "artifacts"):
        kt.add_column(col)
    for k in manifest.kernels:
        cfgs = "\n".join(f"{a}: {json.dumps(c, sort_keys=True)}" for a, c in k.configs.items())
        arts = ", ".join(f"{a}:{per[(k.op, a)]}" for a in manifest.targets.archs)
        kt.add_row(k.op, k.source, ",".join(k.limitations.get("dtypes", [])), cfgs, arts)
    console.print(kt)
