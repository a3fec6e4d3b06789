"""llm-fused 1.1.5-slower1pct: the stable bias_gelu, each of its launches about 1% longer on a GPU (:mod:`slower_common`)."""

from __future__ import annotations

from . import slower_common
from . import stable_bias_gelu as base

OP = slower_common.slowed(base.OP, base)
