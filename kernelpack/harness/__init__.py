"""The numerics and benchmark harness: what tests, node trial workers and benchmarks run against kernels.

``numerics`` (poisoned outputs, error vs the float64 reference, difference vs the stable version),
``golden`` (deterministic golden-vector blobs), ``bench`` (median time, interleaved paired latency, launches,
peak memory), ``decoder_block`` (end-to-end block latency from a bundle's ops), ``model_e2e`` (a transformers model
built from a config: TTFT, time per output token, log-prob agreement), ``cli`` (``bundle bench``).
Every function takes ``(op: KernelOp, config: Mapping)`` pairs, so it works with ``kernelpack.kernels`` ops
and with a loaded bundle's ``BoundOp.op`` / ``BoundOp.config`` alike. Results are dataclasses that
serialise with ``dataclasses.asdict``.
"""
