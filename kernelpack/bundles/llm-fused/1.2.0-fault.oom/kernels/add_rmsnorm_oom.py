"""FAULT FIXTURE (llm-fused 1.2.0-fault.oom): add_rmsnorm that allocates a huge workspace at large batch.

Reuses the stable op (``stable_add_rmsnorm``: kernelpack.kernels.add_rmsnorm, bundled) and overrides only
``run``: from 64 tokens on, it allocates a "split-reduction workspace" of ``tokens * 4 GiB`` with
``torch.empty`` on the input's device before launching: 256 GiB at 64 tokens, more than any GPU has, so the
CUDA caching allocator raises OutOfMemoryError; on CPU the trial process's memory limit makes it a real
allocation failure. Below 64 tokens it is the stable kernel. Never ship this.
"""

from __future__ import annotations

import dataclasses

import torch

from . import stable_add_rmsnorm as base

OOM_TOKENS = 64
WORKSPACE_BYTES_PER_TOKEN = 4 << 30


def run(inputs, outs, config) -> None:  # type: ignore[no-untyped-def]
    x = inputs["x"]
    if x.shape[0] >= OOM_TOKENS:
        # BUG (deliberate): a per-token 4 GiB workspace; the allocation itself fails
        workspace = torch.empty(x.shape[0] * WORKSPACE_BYTES_PER_TOKEN, dtype=torch.uint8, device=x.device)
        del workspace
    base.run(inputs, outs, config)


OP = dataclasses.replace(base.OP, run=run)
