"""judge_family: multiplicity, deciding metric, pass rule, and the simulator drives the same decisions."""

import math

import numpy as np
import pytest

from controller.judge.confseq import margin_test
from controller.judge.family import MetricSeries, judge_family, metric_params, split_alpha
from sim.judge.noise import CLASSES
from sim.judge.sim import Generator, SimConfig, judge_codes, metric_layout

MARGIN = math.log(1.02)


def test_split_alpha_sums_to_alpha_and_favours_summary_metrics() -> None:
    kinds = {f"c{i}": False for i in range(45)} | {"aggregate": True, "e2e": True}
    a = split_alpha(kinds, 0.05)
    assert sum(a.values()) == pytest.approx(0.05)
    assert a["aggregate"] == pytest.approx(0.0125) and a["c0"] == pytest.approx(0.025 / 45)
    assert split_alpha({"x": True, "y": True}, 0.05) == {"x": 0.025, "y": 0.025}


def test_family_false_rollback_rate_bounded_with_every_metric_at_the_margin() -> None:
    # worst case: all 20 metrics sit exactly at their margin, independent skewed noise, 100 looks each.
    rng = np.random.default_rng(3)
    runs, n, alpha = 400, 100, 0.2
    layout = metric_layout(8, SimConfig())
    alphas = split_alpha({k: m.summary for k, m in layout.items()}, alpha)
    corrected = np.zeros(runs, dtype=bool)
    uncorrected = np.zeros(runs, dtype=bool)
    for name, m in layout.items():
        res, clip = metric_params(m)
        x = m.margin + rng.exponential(0.01, (runs, n)) - 0.01
        w = margin_test(x, side="regress", margin=m.margin, resolution=res, far=clip)[:, -1]
        corrected |= w >= math.log(1 / alphas[name])
        uncorrected |= w >= math.log(1 / alpha)
    assert corrected.mean() <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs)
    assert uncorrected.mean() > corrected.mean()  # the correction is doing work


def _metrics(rng: np.random.Generator, n: int, cell_shift: float, agg: float) -> dict[str, MetricSeries]:
    nodes = [f"n{i % 3}" for i in range(n)]
    out = {f"cell{c}": MetricSeries(list(rng.normal(0.0, 0.01, n)), nodes, MARGIN) for c in range(5)}
    out["cell5"] = MetricSeries(list(rng.normal(cell_shift, 0.01, n)), nodes, MARGIN)
    out["aggregate"] = MetricSeries(list(rng.normal(agg, 0.003, n)), nodes, MARGIN, summary=True)
    return out


def test_one_cell_twice_as_slow_rolls_back_naming_the_cell() -> None:
    v = judge_family(_metrics(np.random.default_rng(1), 12, math.log(2.0), 0.0), alpha=0.05, min_samples=5)
    assert v.decision == "regress" and v.deciding == "cell5"
    assert v.metrics["cell5"].lower > MARGIN and v.metrics["aggregate"].decision == "pass"
    d = v.as_dict()
    assert d["alphas"]["aggregate"] == pytest.approx(0.025) and d["metrics"]["cell5"]["decision"] == "regress"


def test_pass_needs_every_must_pass_metric_and_hold_names_the_waiting_one() -> None:
    m = _metrics(np.random.default_rng(2), 30, 0.0, 0.0)
    assert judge_family(m, alpha=0.05, min_samples=5).decision == "pass"
    m["e2e"] = MetricSeries([0.02] * 30, m["aggregate"].node_ids, MARGIN, summary=True)  # sits at the margin
    v = judge_family(m, alpha=0.05, min_samples=5)
    assert v.decision == "hold" and v.deciding == "e2e"
    m["cell2"] = MetricSeries([0.019] * 30, m["aggregate"].node_ids, MARGIN)  # a cell too: every cell must pass
    m.pop("e2e")
    assert judge_family(m, alpha=0.05, min_samples=5).deciding == "cell2"


def test_bad_metric_named() -> None:
    m = {"cell0": MetricSeries([0.0, math.nan], ["a", "b"], MARGIN)}
    with pytest.raises(ValueError, match=r"metric 'cell0': samples\[1\]"):
        judge_family(m, alpha=0.05, min_samples=1)
    with pytest.raises(ValueError, match="at least one"):
        judge_family({}, alpha=0.05, min_samples=1)


@pytest.mark.parametrize("cls", ["p99", "plus1_ar"])
def test_simulator_decisions_equal_judge_family_tick_by_tick(cls: str) -> None:
    cfg = SimConfig(runs=2, cells=3, ticks=8, pool=256, calls=64, e2e_calls=16, classes=(cls,))
    nodes = 3
    rep = Generator(CLASSES[cls], cfg).draw(np.random.default_rng(4), cfg.runs, nodes)
    layout = metric_layout(cfg.cells, cfg)
    first_reg, first_pass = judge_codes(rep.series, nodes, layout, 0.05, 5)
    ids = [f"node{i % nodes}" for i in range(cfg.ticks * nodes)]
    for r in range(cfg.runs):
        got_reg, got_pass = -1, -1
        for t in range(cfg.ticks):
            n = (t + 1) * nodes
            fam_in = {name: MetricSeries(list(rep.series[r, j, :n]), ids[:n], m.margin, summary=m.summary)
                      for j, (name, m) in enumerate(layout.items())}
            d = judge_family(fam_in, alpha=0.05, min_samples=5).decision
            if d == "regress" and got_reg < 0:
                got_reg = t
            if d == "pass" and got_pass < 0 and got_reg < 0:
                got_pass = t
        assert got_reg == (first_reg[r] if first_reg[r] < cfg.ticks else -1)
        assert got_pass == (first_pass[r] if first_pass[r] < cfg.ticks else -1)
