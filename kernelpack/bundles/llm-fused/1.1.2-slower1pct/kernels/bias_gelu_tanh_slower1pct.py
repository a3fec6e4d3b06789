"""llm-fused 1.1.2-slower1pct: the stable bias_gelu_tanh, its kernels reading 1% more bytes (:mod:`slower_common`)."""

from __future__ import annotations

from . import slower_common
from . import stable_bias_gelu_tanh as base

OP = slower_common.slowed(base.OP, base)
