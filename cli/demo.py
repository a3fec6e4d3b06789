"""``kernelctl demo``: the whole system on one machine, no GPU needed.

A real controller and N real agents (posing as sm_80 and sm_90 nodes on two driver versions; kernels run
through Triton's interpreter) on the embedded SQLite default. It makes llm-fused 1.1.0 stable, rolls
out the identical 1.1.1 to promotion (issue 25: the judge holds every cell's mean and p99 to its margin, and
1.1.0's GPU-tuned configs are really slower than 1.0.0's under the interpreter), then rolls out the
numeric-drift fault fixture and expects the judge to roll it back.
Trial before serve: the live view shows the canaries per phase (staged, verified, serving), and the summary
how many nodes served each version (the audit's activations): the fault must have served on none. Exit 0
only when both outcomes happened and the fault never served.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.live import Live
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

from cli.demo_fleet import FleetError, LocalFleet, NodeSpec
from kernelctl.console import EXIT_ERROR, EXIT_USAGE, console, err_console, print_json
from kernelctl.vocab import CANARY_PHASES

STABLE, CANDIDATE, FAULT = "1.1.0", "1.1.1", "1.2.0-fault.drift"

# Two GPU generations on two driver versions: strata sm_80/drv535 and sm_90/drv550.
POSES = [
    {"gpu_name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0", "arch": "sm_80",
     "driver_version": "535.183.01", "cuda_version": "12.2", "memory_total_mb": 81920},
    {"gpu_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "arch": "sm_90",
     "driver_version": "550.90.07", "cuda_version": "12.4", "memory_total_mb": 81559},
]

# Short steps so the demo fits in minutes; production plans default to 1 node, 10%, 50%, 100%.
DEMO_PLAN: dict[str, Any] = {
    "steps": [
        # the judge advances only when every metric's sequence passes (per-cell latency, aggregate, ...): about
        # ten reports per stratum under the interpreter, i.e. five rounds of two canaries' trials
        {"nodes": 2, "bake_seconds": 2, "min_samples": 3, "deadline_seconds": 480},
        # evidence is carried across steps: the widened step bakes, then advances on what was measured
        {"percent": 100, "bake_seconds": 2, "min_samples": 3, "deadline_seconds": 240},
    ],
    # Under the interpreter a kernel's time is Python overhead, noisy on a shared 2-core machine (a few
    # percent per trial); GPU plans keep the 2% default.
    "latency_margin": 0.25,
    # the p99 of an interpreter trial is the slowest of 12 timed calls of Python work: wider still (issue 25)
    "p99_margin": 1.0,
    "max_fleet_share": 1.0,
    "max_label_share": 1.0,
    "trial_rounds": 1,
    "trial_interval_seconds": 0,
    "hold_verdict_seconds": 5,
}
# Each demo node's traffic profile: small batches, because the kernels run through the interpreter (decode batch 4:
# the interpreter's latency cell and the capacity shape coincide, one memory/launch cell per op instead of two).
DEMO_PROFILE = {"batch_sizes": [4], "prefill_tokens": [], "rounds": 1, "fuzz_shapes": 1, "dtypes": ["fp32"],
                "e2e": False}


@dataclass
class Outcome:
    ref: str
    expected: str
    rollout_id: int | None = None
    state: str = "not started"
    reason: str | None = None
    seconds: float = 0.0
    back_to_stable_seconds: float | None = None  # rollback decision -> no node runs the version any more
    served_on: int | None = None  # nodes whose serving processes ever ran it (the audit's activations)
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    never_serve: bool = False  # a fault fixture: no node may ever serve it

    @property
    def ok(self) -> bool:
        return self.state == self.expected and not (self.never_serve and self.served_on)


class DemoView:
    """The live Rich view: phase, rollout, strata with step progress, nodes, latest verdicts."""

    def __init__(self, nodes: int) -> None:
        self.phase = "starting"
        self.nodes_total = nodes
        self.detail: dict[str, Any] | None = None
        self.nodes: list[dict[str, Any]] = []
        self.outcomes: list[Outcome] = []
        self.ui: str | None = None  # where the browser page is while the demo runs
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"))
        self._tasks: dict[str, int] = {}

    def update(self, detail: dict[str, Any], nodes: list[dict[str, Any]]) -> None:
        self.detail, self.nodes = detail, nodes
        steps = detail.get("steps", [])
        for s in detail.get("strata", []):
            key = f"{detail['id']}:{s['stratum']}"
            done = len(steps) if s["state"] == "promoted" else s["step_index"]
            info = f"{s['state']} step {min(s['step_index'] + 1, len(steps))}/{len(steps)}"
            if key not in self._tasks:
                self._tasks[key] = self.progress.add_task(f"{detail['bundle']} {s['stratum']}",
                                                          total=max(1, len(steps)), info=info)
            self.progress.update(self._tasks[key], completed=done, info=info)

    def render(self) -> Group:
        parts: list[Any] = [Panel(self.phase, title="kernelctl demo", expand=False)]
        if self.ui:
            parts.append(self.ui)
        if self.detail:
            d = self.detail
            head = Table(title=f"rollout {d['id']}: {d['bundle']}  state={d['state']}", expand=False)
            for col in ("stratum", "state", "step", "nodes", "latest verdict"):
                head.add_column(col, overflow="fold")
            for s in d.get("strata", []):
                v = s.get("latest_verdict") or {}
                verdict = f"{v.get('decision', '-')} ({v.get('gate', '-')})" if v else "-"
                if v.get("evidence", {}).get("reason"):
                    verdict += f": {v['evidence']['reason']}"
                nodes = ", ".join(f"{k}={n}" for k, n in (s.get("nodes") or {}).items())
                head.add_row(s["stratum"], s["state"], str(s["step_index"] + 1), nodes, verdict)
            parts.append(head)
        parts.append(self.progress)
        if self.nodes:
            by_state: dict[str, int] = {}
            for n in self.nodes:
                active = ",".join(f"{b}@{v}" for b, v in (n.get("active") or {}).items()) or "none"
                by_state[active] = by_state.get(active, 0) + 1
            parts.append(f"nodes by active version: {by_state}")
            phases: dict[str, int] = {}
            for n in self.nodes:
                for p in (n.get("phases") or {}).values():
                    phases[p] = phases.get(p, 0) + 1
            if phases:  # trial before serve: staged (trialled, not served) -> verified -> serving
                parts.append("canaries by phase: " + ", ".join(
                    f"{p}={phases[p]}" for p in CANARY_PHASES if p in phases))
        for o in self.outcomes:
            mark = "[green]ok[/]" if o.ok else "[red]unexpected[/]"
            parts.append(f"{o.ref}: {o.state} (expected {o.expected}) {mark} {o.reason or ''}")
        return Group(*parts)


def _node_specs(count: int) -> list[NodeSpec]:
    specs = []
    for i in range(count):
        pose = POSES[i % len(POSES)]
        specs.append(NodeSpec(name=f"demo-{pose['arch'].replace('_', '')}-{i // len(POSES) + 1}",
                              overrides=pose, labels={"rack": f"r{i % 3}", "cluster": "demo"}))
    return specs


def _run_rollout(fleet: LocalFleet, view: DemoView, live: Live | None, outcome: Outcome,
                 timeout: float, *, operator_full: bool = False) -> None:
    started = time.monotonic()
    r = fleet.start_rollout(outcome.ref, DEMO_PLAN, reason=f"demo: expect {outcome.expected}")
    outcome.rollout_id = r["id"]
    if operator_full:  # the first version has no baseline to judge against: the operator makes it stable
        fleet.api("POST", f"/v1/rollouts/{r['id']}/promote",
                  json={"full": True, "reason": "demo: first version, nothing to compare against"})

    def on_update(detail: dict[str, Any]) -> None:
        if live is not None:
            view.update(detail, fleet.api("GET", "/v1/nodes"))
            live.update(view.render())

    detail = fleet.wait_rollout(r["id"], timeout=timeout, on_update=on_update)
    outcome.state = detail["state"]
    outcome.seconds = round(time.monotonic() - started, 1)
    outcome.verdicts = [v for v in detail.get("verdicts", []) if v["decision"] != "hold"]
    decisive = [v for v in outcome.verdicts if v["decision"] in ("rollback", "promote", "pause")]
    if decisive:  # the judge's (or operator's) deciding verdict, else the rollout's own reason
        v = decisive[0]
        outcome.reason = f"{v['decision']} by gate {v['gate']}: {v['evidence'].get('reason', '')}".rstrip(": ")
    elif operator_full:
        outcome.reason = "promoted fully by the operator (first version: no baseline to judge against)"
    elif detail.get("reason"):
        outcome.reason = detail["reason"]
    if detail["state"] == "rolled_back":  # every canary switches back to its staged stable version
        version = outcome.ref.split("@", 1)[1]
        t = time.monotonic()
        while time.monotonic() - t < 30:
            nodes = fleet.api("GET", "/v1/nodes")
            if not any(version in (n.get("active") or {}).values() for n in nodes):
                outcome.back_to_stable_seconds = round(time.monotonic() - t, 1)
                break
            time.sleep(0.2)
        if live is not None:
            view.update(detail, fleet.api("GET", "/v1/nodes"))
            live.update(view.render())


def _record_served(fleet: LocalFleet, outcomes: list[Outcome]) -> None:
    """How many nodes served each version (the audit's "what ran": staged-only canaries do not count)."""
    from controller.audit import nodes_that_ran
    from controller.db.engine import make_engine, session_factory

    engine = make_engine(fleet.db_url, read_only=True)
    with session_factory(engine)() as session:
        for o in outcomes:
            if o.rollout_id is not None:
                o.served_on = len({r["node"] for r in nodes_that_ran(session, o.ref)})
    engine.dispose()


def _summary_tables(fleet: LocalFleet) -> list[Any]:
    from controller.audit import AuditFilters, query_events
    from controller.db.engine import make_engine, session_factory

    compat = fleet.api("GET", "/v1/compat")
    rows = compat.get("rows", compat) if isinstance(compat, dict) else compat
    matrix = Table(title="compatibility matrix (bundle version x stratum)")
    strata = sorted({r["stratum"] for r in rows})
    matrix.add_column("bundle")
    for s in strata:
        matrix.add_column(s)
    for ref in sorted({r["bundle"] for r in rows}):
        cells = {r["stratum"]: r["state"] for r in rows if r["bundle"] == ref}
        matrix.add_row(ref, *[cells.get(s, "-") for s in strata])
    engine = make_engine(fleet.db_url, read_only=True)
    with session_factory(engine)() as session:
        events = query_events(session, AuditFilters(action="rollout.*", limit=40)) + query_events(
            session, AuditFilters(action="bundle.*", limit=20))
        verified = len(query_events(session, AuditFilters(action="assignment.verified", limit=10_000)))
    engine.dispose()
    audit = Table(title="audit trail (rollout and bundle events)")
    for col in ("at", "actor", "action", "bundle", "reason"):
        audit.add_column(col, overflow="fold")
    for e in sorted(events, key=lambda e: (e.at, e.id)):
        audit.add_row(e.at.strftime("%H:%M:%S"), e.actor, e.action, e.bundle or "", e.reason or "")
    audit.caption = f"{verified} pre-serve trial(s) accepted (assignment.verified): only those canaries served"
    return [matrix, audit]


def demo(
    nodes: Annotated[int, typer.Option(help="Number of agent processes.", min=2, max=64)] = 6,
    db: Annotated[str | None, typer.Option("--db", help="Database URL (default: SQLite in the work dir).")] = None,
    keep: Annotated[Path | None, typer.Option(help="Keep the database, keys, bundles and logs in DIR.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary only.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds allowed per rollout.")] = 600.0,
    aot: Annotated[bool, typer.Option(
        "--aot/--no-aot", help="Also compile the bundles ahead of time for the archs the fleet poses as "
        "(sm_80, sm_90; cached). The CPU fleet runs every kernel through Triton's interpreter from the "
        "signed sources, so the default builds source-only bundles and compiles nothing.")] = False,
    notify_url: Annotated[list[str] | None, typer.Option(
        "--notify-url", help="Webhook for the demo controller's notifications (repeatable; default: "
        "KERNELCTL_NOTIFY_URLS).", show_default=False)] = None,
) -> None:
    """Run a real controller and agents locally: promote llm-fused 1.1.1, roll back a numeric-drift fault."""
    from controller.notify import NotifyConfigError, parse_targets

    notify = ",".join(notify_url) if notify_url else os.environ.get("KERNELCTL_NOTIFY_URLS", "")
    try:
        notify_targets = parse_targets(notify)
    except NotifyConfigError as exc:
        err_console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(EXIT_USAGE) from None
    workdir = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="kernelctl-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    profile = workdir / "profile.json"
    profile.write_text(json.dumps(DEMO_PROFILE))
    # trials back to back (a laptop demo, not a production node: production agents keep a 10% duty cycle)
    fleet = LocalFleet(workdir, db_url=db, extra_env={"KERNELCTL_PROFILE": str(profile),
                                                      "KERNELCTL_TRIAL_DUTY_CYCLE": "1.0"},
                       controller_env={"KERNELCTL_NOTIFY_URLS": notify} if notify_targets else None)
    view = DemoView(nodes)
    outcomes = [Outcome(f"llm-fused@{STABLE}", "promoted"), Outcome(f"llm-fused@{CANDIDATE}", "promoted"),
                Outcome(f"llm-fused@{FAULT}", "rolled_back", never_serve=True)]
    view.outcomes = outcomes
    t0 = time.monotonic()
    error: str | None = None
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    live = None if json_out else Live(view.render(), console=console, refresh_per_second=4, transient=False)
    try:
        if live:
            live.start()

        def phase(text: str) -> None:
            view.phase = text
            if live:
                live.update(view.render())

        phase("migrating the changelog database; generating a signing key")
        fleet.prepare_database()
        key = fleet.generate_key()
        phase("starting the controller (kernelctl serve on loopback)")
        fleet.start_controller()
        view.ui = f"follow it in a browser: {fleet.url}/ui/  (viewer token {fleet.tokens['viewer']})"
        # the agents start (and register) while the bundles are built: the two overlap on a 2-core machine
        phase(f"starting {nodes} agents (sm_80 on driver 535, sm_90 on driver 550)")
        for spec in _node_specs(nodes):
            fleet.start_agent(spec)
        aot_archs = sorted({p["arch"] for p in POSES}) if aot else []
        phase("building and signing bundles (" + (f"compiled ahead of time for {'/'.join(aot_archs)})" if aot else
                                                  "source-only: the CPU fleet interprets the kernels)"))
        built = fleet.build_bundles([STABLE, CANDIDATE, FAULT], key, aot_archs=aot_archs,
                                    on_built=lambda v: phase(f"built and signed llm-fused {v}"))
        for path in built.values():
            fleet.push(path)
        fleet.wait_nodes(nodes)
        for i, outcome in enumerate(outcomes):
            how = "operator promotes it fully" if i == 0 else f"the judge decides; expect {outcome.expected}"
            phase(f"rolling out {outcome.ref} ({how})")
            _run_rollout(fleet, view, live, outcome, timeout, operator_full=i == 0)
            if live:
                live.update(view.render())
        phase(f"done in {time.monotonic() - t0:.0f}s")
        _record_served(fleet, outcomes)
        tables = _summary_tables(fleet)
    except KeyboardInterrupt:
        error = "interrupted"
        tables = []
    except FleetError as exc:
        error = str(exc)
        tables = []
    finally:
        if live:
            live.stop()
        fleet.stop()
        signal.signal(signal.SIGTERM, previous)
    notifications = None
    if notify_targets:
        with contextlib.suppress(Exception):  # the database may not exist if start-up failed
            notifications = fleet.notification_counts()
    ok = error is None and all(o.ok for o in outcomes)
    audit_cmd = f"kernelctl audit --db {fleet.db_url}" if keep or db else None
    summary = {
        "ok": ok,
        "seconds": round(time.monotonic() - t0, 1),
        "nodes": nodes,
        "database": fleet.db_url if (keep or db) else None,
        "error": error,
        "notifications": notifications,
        "rollouts": [{"bundle": o.ref, "rollout_id": o.rollout_id, "state": o.state, "expected": o.expected,
                      "reason": o.reason, "seconds": o.seconds, "back_to_stable_seconds": o.back_to_stable_seconds,
                      "served_on": o.served_on,
                      "verdicts": [{k: v[k] for k in ("stratum", "decision", "gate", "samples")}
                                   for v in o.verdicts]} for o in outcomes],
    }
    if json_out:
        print_json(summary)
    else:
        console.print()
        for t in tables:
            console.print(t)
        for o in outcomes:
            colour = "green" if o.ok else "red"
            back = (f"; every node back on stable {o.back_to_stable_seconds}s after the decision"
                    if o.back_to_stable_seconds is not None else "")
            if o.state == "rolled_back" and o.served_on == 0:
                back = "; never served on any node: every canary trialled it before serving and it failed there"
            elif o.served_on:
                back += f"; served on {o.served_on} node(s)"
            console.print(f"[{colour}]{o.ref}: {o.state}[/] (expected {o.expected}, {o.seconds}s) "
                          f"{o.reason or ''}{back}")
        if notifications is not None:
            console.print(f"webhook notifications to {', '.join(t.shown for t in notify_targets)}: "
                          f"{notifications['delivered']} delivered, {notifications['failed']} failed")
        if audit_cmd:
            console.print(f"query the changelog again: [bold]{audit_cmd}[/]")
        else:
            console.print("run with --keep DIR to keep the database and query it again with "
                          "`kernelctl audit --db sqlite:///DIR/kernelctl.db`")
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    if not ok:
        bad = error or "; ".join(f"{o.ref} ended {o.state}, expected {o.expected}"
                                 + (f", served on {o.served_on} node(s)" if o.never_serve and o.served_on else "")
                                 for o in outcomes if not o.ok)
        err_console.print(f"[bold red]demo failed:[/] {bad}")
        raise typer.Exit(EXIT_ERROR)
