"""judge_latency: regress / pass / hold, input errors, min_samples and per-node balance."""

import json
import math

import numpy as np
import pytest

from controller.judge import balance_by_node, judge_latency


def _noise(seed: int, n: int, mean: float, sd: float = 0.02) -> list[float]:
    rng = np.random.default_rng(seed)
    return list(mean + sd * rng.standard_t(4, n))


def test_clear_ten_percent_regression_regresses() -> None:
    v = judge_latency(_noise(1, 120, math.log(1.10)))
    assert v.decision == "regress"
    assert v.lower > v.margin and v.n == 120
    assert v.reason.startswith("candidate slower: lower bound +") and "> margin +2.0% over 120 samples" in v.reason


def test_aa_with_few_samples_holds() -> None:
    v = judge_latency(_noise(2, 4, 0.0))
    assert v.decision == "hold" and "too few samples: 4 < min_samples 5" in v.reason
    v = judge_latency(_noise(3, 12, 0.0))
    assert v.decision == "hold" and (v.lower is None or v.lower < v.margin) and (v.upper is None or v.margin < v.upper)


def test_zero_effect_eventually_passes() -> None:
    samples = _noise(4, 400, 0.0)
    decisions = [judge_latency(samples[:n]).decision for n in (10, 400)]
    assert decisions == ["hold", "pass"]
    v = judge_latency(samples)
    assert v.upper < v.margin and "candidate within margin" in v.reason


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_samples_refused(bad: float) -> None:
    with pytest.raises(ValueError, match=r"samples\[2\] is .*must be finite"):
        judge_latency([0.0, 0.01, bad, 0.0, 0.0])


def test_bad_parameters_refused() -> None:
    with pytest.raises(ValueError, match="node_ids has 1 entries but samples has 2"):
        judge_latency([0.0, 0.0], node_ids=["a"])
    with pytest.raises(ValueError, match="margin"):
        judge_latency([0.0], margin=-0.1)
    with pytest.raises(ValueError, match="alpha"):
        judge_latency([0.0], alpha=0.0)
    with pytest.raises(ValueError, match="min_samples"):
        judge_latency([0.0], min_samples=0)
    with pytest.raises(ValueError, match="alpha_pass"):
        judge_latency([0.0], alpha_pass=1.0)
    with pytest.raises(ValueError, match="node_plan covers"):
        from controller.judge.latency import NodePlan
        judge_latency([0.0, 0.0], node_ids=["a", "b"], node_plan=NodePlan.of(["a"]))
    with pytest.raises(ValueError, match="more than twice the margin"):
        judge_latency([0.0], margin=0.05, clip=0.08)
    with pytest.raises(ValueError, match="sequence of numbers"):
        judge_latency(["fast"])  # type: ignore[list-item]


def test_min_samples_honoured() -> None:
    samples = [0.2] * 30  # a +22% regression on every report
    assert judge_latency(samples, min_samples=31).decision == "hold"
    assert judge_latency(samples, min_samples=30).decision == "regress"
    assert judge_latency([], min_samples=1).decision == "hold"


def test_clipped_outliers_counted() -> None:
    samples = [*_noise(5, 200, 0.0), 1.5, -2.0]
    v = judge_latency(samples)
    assert v.clipped >= 2 and "winsorised" in v.reason
    assert v.decision != "regress"


def test_noisy_neighbour_capped_online() -> None:
    # node "a" floods 10 reports per tick claiming +10%; five quiet nodes report one each per tick at 0%
    samples, nodes = [], []
    for _ in range(8):
        samples += [0.1] * 10 + [0.0] * 5
        nodes += ["a"] * 10 + list("bcdef")
    keep = balance_by_node(nodes, 0.2)
    kept_a = int(keep[np.array(nodes) == "a"].sum())
    assert kept_a <= 0.2 * keep.sum() + 1 and kept_a < 15
    # online: a longer history never changes which earlier samples were used (nested in time)
    np.testing.assert_array_equal(balance_by_node(nodes[:50], 0.2), keep[:50])
    v = judge_latency(samples, node_ids=nodes)
    assert v.dropped == 80 - kept_a and v.nodes == 6 and "per-node balance" in v.reason
    assert judge_latency(samples).mean > v.mean  # type: ignore[operator]


def test_single_node_not_capped_and_evidence_is_json() -> None:
    v = judge_latency(_noise(6, 40, 0.0), node_ids=["n1"] * 40)
    assert v.dropped == 0 and v.n == 40
    json.dumps(v.as_dict(), allow_nan=False)


def test_evidence_kept_when_the_canary_widens() -> None:
    # 40 ticks on one node, then the step widens to three: the first node's history stays in the sequence
    rng = np.random.default_rng(9)
    samples = list(0.0 + 0.01 * rng.standard_normal(40))
    nodes = ["n1"] * 40
    for _ in range(10):
        samples += list(0.01 * rng.standard_normal(3))
        nodes += ["n1", "n2", "n3"]
    v = judge_latency(samples, node_ids=nodes)
    assert v.dropped == 0 and v.n == 70 and v.nodes == 3 and v.decision == "pass"


def test_one_node_five_percent_detected_quickly() -> None:
    # the plan's first step: one canary node, +5%, report sd 1%: rolled back within 20 samples
    rng = np.random.default_rng(4)
    samples = list(math.log(1.05) + 0.01 * rng.standard_normal(20))
    first = next(n for n in range(5, 21) if judge_latency(samples[:n], node_ids=["a"] * n).decision == "regress")
    assert first <= 15
