"""Fleet-simulator scenarios: what each one rolls out, how its agents misbehave, and what must come out.

A scenario is data only (the simulator in :mod:`sim.fleet` acts on it): the candidate version,
the true latency effect of the candidate, which strata report numeric errors, whether a share of agents
stops heartbeating mid-rollout, whether the controller is SIGKILLed and restarted mid-rollout, and the
expected final state of every stratum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kernelctl.vocab import stratum_key

# The simulated heterogeneous fleet: (arch, compute capability, driver, GPU name). One stratum each.
FLEET_KINDS: tuple[tuple[str, str, str, str], ...] = (
    ("sm_80", "8.0", "535.183.01", "NVIDIA A100-SXM4-80GB"),
    ("sm_90", "9.0", "550.54.15", "NVIDIA H100 80GB HBM3"),
    ("sm_90", "9.0", "580.65.06", "NVIDIA H100 80GB HBM3"),
)
TRITON_VERSION = "3.6.0"
BREACH_STRATUM = "sm_80/drv535/triton3.6.0"  # the one stratum that reports numeric errors


def stratum_of(kind: tuple[str, str, str, str]) -> str:
    arch, _cc, driver, _gpu = kind
    return stratum_key(arch, driver, TRITON_VERSION)


@dataclass(frozen=True)
class Scenario:
    """One simulated rollout of a candidate over a baseline (``llm-fused@1.0.0``)."""

    name: str
    candidate: str  # version of llm-fused rolled out over 1.0.0
    description: str
    log_effect: float = 0.0  # true ln(candidate/stable) latency effect on every node
    numeric_error_strata: tuple[str, ...] = ()  # nodes of these strata report numeric_error
    stale_share: float = 0.0  # share of agents that stop heartbeating once the rollout runs
    restart_controller: bool = False  # SIGKILL + restart the controller mid-rollout
    expect_rolled_back: tuple[str, ...] = ()  # strata that must end rolled back ("*": all)
    healthy: bool = True  # a rollback of a stratum not in expect_rolled_back is a false rollback

    def expected_state(self, stratum: str) -> str:
        if "*" in self.expect_rolled_back or stratum in self.expect_rolled_back:
            return "rolled_back"
        return "promoted"


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("healthy", "1.1.0", "a clean candidate (no true slow-down): every stratum must be promoted"),
        Scenario("latency-regression", "1.2.0-fault.slow",
                 "candidate 10% slower on every node: the latency gate must roll every stratum back",
                 log_effect=math.log(1.10), expect_rolled_back=("*",), healthy=False),
        Scenario("numeric-breach-one-stratum", "1.2.0-fault.drift",
                 f"numeric_error reports on {BREACH_STRATUM} only: that stratum rolls back, the others promote",
                 numeric_error_strata=(BREACH_STRATUM,), expect_rolled_back=(BREACH_STRATUM,), healthy=False),
        Scenario("stale-agents", "1.1.0",
                 "10% of the agents stop heartbeating once the rollout runs: they turn stale and are excluded; "
                 "the rollout still promotes", stale_share=0.10),
        Scenario("controller-restart", "1.1.0",
                 "the controller is SIGKILLed mid-rollout and restarted: nothing lost, the rollout promotes",
                 restart_controller=True),
    )
}


def get_scenario(name: str) -> Scenario:
    """The scenario called ``name``; ValueError naming the known ones otherwise."""
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}: choose one of {', '.join(SCENARIOS)}") from None
