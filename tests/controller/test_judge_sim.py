"""Noise classes and the ``sim judge`` CLI (small runs)."""

import json

import numpy as np
from typer.testing import CliRunner

from sim.judge.cli import sim_app
from sim.judge.noise import NOISE_CLASSES, FamilyNoise, NoiseModel, _timing_noise, simulate_reports
from sim.judge.sim import cell_effects, traffic_weights


def test_legacy_noise_model_used_by_the_fleet_simulator() -> None:
    rng = np.random.default_rng(0)
    reps = simulate_reports(rng, runs=20, ticks=30, nodes=4, log_effect=0.05, model=NoiseModel())
    assert reps.ratio.shape == (20, 30, 4) and abs(np.median(reps.ratio) - 0.05) < 0.01


def _draw(name: str, scenario: str = "identical", nodes: int = 3) -> np.ndarray:
    fam = FamilyNoise(NOISE_CLASSES[name], 9, seed=0, pool=4096)
    rep = fam.draw(np.random.default_rng(1), runs=60, ticks=40, nodes=nodes, cell_effect=cell_effects(scenario, 9),
                   weights=traffic_weights(9))
    assert rep.cells.shape == (60, 40, nodes, 9) and rep.e2e.shape == (60, 40, nodes)
    return rep.cells


def _lag1(x: np.ndarray) -> float:
    r = x - x.mean(axis=1, keepdims=True)
    return float((r[:, 1:] * r[:, :-1]).sum() / (r * r).sum())


def test_noise_classes_have_their_property() -> None:
    iid, ar = _draw("iid").mean(-1), _draw("autocorrelated").mean(-1)
    assert abs(_lag1(iid)) < 0.1 < 0.25 < _lag1(ar)
    offset = _draw("offset")
    assert offset[:, :, 0].mean() - offset[:, :, 1:].mean() > 0.003
    rng = np.random.default_rng(2)
    raw_heavy = _timing_noise(rng, (100_000,), 0.02, NOISE_CLASSES["heavy"])
    raw_iid = _timing_noise(rng, (100_000,), 0.02, NOISE_CLASSES["iid"])
    assert np.percentile(raw_heavy, 99) > 3 * np.percentile(raw_iid, 99)  # the raw timings are heavy-tailed
    assert _draw("heavy").std() < 1.5 * _draw("iid").std()  # ... which the per-report statistic tames
    drift = _draw("drift").mean(-1)
    assert np.abs(drift[:, -5:].mean(1) - drift[:, :5].mean(1)).mean() > 0.002
    assert abs(np.median(_draw("iid", "plus5")) - np.log(1.05)) < 0.005
    two_x = _draw("iid", "cell2x")
    assert abs(np.median(two_x[..., -1]) - np.log(2.0)) < 0.01 and abs(np.median(two_x[..., 0])) < 0.005


def test_cli_small_run_json() -> None:
    res = CliRunner().invoke(sim_app, ["judge", "--noise", "contention", "--runs", "40", "--nodes", "1,3",
                                       "--scenario", "identical,plus5", "--ticks", "30", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert set(out) == {"config", "rows", "elapsed_s", "cpu_s"} and out["config"]["noise"]["name"] == "contention"
    rows = {(r["nodes"], r["scenario"]): r for r in out["rows"]}
    assert set(rows) == {(1, "identical"), (3, "identical"), (1, "plus5"), (3, "plus5")}
    for r in out["rows"]:
        assert {"judge", "ttest", "mannwhitney"} <= set(r)
    assert rows[(3, "identical")]["judge"]["false_rollback_rate"] == 0.0
    assert rows[(3, "plus5")]["judge"]["rollback_rate"] >= 0.9
    assert rows[(3, "identical")]["judge"]["undecided_rate"] <= 0.05


def test_cli_table_and_bad_options() -> None:
    res = CliRunner().invoke(sim_app, ["judge", "--runs", "20", "--nodes", "1", "--scenario", "cell2x",
                                       "--ticks", "12", "--no-baselines"])
    assert res.exit_code == 0 and "sim judge --noise iid" in res.output, res.output
    res = CliRunner().invoke(sim_app, ["judge", "--runs", "5", "--noise", "sunspots"])
    assert res.exit_code == 2 and "unknown noise class 'sunspots'" in res.output
    res = CliRunner().invoke(sim_app, ["judge", "--runs", "5", "--nodes", "1,many"])
    assert res.exit_code == 2 and "'many' is not a valid int" in res.output
