"""kernelctl.vocab: the stratum key round-trips and refuses what is not one; the state sets are consistent."""

from __future__ import annotations

import pytest

from kernelctl import vocab


@pytest.mark.parametrize(("arch", "driver", "triton", "key"), [
    ("sm_90", "550.54.15", "3.6.0", "sm_90/drv550/triton3.6.0"),
    ("sm_80", " 535.183.01 ", "3.6.0", "sm_80/drv535/triton3.6.0"),
    ("cpu", "unknown", "3.6.0", "cpu/drvunknown/triton3.6.0"),
])
def test_stratum_key_round_trips(arch: str, driver: str, triton: str, key: str) -> None:
    assert vocab.stratum_key(arch, driver, triton) == key
    assert vocab.parse_stratum(key) == vocab.Stratum(arch, key.split("/drv")[1].split("/")[0], triton)


@pytest.mark.parametrize("bad", ["", "sm_90", "sm_90/drv550", "sm_90/triton3.6.0", "/drv550/triton3.6.0",
                                 "sm_90/drv/triton3.6.0", "sm_90/drv550/triton"])
def test_parse_stratum_refuses_other_text(bad: str) -> None:
    with pytest.raises(ValueError, match="is not ARCH/drvMAJOR/tritonVERSION"):
        vocab.parse_stratum(bad)


def test_state_sets() -> None:
    assert set(vocab.TERMINAL_STATES) | set(vocab.ACTIVE_STATES) == set(vocab.ROLLOUT_STATES)
    assert not set(vocab.TERMINAL_STATES) & set(vocab.ACTIVE_STATES)
    assert vocab.CANARY_PHASES == ("staged", "verified", "serving")
    assert vocab.DTYPES == ("fp16", "bf16", "fp32") and "ok" in vocab.OUTCOMES
