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
    """Per judge: promoted / rolled back (median reports) / undecided."""
    out = []
    for key in ("judge", "ttest", "mannwhitney"):
        r = row.get(key)
        if not isinstance(r, dict):
            out.append("-")
            continue
        text = (f"promoted {_fmt_rate(r['promoted'])}; rolled back {_fmt_rate(r['rolled_back'])} "
                f"(med {_fmt_n(r['median_reports_to_rollback'])})")
        if "undecided" in r:
            text += f"; undecided {_fmt_rate(r['undecided'])}"
        if "undecided_at_deadline" in r:
            text += f" (open at the deadline {_fmt_rate(r['undecided_at_deadline'])})"
        out.append(text)
    return out


@sim_app.command("judge")
def judge_cmd(
    classes: str = typer.Option("all", "--classes", help="Comma-separated candidate classes (identical, plus1_ar, "
                                "plus5, spread, tail10, p99, late, heavy_cell) or 'all'."),
    runs: int = typer.Option(2000, "--runs", min=1, help="Simulated canary steps per row."),
    seed: int = typer.Option(0, "--seed", help="Random seed (report figures on a seed you did not tune on)."),
    nodes: str = typer.Option("1,3,10", "--nodes", help="Comma-separated canary sizes (one report per tick each)."),
    ticks: int = typer.Option(60, "--ticks", min=1, help="Ticks to the step deadline (= reports per node)."),
    extension: float = typer.Option(1.0, "--extension", min=0.0, max=10.0, help="Deadline extension of a clean "
                                    "hold, a fraction of --ticks (the controller's StepSpec.deadline_extension)."),
    cells: int = typer.Option(8, "--cells", min=2, help="(op, batch-size) cells per report (cell 0: 60% traffic)."),
    calls: int = typer.Option(512, "--calls", min=8, help="Timed calls per arm and cell in one report."),
    margin_pct: float = typer.Option(2.0, "--margin-pct", min=0.0, help="Allowed mean slow-down in percent."),
    p99_margin_pct: float = typer.Option(10.0, "--p99-margin-pct", min=0.0, help="Allowed p99 growth in percent."),
    alpha: float = typer.Option(0.05, "--alpha", min=1e-9, max=0.999, help="Family false-rollback level."),
    baselines: bool = typer.Option(True, "--baselines/--no-baselines", help="Also run the t-test and "
                                   "Mann-Whitney baselines on the same reports."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Simulate canary steps of the issue-25 candidate classes; the judge and, side by side, two baselines."""
    from sim.judge.noise import CLASSES  # numpy, scipy
    from sim.judge.sim import SimConfig, parse_csv, simulate

    try:
        names = tuple(CLASSES) if classes == "all" else parse_csv(classes)
        cfg = SimConfig(runs=runs, seed=seed, classes=names, nodes=parse_csv(nodes, int), ticks=ticks, extension=extension, cells=cells,
                        calls=calls, margin=math.log1p(margin_pct / 100.0),
                        p99_margin=math.log1p(p99_margin_pct / 100.0), alpha=alpha, baselines=baselines)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    rep = simulate(cfg)
    if as_json:
        typer.echo(json.dumps(rep, indent=2))
        return
    console = Console()
    table = Table(title=f"sim judge: {runs} runs/row, {ticks} ticks to the deadline (+{extension:g}x for a clean hold), {cells} cells x {calls} calls, "
                        f"margin mean +{margin_pct:g}% p99 +{p99_margin_pct:g}%, alpha {alpha:g}, seed {seed}")
    for col in ("class", "verdict due", "canaries", "judge (mean + p99, betting)", "repeated t-test (mean)",
                "Mann-Whitney (mean)"):
        table.add_column(col)
    for row in rep["rows"]:  # type: ignore[union-attr]
        table.add_row(str(row["class"]), str(row["expected"]), str(row["nodes"]), *_cells(row))
    console.print(table)
    console.print(f"promoted: passed before any regress; rolled back: regressed before any pass (median reports "
                  f"per canary); undecided: neither by the extended deadline. {rep['cpu_s']} s CPU, {rep['elapsed_s']} s wall")
