"""judge_family: multiplicity, deciding metric, pass rule, and the simulator drives the same decisions."""

import math

import numpy as np
import pytest

from controller.judge.confseq import margin_test
from controller.judge.family import MetricSeries, judge_family, metric_params, split_alpha
from sim.judge.noise import NOISE_CLASSES, FamilyNoise
from sim.judge.sim import cell_effects, family_series, judge_codes, metric_layout, traffic_weights

MARGIN = math.log(1.02)


def test_split_alpha_sums_to_alpha_and_favours_advance_metrics() -> None:
    kinds = {f"c{i}": False for i in range(45)} | {"aggregate": True, "e2e": True}
    a = split_alpha(kinds, 0.05)
    assert sum(a.values()) == pytest.approx(0.05)
    assert a["aggregate"] == pytest.approx(0.0125) and a["c0"] == pytest.approx(0.025 / 45)
    assert split_alpha({"x": True, "y": True}, 0.05) == {"x": 0.025, "y": 0.025}


def test_family_false_rollback_rate_bounded_with_every_metric_at_the_margin() -> None:
    # worst case: all 47 metrics sit exactly at their margin, independent skewed noise, 100 looks each.
    rng = np.random.default_rng(3)
    runs, n, alpha = 400, 100, 0.2
    layout = metric_layout(45, MARGIN)
    alphas = split_alpha({k: m.advance for k, m in layout.items()}, alpha)
    corrected = np.zeros(runs, dtype=bool)
    uncorrected = np.zeros(runs, dtype=bool)
    for name, m in layout.items():
        res, clip = metric_params(m)
        x = MARGIN + rng.exponential(0.01, (runs, n)) - 0.01
        w = margin_test(x, side="regress", margin=MARGIN, resolution=res, far=clip)[:, -1]
        corrected |= w >= math.log(1 / alphas[name])
        uncorrected |= w >= math.log(1 / alpha)
    assert corrected.mean() <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs)
    assert uncorrected.mean() > corrected.mean()  # the correction is doing work


def _metrics(rng: np.random.Generator, n: int, cell_shift: float, agg: float) -> dict[str, MetricSeries]:
    nodes = [f"n{i % 3}" for i in range(n)]
    out = {f"cell{c}": MetricSeries(list(rng.normal(0.0, 0.01, n)), nodes, MARGIN) for c in range(5)}
    out["cell5"] = MetricSeries(list(rng.normal(cell_shift, 0.01, n)), nodes, MARGIN)
    out["aggregate"] = MetricSeries(list(rng.normal(agg, 0.003, n)), nodes, MARGIN, advance=True)
    return out


def test_one_cell_twice_as_slow_rolls_back_naming_the_cell() -> None:
    v = judge_family(_metrics(np.random.default_rng(1), 12, math.log(2.0), 0.0), alpha=0.05, min_samples=5)
    assert v.decision == "regress" and v.deciding == "cell5"
    assert v.metrics["cell5"].lower > MARGIN and v.metrics["aggregate"].decision == "pass"
    d = v.as_dict()
    assert d["alphas"]["aggregate"] == pytest.approx(0.025) and d["metrics"]["cell5"]["decision"] == "regress"


def test_pass_needs_every_advance_metric_and_hold_names_the_waiting_one() -> None:
    m = _metrics(np.random.default_rng(2), 30, 0.0, 0.0)
    assert judge_family(m, alpha=0.05, min_samples=5).decision == "pass"
    m["e2e"] = MetricSeries([0.02] * 30, m["aggregate"].node_ids, MARGIN, advance=True)  # sits at the margin
    v = judge_family(m, alpha=0.05, min_samples=5)
    assert v.decision == "hold" and v.deciding == "e2e"
    only_cells = {k: s for k, s in m.items() if not s.advance}
    assert judge_family(only_cells, alpha=0.05, min_samples=5).decision == "hold"


def test_bad_metric_named() -> None:
    m = {"cell0": MetricSeries([0.0, math.nan], ["a", "b"], MARGIN)}
    with pytest.raises(ValueError, match=r"metric 'cell0': samples\[1\]"):
        judge_family(m, alpha=0.05, min_samples=1)
    with pytest.raises(ValueError, match="at least one metric"):
        judge_family({}, alpha=0.05, min_samples=1)


@pytest.mark.parametrize(("noise", "scenario"), [("contention", "plus5"), ("autocorrelated", "cell2x")])
def test_simulator_decisions_equal_judge_family_tick_by_tick(noise: str, scenario: str) -> None:
    cells, nodes, ticks, runs = 6, 3, 8, 2
    weights = traffic_weights(cells)
    fam = FamilyNoise(NOISE_CLASSES[noise], cells, seed=1, pool=4096)
    rep = fam.draw(np.random.default_rng(4), runs=runs, ticks=ticks, nodes=nodes,
                   cell_effect=cell_effects(scenario, cells), weights=weights)
    series = family_series(rep.cells, rep.e2e, weights)
    layout = metric_layout(cells, MARGIN)
    first_reg, first_pass = judge_codes(series, nodes, layout, 0.05, 5)
    ids = [f"node{i % nodes}" for i in range(ticks * nodes)]
    for r in range(runs):
        got_reg, got_pass = -1, -1
        for t in range(ticks):
            n = (t + 1) * nodes
            fam_in = {name: MetricSeries(list(series[r, j, :n].astype(float)), ids[:n], m.margin, m.advance)
                      for j, (name, m) in enumerate(layout.items())}
            d = judge_family(fam_in, alpha=0.05, min_samples=5).decision
            if d == "regress" and got_reg < 0:
                got_reg = t
            if d == "pass" and got_pass < 0 and got_reg < 0:
                got_pass = t
        assert got_reg == (first_reg[r] if first_reg[r] < ticks else -1)
        assert got_pass == (first_pass[r] if first_pass[r] < ticks else -1)
