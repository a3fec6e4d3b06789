"""llm-fused 1.1.5-slower0pct: the stable fp8_quant, launched through 1.1.5-slower1pct's wrapper with no wait (:mod:`slower_common`)."""

from __future__ import annotations

from . import slower_common
from . import stable_fp8_quant as base

OP = slower_common.slowed(base.OP, base)
