"""Golden vectors: deterministic bytes, verification, corruption and kernel-change detection."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hashlib
import json
import struct
import subprocess
import sys

import pytest

from kernelpack.harness.golden import MAGIC, GoldenFormatError, check_golden, make_golden, read_golden
from tests.kernelpack.test_harness_numerics import make_axpy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_golden_bytes_identical_across_calls_and_processes():
    op = make_axpy()
    a = make_golden(op, "fp16", seed=11)
    b = make_golden(make_axpy(), "fp16", seed=11)
    assert a == b
    assert a != make_golden(op, "fp16", seed=12)
    code = (
        "import hashlib,sys; from tests.kernelpack.test_harness_numerics import make_axpy;"
        "from kernelpack.harness.golden import make_golden;"
        "sys.stdout.write(hashlib.sha256(make_golden(make_axpy(), 'fp16', seed=11)).hexdigest())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert other.stdout.strip() == hashlib.sha256(a).hexdigest()


def test_golden_layout_holds_inputs_and_float64_refs():
    op = make_axpy()
    header, payload = read_golden(make_golden(op, "bf16", seed=1))
    assert header["op"] == "axpy" and header["dtype"] == "bf16"
    assert [c["shape"] for c in header["cases"]] == [dict(s) for s in op.test_shapes]
    case = header["cases"][1]
    assert {e["name"]: e["dtype"] for e in case["inputs"]} == {"x": "bfloat16", "y": "bfloat16"}
    assert case["refs"][0]["dtype"] == "float64" and case["refs"][0]["nbytes"] == 257 * 8
    assert len(payload) == sum(e["nbytes"] for c in header["cases"] for e in c["inputs"] + c["refs"])


def test_check_golden_passes_good_and_catches_changed_kernel():
    blob = make_golden(make_axpy(), "fp32", seed=5)
    good = check_golden(make_axpy(), {"BLOCK": 64}, blob, device=DEVICE)
    assert len(good) == 2 and all(r.passed for r in good)
    changed = check_golden(make_axpy("drift"), {}, blob, device=DEVICE)
    assert not any(r.passed for r in changed) and all(r.n_out_of_tol > 0 for r in changed)
    holes = check_golden(make_axpy("unwritten"), {}, blob, device=DEVICE)
    assert all(r.unwritten == 1 and not r.passed for r in holes)


def test_golden_uses_stored_inputs_not_regenerated_ones():
    blob = make_golden(make_axpy(), "fp32", seed=5)
    op = make_axpy()
    op.make_inputs = lambda *a: pytest.fail("check_golden must not regenerate inputs")
    assert all(r.passed for r in check_golden(op, {}, blob, device=DEVICE))


def test_corrupt_or_foreign_blobs_are_rejected_clearly():
    blob = make_golden(make_axpy(), "fp32", seed=5)
    with pytest.raises(GoldenFormatError, match="bad magic"):
        check_golden(make_axpy(), {}, b"PK\x03\x04" + blob, device=DEVICE)
    with pytest.raises(GoldenFormatError, match="digest mismatch"):
        check_golden(make_axpy(), {}, blob[:-1] + bytes([blob[-1] ^ 1]), device=DEVICE)
    with pytest.raises(GoldenFormatError, match="truncated"):
        read_golden(blob[: len(MAGIC) + 20])
    other = make_axpy()
    other.name = "bias_gelu"
    with pytest.raises(GoldenFormatError, match="for op 'axpy', not 'bias_gelu'"):
        check_golden(other, {}, blob, device=DEVICE)
    (hlen,) = struct.unpack("<Q", blob[len(MAGIC) : len(MAGIC) + 8])
    header = json.loads(blob[len(MAGIC) + 8 : len(MAGIC) + 8 + hlen])
    header["format"] = 99
    h = json.dumps(header).encode()
    with pytest.raises(GoldenFormatError, match="unsupported golden format 99"):
        read_golden(MAGIC + struct.pack("<Q", len(h)) + h + blob[len(MAGIC) + 8 + hlen :])


def test_real_op_bias_gelu_golden_roundtrip():
    from kernelpack.kernels.bias_gelu import OP

    blob = make_golden(OP, "fp16", seed=3)
    assert blob == make_golden(OP, "fp16", seed=3)
    res = check_golden(OP, {"BLOCK_N": 64}, blob, device=DEVICE)
    assert len(res) == len(OP.test_shapes) and all(r.passed for r in res)
    assert read_golden(blob)[0]["format"] == 1  # an op without run-time parameters: the format as before


def test_run_time_parameters_are_stored_per_case_and_bind_the_kernel():
    """add_rmsnorm's eps: consecutive seeds take each sample (1e-6, 1e-5), the blob (format 2) stores it per
    case, and a kernel that ignores the eps it is given fails the case with eps 1e-5 (rows near eps in size)."""
    import dataclasses

    from kernelpack.kernels.add_rmsnorm import OP

    blob = make_golden(OP, "fp32", seed=0)
    header, _ = read_golden(blob)
    assert header["format"] == 2
    assert [c["params"] for c in header["cases"]] == [{"eps": 1e-6}, {"eps": 1e-5}]
    assert all(e["name"] != "eps" for c in header["cases"] for e in c["inputs"])
    assert all(r.passed for r in check_golden(OP, None, blob, device=DEVICE))

    def ignores_eps(inputs, outs, config):
        OP.run({k: v for k, v in inputs.items() if k != "eps"}, outs, config)

    res = check_golden(dataclasses.replace(OP, run=ignores_eps), None, blob, device=DEVICE)
    assert [r.passed for r in res] == [True, True, False, True]  # (case, output): y of the eps 1e-5 case
