"""``kernelctl sim`` Typer sub-app; owns the ``judge`` command (the judge simulator).

cli/app.py mounts ``sim_app`` as ``kernelctl sim`` and adds ``sim fleet`` (sim/fleet) to it.
Exit codes: 0 done; 2 bad option (unknown noise class or scenario, malformed list), one line naming it.
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


def _cells(row: dict[str, object]) -> list[str]:
    """Judge column texts: false rollbacks or detection (<=10 ticks, median), pass median, undecided."""
    out = []
    for key in ("judge", "ttest", "mannwhitney"):
        r = row.get(key)
        if not isinstance(r, dict):
            out.append("-")
            continue
        if "false_rollback_rate" in r:
            text = f"FR {_fmt_rate(r['false_rollback_rate'])}"
        else:
            text = (f"det {_fmt_rate(r['rollback_rate'])} (<=10: {_fmt_rate(r['rollback_within_10_rate'])}, "
                    f"med {_fmt_n(r['median_ticks_to_rollback'])})")
        if "undecided_rate" in r:
            text += f"; pass med {_fmt_n(r['median_ticks_to_pass'])}; undec {_fmt_rate(r['undecided_rate'])}"
        out.append(text)
    return out


@sim_app.command("judge")
def judge_cmd(
    noise: str = typer.Option("iid", "--noise", help="Noise class: iid, autocorrelated, contention, offset, "
                              "heavy, drift, or 'all'."),
    runs: int = typer.Option(10_000, "--runs", min=1, help="Simulated canary steps per row."),
    seed: int = typer.Option(0, "--seed", help="Random seed (report figures on a seed you did not tune on)."),
    nodes: str = typer.Option("1,3,10", "--nodes", help="Comma-separated canary sizes (one report per tick each)."),
    scenario: str = typer.Option("identical,plus1,plus5,cell2x", "--scenario",
                                 help="Comma-separated: identical, plus1 (+1% everywhere), plus5, cell2x "
                                      "(least-traffic cell 2x slower)."),
    ticks: int = typer.Option(60, "--ticks", min=1, help="Ticks to the step deadline (= samples per node)."),
    cells: int = typer.Option(45, "--cells", min=1, help="(op, batch-size) cells per report."),
    margin_pct: float = typer.Option(2.0, "--margin-pct", min=0.0, help="Allowed slow-down in percent."),
    alpha: float = typer.Option(0.05, "--alpha", min=1e-9, max=0.999, help="Family false-rollback level."),
    baselines: bool = typer.Option(True, "--baselines/--no-baselines", help="Also run the t-test and "
                                   "Mann-Whitney baselines on the same reports."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Simulate canary steps and judge them with the family judge and, side by side, two baselines."""
    from sim.judge.noise import NOISE_CLASSES  # numpy, scipy
    from sim.judge.sim import SimConfig, parse_csv, simulate

    names = list(NOISE_CLASSES) if noise == "all" else [noise]
    try:
        node_list = parse_csv(nodes, int)
        scen = parse_csv(scenario)
        cfgs = [SimConfig(runs=runs, seed=seed, noise=n, nodes=node_list, scenarios=scen, ticks=ticks, cells=cells,
                          margin=math.log1p(margin_pct / 100.0), alpha=alpha, baselines=baselines) for n in names]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    reports = [simulate(c) for c in cfgs]
    if as_json:
        typer.echo(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
        return
    console = Console()
    for rep in reports:
        conf = rep["config"]
        table = Table(title=f"sim judge --noise {conf['noise']['name']}: {runs} runs/row, {ticks} ticks to the "  # type: ignore[index]
                            f"deadline, {cells} cells, margin +{margin_pct:g}%, alpha {alpha:g}, seed {seed}")
        for col in ("nodes", "scenario", "judge (betting CS family)", "repeated t-test", "Mann-Whitney"):
            table.add_column(col)
        for row in rep["rows"]:  # type: ignore[union-attr]
            table.add_row(str(row["nodes"]), str(row["scenario"]), *_cells(row))
        console.print(table)
        console.print(f"FR: false rollbacks at any tick; det: rolled back before any pass (<=10 ticks, median "
                      f"ticks); undec: neither by the deadline. {rep['cpu_s']} s CPU, {rep['elapsed_s']} s wall")
