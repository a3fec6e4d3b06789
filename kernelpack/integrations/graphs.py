"""Captured graphs that follow the agent's version switches: re-capture when what the runtime serves changes.

A CUDA graph (or a CUDA-graph-backed ``torch.compile`` mode such as ``reduce-overhead``) records the Triton
launches of the version active when it was captured and never enters ``torch.ops.kernelctl.*`` bodies again.
These wrappers check the runtime before every call (:meth:`kernelpack.runtime.Runtime.poll`: one ``stat`` of
``active.json``) and compare :meth:`~kernelpack.runtime.Runtime.served_key`:

* :class:`SwitchingGraph` keeps one CUDA graph per served key and input shapes (at most ``keep``), so the
  first call after a switch captures the new version and a rollback to a key captured before replays it at once.
  Without CUDA (the CPU / eager path) it calls the step eagerly: each op resolves the active version per call.
* :func:`follow_switches` wraps a ``torch.compile``d callable and runs ``torch._dynamo.reset()`` (which drops
  compiled graphs and their CUDA graph trees) before the first call under a new key, so that call recompiles.

Switch latency: the first step that *starts* after the agent's atomic rename of ``active.json`` runs the new
version (eager path: the first op call after it). That step also pays the warm-up and capture (or the
recompile); a step already running finishes on the version it started with.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kernelpack import torch_ops
from kernelpack.runtime import Runtime

log = logging.getLogger("kernelpack.integrations.graphs")

Key = tuple[Any, ...]


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    static_in: tuple[torch.Tensor, ...]
    static_out: Any


@dataclass
class SwitchingGraph:
    """``step(*tensors)`` replayed from a CUDA graph of the served version; re-captured after a switch."""

    fn: Callable[..., Any]
    runtime: Runtime | None = None
    bundle: str | None = None
    keep: int = 2
    warmup: int = 2
    key_fn: Callable[[], Any] | None = None  # what a capture is valid for (default: the runtime's served key)
    captures: int = 0
    last_key: Key | None = None
    _graphs: OrderedDict[Key, _Captured] = field(default_factory=OrderedDict)

    def _rt(self) -> Runtime:
        return self.runtime or torch_ops.runtime()

    def key(self) -> Any:
        if self.key_fn is not None:
            return self.key_fn()
        rt = self._rt()
        rt.poll()
        return rt.served_key(self.bundle or torch_ops.bundle())

    def __call__(self, *args: torch.Tensor) -> Any:
        served = self.key()
        if not args or args[0].device.type != "cuda":
            self.last_key = (served,)
            return self.fn(*args)
        key = (served, tuple((tuple(a.shape), a.dtype) for a in args))
        cap = self._graphs.get(key)
        if cap is None:
            cap = self._capture(key, args)
        else:
            self._graphs.move_to_end(key)
        for dst, src in zip(cap.static_in, args, strict=True):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        cap.graph.replay()
        self.last_key = key
        return cap.static_out

    def _capture(self, key: Key, args: Sequence[torch.Tensor]) -> _Captured:
        while len(self._graphs) >= self.keep:
            self._graphs.popitem(last=False)
        static_in = tuple(a.clone() for a in args)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compiles/loads the new version's kernels outside capture
            for _ in range(self.warmup):
                self.fn(*static_in)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self.fn(*static_in)
        self.captures += 1
        log.info("captured a CUDA graph for served key %s (%d captures)", key[0], self.captures)
        cap = _Captured(graph, static_in, static_out)
        self._graphs[key] = cap
        return cap

    def reset(self) -> None:
        self._graphs.clear()


def follow_switches(fn: Callable[..., Any], runtime: Runtime | None = None, bundle: str | None = None,
                    reset: Callable[[], None] | None = None) -> Callable[..., Any]:
    """Wrap a ``torch.compile``d callable: before the first call under a new served key, ``reset()``
    (default ``torch._dynamo.reset``) so that call recompiles and re-captures with the new version."""
    state: dict[str, Any] = {"key": None}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rt = runtime or torch_ops.runtime()
        rt.poll()
        key = rt.served_key(bundle or torch_ops.bundle())
        if state["key"] is not None and key != state["key"]:
            log.info("served kernels changed (%s -> %s): dropping compiled graphs", state["key"], key)
            (reset or torch._dynamo.reset)()
        state["key"] = key
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper
