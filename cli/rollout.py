"""``kernelctl rollout start|list|status|explain``: start a canary rollout and follow the judge's verdicts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from cli.common import JsonOption, RolloutIdArg, TokenOption, UrlOption, fetch, remote, split_ref
from kernelctl.console import EXIT_USAGE, console, esc, fail, print_json, safe
from kernelctl.vocab import CANARY_PHASES, ROLLOUT_STATES, TERMINAL_STATES, step_number

# ------------------------------------------------------------------------------------------ rollouts
rollout_app = typer.Typer(help="Start and follow rollouts.", no_args_is_help=True)


def step_of(step_index: int, steps: int) -> str:
    """``"2/4"``: a step as people number it (from 1, :func:`kernelctl.vocab.step_number`) of the plan's."""
    return f"{min(step_number(step_index), steps) if steps else step_number(step_index)}/{steps}"


def outcome_line(r: dict[str, Any]) -> str:
    """What happened to each stratum of an ended rollout (``promoted on A; rolled back on B``), or ``""``."""
    if r["state"] not in TERMINAL_STATES or not r.get("strata"):
        return ""
    by: dict[str, list[str]] = {}
    for s in r["strata"]:
        by.setdefault(s["state"].replace("_", " "), []).append(s["stratum"])
    return "; ".join(f"{state} on {', '.join(sorted(names))}" for state, names in sorted(by.items()))


def _rollout_renderable(r: dict[str, Any]) -> Group:
    n_steps = len(r["steps"])
    outcome = outcome_line(r)
    head = (f"rollout [bold]{esc(r['id'])}[/] {esc(r['bundle'])}  state [bold]{esc(r['state'])}[/]"
            + (f" ({esc(outcome)})" if outcome else "")
            + f"  step {step_of(r['step_index'], n_steps)}  by {esc(r['created_by'])}"
            + (f"  reason: {esc(r['reason'])}" if r.get("reason") else ""))
    strata = Table(title="strata")
    for col in ("stratum", "state", "step", "baseline", "fleet", "assigned", "active", "staged/\nverified/\nserving"):
        strata.add_column(col, overflow="fold")  # folded, never cut
    verdicts: list[Any] = []
    for s in r["strata"]:
        strata.add_row(
            safe(s["stratum"]), safe(s["state"]), step_of(s["step_index"], n_steps), safe(s.get("baseline") or "-"),
            str(s["nodes"].get("fleet", 0)), str(s["nodes"].get("assigned", 0)), str(s["nodes"].get("active", 0)),
            "/".join(str(s["nodes"].get(p, 0)) for p in CANARY_PHASES),
        )
        v = s.get("latest_verdict")
        if v:  # a paragraph per stratum: wrapped at spaces, so no number is ever cut
            keys = ("reason", "log_ratio", "ci", "lower", "upper", "margin", "n", "failures")
            ev = ", ".join(f"{k}={v['evidence'][k]}" for k in keys if k in v["evidence"])
            metric = v["evidence"].get("deciding_metric")
            verdicts.append(safe(f"{s['stratum']}: {v['decision']}/{v['gate']} at step "
                                 f"{step_of(v['step_index'], n_steps)} ({v['samples']} samples)"
                                 + (f", deciding metric {metric}" if metric else "") + (f": {ev}" if ev else "")))
        if s.get("reason") and s["state"] not in ("progressing", "pending") and (
                not v or s["reason"] != f"judge: {v['evidence'].get('reason')}"):
            verdicts.append(safe(f"{s['stratum']}: {s['state']}: {s['reason']}"))
    steps = Table("step", "size", "bake s", "min samples", "deadline s", title="plan")
    for st in r["steps"]:
        size = f"{st['nodes']} node(s)" if st["nodes"] is not None else f"{st['percent']:g}%"
        steps.add_row(str(step_number(st["index"])), size, f"{st['bake_seconds']:g}", str(st["min_samples"]),
                      f"{st['deadline_seconds']:g}")
    latest = [Text("latest verdicts", style="italic"), *verdicts] if verdicts else []
    return Group(Panel(head), strata, *latest, steps)


@rollout_app.command("start")
def rollout_start(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="NAME@VERSION")],
    plan: Annotated[Path | None, typer.Option(help="Plan file (JSON or YAML).")] = None,
    force: Annotated[bool, typer.Option(help="Start even if the blast-radius checks refuse.")] = False,
    reason: Annotated[str | None, typer.Option(help="Why (recorded in the changelog).")] = None,
    accept_contract_change: Annotated[str | None, typer.Option(
        "--accept-contract-change", metavar="WHY",
        help="Accept a candidate that loosens the stable version's tolerances, domain or golden vectors "
             "(the reason is recorded in the changelog).")] = None,
    url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False,
) -> None:
    """Start a canary rollout of a registered bundle version."""
    split_ref(ref)
    body: dict[str, Any] = {"bundle": ref, "force": force, "reason": reason}
    if accept_contract_change is not None:
        body["accept_contract_change"] = accept_contract_change
    if plan is not None:
        body["plan"] = _read_plan(plan)
    r = remote(ctx, url, token).request("POST", "/v1/rollouts", json=body)
    if json_out:
        print_json(r)
    else:
        console.print(f"rollout [bold]{esc(r['id'])}[/] of {esc(r['bundle'])} started ({esc(r['state'])}, "
                      f"{len(r['strata'])} strata)")


def _read_plan(path: Path) -> Any:
    import json

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        fail(f"cannot read plan {path}: {exc.strerror or exc}", EXIT_USAGE)
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        import yaml  # optional

        return yaml.safe_load(text)
    except ImportError:
        fail(f"plan {path} is not valid JSON", EXIT_USAGE)
    except Exception as exc:
        fail(f"plan {path} is neither JSON nor YAML: {str(exc).splitlines()[0]}", EXIT_USAGE)


@rollout_app.command("list")
def rollout_list(ctx: typer.Context, state: Annotated[str | None, typer.Option(help="Only this state.")] = None,
                 url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """List rollouts, newest first."""
    if state is not None and state not in ROLLOUT_STATES:
        fail(f"--state {state!r}: expected one of {', '.join(ROLLOUT_STATES)}", EXIT_USAGE)
    rows = fetch(ctx, url, token, json_out, "/v1/rollouts", state_filter=state)
    table = Table("id", "bundle", "state", "step", "created", "by", "reason")
    for r in rows:
        table.add_row(str(r["id"]), safe(r["bundle"]), safe(r["state"]), str(step_number(r["step_index"])),
                      safe(r["created_at"][:19]), safe(r["created_by"]), safe(r.get("reason") or ""))
    console.print(table)


@rollout_app.command("status")
def rollout_status(
    ctx: typer.Context,
    rollout_id: RolloutIdArg,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh until the rollout ends (Ctrl-C stops).")] = False,
    interval: Annotated[float, typer.Option(help="Refresh period with --watch.")] = 2.0,
    url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False,
) -> None:
    """Show a rollout: strata, step, nodes per state, latest verdicts with evidence."""
    client = remote(ctx, url, token)
    r = client.request("GET", f"/v1/rollouts/{rollout_id}")
    if not watch:
        if json_out:
            print_json(r)
        else:
            console.print(_rollout_renderable(r))
        return
    try:
        if json_out:  # no live view: wait quietly, print the final state as JSON
            while r["state"] not in TERMINAL_STATES:
                time.sleep(max(0.2, interval))
                r = client.request("GET", f"/v1/rollouts/{rollout_id}")
        else:
            with Live(_rollout_renderable(r), console=console, refresh_per_second=4) as live:
                while r["state"] not in TERMINAL_STATES:
                    time.sleep(max(0.2, interval))
                    r = client.request("GET", f"/v1/rollouts/{rollout_id}")
                    live.update(_rollout_renderable(r))
    except KeyboardInterrupt:
        pass
    if json_out:
        print_json(r)


def _fmt_metric(unit: str, x: float | None) -> str:
    import math

    if x is None:
        return "-"
    if unit == "log_ratio":
        return f"{math.expm1(x):+.1%}"
    if unit == "ratio":
        return f"{x:.2f}x"
    return f"{x:.3g}"


def _fmt_seconds(x: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x * 1e9:.3g} ns"


def _fmt_arm(m: dict[str, Any], arm: str) -> str:
    """One arm of a latency metric: its mean and p99 (and n) in the latest report."""
    arms = m.get("arms") or {}
    a = arms.get(arm) or {}
    if not a:
        return "-"
    dropped = arms.get("contended_windows") or 0
    return (f"mean {_fmt_seconds(a['mean_s'])}, p99 {_fmt_seconds(a['p99_s'])} (n {a['n']}"
            + (f"; {dropped} contended window(s) dropped" if dropped else "") + ")")


def _fmt_bound(m: dict[str, Any]) -> str:
    """The bound that decides against the margin: "upper +1.2% (pass needs < margin)" / "lower +6.0%"; for the
    resource metrics what they compare (launches: stable's count; memory: the largest ratio)."""
    if m["kind"] == "launches":
        return "-" if m["upper"] is None else f"{m['upper']:g} (stable)"
    if m["kind"] == "memory":
        return "-" if m["upper"] is None else f"max {_fmt_metric('ratio', m['upper'])}"
    side = m.get("bound_side")
    if side is None:
        return "-"
    if m.get("bound") is None:
        return f"{side}: none yet"
    return f"{side} {_fmt_metric(m['unit'], m['bound'])}"


def explain_renderable(doc: dict[str, Any]) -> Group:
    """metric x stratum: estimate, the deciding bound, margin, n, both arms' mean and p99, decision."""
    parts: list[Any] = [Panel(f"rollout [bold]{doc['rollout_id']}[/] {doc['bundle']}  state [bold]{doc['state']}[/]")]
    for s in doc["strata"]:
        title = (f"{s['stratum']}  {s['state']} step {step_number(s['step_index'])}  verdict "
                 f"{s['decision']}/{s['gate']}  deciding: {s.get('deciding_metric') or '-'}")
        t = Table("metric", "kind", "value", "bound", "margin", "n", "stable", "candidate", "decision", "decided",
                  title=title, caption=(s.get("reason") or "") + "\nbound: the one-sided confidence bound that decides "
                  "(upper: below the margin to pass; lower: above it to roll back)")
        for col in t.columns:
            col.overflow = "fold"  # folded, never cut
        for m in s["metrics"]:
            margin = m["margin"]
            if m["unit"] == "ratio" and margin is not None:
                margin_s = f"+{margin:.0%}"
            elif m["unit"] == "log_ratio":
                margin_s = _fmt_metric("log_ratio", margin)
            else:
                margin_s = "-" if margin is None else f"{margin:g}"
            t.add_row(m["metric"], m["kind"], _fmt_metric(m["unit"], m["value"]), _fmt_bound(m), margin_s, str(m["n"]),
                      _fmt_arm(m, "stable"), _fmt_arm(m, "candidate"), m["decision"],
                      "[bold]yes[/]" if m["deciding"] else "")
        parts.append(t)
    return Group(*parts)


@rollout_app.command("explain")
def rollout_explain(
    ctx: typer.Context,
    rollout_id: RolloutIdArg,
    stratum: Annotated[str | None, typer.Option(help="Only this stratum.")] = None,
    url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False,
) -> None:
    """Explain the judge's verdicts: every metric per stratum (value, bounds, margin, decision, which decided)."""
    doc = fetch(ctx, url, token, json_out, f"/v1/rollouts/{rollout_id}/explain", stratum=stratum)
    console.print(explain_renderable(doc))
