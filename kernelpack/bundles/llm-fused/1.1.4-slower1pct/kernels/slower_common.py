"""llm-fused 1.1.4-slower1pct: every op is the stable op, each of whose kernel launches takes about 1% longer on a GPU.

Not a fault: a candidate slightly slower everywhere (issue 25: "a 1%-slower-everywhere one promoted", inside
the 2% margin), numerically identical to stable. :func:`slowed` takes a stable op module (bundled as
``stable_<op>``) and makes each Triton kernel defined there launch as a wrapper kernel, generated from the
kernel's own signature, that runs the stable kernel's body unchanged (called as a device function: the same
program ids, grid and launch count). On a GPU the launch's first program writes the global timer at its start
to a per-device scratch word, and the launch's last program, after its body, waits 1% of the time since then
(counted in its SM's cycles at ``CYCLES_PER_NS``, so a coarse global timer cannot round a short wait up to a
whole tick). The last program is dispatched last, so the launch was meant to end about 1% later; on an H200 it
measured +4-12% at decode sizes (``scripts/gpu-cells``, docs/gpu.md run Z).

Why per launch: 1.1.3 made *every program* wait 1% of its own time, and 1.1.2 made every program read 1% more
bytes; on an H200 both changed a call by -14% to +14% depending on the cell (``scripts/gpu-cells``, docs/gpu.md
runs V-Y), while the same wrapper without the wait measured identical to stable. Under the Triton interpreter
(no GPU timer) the wrapper only runs the stable body: same bits, same launches, no slowdown. The wrapper is
compiled where it runs (no AOT).
"""

from __future__ import annotations

import dataclasses
import inspect
import linecache
import os
import threading
from types import ModuleType
from typing import Any

import torch
import triton
import triton.language as tl

SLOW_PERCENT = 1
"""How much longer each program runs, in percent of its own time."""
WRAPPED: list[str] = []
"""Names of the kernels launched through a wrapper so far (tests read it)."""


CYCLES_PER_NS = 1.7
"""SM cycles per nanosecond the wait assumes (H100/H200 clocks under load: 1.6-1.98 GHz, so the wait is
0.85-1.15% of the launch's time)."""


@triton.jit
def _ns():
    """The GPU's global nanosecond timer (``%globaltimer``): comparable between SMs."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _cycles():
    """This SM's cycle counter (``%clock64``)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _linear_pid():
    return tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))


@triton.jit
def _last_pid():
    return tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2) - 1


@triton.jit
def note_start(start_ptr, t0):
    """The launch's first program records when the launch started."""
    if _linear_pid() == 0:
        tl.store(start_ptr, t0)


@triton.jit
def wait_share(start_ptr, t0, PERCENT: tl.constexpr, MILLI_CYCLES_PER_NS: tl.constexpr):
    """The launch's last program waits ``PERCENT`` % of the time since the launch started (``t0``: its own
    start, used when the first program's note is not there yet or is an earlier launch's)."""
    if _linear_pid() == _last_pid():
        t1 = _ns()
        own = t1 - t0
        launch = t1 - tl.load(start_ptr, volatile=True)
        launch = tl.where((launch >= own) & (launch <= 64 * own + 100_000), launch, own)
        wait = launch * PERCENT * MILLI_CYCLES_PER_NS // 100_000
        c = _cycles()
        end = c + wait
        while c < end:
            c = _cycles()


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _wrapper_source(kernel: Any, name: str, *, timed: bool) -> str:
    params = inspect.signature(kernel.fn).parameters.values()  # compiled and interpreted kernels alike
    sig = ", ".join(f"{p.name}: tl.constexpr" if "constexpr" in str(p.annotation) else p.name for p in params)
    call = ", ".join(f"{p.name}={p.name}" for p in params)
    if not timed:
        return f"def {name}({sig}):\n    _stable_kernel({call})\n"
    return (f"def {name}({sig}, _slow_start, SLOW_PERCENT: tl.constexpr, MILLI_CYCLES_PER_NS: tl.constexpr):\n"
            f"    _t0 = _ns()\n"
            f"    note_start(_slow_start, _t0)\n"
            f"    _stable_kernel({call})\n"
            f"    wait_share(_slow_start, _t0, SLOW_PERCENT, MILLI_CYCLES_PER_NS)\n")


def _make_wrapper(kernel: Any, *, timed: bool) -> Any:
    name = f"{kernel.fn.__name__}_slower1pct"
    src = _wrapper_source(kernel, name, timed=timed)
    filename = f"<llm-fused-1.1.4-slower1pct:{name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # Triton reads the source
    scope: dict[str, Any] = {"tl": tl, "_ns": _ns, "note_start": note_start, "wait_share": wait_share,
                             "_stable_kernel": kernel}
    exec(compile(src, filename, "exec"), scope)
    return triton.jit(scope[name])


_SCRATCH: dict[torch.device, torch.Tensor] = {}
_SCRATCH_LOCK = threading.Lock()


def _scratch(args: tuple, kwargs: dict) -> torch.Tensor:
    """One int64 word per device for the launch's start time (on the device of the launch's first tensor)."""
    dev = next(a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
    with _SCRATCH_LOCK:
        if dev not in _SCRATCH:
            _SCRATCH[dev] = torch.zeros(1, dtype=torch.int64, device=dev)
        return _SCRATCH[dev]


def _slow_class(base: type) -> type:
    """A subclass of the kernel's class whose ``kernel[grid](...)`` launches the wrapper instead."""

    class Slowed(base):  # type: ignore[misc, valid-type]
        def __getitem__(self, grid: Any) -> Any:
            timed = not interpreted()
            key = f"_slower_wrapper_{'timed' if timed else 'interpreted'}"
            wrapper = self.__dict__.get(key)
            if wrapper is None:
                wrapper = self.__dict__[key] = _make_wrapper(self, timed=timed)

            def launch(*args: Any, **kwargs: Any) -> Any:
                WRAPPED.append(self.fn.__name__)
                extra = {"_slow_start": _scratch(args, kwargs), "SLOW_PERCENT": SLOW_PERCENT,
                         "MILLI_CYCLES_PER_NS": round(1000 * CYCLES_PER_NS)} if timed else {}
                return wrapper[grid](*args, **extra, **kwargs)

            return launch

    Slowed.__name__ = f"Slowed{base.__name__}"
    return Slowed


def slowed(op: Any, *modules: ModuleType) -> Any:
    """``op`` (unchanged object identity of its functions) with every Triton kernel defined in ``modules``
    launching through its wrapper; returns a copy of the op tagged in its ``name`` only."""
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, triton.runtime.jit.KernelInterface) and value.fn.__module__ == module.__name__ \
                    and not type(value).__name__.startswith("Slowed"):
                value.__class__ = _slow_class(type(value))
    return dataclasses.replace(op)

