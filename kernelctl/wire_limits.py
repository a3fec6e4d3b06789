"""What a measurement can physically be, and what the database can hold: the constrained types of the wire.

Every figure an agent reports is refused with 422 (naming the field) when no GPU could have produced it, before
anything is stored: a latency below a nanosecond (``1e-320`` s is a denormal, not a timing), more Triton launches
in one call than a serving step makes, a tensor dimension past what a kernel can index, NaN, infinity or a
negative count. Each bound is one reusable annotated type, so a model that changes shape (the latency report
models of issue 25, say) keeps its bounds by using the type; a wire field that lands in a database column is
bounded by the column too (``INT32_MAX`` for an INTEGER column). No imports beyond pydantic: agents import
this through ``kernelctl.wire``.
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import AfterValidator, Field, StringConstraints

INT32_MAX = 2**31 - 1  # an INTEGER column (PostgreSQL's int4; SQLite's is wider)
INT64_MAX = 2**63 - 1  # a BIGINT column

MIN_LATENCY_S = 1e-9  # one nanosecond: below a GPU clock cycle; no event timer resolves less
MAX_LATENCY_S = 3600.0  # a kernel call or decoder block taking an hour is a hung measurement
MAX_LAUNCHES_PER_CALL = 100_000  # Triton launches of one op call: a whole serving step makes fewer
MAX_TENSOR_DIM = INT32_MAX  # a tensor dimension a kernel indexes (int32 offsets)
MAX_SHAPE_DIMS = 16
MAX_ELEMENTS = 2**48  # elements of one checked tensor: more than any device memory holds
MAX_TRIAL_SECONDS = 7 * 86400.0  # one trial's wall time


def finite(v: float) -> float:
    if not math.isfinite(v):
        raise ValueError("must be a finite number (NaN and infinity are refused)")
    return v


Finite = Annotated[float, AfterValidator(finite)]
NonNegFinite = Annotated[float, AfterValidator(finite), Field(ge=0)]
# A kernel (or decoder block) latency in seconds: at least a nanosecond and below an hour.
LatencySeconds = Annotated[float, AfterValidator(finite), Field(ge=MIN_LATENCY_S, lt=MAX_LATENCY_S)]
TrialSeconds = Annotated[float, AfterValidator(finite), Field(ge=0, le=MAX_TRIAL_SECONDS)]
LaunchCount = Annotated[int, Field(ge=0, le=MAX_LAUNCHES_PER_CALL)]
TensorDim = Annotated[int, Field(ge=0, le=MAX_TENSOR_DIM)]
ElementCount = Annotated[int, Field(ge=0, le=MAX_ELEMENTS)]
OpName = Annotated[str, StringConstraints(max_length=64)]
DimName = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[ -~]+$")]
# A numerics check's shape: named dimensions (``{"tokens": 128, "hidden": 4096}``), each a real dimension.
Shape = Annotated[dict[DimName, TensorDim], Field(max_length=MAX_SHAPE_DIMS)]
# Triton launches per call of each op.
LaunchesPerCall = Annotated[dict[OpName, LaunchCount], Field(max_length=256)]
Int32 = Annotated[int, Field(ge=0, le=INT32_MAX)]  # a count stored in an INTEGER column
