"""``kernelctl sim fleet``: the Typer ``app`` (one command) that the root CLI mounts under ``sim``."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kernelctl.console import fail
from sim.fleet.config import DEFAULT_HEARTBEAT_S, FleetConfig, SimError
from sim.fleet.scenarios import SCENARIOS, get_scenario

app = typer.Typer(no_args_is_help=True, help="Fleet simulator: N simulated agents against a real controller.")


@app.command("fleet")
def fleet_command(
    nodes: int = typer.Option(1000, "--nodes", min=1, max=100_000, help="Simulated agents."),
    db: str = typer.Option(..., "--db", help="Database URL (PostgreSQL: postgresql+psycopg://user@host:5432/db)."),
    scenario: str = typer.Option("healthy", "--scenario", help=f"One of: {', '.join(SCENARIOS)}."),
    fresh: bool = typer.Option(False, "--fresh", help="Create a throw-away database next to --db and drop it after."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    duration_limit: float = typer.Option(600.0, "--duration-limit", min=10, help="Give up after this many seconds."),
    heartbeat_seconds: float = typer.Option(DEFAULT_HEARTBEAT_S, "--heartbeat-seconds", min=0.2,
                                           help="Heartbeat period (each agent holds a watch this long)."),
    tick_seconds: float = typer.Option(1.0, "--tick-seconds", min=0.1, help="Controller judge tick period."),
    connections: int = typer.Option(64, "--connections", min=1, max=1024,
                                     help="Registrations, report batches and downloads in flight at once."),
    margin_pct: float = typer.Option(2.0, "--margin-pct", min=0.1, max=50, help="Allowed latency slow-down in %."),
    seed: int = typer.Option(0, "--seed", help="Random seed of the noise model."),
    stale_after: float | None = typer.Option(None, "--stale-after", min=1,
                                             help="Seconds without heartbeat before a node is stale "
                                                  "(default: max(3 heartbeats, 15 s))."),
    trial_interval: float | None = typer.Option(None, "--trial-interval", min=0.05,
                                                help="Seconds between simulated trials on a canary (default: the "
                                                     "heartbeat period, or nodes/50 s if longer)."),
    report_kb: tuple[float, float] = typer.Option((6.0, 46.0), "--report-kb",
                                                  help="Report sizes in KB, drawn per agent between these two "
                                                       "(a real agent's on CPU: 6-46 KB)."),
    download_once: bool = typer.Option(False, "--download-once",
                                       help="Download each version once for the whole fleet (default: every "
                                            "canary downloads it, as real agents do)."),
    lost_reply_share: float = typer.Option(0.02, "--lost-reply-share", min=0.0, max=1.0,
                                           help="Share of registration replies lost on purpose (retried)."),
    ingest_processes: int = typer.Option(0, "--ingest-processes", min=0, max=64,
                                         help="The controller's report worker processes (KERNELCTL_INGEST_PROCESSES; "
                                              "0: two threads of the API process)."),
    api_workers: int = typer.Option(1, "--api-workers", min=1, max=64,
                                    help="The controller's API worker processes (KERNELCTL_API_WORKERS; "
                                         "PostgreSQL only past 1)."),
    bundle_cache: Path | None = typer.Option(None, "--bundle-cache",
                                             help="Where the signed simulation bundles are built once "
                                                  "(default: the user cache dir)."),
) -> None:
    """Drive N simulated agents against a real controller and database; print throughput, latency, TTR."""
    try:
        sc = get_scenario(scenario)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--scenario") from None
    if not db.startswith(("postgresql", "sqlite")):
        raise typer.BadParameter(f"unsupported database URL {db!r}: expected postgresql+psycopg://... or sqlite:///...",
                                 param_hint="--db")
    cfg = FleetConfig(nodes=nodes, db_url=db, scenario=sc, fresh=fresh, duration_limit=duration_limit,
                      heartbeat_seconds=heartbeat_seconds, tick_seconds=tick_seconds, connections=connections,
                      margin_pct=margin_pct, seed=seed, stale_after=stale_after,
                      bundle_cache=bundle_cache, trial_interval=trial_interval, report_kb=report_kb,
                      download_per_agent=not download_once, lost_reply_share=lost_reply_share,
                      ingest_processes=ingest_processes, api_workers=api_workers)
    # the simulator itself (numpy, asyncio agents) only for this command: every other kernelctl verb starts
    # without it (this module is mounted by cli/app.py)
    from sim.fleet.report import print_table
    from sim.fleet.run import run_fleet

    try:
        res = run_fleet(cfg)
    except SimError as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(res, indent=2))
    else:
        print_table(res)
    if not res["passed"]:
        raise typer.Exit(1)


if __name__ == "__main__":  # pragma: no cover - ``python -m sim.fleet.cli ...``
    app()
