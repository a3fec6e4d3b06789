"""Numerics where production runs: edge-value inputs, and candidate vs stable at production shapes.

Edge values (:func:`edge_cases`): for every floating input of two or more dimensions (activations; 1-D
weights and biases keep their random values), viewed as rows over the last dimension: an all-zero tensor,
all-zero rows (padding tokens), constant rows, magnitudes near the dtype's largest finite value and their
negatives, tiny and subnormal values, and mixed row scales (1e-6 to 1e6, inside the dtype's range). An op module adds its
own cases through ``KernelOp.edge_inputs`` (mask boundaries, the end of a rotary table, ...).

The edge rule (:func:`check_edge`): an output element that is non-finite where the float64 reference,
rounded to the output dtype, is finite is a numeric error, unless the stable version is non-finite there too
(an old defect is not the candidate's); without a stable version, unless the op's eager PyTorch math in the
same dtype is non-finite there (values near a dtype's limit overflow any float32 accumulation). Tolerances are not applied to edge values: at the dtype's limits the
op's tolerances do not describe what a correct kernel can do (a result's ``max_abs_err`` is reported, not judged).
Edge inputs are a function of (op, dtype, shape) only (:func:`edge_seed`), drawn on the CPU: the same on every
node and in every trial, so a stable bundle cannot pass on one node and fail on another by the luck of a seed.

Production shapes (:func:`check_production`): the candidate and stable run on identical inputs at a shape
the latency phase times; every element of every output is compared under the op's tolerance (stable is the
reference there); the float64 reference is computed on a sample of rows (first, last, and random ones, rows
past the first thousand included) when the op's inputs can be sliced by rows, on the whole tensor when that
is cheap, else skipped (noted).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kernelpack.harness.fingerprint import fingerprints
from kernelpack.harness.numerics import (
    NumericResult,
    clone_inputs,
    comparable,
    compare_output,
    make_generator,
    poisoned_mask,
    resolve_dtype,
    run_poisoned,
    tolerance_for,
)
from kernelpack.kernels.spec import DTYPES, Inputs, KernelOp, Shape, Tolerance

OpCfg = tuple[KernelOp, Mapping]
CASES = ("zero_tensor", "zero_rows", "constant_rows", "near_max", "tiny", "mixed_scale")
FULL_REFERENCE_ELEMENTS = 1 << 24  # below this many input elements the float64 reference covers every row
SAMPLE_ROWS = 96


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _edge_tensor(case: str, t: torch.Tensor, gen: torch.Generator, max_abs: float | None = None) -> torch.Tensor:
    """``t`` (random values) turned into one edge case, same shape and dtype."""
    fi = torch.finfo(t.dtype)
    x = _rows(t.detach().to(torch.float64).clone())
    n = x.shape[0]
    sign = torch.where(torch.rand(x.shape, generator=gen, device=gen.device).to(x.device) < 0.5, -1.0, 1.0)
    if case == "zero_tensor":
        x.zero_()
    elif case == "zero_rows":
        x[::3] = 0.0
        x[-1] = 0.0
    elif case == "constant_rows":
        consts = torch.linspace(-2.0, 2.0, n, dtype=torch.float64, device=x.device)
        x[:] = consts[:, None]
    elif case == "near_max":
        x[:] = sign * (fi.max * 0.5 if max_abs is None else min(fi.max * 0.5, max_abs))  # the op's domain cap
        x[1::2] = x[1::2] * 1e-3  # near-limit rows next to moderate ones
    elif case == "tiny":
        x[:] = sign * fi.tiny
        x[::2] = sign[::2] * fi.tiny * 0.25  # subnormal
        x[-1] = x[-1] * 0.0  # signed zeros
    elif case == "mixed_scale":
        # rows from 1e-6 to 1e6 (inside the dtype's range): activations of very different magnitudes in one
        # batch, not the dtype's limits (that is near_max / tiny). Each row is first scaled to a largest
        # magnitude of 1: random values reach |x| ~ 4-5, which at fp16's top scale (10**3.8) used to overflow
        # to inf in the input itself, depending on the seed (an input outside the dtype, not an edge value)
        top = min(6.0, math.log10(fi.max) - 1.0)
        bottom = max(math.log10(fi.tiny) + 1.0, -6.0)
        exps = torch.linspace(bottom, top, max(n, 2), dtype=torch.float64, device=x.device)[:n]
        peak = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-300)
        x = x / peak * torch.pow(10.0, exps)[:, None]
    else:  # pragma: no cover - guarded by CASES
        raise ValueError(f"unknown edge case {case!r}")
    return x.reshape(t.shape).to(t.dtype)


def edge_seed(op_name: str, dtype: str, shape: Shape) -> int:
    """The seed of an op's edge inputs: a function of (op, dtype, shape) only, so every node of a fleet, every
    trial and every repeat judges the same inputs (a trial's own seed varies the fuzz phase, not these)."""
    key = f"{op_name}|{dtype}|" + ",".join(f"{k}={int(v)}" for k, v in sorted(shape.items()))
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def edge_cases(op: KernelOp, shape: Shape, dtype: str, device: torch.device) -> list[tuple[str, Inputs]]:
    """(case name, inputs) for the generic edge values of ``op`` at ``shape``, then the op's own cases.

    Inputs are drawn on the CPU from :func:`edge_seed` and moved to ``device``: the same values on every node whatever its GPU (a CUDA generator's stream depends on
    the device's launch geometry) and in every repeat. The shapes are small (an op's test shape).
    """
    tdtype = resolve_dtype(dtype)
    base = edge_seed(op.name, dtype, shape)
    cpu = torch.device("cpu")
    out: list[tuple[str, Inputs]] = []
    for i, case in enumerate(CASES):
        inputs = op.make_inputs(dict(shape), tdtype, device, make_generator(cpu, base + i))
        touched = False
        for name, t in list(inputs.items()):
            if isinstance(t, torch.Tensor) and t.dtype == tdtype and t.dim() >= 2 and t.numel():
                edged = _edge_tensor(case, t.cpu(), make_generator(cpu, base + 100 + i), op.domain.max_abs)
                inputs[name] = edged.to(t.device)
                touched = True
        if touched:
            out.append((case, inputs))
    if op.edge_inputs is not None:
        out.extend((f"op:{name}", inp) for name, inp in op.edge_inputs(dict(shape), tdtype, device,
                                                                       make_generator(cpu, base + 999)))
    return out


def _ref_finite_in(out_dtype: torch.dtype, ref: torch.Tensor) -> torch.Tensor:
    """Elements where the float64 reference is finite once rounded to the output's dtype."""
    r = ref.detach().to("cpu", torch.float64)
    if out_dtype.is_floating_point and out_dtype in (torch.float16, torch.bfloat16, torch.float32):
        fmax = torch.finfo(out_dtype).max
        return torch.isfinite(r) & (r.abs() <= fmax)
    if out_dtype.is_floating_point:  # fp8 and friends: saturating formats, judge finiteness of the reference
        return torch.isfinite(r)
    return torch.ones_like(r, dtype=torch.bool)


@dataclass
class EdgeOutcome:
    case: str
    result: NumericResult


def check_edge(candidate: OpCfg, stable: OpCfg | None, dtype: str, shape: Shape, *,
               device: torch.device) -> list[EdgeOutcome]:
    """Run every edge case of the candidate (and stable on the same inputs); see the module docstring.
    The inputs depend on (op, dtype, shape) only (:func:`edge_seed`)."""
    op, cfg = candidate
    tol = tolerance_for(op, dtype)
    seed = edge_seed(op.name, dtype, shape)
    outs_list: list[EdgeOutcome] = []
    for case, inputs in edge_cases(op, shape, dtype, device):
        refs = op.reference(clone_inputs(inputs))
        outs, modified = run_poisoned(op, cfg, inputs)
        if (st := comparable(stable, op, inputs)) is not None:
            other = run_poisoned(st[0], st[1], inputs)[0]
        else:  # no stable version (able to take these inputs): the op's eager math in the dtype says what it allows
            other = op.eager(clone_inputs(inputs))
        for i, (o, ref) in enumerate(zip(outs, refs, strict=True)):
            unwritten = int(poisoned_mask(o).sum())
            of = o.detach().to("cpu", torch.float64)
            cand_bad = ~torch.isfinite(of) & ~poisoned_mask(o).cpu()
            expect = _ref_finite_in(o.dtype, ref)
            expect &= torch.isfinite(other[i].detach().to("cpu", torch.float64))
            bad = int((cand_bad & expect).sum())
            finite = torch.isfinite(of) & torch.isfinite(ref.detach().to("cpu", torch.float64))
            err = float((of - ref.detach().to("cpu", torch.float64)).abs()[finite].max()) if finite.any() else 0.0
            res = NumericResult(
                op=op.name, dtype=dtype, shape=dict(shape), output=i, n_elements=o.numel(), unwritten=unwritten,
                nonfinite=bad, max_abs_err=err, max_rel_err=0.0, n_out_of_tol=bad, atol=tol.atol, rtol=tol.rtol,
                within_tolerance=bad == 0, inputs_modified=modified, seed=seed)
            outs_list.append(EdgeOutcome(case, res.finalize()))
    return outs_list


def _sample_rows(n: int, seed: int) -> torch.Tensor:
    if n <= SAMPLE_ROWS:
        return torch.arange(n)
    g = torch.Generator().manual_seed(seed)
    head = torch.arange(0, 16)
    tail = torch.arange(n - 16, n)
    rand = torch.randint(16, n - 16, (SAMPLE_ROWS - 32,), generator=g)
    past = torch.arange(min(1000, n - 17), n - 16, max(1, (n - 1016) // 8)) if n > 1032 else torch.empty(0, dtype=torch.long)
    return torch.unique(torch.cat([head, rand, past, tail]))


def _sliced_reference(op: KernelOp, inputs: Inputs, tokens: int, rows: torch.Tensor) -> tuple[object, bool]:
    """The float64 reference on ``rows`` of every input whose leading dimension is the token count;
    (outputs, ok). Not ok when the op refuses the sliced inputs (its rows are not independent)."""
    sliced = {k: (v.index_select(0, rows.to(v.device)) if isinstance(v, torch.Tensor) and v.dim() >= 1
                  and v.shape[0] == tokens else v) for k, v in inputs.items()}
    if all(sliced[k] is inputs[k] for k in inputs):
        return None, False
    try:
        op.shape_of(sliced)
        return op.reference(clone_inputs(sliced)), True
    except Exception:
        return None, False


def production_inputs(op: KernelOp, dtype: str, shape: Shape, device: torch.device, seed: int | None = None
                      ) -> tuple[Inputs, int]:
    """The production check's inputs at ``shape`` (seeded by :func:`edge_seed` unless ``seed``) and the seed."""
    if seed is None:
        seed = edge_seed(op.name, dtype, shape)
    return op.make_inputs(dict(shape), resolve_dtype(dtype), device, make_generator(device, seed)), seed


def candidate_fingerprints(candidate: OpCfg, dtype: str, shape: Shape, *, device: torch.device,
                           seed: int | None = None) -> list[str]:
    """One run of the candidate on the production check's inputs: its outputs' bit fingerprints (the GPU memo's
    repeat check, :mod:`agents.trial_memo`)."""
    op, cfg = candidate
    inputs, _ = production_inputs(op, dtype, shape, device, seed)
    return fingerprints(run_poisoned(op, cfg, inputs)[0])


def check_production(candidate: OpCfg, stable: OpCfg | None, dtype: str, shape: Shape, *, device: torch.device,
                     token_dim: str, seed: int | None = None, tolerance: Tolerance | None = None, runs: int = 1,
                     fingerprints_out: list[list[str]] | None = None) -> tuple[list[NumericResult], list[str]]:
    """Candidate vs stable over the whole output at ``shape`` and vs the float64 reference on sampled rows
    (or the whole tensor when cheap); returns (results, notes). Inputs and the row sample come from ``seed``,
    by default :func:`edge_seed` of (op, dtype, shape): every trial of a node judges the same inputs (on a GPU
    they are drawn on the device, so nodes of one GPU model draw the same values).

    ``runs`` > 1 runs the candidate that many times on the same inputs and checks every output (the reference
    and stable are computed once); the results are the first failing run's, else the first run's, and a note
    says when the runs' output bits differed. ``fingerprints_out`` receives each run's output fingerprints."""
    op, cfg = candidate
    tol = tolerance or tolerance_for(op, dtype)
    notes: list[str] = []
    inputs, seed = production_inputs(op, dtype, shape, device, seed)
    st = comparable(stable, op, inputs)
    other = run_poisoned(st[0], st[1], inputs)[0] if st is not None else None
    tokens = int(shape.get(token_dim, 0))
    numel = sum(v.numel() for v in inputs.values() if isinstance(v, torch.Tensor))
    rows: torch.Tensor | None = None
    refs: object = None
    if numel <= FULL_REFERENCE_ELEMENTS:
        refs = op.reference(clone_inputs(inputs))
    elif tokens:
        rows = _sample_rows(tokens, seed)
        refs, ok = _sliced_reference(op, inputs, tokens, rows)
        if not ok:
            notes.append(f"{op.name} {dtype} {shape}: float64 reference skipped at this size (rows not "
                         "separable); compared with stable over the whole tensor")
            refs = None
    chosen: list[NumericResult] | None = None
    prints: list[list[str]] = []
    for _ in range(max(1, runs)):
        outs, modified = run_poisoned(op, cfg, inputs)
        if runs > 1 or fingerprints_out is not None:
            prints.append(fingerprints(outs))
        results = [_production_result(op, dtype, shape, seed, tol, o, i, refs, rows, tokens, other, modified)
                   for i, o in enumerate(outs)]
        if chosen is None or (all(r.passed for r in chosen) and not all(r.passed for r in results)):
            chosen = results
        del outs
    if len({tuple(p) for p in prints}) > 1:
        notes.append(f"{op.name} {dtype} {shape}: the candidate's output bits differed between {len(prints)} runs "
                     "on the same inputs (nondeterministic); every run was checked")
    if fingerprints_out is not None:
        fingerprints_out.extend(prints)
    return chosen or [], notes


def _production_result(op: KernelOp, dtype: str, shape: Shape, seed: int, tol: Tolerance, o: torch.Tensor, i: int,
                       refs: object, rows: torch.Tensor | None, tokens: int, other: Sequence[torch.Tensor] | None,
                       modified: bool) -> NumericResult:
    """One output of one production run against the reference (sampled rows or whole) and stable."""
    ref = None
    out_cmp = o
    if refs is not None:
        ref = refs[i]  # type: ignore[index]
        out_cmp = o.index_select(0, rows.to(o.device)) if rows is not None and o.shape[0] == tokens else o
        if tuple(out_cmp.shape) != tuple(ref.shape):
            out_cmp, ref = o, None
    if ref is not None:
        unwritten, nonfinite, max_abs, max_rel, n_out, within = compare_output(out_cmp, ref, tol)
        if rows is not None:  # a row sample against the reference; unwritten elements over the whole tensor
            unwritten = int(poisoned_mask(o).sum())
            within = within and unwritten == 0
    else:
        unwritten = int(poisoned_mask(o).sum())
        nonfinite = int((~torch.isfinite(o.detach()) & ~poisoned_mask(o)).sum())  # on the device, no copy
        max_abs, max_rel, n_out, within = 0.0, 0.0, 0, unwritten == 0 and nonfinite == 0
    res = NumericResult(op=op.name, dtype=dtype, shape=dict(shape), output=i, n_elements=o.numel(),
                        unwritten=unwritten, nonfinite=nonfinite, max_abs_err=max_abs, max_rel_err=max_rel,
                        n_out_of_tol=n_out, atol=tol.atol, rtol=tol.rtol, within_tolerance=within,
                        inputs_modified=modified, seed=seed)
    if other is not None:
        res.against_max_abs_diff, res.against_within_tolerance = _diff_on_device(o, other[i], tol)
    return res.finalize()


def _diff_on_device(a: torch.Tensor, b: torch.Tensor, tol: Tolerance, chunk: int = 1 << 26) -> tuple[float, bool]:
    """:func:`diff_outputs` computed on the tensors' device in float64 chunks (a GPU's production tensors are
    too large to copy to the host), reduced there and read back in one host sync (the CPU runs the same code)."""
    if a.shape != b.shape:
        return math.inf, False
    x, y = a.detach().reshape(-1), b.detach().reshape(-1)
    if x.numel() == 0:
        return 0.0, True
    worst = torch.zeros((), dtype=torch.float64, device=x.device)
    bad = torch.zeros((), dtype=torch.int64, device=x.device)  # non-finite or out of tolerance
    nonfinite = torch.zeros((), dtype=torch.int64, device=x.device)
    for i in range(0, x.numel(), chunk):
        xs, ys = x[i:i + chunk].to(torch.float64), y[i:i + chunk].to(torch.float64)
        finite = torch.isfinite(xs) & torch.isfinite(ys)
        d = (xs - ys).abs()
        nonfinite += (~finite).sum()
        worst = torch.maximum(worst, torch.where(finite, d, 0.0).max())
        bad += (~(d <= tol.atol + tol.rtol * ys.abs())).sum()
    w, n_bad, n_nonfinite = torch.stack([worst, bad.to(torch.float64), nonfinite.to(torch.float64)]).tolist()
    if n_nonfinite:
        return math.inf, False
    return w, n_bad == 0


def stricter(a: Tolerance, b: Tolerance | None) -> Tolerance:
    """The tighter of two tolerances (per field)."""
    return a if b is None else Tolerance(min(a.atol, b.atol), min(a.rtol, b.rtol))


def dtypes_of(op: KernelOp) -> list[str]:
    return [d for d in op.domain.dtypes if d in op.tolerances and d in DTYPES]


EdgeHook = Callable[[Shape, torch.dtype, torch.device, torch.Generator], Sequence[tuple[str, Inputs]]]
