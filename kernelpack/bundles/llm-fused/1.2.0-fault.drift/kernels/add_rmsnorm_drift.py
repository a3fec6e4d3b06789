"""FAULT FIXTURE (llm-fused 1.2.0-fault.drift): add_rmsnorm with a wrong-count bug on wide rows.

Reuses the stable op (``stable_add_rmsnorm``: kernelpack.kernels.add_rmsnorm, bundled) and overrides only
``run``: for hidden >= 256 the "wide-row path" normalises by a count that misses a tail chunk of hidden // 8, so
the variance is 8/7 too large and every output of a wide row is ~6.5% too small (the stable kernel runs with
its weight scaled by sqrt(count / hidden), which is that bug's output up to eps): far outside the tolerance of
every dtype, on GPUs and under the CPU interpreter alike. Rows with hidden < 256 take the correct path, so
small golden shapes alone do not catch it. Never ship this.
"""

from __future__ import annotations

import dataclasses
import math

from . import stable_add_rmsnorm as base


def run(inputs, outs, config) -> None:  # type: ignore[no-untyped-def]
    n = inputs["x"].shape[-1]
    if n >= 256:  # BUG (deliberate): wide rows normalised by n - n // 8 instead of n
        inputs = {**inputs, "weight": inputs["weight"] * math.sqrt((n - n // 8) / n)}
    base.run(inputs, outs, config)


OP = dataclasses.replace(base.OP, run=run)
