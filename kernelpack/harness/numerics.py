"""Numerical correctness of one kernel version: poisoned outputs, error against the float64 reference, and
the output difference against another (stable) version on the same inputs.

Every output buffer is filled with a poison bit pattern (a NaN with an all-ones payload for float outputs,
the e4m3/e5m2 NaN byte for fp8, the largest value for integers) before the kernel runs, so an element the
kernel never writes is counted instead of silently reading as a plausible number. NaN or Inf in an output
is never a pass.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kernelpack.kernels.spec import DTYPES, KernelOp, Outputs, Shape, Tolerance, call_inputs

# Bit patterns written into output buffers before a kernel runs (viewed as the same-width integer type).
# Float poisons are *signalling* NaNs with a distinctive payload. No arithmetic produces one: every NaN a
# kernel computes is quiet, and each platform has its own canonical NaN (x86/NumPy: 0x7FC00000 / 0x7E00;
# NVIDIA GPUs: all mantissa bits set, 0x7FFFFFFF / 0x7FFF, the pattern this harness used to poison with, so
# on a GPU every computed NaN read as "unwritten" and was never excused by a non-finite reference). So a
# computed NaN is counted as non-finite and only a never-written element as unwritten, on every platform.
_POISON_BITS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float64: (torch.int64, 0x7FF5A5A5A5A5A5A5),
    torch.float32: (torch.int32, 0x7FA5A5A5),
    torch.float16: (torch.int16, 0x7D5A),
    torch.bfloat16: (torch.int16, 0x7FA5),
    torch.float8_e4m3fn: (torch.uint8, 0xFF),  # e4m3fn: S.1111.111 is its only NaN; GPUs write +NaN (0x7F)
    torch.float8_e4m3fnuz: (torch.uint8, 0x80),  # fnuz: negative zero encodes NaN (its only one)
    torch.float8_e5m2: (torch.uint8, 0xFD),  # e5m2: exponent all ones, mantissa 01 (signalling), negative
    torch.float8_e5m2fnuz: (torch.uint8, 0x80),
}
# NaN bit patterns that real hardware writes for a computed NaN (tests check the poisons differ from these)
COMPUTED_NANS: dict[torch.dtype, tuple[int, ...]] = {
    torch.float64: (0x7FF8000000000000, -0x0008000000000000, 0x7FFFFFFFFFFFFFFF),
    torch.float32: (0x7FC00000, -0x00400000, 0x7FFFFFFF),
    torch.float16: (0x7E00, -0x0200, 0x7FFF),
    torch.bfloat16: (0x7FC0, -0x0040, 0x7FFF),
}


class HarnessError(ValueError):
    """The harness was asked something it cannot answer (unknown dtype, missing tolerance, bad shapes)."""


@dataclass
class NumericResult:
    """One output of one op on one shape; JSON-serialisable via ``dataclasses.asdict``."""

    op: str
    dtype: str
    shape: dict[str, int]
    output: int  # index into the op's output tuple
    n_elements: int
    unwritten: int  # elements still holding the poison pattern after the kernel ran
    nonfinite: int  # NaN/Inf elements that the kernel wrote
    max_abs_err: float  # vs the float64 reference, over finite elements (inf if none)
    max_rel_err: float  # max |out-ref| / |ref| over elements with |ref| > atol (0 if none)
    n_out_of_tol: int  # elements violating |out-ref| <= atol + rtol*|ref| (non-finite ones included)
    atol: float
    rtol: float
    within_tolerance: bool
    inputs_modified: bool = False  # the kernel wrote into one of its inputs
    against_max_abs_diff: float | None = None  # vs the other version's output on the same inputs
    against_within_tolerance: bool | None = None
    seed: int | None = None
    passed: bool = False  # set by finalize(): every check above is good

    def finalize(self) -> NumericResult:
        ok = self.within_tolerance and self.unwritten == 0 and self.nonfinite == 0 and not self.inputs_modified
        self.passed = ok and self.against_within_tolerance is not False
        return self


def resolve_dtype(dtype: str) -> torch.dtype:
    """Map a manifest dtype name (``fp16``/``bf16``/``fp32``) to the torch dtype, with a clear error."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise HarnessError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}") from None


def resolve_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise HarnessError(f"device {device!r} requested but CUDA is not available")
    return dev


def tolerance_for(op: KernelOp, dtype: str) -> Tolerance:
    try:
        return op.tolerances[dtype]  # type: ignore[index]
    except KeyError:
        raise HarnessError(
            f"op {op.name!r} declares no tolerance for dtype {dtype!r} (has {sorted(op.tolerances)})"
        ) from None


def merged_config(op: KernelOp, config: Mapping | None) -> dict:
    return {**op.default_config, **(config or {})}


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with its dtype's poison pattern and return it."""
    if t.dtype in _POISON_BITS:
        int_dtype, bits = _POISON_BITS[t.dtype]
        t.view(int_dtype).fill_(bits)
    elif t.dtype == torch.bool:
        t.fill_(True)
    elif not t.dtype.is_floating_point and not t.dtype.is_complex:
        t.fill_(torch.iinfo(t.dtype).max)
    else:
        t.fill_(float("nan"))
    return t


def poisoned_mask(t: torch.Tensor) -> torch.Tensor:
    """Boolean mask of elements that still hold the poison pattern."""
    if t.dtype in _POISON_BITS:
        int_dtype, bits = _POISON_BITS[t.dtype]
        return t.view(int_dtype) == bits
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        return torch.zeros_like(t, dtype=torch.bool)  # no distinguishable pattern: never counted
    return t == torch.iinfo(t.dtype).max


def alloc_poisoned(op: KernelOp, inputs: Mapping[str, torch.Tensor]) -> Outputs:
    return tuple(poison_(o) for o in op.alloc_outputs(dict(inputs)))


def clone_inputs(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _inputs_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor):
            if not _bits_equal(v, w):
                return False
        elif v != w:
            return False
    return True


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included), so a NaN input is not reported as modified."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    x = a.detach().contiguous().reshape(-1).view(torch.uint8)
    y = b.detach().contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(x, y))


def run_poisoned(
    op: KernelOp, config: Mapping | None, inputs: Mapping[str, torch.Tensor]
) -> tuple[Outputs, bool]:
    """Run ``op`` on a private copy of ``inputs`` into poisoned outputs; return (outputs, inputs_modified).
    Run-time parameters ``op`` does not take are left out (see :func:`comparable`)."""
    private = clone_inputs(call_inputs(op, inputs, {}) or {})
    outs = alloc_poisoned(op, private)
    op.run(private, outs, merged_config(op, config))
    if any(o.is_cuda for o in outs):
        torch.cuda.synchronize()
    return outs, not _inputs_equal({k: inputs[k] for k in private}, private)


def comparable(other: tuple[KernelOp, Mapping] | None, op: KernelOp,
               inputs: Mapping[str, object]) -> tuple[KernelOp, Mapping] | None:
    """``other`` (the stable version) when it can compute ``inputs``, else None: a version built before one of
    ``op``'s run-time parameters existed computes with its default only, so it is no comparison for inputs that
    set another value (those are judged against the float64 reference alone)."""
    if other is None or call_inputs(other[0], inputs, op.domain.params) is None:
        return None
    return other


def compare_output(
    out: torch.Tensor, ref: torch.Tensor, tol: Tolerance
) -> tuple[int, int, float, float, int, bool]:
    """(unwritten, nonfinite, max_abs_err, max_rel_err, n_out_of_tol, within) for one output.

    Computed in float64 on the output's device, every statistic reduced there and read back in one host
    sync: on a GPU a production tensor is never copied to the host (the float64 copies and a dozen host
    passes over them took most of a GPU trial's production phase)."""
    if tuple(out.shape) != tuple(ref.shape):
        raise HarnessError(f"output shape {tuple(out.shape)} differs from reference shape {tuple(ref.shape)}")
    if out.numel() == 0:
        return 0, 0, 0.0, 0.0, 0, True
    unwritten_mask = poisoned_mask(out)
    o = out.detach().to(torch.float64)
    r = ref.detach().to(o.device, torch.float64)
    finite = torch.isfinite(o)
    ref_finite = torch.isfinite(r)
    both = finite & ref_finite
    err = (o - r).abs()
    ra = r.abs()
    sig = both & (ra > tol.atol)
    zero = torch.zeros((), dtype=torch.float64, device=o.device)
    stats = torch.stack([
        unwritten_mask.sum().to(torch.float64),
        (~finite & ~unwritten_mask).sum().to(torch.float64),
        both.all().to(torch.float64),
        torch.where(both, err, zero).max(),
        (~(err <= tol.atol + tol.rtol * ra)).sum().to(torch.float64),  # NaN/Inf errors count as violations
        torch.where(sig, err / torch.where(sig, ra, 1.0), zero).max(),
    ]).tolist()
    unwritten, nonfinite, n_out = int(stats[0]), int(stats[1]), int(stats[4])
    max_abs = stats[3] if stats[2] else math.inf  # a NaN/Inf in the output (or the reference) is unbounded
    within = n_out == 0 and unwritten == 0 and nonfinite == 0
    return unwritten, nonfinite, max_abs, stats[5], n_out, within


def diff_outputs(a: torch.Tensor, b: torch.Tensor, tol: Tolerance) -> tuple[float, bool]:
    """Max |a-b| and whether every element satisfies |a-b| <= atol + rtol*|b| (``b`` is the stable one)."""
    x = a.detach().to("cpu", torch.float64)
    y = b.detach().to("cpu", torch.float64)
    if x.shape != y.shape:
        return math.inf, False
    if x.numel() == 0:
        return 0.0, True
    d = (x - y).abs()
    finite = torch.isfinite(x) & torch.isfinite(y)
    max_diff = float(d.max()) if finite.all() else math.inf
    ok = bool(finite.all()) and bool((d <= tol.atol + tol.rtol * y.abs()).all())
    return max_diff, ok


def evaluate(
    op: KernelOp,
    config: Mapping | None,
    dtype: str,
    shape: Shape,
    inputs: Mapping[str, torch.Tensor],
    refs: Sequence[torch.Tensor],
    *,
    seed: int | None = None,
    against: tuple[KernelOp, Mapping] | None = None,
) -> list[NumericResult]:
    """Run ``op`` on ``inputs`` and compare every output with ``refs`` (and with ``against`` if given)."""
    tol = tolerance_for(op, dtype)
    outs, modified = run_poisoned(op, config, inputs)
    if len(outs) != len(refs):
        raise HarnessError(f"op {op.name!r} produced {len(outs)} outputs but the reference has {len(refs)}")
    other: Outputs | None = None
    against = comparable(against, op, inputs)
    if against is not None:
        other, _ = run_poisoned(against[0], against[1], inputs)
        if len(other) != len(outs):
            raise HarnessError(
                f"versions of {op.name!r} disagree on the number of outputs: {len(outs)} vs {len(other)}"
            )
    results = []
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        unwritten, nonfinite, max_abs, max_rel, n_out, within = compare_output(out, ref, tol)
        res = NumericResult(
            op=op.name, dtype=dtype, shape=dict(shape), output=i, n_elements=out.numel(),
            unwritten=unwritten, nonfinite=nonfinite, max_abs_err=max_abs, max_rel_err=max_rel,
            n_out_of_tol=n_out, atol=tol.atol, rtol=tol.rtol, within_tolerance=within,
            inputs_modified=modified, seed=seed,
        )
        if other is not None:
            res.against_max_abs_diff, res.against_within_tolerance = diff_outputs(out, other[i], tol)
        results.append(res.finalize())
    return results


def make_generator(device: torch.device | None, seed: int) -> torch.Generator:
    """A seeded generator on ``device`` (CPU when None).

    Ops draw their inputs from ``gen`` on the generator's device and move them to the target device (the
    convention of kernelpack.kernels). On a GPU the inputs are drawn there: drawing prefill-sized inputs
    (hundreds of millions of elements) on the host would dominate a trial's time. Golden vectors carry
    their own inputs, so nothing depends on CPU and GPU drawing the same values.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return torch.Generator(device=dev).manual_seed(seed)


def check_numerics(
    op: KernelOp,
    config: Mapping | None,
    dtype: str,
    shapes: Sequence[Shape],
    *,
    device: str | torch.device,
    seed: int,
    against: tuple[KernelOp, Mapping] | None = None,
) -> list[NumericResult]:
    """Fresh seeded random inputs per shape; one NumericResult per (shape, output).

    Inputs for shape ``i`` come from ``seed + i`` so adding a shape does not change the others. The
    reference runs in float64 on the inputs' device.
    """
    tdtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    tolerance_for(op, dtype)
    if not shapes:
        raise HarnessError(f"no shapes given for op {op.name!r}")
    results: list[NumericResult] = []
    for i, shape in enumerate(shapes):
        s = seed + i
        op.domain.check(tdtype, shape)
        inputs = op.make_inputs(shape, tdtype, dev, make_generator(dev, s))
        refs = op.reference(clone_inputs(inputs))
        results.extend(evaluate(op, config, dtype, shape, inputs, refs, seed=s, against=against))
    return results


def fuzz_shapes(op: KernelOp, n: int, rng: random.Random | int | None = None) -> list[Shape]:
    """``n`` random shapes inside the op's domain via ``op.fuzz``; fresh randomness unless seeded."""
    if op.fuzz is None:
        raise HarnessError(f"op {op.name!r} declares no shape fuzzer")
    if n < 0:
        raise HarnessError(f"n must be >= 0, got {n}")
    if not isinstance(rng, random.Random):
        rng = random.Random(rng)  # None -> seeded from os.urandom
    return [dict(op.fuzz(rng)) for _ in range(n)]


def all_passed(results: Sequence[NumericResult]) -> bool:
    return bool(results) and all(r.passed for r in results)
