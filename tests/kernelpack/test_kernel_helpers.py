"""The helpers every op module shares (``kernelpack.kernels.spec``) and the fault fixtures written as small
modules over the stable op (issue 15): what they refuse, what a fixture bundle carries."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kernelpack.build import collect_sources
from kernelpack.kernels import spec
from kernelpack.manifest import load_source

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "kernelpack" / "bundles" / "llm-fused"


def test_launch_config_refuses_unknown_keys_and_bad_values() -> None:
    defaults = {"BLOCK": 64, "num_warps": 4, "num_stages": 3}
    assert spec.launch_config("op", defaults, {"BLOCK": 128}) == {"BLOCK": 128, "num_warps": 4, "num_stages": 3}
    assert spec.launch_config("op", defaults, {"num_stages": 5})["num_stages"] == 5  # any positive int
    with pytest.raises(ValueError, match=r"op: unknown launch config key\(s\) \['BLOK'\]"):
        spec.launch_config("op", defaults, {"BLOK": 64})
    with pytest.raises(ValueError, match="op: launch config BLOCK=96 must be a positive int power of 2"):
        spec.launch_config("op", defaults, {"BLOCK": 96})
    with pytest.raises(ValueError, match="num_warps=0 must be a positive int"):
        spec.launch_config("op", defaults, {"num_warps": 0})
    assert spec.launch_config("op", {**defaults, "R": 3}, {}, any_int=("num_stages", "R"))["R"] == 3


def test_launch_config_flags_take_zero_or_one_only() -> None:
    defaults = {"BLOCK": 64, "num_warps": 4, "FAST": 0}
    assert spec.launch_config("op", defaults, {"FAST": 1}, flags=("FAST",))["FAST"] == 1
    assert spec.launch_config("op", defaults, {}, flags=("FAST",))["FAST"] == 0
    for bad in (2, -1, True, "1", 1.0):
        with pytest.raises(ValueError, match=f"op: launch config FAST={bad!r} must be 0 or 1"):
            spec.launch_config("op", defaults, {"FAST": bad}, flags=("FAST",))
    with pytest.raises(ValueError, match="FAST=0 must be a positive int"):  # not a flag: a block size
        spec.launch_config("op", defaults, {})


def test_same_layout_and_check_outputs_name_the_tensors() -> None:
    a, b = torch.zeros(3, 8), torch.zeros(3, 8)
    assert spec.same_layout("op", {"a": a, "b": b}, ("tokens", "hidden")) == {"tokens": 3, "hidden": 8}
    with pytest.raises(spec.DomainError, match=r"op: a must be 2-D \(tokens, hidden\), got shape \(24,\)"):
        spec.same_layout("op", {"a": a.reshape(-1), "b": b}, ("tokens", "hidden"))
    with pytest.raises(spec.DomainError, match=r"op: b shape \(3, 4\) must equal a shape \(3, 8\)"):
        spec.same_layout("op", {"a": a, "b": b[:, :4]}, ("tokens", "hidden"))
    with pytest.raises(spec.DomainError, match=r"op: b .*float16.* must match a"):
        spec.same_layout("op", {"a": a, "b": b.half()}, ("tokens", "hidden"))
    spec.check_outputs("op", (torch.empty(3, 8),), a)
    with pytest.raises(ValueError, match=r"op: output must be a contiguous torch.float32 tensor of shape \(3, 8\)"):
        spec.check_outputs("op", (torch.empty(8, 3).t(),), a)
    with pytest.raises(ValueError, match="op: outputs must be contiguous"):
        spec.check_outputs("op", (torch.empty(3, 8), torch.empty(3, 8, dtype=torch.half)), a)


def test_a_domain_error_names_its_op() -> None:
    """Callers tell which op refused its input from ``DomainError.op``, never from the message text."""
    from kernelpack.kernels.swiglu import OP

    g = torch.zeros(3, 8, dtype=torch.float64)  # float64 is outside every op's domain
    with pytest.raises(spec.DomainError) as info:
        OP({"gate": g, "up": g})
    assert info.value.op == "swiglu"


@pytest.mark.parametrize("fault", ["crash", "drift", "oom", "slow", "edge", "rows", "memory", "launches", "cell",
                                   "race"])
def test_fault_fixtures_are_small_modules_over_the_stable_op(fault: str) -> None:
    """Each fixture imports the stable op and overrides only its faulty part; its bundle carries the stable
    source (and the shared modules that source imports) byte for byte."""
    src = FIXTURES / f"1.2.0-fault.{fault}"
    (module,) = (src / "kernels").glob("*.py")
    tree = ast.parse(module.read_text())
    stable = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1 for a in n.names]
    assert len(stable) == 1 and stable[0].startswith("stable_"), stable
    op = stable[0].removeprefix("stable_")
    assert len(module.read_text().splitlines()) < 90  # not a copy of the op (those were ~190 lines)
    files, deps = collect_sources(src, load_source(src))
    installed = REPO / "kernelpack" / "kernels"
    assert files[f"kernels/{stable[0]}.py"] == (installed / f"{op}.py").read_bytes()
    for shared in ("norm_common", "gelu_common"):  # what the installed ops import, bundled with them
        assert files[f"kernels/{shared}.py"] == (installed / f"{shared}.py").read_bytes()
    assert f"kernels/{stable[0]}.py" in deps[op]
