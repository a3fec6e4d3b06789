"""Every bundle op as a PyTorch operator ``torch.ops.kernelctl.<op>`` that runs the node's active version.

Importing this module registers, for each op module in ``kernelpack.kernels`` (the ``KernelOp`` contract), a
``torch.library`` operator with the op's input tensors in the order of its ``make_inputs``, then its run-time
parameters (``Domain.params``: model parameters such as a norm's eps) as ``float`` arguments with their
defaults::

    y, h = torch.ops.kernelctl.add_rmsnorm(x, residual, weight, 1e-5)   # eps (default 1e-6)
    y = torch.ops.kernelctl.swiglu(gate, up)

The operator body asks the runtime (:func:`kernelpack.runtime.get_op`, or the runtime given to
:func:`configure`) on every call for the op of the node's active bundle that provides it (several bundles may
be active, one per op; or the bundle given to :func:`configure`), with its fallbacks (stable version, then the
PyTorch path; a call outside the op's domain runs the PyTorch path). Its fake (meta) implementation
is the op's ``alloc_outputs``, so ``torch.compile(fullgraph=True)`` traces the operator as one opaque node
(no graph break) and a CUDA-graph capture records the Triton launches of the version active at capture time.
Forward only (inference): there is no autograd formula.

Because a captured graph never re-enters the body, code that captures must re-capture after a switch:
``kernelpack.integrations.graphs`` does that from the runtime's generation number.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import kernelpack.kernels as kernels_pkg
from kernelpack.kernels.spec import KernelOp
from kernelpack.runtime import Runtime, default_runtime, reference_op

if TYPE_CHECKING:
    from kernelpack.loader import BoundOp

NAMESPACE = "kernelctl"


@dataclass(frozen=True)
class OpSignature:
    name: str
    inputs: tuple[str, ...]  # tensors
    n_outputs: int
    params: tuple[tuple[str, float], ...] = ()  # (name, default) of each run-time parameter, after the tensors

    @property
    def schema(self) -> str:
        args = ", ".join([f"Tensor {n}" for n in self.inputs] + [f"float {n}={d!r}" for n, d in self.params])
        ret = "Tensor" if self.n_outputs == 1 else "(" + ", ".join(["Tensor"] * self.n_outputs) + ")"
        return f"{self.name}({args}) -> {ret}"


@dataclass
class _State:
    runtime: Runtime | None = None
    bundle: str | None = None  # None: each op from the active bundle that provides it
    served: dict[str, str] | None = None  # op -> "bundle@version" (or "reference") of its last call
    pinned: Mapping[str, BoundOp] | None = None  # set by pinned(): these ops instead of the runtime's


_state = _State(served={})
_lock = threading.Lock()
SIGNATURES: dict[str, OpSignature] = {}
_LIB: torch.library.Library | None = None


def configure(runtime: Runtime | None = None, bundle: str | None = None) -> None:
    """Serve the operators from ``runtime`` (default: the process-wide one), each op from the active bundle that
    provides it, or every op from ``bundle`` when given."""
    _state.runtime, _state.bundle = runtime, bundle


def runtime() -> Runtime:
    """The runtime the operators dispatch through."""
    return _state.runtime or default_runtime()


def bundle() -> str | None:
    """The bundle every op is served from, or None: each op from the active bundle that provides it."""
    return _state.bundle


@contextmanager
def pinned(ops: Mapping[str, BoundOp]) -> Iterator[None]:
    """Serve the operators from ``ops`` (a loaded bundle's ``BoundOp``s; ops it lacks run the PyTorch path)
    instead of the runtime, for measuring two versions side by side in one process (the trial)."""
    before = _state.pinned
    _state.pinned = ops
    try:
        yield
    finally:
        _state.pinned = before


_REFS: dict[str, BoundOp] = {}


def _resolve(name: str) -> BoundOp:
    if _state.pinned is None:
        return runtime().get_op(name, _state.bundle)
    bound = _state.pinned.get(name)
    if bound is None:
        bound = _REFS.get(name) or _REFS.setdefault(name, reference_op(name))
    return bound


@torch.compiler.assume_constant_result
def kernel_wins(name: str, tokens: int) -> bool:
    """Whether the version that serves op ``name`` says its kernel wins at ``tokens`` tokens per call on this
    node's arch (its manifest's ``wins`` table; True where it ships none). Under ``torch.compile`` this is
    evaluated once at trace time (a constant of the graph, no graph break)."""
    return _resolve(name).wins_at(tokens)


def last_served(op: str) -> str | None:
    """Which version ran ``op``'s last eager call (``"llm-fused@1.1.0"``, or ``"reference"``)."""
    assert _state.served is not None
    return _state.served.get(op)


def _installed_ops() -> dict[str, KernelOp]:
    ops: dict[str, KernelOp] = {}
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        if info.name == "spec" or info.name.endswith("_common"):  # the contract and shared helpers: no op
            continue
        op = importlib.import_module(f"kernelpack.kernels.{info.name}").OP  # every other module is one op
        assert isinstance(op, KernelOp), f"kernelpack.kernels.{info.name}.OP is not a KernelOp"
        ops[op.name] = op
    return ops


def signature_of(op: KernelOp) -> OpSignature:
    """Input tensor names (``make_inputs`` order), run-time parameters with their defaults and output count,
    read from the op's smallest test shape."""
    shape = op.test_shapes[0] if op.test_shapes else op.fuzz(__import__("random").Random(0))  # type: ignore[misc]
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[op.domain.dtypes[0]]
    gen = torch.Generator().manual_seed(0)
    inputs = op.make_inputs(shape, dtype, torch.device("cpu"), gen)
    tensors = tuple(k for k, v in inputs.items() if isinstance(v, torch.Tensor))
    params = tuple((k, float(p.default)) for k, p in op.domain.params.items())
    return OpSignature(op.name, tensors, len(op.alloc_outputs(inputs)), params)


def _arguments(sig: OpSignature, args: Sequence[object], kwargs: Mapping[str, object]) -> dict[str, object]:
    """The op's inputs by name from an operator call (parameters the caller left out take their defaults)."""
    out = dict(zip(sig.inputs + tuple(n for n, _ in sig.params), args, strict=False))  # trailing params optional
    return {**out, **{n: kwargs.get(n, d) for n, d in sig.params if n not in out}}


def _no_alias(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """An operator's outputs may not alias its inputs (a PyTorch fallback could return a view): copy those."""
    ptrs = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    return [o.clone() if o.numel() and o.untyped_storage().data_ptr() in ptrs else o for o in outs]


def _make_impl(sig: OpSignature):
    def impl(*args: object, **kwargs: object):
        bound = _resolve(sig.name)
        outs = bound(_arguments(sig, args, kwargs))
        assert _state.served is not None
        _state.served[sig.name] = bound.bundle
        res = _no_alias(outs, [a for a in args if isinstance(a, torch.Tensor)])
        return res[0] if sig.n_outputs == 1 else tuple(res)

    return impl


def _make_fake(sig: OpSignature, op: KernelOp):
    def fake(*args: object, **kwargs: object):
        outs = op.alloc_outputs(_arguments(sig, args, kwargs))
        return outs[0] if sig.n_outputs == 1 else tuple(outs)

    return fake


def register() -> dict[str, OpSignature]:
    """Define ``torch.ops.kernelctl.<op>`` for every installed op module (idempotent; runs on import)."""
    global _LIB
    with _lock:
        if _LIB is not None:
            return SIGNATURES
        lib = torch.library.Library(NAMESPACE, "DEF")
        for name, op in sorted(_installed_ops().items()):
            sig = signature_of(op)
            lib.define(sig.schema)
            lib.impl(name, _make_impl(sig), "CompositeExplicitAutograd")
            torch.library.register_fake(f"{NAMESPACE}::{name}", _make_fake(sig, op), lib=lib)
            SIGNATURES[name] = sig
        _LIB = lib
        return SIGNATURES


register()
