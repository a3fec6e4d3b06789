"""Noise model properties and the ``sim judge`` CLI."""

import json

import numpy as np
from typer.testing import CliRunner

from controller.judge.cli import sim_app
from controller.judge.noise import NoiseModel, simulate_reports


def test_noise_model_heavy_tails_autocorrelation_and_effect() -> None:
    rng = np.random.default_rng(0)
    model = NoiseModel(ratio_sd=0.02, ratio_phi=0.8)
    reps = simulate_reports(rng, runs=40, ticks=40, nodes=5, log_effect=0.05, model=model)
    assert reps.ratio.shape == (40, 40, 5)
    assert abs(np.median(reps.ratio) - 0.05) < 0.01

    def lag1(x: np.ndarray) -> float:
        r = x - x.mean(axis=1, keepdims=True)
        return float((r[:, 1:] * r[:, :-1]).sum() / (r * r).sum())

    flat = simulate_reports(rng, runs=40, ticks=40, nodes=5, log_effect=0.05, model=NoiseModel(ratio_sd=0.0))
    assert lag1(reps.ratio) > 0.25 > 0.1 > abs(lag1(flat.ratio))  # AR(1) across consecutive trials of a node
    z = (reps.ratio - reps.ratio.mean()) / reps.ratio.std()
    assert (z**4).mean() > 4.0  # heavier tails than a normal (kurtosis 3)
    assert reps.stable.std() / reps.stable.mean() > 0.05  # per-node baselines differ


def test_cli_json_has_expected_keys() -> None:
    res = CliRunner().invoke(sim_app, ["judge", "--runs", "200", "--seed", "7", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert set(out) == {"config", "results", "elapsed_s", "cpu_s"}
    assert out["config"]["runs"] == 200 and out["config"]["nodes"] == 10
    regs = [row["regression"] for row in out["results"]]
    assert regs == [0.0, 0.02, 0.05, 0.10]
    for row in out["results"]:
        assert set(row) == {"regression", "kind", "confseq", "mannwhitney", "mannwhitney_no_effect_size"}
        assert {"rollback_rate", "median_samples_to_rollback", "p90_samples_to_rollback", "pass_rate",
                "median_samples_to_pass", "inconclusive_rate", "clipped_share"} <= set(row["confseq"])
    aa, big = out["results"][0], out["results"][3]
    assert aa["kind"] == "false_rollback" and aa["confseq"]["rollback_rate"] <= 0.02
    assert big["kind"] == "detection" and big["confseq"]["rollback_rate"] >= 0.95


def test_cli_table_and_bad_regression() -> None:
    res = CliRunner().invoke(sim_app, ["judge", "--runs", "50", "--regression", "0.05", "--max-samples", "20"])
    assert res.exit_code == 0 and "Mann-Whitney" in res.output
    res = CliRunner().invoke(sim_app, ["judge", "--runs", "50", "--regression", "0.0,fast"])
    assert res.exit_code == 2 and "'fast' is not a number" in res.output
