"""Kernel bundles (imports only kernelctl): format, signing, build, verification, loader and runtime; the
fused ops in ``kernels``, numerics and benchmarks in ``harness``, bundle sources in ``bundles``."""
