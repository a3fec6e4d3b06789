"""``kernelctl bundle bench FILE``: load a verified bundle and benchmark every op on this machine.

``register(bundle_app)`` (called by cli/app.py) mounts the command on the bundle Typer sub-app; ``bench_command`` is the plain
function behind it. Prints one Rich table per op (median latency, achieved GB/s, launches per call, host
launch overhead, peak memory) or, with ``--json``, a JSON document of ``BenchResult`` records.
"""

from __future__ import annotations

import dataclasses
import os
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer


class Sizes(str, Enum):
    test = "test"
    decode = "decode"
    prefill = "prefill"


class DType(str, Enum):
    fp16 = "fp16"
    bf16 = "bf16"
    fp32 = "fp32"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


def _fmt_shape(shape: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def bench_command(
    file: Annotated[Path, typer.Argument(help="bundle file (.kpack) or an extracted bundle directory")],
    trusted_keys: Annotated[Path, typer.Option("--trusted-keys", help="directory of trusted ed25519 public keys")],
    json_out: Annotated[bool, typer.Option("--json", help="print JSON instead of tables")] = False,
    sizes: Annotated[
        Sizes | None, typer.Option("--sizes", help="shape set: test (tiny), decode or prefill; "
                                   "default decode on a GPU, test on the CPU interpreter")
    ] = None,
    dtype: Annotated[DType, typer.Option("--dtype", help="input dtype")] = DType.bf16,
    op_filter: Annotated[list[str] | None, typer.Option("--op", help="only these ops (repeatable)")] = None,
    arch: Annotated[str | None, typer.Option("--arch", help="override the detected arch (sm_XY)")] = None,
) -> None:
    """Benchmark every op of a verified bundle on this machine."""
    import torch

    from kernelctl.console import EXIT_REFUSED, EXIT_USAGE, console, fail, print_json

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the bundle's kernel modules are imported
    from kernelpack.errors import BundleError
    from kernelpack.harness.bench import bench_op
    from kernelpack.loader import load_bundle

    if not file.exists():
        fail(f"bundle {file} does not exist", EXIT_USAGE)
    if not trusted_keys.is_dir():
        fail(f"--trusted-keys {trusted_keys} is not a directory", EXIT_USAGE)
    try:
        bundle = load_bundle(file, trusted_keys, arch=arch)
    except BundleError as exc:
        fail(f"cannot load {file}: {exc}", EXIT_REFUSED)
    unknown = sorted(set(op_filter or ()) - set(bundle.ops))
    if unknown:
        fail(f"bundle {bundle.name}@{bundle.version} has no op(s) {', '.join(unknown)} "
             f"(has {', '.join(sorted(bundle.ops))})", EXIT_USAGE)
    size_set = sizes or (Sizes.decode if cuda else Sizes.test)
    device = torch.device("cuda" if cuda else "cpu")
    report: dict[str, Any] = {
        "bundle": bundle.name, "version": bundle.version, "digest": bundle.digest, "arch": bundle.arch,
        "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
        "dtype": dtype.value, "sizes": size_set.value, "results": [], "skipped": [],
    }
    for name in sorted(op_filter or bundle.ops):
        bound = bundle.ops[name]
        op = bound.op
        shapes = {"test": op.test_shapes, "decode": op.decode_shapes, "prefill": op.prefill_shapes}[size_set.value]
        reason = None
        if not bound.supported:
            reason = f"Triton kernels disabled here: {bound.unsupported}"
        elif dtype.value not in op.domain.dtypes:
            reason = f"dtype {dtype.value} not in the op's domain {list(op.domain.dtypes)}"
        elif not shapes:
            reason = f"op declares no {size_set.value} shapes"
        if reason:
            report["skipped"].append({"op": name, "reason": reason})
            continue
        with bound.cache_scope():
            for shape in shapes:
                res = bench_op(op, bound.config, dtype.value, dict(shape), device=device)
                report["results"].append(dataclasses.asdict(res))
    if json_out:
        print_json(report)
        return
    _print_tables(console, report)


def _print_tables(console: Any, report: dict[str, Any]) -> None:
    from rich.table import Table

    console.print(f"[bold]{report['bundle']}@{report['version']}[/] on {report['device']} "
                  f"({report['dtype']}, {report['sizes']} sizes)")
    by_op: dict[str, list[dict[str, Any]]] = {}
    for r in report["results"]:
        by_op.setdefault(r["op"], []).append(r)
    for op, rows in by_op.items():
        table = Table(title=op, title_justify="left")
        for col in ("shape", "median", "GB/s", "launches", "host overhead", "peak mem"):
            table.add_column(col, justify="left" if col == "shape" else "right", no_wrap=True)
        for r in rows:
            table.add_row(
                _fmt_shape(r["shape"]), f"{r['median_s'] * 1e6:,.1f} µs", f"{r['gbps']:,.2f}",
                str(r["launches_per_call"]), f"{r['launch_overhead_s'] * 1e6:,.1f} µs",
                _fmt_bytes(r["peak_memory_bytes"]),
            )
        console.print(table)
    for s in report["skipped"]:
        console.print(f"[yellow]skipped {s['op']}:[/] {s['reason']}")


def register(bundle_app: typer.Typer) -> None:
    """Mount ``bench`` on the ``kernelctl bundle`` sub-app."""
    bundle_app.command("bench")(bench_command)
