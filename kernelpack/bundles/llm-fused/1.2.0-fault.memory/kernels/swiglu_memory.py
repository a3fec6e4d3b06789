"""FAULT FIXTURE (llm-fused 1.2.0-fault.memory): swiglu with a 4x staging buffer.

Reuses the stable op (``stable_swiglu``: kernelpack.kernels.swiglu, bundled) and overrides only ``run``: every
call allocates and zero-fills a staging buffer four times the size of its output before the stable kernel
runs. Outputs exact; peak memory about five times the stable version's. Never ship this.
"""

from __future__ import annotations

import dataclasses

import torch

from . import stable_swiglu as base


def run(inputs, outs, config) -> None:  # type: ignore[no-untyped-def]
    staging = torch.zeros(4 * outs[0].numel(), dtype=outs[0].dtype, device=outs[0].device)  # BUG (deliberate)
    base.run(inputs, outs, config)
    del staging


OP = dataclasses.replace(base.OP, run=run)
