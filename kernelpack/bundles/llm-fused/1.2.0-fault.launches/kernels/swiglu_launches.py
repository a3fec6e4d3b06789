"""FAULT FIXTURE (llm-fused 1.2.0-fault.launches): swiglu launches twice at one token.

Reuses the stable op (``stable_swiglu``: kernelpack.kernels.swiglu, bundled) and overrides only ``run``: with
one token (decode batch 1) the stable kernel is launched twice on the same buffers. Same output, about twice
the time in that cell. Never ship this.
"""

from __future__ import annotations

import dataclasses

from . import stable_swiglu as base


def run(inputs, outs, config) -> None:  # type: ignore[no-untyped-def]
    base.run(inputs, outs, config)
    if inputs["gate"].shape[0] == 1:
        base.run(inputs, outs, config)  # BUG (deliberate): a second, redundant launch


OP = dataclasses.replace(base.OP, run=run)
