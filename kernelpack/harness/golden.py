"""Golden vectors: deterministic, byte-identical blobs of inputs and float64 reference outputs per op.

Layout (no pickle, no ``torch.save`` and its random serialisation id)::

    b"KPGOLD1\\n" | u64 little-endian header length | header (canonical JSON, UTF-8) | payload

The header lists, per test shape, every input and reference tensor as (name, dtype, shape, offset, nbytes)
into the payload, plus the payload's sha256, and the op's run-time parameters of that case (``"params"``, e.g.
``{"eps": 1e-5}``: format 2; a blob of an op without parameters stays format 1, byte for byte as before, and
format 1 blobs are still read). Tensors are raw little-endian bytes in C order. Inputs are
generated on the CPU from ``seed + i`` and references computed there in float64, so the same torch build
produces the same bytes on every machine.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kernelpack.harness.numerics import (
    HarnessError,
    NumericResult,
    clone_inputs,
    evaluate,
    make_generator,
    resolve_device,
    resolve_dtype,
    tolerance_for,
)
from kernelpack.kernels.spec import KernelOp, Shape

MAGIC = b"KPGOLD1\n"
FORMAT_VERSION = 1
PARAMS_FORMAT_VERSION = 2  # cases carry the op's run-time parameters
_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
        torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    )
}


class GoldenFormatError(HarnessError):
    """The golden blob is truncated, corrupt, of an unknown format, or for a different op."""


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    data = flat.view(torch.uint8).numpy().tobytes()
    if sys.byteorder != "little" and flat.element_size() > 1:  # pragma: no cover - big-endian hosts
        raise GoldenFormatError("golden vectors are little-endian; this host is big-endian")
    return data


def _dtype_name(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise HarnessError(f"golden vectors cannot store tensors of dtype {t.dtype}")
    return name


def make_golden(op: KernelOp, dtype: str, seed: int, shapes: Sequence[Shape] | None = None) -> bytes:
    """Inputs and float64 references for ``op.test_shapes`` (or ``shapes``), as deterministic bytes."""
    tdtype = resolve_dtype(dtype)
    tolerance_for(op, dtype)
    shapes = list(op.test_shapes if shapes is None else shapes)
    if not shapes:
        raise HarnessError(f"op {op.name!r} has no test shapes to build golden vectors from")
    cpu = torch.device("cpu")
    payload = bytearray()
    cases: list[dict[str, Any]] = []

    def put(name: str, t: torch.Tensor) -> dict[str, Any]:
        if not isinstance(t, torch.Tensor):
            raise HarnessError(f"op {op.name!r}: golden entry {name!r} is not a tensor ({type(t).__name__})")
        data = _tensor_bytes(t)
        entry = {"name": name, "dtype": _dtype_name(t), "shape": list(t.shape), "offset": len(payload),
                 "nbytes": len(data)}
        payload.extend(data)
        return entry

    for i, shape in enumerate(shapes):
        op.domain.check(tdtype, shape)
        s = seed + i
        inputs = op.make_inputs(dict(shape), tdtype, cpu, make_generator(cpu, s))
        refs = op.reference(clone_inputs(inputs))
        params = {k: float(v) for k, v in inputs.items() if k in op.domain.params}
        cases.append({
            "shape": dict(shape),
            "seed": s,
            "inputs": [put(k, v) for k, v in inputs.items() if k not in params],
            "refs": [put(f"out{j}", r.to(torch.float64)) for j, r in enumerate(refs)],
            **({"params": params} if params else {}),
        })
    header = {
        "format": PARAMS_FORMAT_VERSION if any("params" in c for c in cases) else FORMAT_VERSION,
        "op": op.name,
        "dtype": dtype,
        "seed": seed,
        "torch": torch.__version__.split("+")[0],
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "cases": cases,
    }
    hbytes = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return MAGIC + struct.pack("<Q", len(hbytes)) + hbytes + bytes(payload)


def read_golden(blob: bytes) -> tuple[dict[str, Any], memoryview]:
    """Parse and verify a golden blob; returns (header, payload). Raises GoldenFormatError when bad."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise GoldenFormatError(f"golden blob must be bytes, got {type(blob).__name__}")
    view = memoryview(blob)
    if len(view) < len(MAGIC) + 8 or bytes(view[: len(MAGIC)]) != MAGIC:
        raise GoldenFormatError("not a golden-vector blob (bad magic)")
    (hlen,) = struct.unpack("<Q", view[len(MAGIC) : len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if start + hlen > len(view):
        raise GoldenFormatError(f"golden blob truncated: header says {hlen} bytes, {len(view) - start} left")
    try:
        header = json.loads(bytes(view[start : start + hlen]))
    except ValueError as e:
        raise GoldenFormatError(f"golden header is not valid JSON: {e}") from None
    if not isinstance(header, dict) or header.get("format") not in (FORMAT_VERSION, PARAMS_FORMAT_VERSION):
        raise GoldenFormatError(f"unsupported golden format {header.get('format') if isinstance(header, dict) else header!r}")
    payload = view[start + hlen :]
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise GoldenFormatError("golden payload digest mismatch (corrupt or truncated blob)")
    return header, payload


def _tensor_from(entry: Mapping[str, Any], payload: memoryview, device: torch.device) -> torch.Tensor:
    try:
        dt = _TORCH_DTYPES[entry["dtype"]]
        shape = [int(x) for x in entry["shape"]]
        off, n = int(entry["offset"]), int(entry["nbytes"])
    except (KeyError, TypeError, ValueError) as e:
        raise GoldenFormatError(f"bad tensor entry {dict(entry)!r}: {e}") from None
    if off < 0 or off + n > len(payload):
        raise GoldenFormatError(f"tensor {entry.get('name')!r} lies outside the payload")
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dt).element_size()
    if numel * itemsize != n:
        raise GoldenFormatError(f"tensor {entry.get('name')!r}: {n} bytes do not fit shape {shape} of {dt}")
    if n == 0:
        return torch.empty(shape, dtype=dt, device=device)
    raw = torch.frombuffer(bytearray(payload[off : off + n]), dtype=torch.uint8)
    return raw.view(dt).reshape(shape).to(device)


def check_golden(
    op: KernelOp, config: Mapping | None, blob: bytes, *, device: str | torch.device
) -> list[NumericResult]:
    """Run ``op`` on the stored inputs and compare with the stored float64 references."""
    header, payload = read_golden(blob)
    if header.get("op") != op.name:
        raise GoldenFormatError(f"golden vectors are for op {header.get('op')!r}, not {op.name!r}")
    dtype = header["dtype"]
    resolve_dtype(dtype)
    dev = resolve_device(device)
    results: list[NumericResult] = []
    for case in header["cases"]:
        inputs: dict[str, Any] = {e["name"]: _tensor_from(e, payload, dev) for e in case["inputs"]}
        inputs.update(case.get("params") or {})
        refs = [_tensor_from(e, payload, dev) for e in case["refs"]]
        results.extend(evaluate(op, config, dtype, case["shape"], inputs, refs, seed=case.get("seed")))
    return results
