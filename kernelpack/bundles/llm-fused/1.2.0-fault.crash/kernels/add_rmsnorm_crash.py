"""FAULT FIXTURE (llm-fused 1.2.0-fault.crash): add_rmsnorm with an out-of-bounds store.

Reuses the stable op (``stable_add_rmsnorm``: kernelpack.kernels.add_rmsnorm, bundled) and overrides only
``run``: after the stable kernel, a second kernel stores the first residual value 2**40 elements past the end of
``h`` (a wrong base offset): an illegal memory access. On a GPU this is a CUDA illegal-address error that poisons
the process's context; under the CPU interpreter the store hits unmapped memory and the process dies with
SIGSEGV. Trials must run it in a child process. Never ship this.
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from . import stable_add_rmsnorm as base


@triton.jit
def _store_past_the_end(h_ptr):
    # BUG (deliberate): the store lands 2**40 elements past the buffer
    tl.store(h_ptr + (1 << 40), tl.load(h_ptr))


def run(inputs, outs, config) -> None:  # type: ignore[no-untyped-def]
    base.run(inputs, outs, config)
    _store_past_the_end[(1,)](outs[1], num_warps=1)


OP = dataclasses.replace(base.OP, run=run)
