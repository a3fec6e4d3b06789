"""The contract every fused op module in a kernel bundle implements.

A bundle ships op modules as *source*; the loader imports them into a private namespace. Each op module
exposes one module-level ``OP: KernelOp`` object. This file is the stable ABI between bundle code and the
installed kernelctl (harness, loader, runtime, agents): bundle modules may import the standard library,
``torch``, ``triton`` and this module, and sibling modules of their bundle relatively (``from . import x``;
``from . import stable_<op>`` bundles the installed ``kernelpack.kernels.<op>``); nothing else (the build
checks). Helpers every op module shares live here: :func:`launch_config` (launch-config validation) and
:func:`module_op` (the ``KernelOp`` of a module that follows the naming convention).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

# the vocabulary's one home; bundle modules keep importing DTypeName from here
from kernelctl.vocab import DTypeName

DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
TRITON_DTYPES: dict[str, str] = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}

Shape = dict[str, int]  # named problem dimensions, e.g. {"tokens": 8192, "hidden": 4096}
Inputs = dict[str, Any]  # input tensors by name, plus the op's scalar parameters (``Domain.params``) by name
Outputs = tuple[torch.Tensor, ...]
LaunchConfig = Mapping[str, Any]  # per-arch launch parameters from the manifest (BLOCK sizes, num_warps, ...)


class DomainError(ValueError):
    """An input lies outside a kernel's declared domain (dtype, shape range, alignment, contiguity); ``op``
    names the op whose domain it is (set by :meth:`KernelOp.__call__` when the raiser did not)."""

    def __init__(self, message: str, *, op: str | None = None) -> None:
        super().__init__(message)
        self.op = op


@dataclass(frozen=True)
class Tolerance:
    """Allowed error of an output against the float64 reference: |out - ref| <= atol + rtol * |ref|."""

    atol: float
    rtol: float

    def allows(self, max_abs_err: float, ref_abs: float = 0.0) -> bool:
        return max_abs_err <= self.atol + self.rtol * ref_abs


@dataclass(frozen=True)
class DimRange:
    lo: int
    hi: int
    multiple_of: int = 1

    def contains(self, v: int) -> bool:
        return self.lo <= v <= self.hi and v % self.multiple_of == 0


@dataclass(frozen=True)
class Param:
    """A scalar argument a model sets at run time (a norm's eps): a float in ``[lo, hi]``, passed to the kernel.

    ``default`` is what the operator passes when the caller gives none, and what an op built before the
    parameter existed computes with (it took the value as a constant); ``samples`` are the values an op's
    ``make_inputs`` cycles through with the generator's seed (:func:`draw_params`), so the harness's
    consecutive seeds (golden vectors, fuzzing, edge values) check every one of them."""

    default: float
    lo: float
    hi: float
    samples: tuple[float, ...]

    def contains(self, v: float) -> bool:
        return isinstance(v, (int, float)) and math.isfinite(v) and self.lo <= v <= self.hi

    def to_json(self) -> dict[str, Any]:
        return {"default": self.default, "lo": self.lo, "hi": self.hi, "samples": list(self.samples)}


@dataclass(frozen=True)
class Domain:
    """Documented limitations of a kernel; calls outside it fall back to the reference (or are refused)."""

    dtypes: tuple[DTypeName, ...]
    dims: Mapping[str, DimRange]
    contiguous: bool = True
    notes: str = ""
    # largest input magnitude the op is specified for (None: the dtype's limits); the edge-value check caps
    # its near-limit inputs here. Part of the numeric contract (recorded in the manifest's limitations).
    max_abs: float | None = None
    # the op's scalar arguments (model parameters such as eps), by name; recorded in the manifest's limitations
    params: Mapping[str, Param] = field(default_factory=dict)

    def check(self, dtype: torch.dtype, shape: Shape, tensors: Mapping[str, Any] = ()) -> None:
        names = {v: k for k, v in DTYPES.items()}
        if names.get(dtype) not in self.dtypes:
            raise DomainError(f"dtype {dtype} not in domain {self.dtypes}")
        for dim, rng in self.dims.items():
            if dim not in shape:
                raise DomainError(f"missing dimension {dim!r}")
            if not rng.contains(shape[dim]):
                raise DomainError(
                    f"{dim}={shape[dim]} outside [{rng.lo}, {rng.hi}] (multiple of {rng.multiple_of})"
                )
        for name, t in dict(tensors).items():
            if isinstance(t, torch.Tensor):
                if self.contiguous and not t.is_contiguous():
                    raise DomainError(f"input {name!r} is not contiguous")
            elif name in self.params and not self.params[name].contains(t):
                p = self.params[name]
                raise DomainError(f"{name}={t!r} outside [{p.lo:g}, {p.hi:g}]")

    def to_json(self) -> dict[str, Any]:
        return {
            "dtypes": list(self.dtypes),
            "dims": {k: {"lo": r.lo, "hi": r.hi, "multiple_of": r.multiple_of} for k, r in self.dims.items()},
            "contiguous": self.contiguous,
            "notes": self.notes,
            **({"max_abs": self.max_abs} if self.max_abs is not None else {}),
            **({"params": {k: p.to_json() for k, p in self.params.items()}} if self.params else {}),
        }

    def param(self, inputs: Mapping[str, Any], name: str) -> float:
        """The value of parameter ``name`` in ``inputs`` (its default when the caller gave none: inputs stored
        before the parameter existed, such as an older bundle's golden vectors)."""
        return float(inputs.get(name, self.params[name].default))


def draw_params(domain: Domain, gen: torch.Generator) -> dict[str, float]:
    """One sample of each of ``domain``'s parameters, chosen by the generator's seed (seed ``i`` takes sample
    ``i mod n``): the harness draws shape ``i`` from seed ``base + i``, so a run over consecutive seeds checks every
    sample, and the same seed always gives the same value."""
    seed = gen.initial_seed()
    return {k: p.samples[seed % len(p.samples)] for k, p in domain.params.items()}


def call_inputs(op: KernelOp, inputs: Mapping[str, Any], contract: Mapping[str, Param]) -> Inputs | None:
    """``inputs`` as ``op`` takes them: the tensors and the parameters it declares. ``None`` when ``inputs``
    give a parameter ``op`` does not take a value other than ``contract``'s default (an op built before the
    parameter existed computes with the default only: it cannot serve that call)."""
    mine = op.domain.params
    out: Inputs = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) or k in mine:
            out[k] = v
        elif k in contract and float(v) != contract[k].default:
            return None
    return out


@dataclass(frozen=True)
class AotSpec:
    """One ahead-of-time compilation unit: a @triton.jit function with a concrete signature."""

    fn: Any  # triton.JITFunction
    signature: dict[str, str]  # e.g. {"x": "*bf16", "n": "i32", "BLOCK": "constexpr"}
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3


@dataclass
class KernelOp:
    """One fused op: Triton implementation(s), float64 reference, domain, tolerances and benchmark facts.

    ``alloc_outputs(inputs)`` allocates the output buffers (``torch.empty``; the harness fills them with a
    poison value first so an unwritten element is caught); ``run(inputs, outs, config)`` launches the Triton
    kernel(s) writing into ``outs``; ``reference(inputs)`` computes in float64 and returns float64 outputs;
    ``eager(inputs)`` is the same math in plain PyTorch in the input dtype (what torch.compile and the eager
    baseline run). Outputs are tuples in the same order for all three.
    """

    name: str
    description: str
    domain: Domain
    tolerances: Mapping[DTypeName, Tolerance]
    make_inputs: Callable[[Shape, torch.dtype, torch.device, torch.Generator], Inputs]
    shape_of: Callable[[Inputs], Shape]
    alloc_outputs: Callable[[Inputs], Outputs]
    run: Callable[[Inputs, Outputs, LaunchConfig], None]
    reference: Callable[[Inputs], Outputs]
    eager: Callable[[Inputs], Outputs]
    bytes_moved: Callable[[Shape, torch.dtype], int]
    flops: Callable[[Shape], int] = lambda s: 0
    # shapes for the harness: small ones that the interpreter runs in CI, decode and prefill sizes on GPUs
    test_shapes: tuple[Shape, ...] = ()
    decode_shapes: tuple[Shape, ...] = ()
    prefill_shapes: tuple[Shape, ...] = ()
    fuzz: Callable[[Any], Shape] | None = None  # random.Random -> a shape inside the domain (small)
    aot: Callable[[DTypeName, LaunchConfig], list[AotSpec]] | None = None
    default_config: LaunchConfig = field(default_factory=dict)
    launches_per_call: int = 1
    # optional: the op's own edge-value inputs (mask boundaries, the end of a rotary table, ...) as
    # (case name, inputs) pairs; the harness adds generic ones (zero/constant rows, dtype limits, subnormals)
    edge_inputs: Callable[[Shape, torch.dtype, torch.device, torch.Generator], list[tuple[str, Inputs]]] | None = None

    def __call__(self, inputs: Inputs, config: LaunchConfig | None = None) -> Outputs:
        t0 = first_tensor(inputs)
        try:
            self.domain.check(t0.dtype, self.shape_of(inputs), inputs)
        except DomainError as exc:
            exc.op = exc.op or self.name
            raise
        outs = self.alloc_outputs(inputs)
        self.run(inputs, outs, {**self.default_config, **(config or {})})
        return outs


def first_tensor(inputs: Mapping[str, Any]) -> torch.Tensor:
    """The first tensor among an op's inputs (whose dtype and device the call runs in)."""
    return next(v for v in inputs.values() if isinstance(v, torch.Tensor))


def launch_config(op: str, defaults: Mapping[str, int], config: LaunchConfig,
                  any_int: tuple[str, ...] = ("num_stages",), flags: tuple[str, ...] = ()) -> dict[str, int]:
    """``defaults`` overridden by ``config``, validated: only known keys, every value a positive int and a power
    of 2 (block sizes, warps) except the keys in ``any_int`` (any positive int) and in ``flags`` (0 or 1: a
    switch between code paths). A bad value is a ``ValueError`` naming the op and key."""
    unknown = set(config) - set(defaults)
    if unknown:
        raise ValueError(f"{op}: unknown launch config key(s) {sorted(unknown)}; known: {sorted(defaults)}")
    cfg = {**defaults, **config}
    for k, v in cfg.items():
        if k in flags:
            if not isinstance(v, int) or isinstance(v, bool) or v not in (0, 1):
                raise ValueError(f"{op}: launch config {k}={v!r} must be 0 or 1")
            continue
        pow2 = k not in any_int
        if not isinstance(v, int) or v < 1 or (pow2 and v & (v - 1)):
            raise ValueError(f"{op}: launch config {k}={v!r} must be a positive int{' power of 2' if pow2 else ''}")
    return cfg


def same_layout(op: str, tensors: Mapping[str, torch.Tensor], dims: tuple[str, ...]) -> Shape:
    """``dims`` named after the first tensor's shape; every other tensor must have that shape, dtype and device
    (e.g. ``same_layout("swiglu", {"gate": g, "up": u}, ("tokens", "hidden"))``). A mismatch is a
    ``DomainError`` naming the op and both tensors."""
    (first, t0), *rest = tensors.items()
    if t0.dim() != len(dims):
        raise DomainError(f"{op}: {first} must be {len(dims)}-D ({', '.join(dims)}), got shape {tuple(t0.shape)}")
    for name, t in rest:
        if t.shape != t0.shape:
            raise DomainError(f"{op}: {name} shape {tuple(t.shape)} must equal {first} shape {tuple(t0.shape)}")
        if t.dtype != t0.dtype or t.device != t0.device:
            raise DomainError(f"{op}: {name} ({t.dtype}, {t.device}) must match {first} ({t0.dtype}, {t0.device})")
    return dict(zip(dims, t0.shape, strict=True))


def check_outputs(op: str, outs: Outputs, like: torch.Tensor) -> None:
    """Every output buffer a contiguous tensor of ``like``'s shape and dtype (a ``ValueError`` otherwise)."""
    for o in outs:
        if o.shape != like.shape or o.dtype != like.dtype or not o.is_contiguous():
            what = "output must be a contiguous" if len(outs) == 1 else "outputs must be contiguous"
            raise ValueError(f"{op}: {what} {like.dtype} tensor{'s' if len(outs) > 1 else ''} of shape "
                             f"{tuple(like.shape)}")


_MODULE_FIELDS = ("make_inputs", "shape_of", "alloc_outputs", "run", "reference", "eager", "bytes_moved", "flops",
                  "fuzz", "aot")


def module_op(namespace: Mapping[str, Any], **fields: Any) -> KernelOp:
    """The ``KernelOp`` of an op module from its conventional names (``NAME``, ``DOMAIN``, ``DEFAULT_CONFIG`` and
    the functions ``make_inputs``, ``shape_of``, ``alloc_outputs``, ``run``, ``reference``, ``eager``,
    ``bytes_moved``, ``flops``, ``fuzz``, ``aot`` where defined) plus ``fields`` (description, tolerances, shapes,
    ...), which take precedence. Call it as ``OP = module_op(globals(), description=..., ...)``."""
    found = {k: namespace[k] for k in _MODULE_FIELDS if k in namespace}
    base = {"name": namespace["NAME"], "domain": namespace["DOMAIN"],
            "default_config": namespace.get("DEFAULT_CONFIG", {})}
    return KernelOp(**{**base, **found, **fields})
