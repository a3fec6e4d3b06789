"""Candidate classes and the ``sim judge`` CLI (small runs)."""

import json

import numpy as np
from typer.testing import CliRunner

from controller.judge.statistic import arm_moments
from sim.judge.cli import sim_app
from sim.judge.noise import CLASSES, NoiseModel, report_calls, simulate_reports


def test_fleet_noise_model_still_there() -> None:
    rng = np.random.default_rng(0)
    reps = simulate_reports(rng, runs=20, ticks=30, nodes=4, log_effect=0.05, model=NoiseModel())
    assert reps.ratio.shape == (20, 30, 4) and abs(np.median(reps.ratio) - 0.05) < 0.01


def _lr(name: str, heavy: bool = False) -> tuple[float, float]:
    st, ca = report_calls(np.random.default_rng(1), CLASSES[name], 2000, 512, 0.01, True, heavy)
    (sm, sp), (cm, cp) = arm_moments(st), arm_moments(ca)
    return float(np.log(cm / sm).mean()), float(np.log(cp / sp).mean())


def test_classes_have_their_property() -> None:
    assert abs(_lr("identical")[0]) < 0.002 and abs(_lr("identical")[1]) < 0.01
    assert _lr("spread")[0] > 0.04 and _lr("tail10")[0] > 0.08
    mean, p99 = _lr("p99")
    assert mean < 0 and p99 > 0.2  # faster on average, the tail 30% slower
    assert 0.04 < _lr("late")[0] < 0.07 and _lr("heavy_cell", heavy=True)[0] > 0.07


def test_cli_small_run_json() -> None:
    res = CliRunner().invoke(sim_app, ["judge", "--classes", "identical,tail10", "--runs", "30", "--nodes", "3",
                                       "--ticks", "25", "--cells", "3", "--calls", "128", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    rows = {r["class"]: r for r in out["rows"]}
    assert set(rows) == {"identical", "tail10"} and {"judge", "ttest", "mannwhitney"} <= set(rows["tail10"])
    assert rows["identical"]["judge"]["false_rollback"] == 0.0 and rows["identical"]["judge"]["promoted"] >= 0.9
    assert rows["tail10"]["judge"]["rolled_back"] == 1.0


def test_cli_table_and_bad_options() -> None:
    res = CliRunner().invoke(sim_app, ["judge", "--classes", "p99", "--runs", "10", "--nodes", "1", "--ticks", "12",
                                       "--cells", "2", "--calls", "64", "--no-baselines"])
    assert res.exit_code == 0 and "sim judge: 10 runs/row" in res.output, res.output
    res = CliRunner().invoke(sim_app, ["judge", "--runs", "5", "--classes", "sunspots"])
    assert res.exit_code == 2 and "unknown class 'sunspots'" in res.output
    res = CliRunner().invoke(sim_app, ["judge", "--runs", "5", "--nodes", "1,many"])
    assert res.exit_code == 2 and "'many' is not a valid int" in res.output


def test_the_deadline_extension_decides_runs_still_open_at_the_deadline() -> None:
    """A run still open at --ticks goes on to ticks x (1 + extension), as the controller's clean hold does: with
    the extension fewer runs stay open (those are then promoted), and none is rolled back."""
    args = ["judge", "--classes", "plus1_ar", "--runs", "60", "--nodes", "1", "--ticks", "12", "--cells", "2",
            "--calls", "64", "--no-baselines", "--json"]
    rows = {}
    for ext in ("0", "2"):
        res = CliRunner().invoke(sim_app, [*args, "--extension", ext])
        assert res.exit_code == 0, res.output
        rows[ext] = json.loads(res.output)["rows"][0]["judge"]
    plain, extended = rows["0"], rows["2"]
    assert plain["undecided"] == plain["undecided_at_deadline"] > 0  # 12 reports of one AR(1) node: often open
    assert extended["undecided_at_deadline"] > extended["undecided"]  # open at 12 ticks, decided by 36
    assert extended["undecided"] < plain["undecided"]
    assert extended["promoted"] > plain["promoted"] and extended["false_rollback"] == 0.0
