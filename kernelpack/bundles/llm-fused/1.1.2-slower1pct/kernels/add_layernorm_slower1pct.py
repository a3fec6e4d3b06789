"""llm-fused 1.1.2-slower1pct: the stable add_layernorm, its kernels reading 1% more bytes (:mod:`slower_common`)."""

from __future__ import annotations

from . import slower_common
from . import stable_add_layernorm as base

OP = slower_common.slowed(base.OP, base)
