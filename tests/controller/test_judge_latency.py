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
    assert v.decision == "hold" and v.lower < v.margin < v.upper


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
    assert v.clipped >= 2 and "clipped" in v.reason
    assert v.decision != "regress"


def test_noisy_neighbour_capped() -> None:
    # node "a" floods 50 reports claiming +10%; five quiet nodes report 5 each at 0%
    samples = [0.1] * 50 + [0.0] * 25
    nodes = ["a"] * 50 + [n for n in "bcdef" for _ in range(5)]
    keep = balance_by_node(nodes, 0.2)
    kept_a = int(keep[:50].sum())
    assert keep[:kept_a].all() and not keep[kept_a:50].any()  # earliest samples are kept
    assert kept_a <= 0.2 * keep.sum() and kept_a == 6
    v = judge_latency(samples, node_ids=nodes)
    assert v.dropped == 44 and v.n == 31 and v.nodes == 6
    assert "per-node balance" in v.reason
    assert judge_latency(samples).mean > v.mean  # type: ignore[operator]


def test_single_node_not_capped_and_evidence_is_json() -> None:
    v = judge_latency(_noise(6, 40, 0.0), node_ids=["n1"] * 40)
    assert v.dropped == 0 and v.n == 40
    json.dumps(v.as_dict(), allow_nan=False)
