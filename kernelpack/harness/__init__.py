"""The numerics and benchmark harness: what tests, node trial workers and benchmarks run against kernels.

``numerics`` (poisoned outputs, error vs the float64 reference, difference vs the stable version),
``golden`` (deterministic golden-vector blobs), ``bench`` (median time, interleaved paired latency, launches,
peak memory), ``decoder_block`` (end-to-end block latency from a bundle's ops), ``cli`` (``bundle bench``).
Every function takes ``(op: KernelOp, config: Mapping)`` pairs, so it works with ``kernelpack.kernels`` ops
and with a loaded bundle's ``BoundOp.op`` / ``BoundOp.config`` alike. Results are dataclasses that
serialise with ``dataclasses.asdict``.
"""

from kernelpack.harness.bench import (
    BenchResult,
    LatencyPair,
    bench_op,
    launches_per_call,
    median_time,
    paired_latency,
    peak_memory_bytes,
)
from kernelpack.harness.decoder_block import (
    DecoderBlockNumerics,
    DecoderBlockResult,
    decoder_block_latency,
    decoder_block_numerics,
)
from kernelpack.harness.golden import GoldenFormatError, check_golden, make_golden
from kernelpack.harness.numerics import HarnessError, NumericResult, all_passed, check_numerics, fuzz_shapes

__all__ = [
    "BenchResult",
    "DecoderBlockNumerics",
    "DecoderBlockResult",
    "GoldenFormatError",
    "HarnessError",
    "LatencyPair",
    "NumericResult",
    "all_passed",
    "bench_op",
    "check_golden",
    "check_numerics",
    "decoder_block_latency",
    "decoder_block_numerics",
    "fuzz_shapes",
    "launches_per_call",
    "make_golden",
    "median_time",
    "paired_latency",
    "peak_memory_bytes",
]
