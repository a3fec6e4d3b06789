"""``kernelctl demo``: the whole system on one machine, no GPU needed.

A real controller and N real agents (posing as sm_80 and sm_90 nodes on two driver versions; kernels run
through Triton's interpreter) on the embedded SQLite default. It makes llm-fused 1.1.0 stable, rolls
out the identical 1.1.1 to promotion (issue 25: the judge holds every cell's mean and p99 to its margin, and
1.1.0's GPU-tuned configs are really slower than 1.0.0's under the interpreter), then rolls out the
numeric-drift fault fixture and expects the judge to roll it back.
Trial before serve: the live view shows the canaries per phase (staged, verified, serving), and the summary
how many nodes served each version (the audit's activations): the fault must have served on none. Exit 0
only when both outcomes happened and the fault never served.

The demo judges on evidence, never on a clock a busy machine can outrun: its plan's step deadlines outlast the
evidence it allows a step, and :class:`Watch` ends a rollout that pauses, stays undecided after SAMPLE_BUDGET
clean reports, or whose canaries fall silent for longer than their measured trials explain, with one line
naming the rollout, the stratum and why; no further rollout starts after a failure. What it shows while it runs:
cli/demo_view.py.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import shutil
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from cli.demo_fleet import FleetError, LocalFleet, NodeSpec, StratumEvidence
from cli.demo_view import LiveView, PlainView, Planned, RolloutProgress, StratumProgress, View
from kernelctl.console import EXIT_ERROR, EXIT_USAGE, console, err_console, esc, print_json
from kernelctl.vocab import PAUSED, PROGRESSING, PROMOTED, ROLLED_BACK, TERMINAL_STATES

STABLE, CANDIDATE, FAULT = "1.1.0", "1.1.1", "1.2.0-fault.drift"

# Two GPU generations on two driver versions: strata sm_80/drv535 and sm_90/drv550.
POSES = [
    {"gpu_name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0", "arch": "sm_80",
     "driver_version": "535.183.01", "cuda_version": "12.2", "memory_total_mb": 81920},
    {"gpu_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "arch": "sm_90",
     "driver_version": "550.90.07", "cuda_version": "12.4", "memory_total_mb": 81559},
]

# Clean trial reports per stratum the judge needed to pass the candidate in every measured run of the demo (9 or 10,
# docs/benchmarks.md): the "needed" of the progress shown. A stratum still undecided after SAMPLE_BUDGET of them
# is inconclusive and the demo fails, saying so: the demo's limit is a count of evidence, not a wall-clock time.
EXPECTED_SAMPLES = 10
SAMPLE_BUDGET = 6 * EXPECTED_SAMPLES
# No report from a stratum's canaries for STALL_FACTOR x the slowest trial measured so far (at least STALL_FLOOR_S)
# means they are stuck; before any trial was measured the limit is the agents' trial timeout (a hung trial is
# killed and reported by then) plus STALL_FLOOR_S.
STALL_FACTOR, STALL_FLOOR_S = 10.0, 300.0
POLL_S = 1.0


def demo_plan(trial_timeout_s: float) -> dict[str, Any]:
    """The demo's rollout plan. Short bakes so the demo fits in minutes (production plans default to 1 node, 10%,
    50%, 100%). A step's deadline (after which the controller pauses an undecided stratum) scales with the
    evidence the demo allows a step, SAMPLE_BUDGET reports from its two canaries, each of which may take up to
    the agents' trial timeout: a machine however busy cannot pause a stratum that is still collecting evidence;
    the demo itself ends a rollout that stops producing it (:class:`Watch`)."""
    deadline = math.ceil(SAMPLE_BUDGET / 2) * trial_timeout_s
    return {
        "steps": [
            # the judge advances only when every metric's sequence passes (per-cell latency, aggregate, ...):
            # about ten reports per stratum under the interpreter, i.e. five rounds of two canaries' trials
            {"nodes": 2, "bake_seconds": 2, "min_samples": 3, "deadline_seconds": deadline},
            # evidence is carried across steps: the widened step bakes, then advances on what was measured
            {"percent": 100, "bake_seconds": 2, "min_samples": 3, "deadline_seconds": deadline},
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
class Outcome(Planned):
    rollout_id: int | None = None
    seconds: float = 0.0
    back_to_stable_seconds: float | None = None  # rollback decision -> no node runs the version any more
    served_on: int | None = None  # nodes whose serving processes ever ran it (the audit's activations)
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    evidence: dict[str, StratumEvidence] = field(default_factory=dict)
    never_serve: bool = False  # a fault fixture: no node may ever serve it
    operator_full: bool = False  # the operator promotes it at once (the first version: nothing to judge against)

    @property
    def ok(self) -> bool:
        return self.state == self.expected and not (self.never_serve and self.served_on)

    @property
    def needed(self) -> int | None:
        """Clean samples the judge needs (a judged promotion), None when one failing report decides (a fault) or
        the operator does."""
        return EXPECTED_SAMPLES if self.expected == PROMOTED and not self.operator_full else None


@dataclass
class Watch:
    """Ends a rollout on evidence, never on the wall clock: a stratum paused (the demo has no operator to resume
    it), SAMPLE_BUDGET clean reports without a decision, or canaries silent for longer than their measured trials
    explain. Each says which rollout, which stratum and why."""

    trial_timeout_s: float
    slowest_trial_s: float = 0.0  # over every rollout so far: this machine's trial time, as busy as it is

    def quiet_limit(self) -> float:
        if self.slowest_trial_s <= 0:
            return self.trial_timeout_s + STALL_FLOOR_S
        return max(STALL_FLOOR_S, STALL_FACTOR * self.slowest_trial_s)

    def check(self, outcome: Outcome, detail: dict[str, Any], evidence: dict[str, StratumEvidence],
              since: dt.datetime, logs: Path, now: dt.datetime | None = None) -> str | None:
        """What ends the rollout now (None: nothing); ``since``: when it started, ``now``: default the clock."""
        self.slowest_trial_s = max([self.slowest_trial_s, *(e.slowest_trial_s for e in evidence.values())])
        now = now or dt.datetime.now(dt.timezone.utc)
        steps = len(detail.get("steps", [])) or 1
        for s in detail.get("strata", []):
            where = (f"rollout {detail['id']} ({outcome.ref}), stratum {s['stratum']} at step "
                     f"{s['step_index'] + 1}/{steps}")
            if s["state"] == PAUSED:
                return f"{where}: paused: {s.get('reason') or _verdict_text(s)}"
            if s["state"] != PROGRESSING:
                continue
            e = evidence.get(s["stratum"], StratumEvidence())
            if e.ok >= SAMPLE_BUDGET:
                return (f"{where}: inconclusive after {e.ok} clean trial reports (the judge passed the demo's "
                        f"candidate after ~{EXPECTED_SAMPLES} in every measured run); the judge: {_verdict_text(s)}")
            quiet = (now - (e.last_received or since)).total_seconds()
            if quiet > self.quiet_limit():
                measured = (f"{STALL_FACTOR:g}x the slowest trial so far, {self.slowest_trial_s:.0f}s"
                            if self.slowest_trial_s > 0 else
                            f"the agents' trial timeout {self.trial_timeout_s:.0f}s + {STALL_FLOOR_S:.0f}s")
                return (f"{where}: no trial report from its canaries for {quiet:.0f}s (limit {self.quiet_limit():.0f}s"
                        f": {measured}; {e.reports} report(s) so far); see the agents' logs in {logs}")
        return None


def _verdict_text(stratum: dict[str, Any]) -> str:
    v = stratum.get("latest_verdict") or {}
    if not v:
        return "no verdict yet"
    reason = (v.get("evidence") or {}).get("reason")
    return f"{v.get('decision', '-')} ({v.get('gate', '-')})" + (f": {reason}" if reason else "")


def _node_specs(count: int) -> list[NodeSpec]:
    specs = []
    for i in range(count):
        pose = POSES[i % len(POSES)]
        specs.append(NodeSpec(name=f"demo-{pose['arch'].replace('_', '')}-{i // len(POSES) + 1}",
                              overrides=pose, labels={"rack": f"r{i % 3}", "cluster": "demo"}))
    return specs


def _progress(outcome: Outcome, detail: dict[str, Any], evidence: dict[str, StratumEvidence],
              nodes: list[dict[str, Any]], since: dt.datetime, seconds: float) -> RolloutProgress:
    now = dt.datetime.now(dt.timezone.utc)
    steps = len(detail.get("steps", [])) or 1
    strata = []
    for s in detail.get("strata", []):
        e = evidence.get(s["stratum"], StratumEvidence())
        strata.append(StratumProgress(
            stratum=s["stratum"], state=s["state"], step=min(s["step_index"] + 1, steps), steps=steps,
            samples=e.ok, needed=outcome.needed, trials=e.reports, slowest_trial_s=e.slowest_trial_s,
            quiet_s=(now - (e.last_received or since)).total_seconds(), verdict=_verdict_text(s)))
    by_version: dict[str, int] = {}
    phases: dict[str, int] = {}
    for n in nodes:
        active = ",".join(f"{b}@{v}" for b, v in (n.get("active") or {}).items()) or "none"
        by_version[active] = by_version.get(active, 0) + 1
        for ph in (n.get("phases") or {}).values():
            phases[ph] = phases.get(ph, 0) + 1
    return RolloutProgress(detail["id"], outcome.ref, detail["state"], seconds, strata, by_version, phases)


def _run_rollout(fleet: LocalFleet, view: View, plans: list[Outcome], outcome: Outcome, watch: Watch,
                 timeout: float | None) -> str | None:
    """Start ``outcome``'s rollout and follow it to its end. None when it ended as expected, else what went wrong:
    which rollout, which stratum, why."""
    started = time.monotonic()
    since = dt.datetime.now(dt.timezone.utc)
    r = fleet.start_rollout(outcome.ref, demo_plan(watch.trial_timeout_s), reason=f"demo: expect {outcome.expected}")
    outcome.rollout_id, outcome.state = r["id"], r["state"]
    view.planned(plans)
    if outcome.operator_full:  # the first version has no baseline to judge against: the operator makes it stable
        fleet.api("POST", f"/v1/rollouts/{r['id']}/promote",
                  json={"full": True, "reason": "demo: first version, nothing to compare against"})
    problem: str | None = None
    while True:
        detail = fleet.rollout(r["id"])
        outcome.evidence = fleet.evidence(r["id"])
        outcome.state, outcome.seconds = detail["state"], round(time.monotonic() - started, 1)
        view.rollout(_progress(outcome, detail, outcome.evidence, fleet.api("GET", "/v1/nodes"), since,
                               outcome.seconds))
        if detail["state"] in TERMINAL_STATES:
            break
        fleet.check_alive()
        problem = watch.check(outcome, detail, outcome.evidence, since, fleet.procs.log_dir)
        if problem is None and timeout is not None and outcome.seconds > timeout:
            problem = (f"rollout {r['id']} ({outcome.ref}) is still {detail['state']} after {timeout:.0f}s "
                       "(--timeout)")
        if problem:
            break
        time.sleep(POLL_S)
    outcome.verdicts = [v for v in detail.get("verdicts", []) if v["decision"] != "hold"]
    decisive = [v for v in outcome.verdicts if v["decision"] in ("rollback", "promote", "pause")]
    if problem:
        outcome.reason = problem
    elif decisive:  # the judge's (or operator's) deciding verdict, else the rollout's own reason
        v = decisive[0]
        outcome.reason = (f"{v['decision']} by gate {v['gate']} ({v['stratum']}): "
                          f"{v['evidence'].get('reason', '')}").rstrip(": ")
    elif outcome.operator_full:
        outcome.reason = "promoted fully by the operator (first version: no baseline to judge against)"
    elif detail.get("reason"):
        outcome.reason = detail["reason"]
    if detail["state"] == ROLLED_BACK:  # every canary switches back to its staged stable version (a heartbeat)
        version = outcome.ref.split("@", 1)[1]
        t = time.monotonic()
        while time.monotonic() - t < watch.quiet_limit():
            nodes = fleet.api("GET", "/v1/nodes")
            if not any(version in (n.get("active") or {}).values() for n in nodes):
                outcome.back_to_stable_seconds = round(time.monotonic() - t, 1)
                break
            time.sleep(0.2)
        view.rollout(_progress(outcome, detail, outcome.evidence, fleet.api("GET", "/v1/nodes"), since,
                               outcome.seconds))
    outcome.ended = True
    view.planned(plans)
    if problem:
        return problem
    if outcome.state != outcome.expected:
        return f"rollout {r['id']} ({outcome.ref}) ended {outcome.state}, expected {outcome.expected}: {outcome.reason}"
    return None


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
    json_out: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary on stdout (progress "
                                                          "lines on stderr).")] = False,
    timeout: Annotated[float | None, typer.Option(
        help="A wall-clock limit per rollout in seconds (default: none; the demo ends a rollout on evidence: a "
        "paused stratum, no trial report for 10x the slowest trial, or 60 clean reports without a decision).",
        show_default=False)] = None,
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
    from kernelctl.settings import get_settings

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
    # a terminal gets the live view; redirected output (or --json, on stderr) gets timestamped lines
    shown = err_console if json_out else console
    view: View = LiveView(shown) if shown.is_terminal and not json_out else PlainView(shown)
    outcomes = [Outcome(f"llm-fused@{STABLE}", PROMOTED, operator_full=True), Outcome(f"llm-fused@{CANDIDATE}", PROMOTED),
                Outcome(f"llm-fused@{FAULT}", ROLLED_BACK, never_serve=True)]
    watch = Watch(trial_timeout_s=get_settings().trial_timeout_seconds)
    t0 = time.monotonic()
    error: str | None = None
    tables: list[Any] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        view.start()
        view.planned(outcomes)
        view.phase("migrating the changelog database; generating a signing key")
        fleet.prepare_database()
        key = fleet.generate_key()
        view.phase("starting the controller (kernelctl serve on loopback)")
        fleet.start_controller()
        view.link(fleet.url, fleet.tokens["viewer"])
        # the agents start (and register) while the bundles are built: the two overlap on a 2-core machine
        view.phase(f"starting {nodes} agents (sm_80 on driver 535, sm_90 on driver 550)")
        for spec in _node_specs(nodes):
            fleet.start_agent(spec)
        aot_archs = sorted({p["arch"] for p in POSES}) if aot else []
        view.phase("building and signing bundles (" + (
            f"compiled ahead of time for {'/'.join(aot_archs)})" if aot else
            "source-only: the CPU fleet interprets the kernels)"))
        built = fleet.build_bundles([STABLE, CANDIDATE, FAULT], key, aot_archs=aot_archs,
                                    on_built=lambda v: view.phase(f"built and signed llm-fused {v}"))
        for path in built.values():
            fleet.push(path)
        view.phase(f"waiting for the {nodes} agents to register")
        fleet.wait_nodes(nodes)
        for outcome in outcomes:
            how = ("the operator promotes it fully" if outcome.operator_full else
                   f"the judge decides; expect {outcome.expected}")
            view.phase(f"rolling out {outcome.ref} ({how})")
            error = _run_rollout(fleet, view, outcomes, outcome, watch, timeout)
            if error:  # the next rollout would only be refused while this one is still active
                break
        if error is None:
            view.phase(f"done in {time.monotonic() - t0:.0f}s")
            _record_served(fleet, outcomes)
            tables = _summary_tables(fleet)
        else:
            view.phase(f"stopped after {time.monotonic() - t0:.0f}s: {error}")
    except KeyboardInterrupt:
        error = "interrupted"
    except FleetError as exc:
        error = str(exc)
    finally:
        view.stop()
        fleet.stop()
        signal.signal(signal.SIGTERM, previous)
    notifications = None
    if notify_targets:
        with contextlib.suppress(Exception):  # the database may not exist if start-up failed
            notifications = fleet.notification_counts()
    ok = error is None and all(o.ok for o in outcomes)
    if error is None and not ok:
        error = "; ".join(f"{o.ref} served on {o.served_on} node(s): it must never serve"
                          for o in outcomes if o.never_serve and o.served_on)
    summary = {
        "ok": ok,
        "seconds": round(time.monotonic() - t0, 1),
        "nodes": nodes,
        "database": fleet.db_url if (keep or db) else None,
        "error": error,
        "notifications": notifications,
        "rollouts": [{"bundle": o.ref, "rollout_id": o.rollout_id, "state": o.state or "not started",
                      "expected": o.expected, "reason": o.reason, "seconds": o.seconds,
                      "back_to_stable_seconds": o.back_to_stable_seconds, "served_on": o.served_on,
                      "evidence": {s: {"reports": e.reports, "clean": e.ok, "slowest_trial_s": e.slowest_trial_s,
                                       "median_trial_s": round(statistics.median(e.trial_s), 1) if e.trial_s else None}
                                   for s, e in o.evidence.items()},
                      "verdicts": [{k: v[k] for k in ("stratum", "decision", "gate", "samples")}
                                   for v in o.verdicts]} for o in outcomes],
    }
    if json_out:
        print_json(summary)
    else:
        _print_summary(tables, outcomes, fleet, notifications, notify_targets, keep=keep, db=db)
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    if not ok:
        err_console.print(f"[bold red]demo failed:[/] {esc(error or '')}", soft_wrap=True)
        raise typer.Exit(EXIT_ERROR)


def _print_summary(tables: list[Any], outcomes: list[Outcome], fleet: LocalFleet, notifications: dict[str, int] | None,
                   notify_targets: list[Any], *, keep: Path | None, db: str | None) -> None:
    console.print()
    for t in tables:
        console.print(t)
    for o in outcomes:
        if o.state is None:
            console.print(f"[dim]{o.ref}: not started[/] (expected {o.expected}): an earlier rollout failed")
            continue
        colour = "green" if o.ok else "red"
        back = (f"; every node back on stable {o.back_to_stable_seconds}s after the decision"
                if o.back_to_stable_seconds is not None else "")
        if o.state == ROLLED_BACK and o.served_on == 0:
            back = "; never served on any node: every canary trialled it before serving and it failed there"
        elif o.served_on:
            back += f"; served on {o.served_on} node(s)"
        console.print(f"[{colour}]{o.ref}: {o.state}[/] (expected {o.expected}, {o.seconds}s) "
                      f"{esc(o.reason or '')}{back}", soft_wrap=True)
    if notifications is not None:
        console.print(f"webhook notifications to {', '.join(t.shown for t in notify_targets)}: "
                      f"{notifications['delivered']} delivered, {notifications['failed']} failed")
    if keep or db:
        console.print(f"query the changelog again: [bold]kernelctl audit --db {fleet.db_url}[/]", soft_wrap=True)
    if keep and not db:  # README, "Reopening a kept demo"
        console.print(f"see it again in a browser: [bold]KERNELCTL_DATABASE_URL={fleet.db_url} kernelctl serve "
                      f"--trusted-keys {fleet.trusted_dir}[/], then /ui/ with a token from "
                      f"{fleet.workdir / 'bootstrap-tokens'} (its tokens are in the database)", soft_wrap=True)
    if not keep and not db:
        console.print("run with --keep DIR to keep the database and query it again with "
                      "`kernelctl audit --db sqlite:///DIR/kernelctl.db`")
