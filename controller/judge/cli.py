"""``kernelctl sim`` Typer sub-app; owns the ``judge`` command (the judge simulator).

The lead mounts ``sim_app`` as ``kernelctl sim``; other commands (``sim fleet``) are added elsewhere.
"""

from __future__ import annotations

import json
import math

import typer
from rich.console import Console
from rich.table import Table

sim_app = typer.Typer(help="Simulators: the statistical judge (and the fleet).", no_args_is_help=True)


@sim_app.callback()
def _sim() -> None:
    """Simulators for kernelctl (keeps ``sim`` a command group)."""


def _fmt_rate(x: object) -> str:
    return "-" if x is None else f"{float(x) * 100:.2f}%"  # type: ignore[arg-type]


def _fmt_n(x: object) -> str:
    return "-" if x is None else f"{float(x):g}"  # type: ignore[arg-type]


@sim_app.command("judge")
def judge_cmd(
    runs: int = typer.Option(10_000, "--runs", min=1, help="Simulated canaries per regression size."),
    seed: int = typer.Option(0, "--seed", help="Random seed (report figures on a seed you did not tune on)."),
    regression: str = typer.Option("0.0,0.02,0.05,0.10", "--regression",
                                   help="Comma-separated true slow-downs of the candidate (0.05 = 5%)."),
    nodes: int = typer.Option(10, "--nodes", min=1, help="Canary nodes per run (one report per tick each)."),
    max_samples: int = typer.Option(60, "--max-samples", min=1, help="Ticks (= samples per node) per run."),
    margin_pct: float = typer.Option(2.0, "--margin-pct", min=0.0, help="Allowed slow-down in percent."),
    alpha: float = typer.Option(0.05, "--alpha", min=1e-9, max=0.999, help="Confidence-sequence alpha."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Compare the confidence-sequence judge with a Kayenta-style Mann-Whitney judge on simulated canaries."""
    from controller.judge.sim import SimConfig, parse_regressions, results_rows, simulate  # numpy, scipy

    try:
        regs = parse_regressions(regression)
        cfg = SimConfig(runs=runs, seed=seed, regressions=regs, nodes=nodes, max_samples=max_samples,
                        margin=math.log1p(margin_pct / 100.0), alpha=alpha)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    report = simulate(cfg)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    table = Table(title=f"judge simulation: {runs} runs x {nodes} nodes, <= {max_samples} samples/node, "
                        f"margin +{margin_pct:g}%, seed {seed}")
    for col in ("slow-down", "judge", "rollbacks", "median n", "p90 n", "passes", "pass n"):
        table.add_column(col, justify="right")
    for row in results_rows(report):
        cs = row["confseq"]  # type: ignore[index]
        kind = {"false_rollback": "false", "at_margin": "at margin"}.get(str(row["kind"]), "detect")
        reg = f"{float(row['regression']) * 100:+g}% ({kind})"  # type: ignore[arg-type]
        table.add_row(reg, "CS", _fmt_rate(cs["rollback_rate"]),
                      _fmt_n(cs["median_samples_to_rollback"]), _fmt_n(cs["p90_samples_to_rollback"]),
                      _fmt_rate(cs["pass_rate"]), _fmt_n(cs["median_samples_to_pass"]))
        for key, label in (("mannwhitney", "MW+margin"), ("mannwhitney_no_effect_size", "MW")):
            mw = row[key]  # type: ignore[index]
            table.add_row("", label, _fmt_rate(mw["rollback_rate"]), _fmt_n(mw["median_samples_to_rollback"]),
                          _fmt_n(mw["p90_samples_to_rollback"]), "-", "-", end_section=key != "mannwhitney")
    console = Console()
    console.print(table)
    console.print("rollbacks: share of runs rolled back at any tick (false rollbacks below the margin); "
                  "n: samples per node at the decision; CS = confidence-sequence judge, MW = Kayenta-style "
                  f"Mann-Whitney (with / without the margin as effect size). elapsed {report['elapsed_s']} s wall, "
                  f"{report['cpu_s']} s CPU")
