"""Measurements of a fleet simulation: the controller's own histograms from ``/metrics``, the client-side
latencies, the checks that decide whether the run passed, and the table.

Time to rollback is measured twice: from the rollback decision (the judge's verdict time, read from the
rollout) to each canary's switch back to the stable version (the issue's goal), and from the first offending
report sent in the stratum (includes detection). The checks: the run finished, every stratum ended as the
scenario expects, no false rollback, no acknowledged report missing from the database, every rolled-back
canary back on stable, no node stale except the agents the scenario stopped (and those all stale).
"""

from __future__ import annotations

import datetime as dt
import math
import os
from collections import defaultdict
from typing import Any

import numpy as np

from kernelctl.vocab import FullHeartbeat
from sim.fleet.agents import Fleet, Stats
from sim.fleet.config import BUNDLE, FleetConfig


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _metric_histogram(text: str, name: str, must: str = "") -> dict[str, Any]:
    """count, sum and bucket counts of a Prometheus histogram (label sets containing ``must``, summed)."""
    count = total = 0.0
    buckets: dict[float, float] = defaultdict(float)
    for line in text.splitlines():
        if must and must not in line:
            continue
        if line.startswith(name + "_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[math.inf if le == "+Inf" else float(le)] += float(line.rsplit(" ", 1)[1])
    return {"count": count, "sum": total, "buckets": dict(sorted(buckets.items()))}


def _metric_counter(text: str, name: str, must: str = "") -> float:
    """A Prometheus counter's value (label sets containing ``must``, summed)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and must in line)


def _hist_quantile(h: dict[str, Any], q: float) -> float | None:
    if not h["count"]:
        return None
    target = q * h["count"]
    for le, c in h["buckets"].items():
        if c >= target:
            return le
    return None


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def decision_times(detail: dict[str, Any]) -> dict[str, float]:
    """stratum -> wall-clock time (epoch seconds) of its rollback verdict."""
    out: dict[str, float] = {}
    for s in detail.get("strata", []):
        v = s.get("latest_verdict") or {}
        if s.get("state") == "rolled_back" and v.get("decision") == "rollback" and v.get("at"):
            at = dt.datetime.fromisoformat(str(v["at"]).replace("Z", "+00:00"))
            if at.tzinfo is None:
                at = at.replace(tzinfo=dt.timezone.utc)
            out[s["stratum"]] = at.timestamp()
    return out


def summarise(cfg: FleetConfig, fleet: Fleet, stats: Stats, detail: dict[str, Any], rolled: set[str],
              back: list[str], metrics_text: str, nodes: list[dict[str, Any]], stored: set[str], wall: float,
              phases: dict[str, float], restart: dict[str, float] | None) -> dict[str, Any]:
    """The run's measurements and checks (JSON-ready)."""
    sc = cfg.scenario
    lost = sorted(stats.acked - stored)
    unacked = sorted(stats.sent_keys - stats.acked - stats.refused)
    strata = {s["stratum"]: s["state"] for s in detail.get("strata", [])}
    false_rb = sorted(s for s, st in strata.items() if st == "rolled_back" and sc.expected_state(s) != "rolled_back")
    ttr = [stats.back_to_stable[n] - stats.first_offending[s] for n, s in stats.canary_strata.items()
           if s in rolled and n in stats.back_to_stable and s in stats.first_offending]
    decided = decision_times(detail)
    ttr_decision = [stats.back_to_stable_wall[n] - decided[s] for n, s in stats.canary_strata.items()
                    if s in decided and n in stats.back_to_stable_wall]
    reg = sorted(stats.registered_at.values())
    span = (stats.last_report_at or 0) - (stats.first_report_at or 0)
    tick = _metric_histogram(metrics_text, "kernelctl_tick_duration_seconds")
    http = {ep: {"count": len(v), "p50_ms": round(pct(v, 50) * 1000, 2), "p99_ms": round(pct(v, 99) * 1000, 2),
                 "errors": dict(stats.errors.get(ep, {}))} for ep, v in sorted(stats.latency.items()) if v}
    for ep, route in (("reports", "/v1/agents/reports"), ("register", "/v1/agents/register")):
        h = _metric_histogram(metrics_text, "kernelctl_http_request_duration_seconds", f'route="{route}"')
        if ep in http and h["count"]:
            http[ep]["server_mean_ms"] = round(h["sum"] / h["count"] * 1000, 2)
            q = _hist_quantile(h, 0.99)
            http[ep]["server_p99_le_ms"] = None if q is None else q * 1000
            ok = _metric_histogram(metrics_text, "kernelctl_http_request_duration_seconds",
                                   f'route="{route}",status="200"')
            if ok["count"]:  # the answered requests alone (a 503 with Retry-After is quick)
                q = _hist_quantile(ok, 0.99)
                http[ep]["server_200"] = {"count": int(ok["count"]), "mean_ms": round(ok["sum"] / ok["count"] * 1000, 2),
                                          "p99_le_ms": None if q is None else q * 1000}
            busy = _metric_histogram(metrics_text, "kernelctl_http_request_duration_seconds",
                                     f'route="{route}",status="503"')
            http[ep]["server_503"] = int(busy["count"])
    if "heartbeat" in http:  # the controller's time per heartbeat without the watch's hold, by path
        for path in ("fast", "switch", "slow", ""):
            h = _metric_histogram(metrics_text, "kernelctl_heartbeat_service_seconds", f'path="{path}"' if path else "")
            if h["count"]:
                q = _hist_quantile(h, 0.99)
                http["heartbeat"][f"server_{path or 'all'}"] = {
                    "count": int(h["count"]), "mean_ms": round(h["sum"] / h["count"] * 1000, 2),
                    "p99_le_ms": None if q is None else q * 1000}
    server: dict[str, Any] = {}  # the controller's own work: group commits, snapshot reloads, catch-up waits
    for key, name, must in (("registrations", "kernelctl_group_commit_seconds", 'what="registrations"'),
                            ("switches", "kernelctl_group_commit_seconds", 'what="switches"'),
                            ("reload", "kernelctl_desired_reload_seconds", ""),
                            ("catch_up_watch", "kernelctl_heartbeat_catch_up_seconds", 'watch="true"'),
                            ("catch_up_other", "kernelctl_heartbeat_catch_up_seconds", 'watch="false"')):
        h = _metric_histogram(metrics_text, name, must)
        if h["count"]:
            q = _hist_quantile(h, 0.99)
            server[key] = {"count": int(h["count"]), "mean_ms": round(h["sum"] / h["count"] * 1000, 2),
                           "p99_le_ms": None if q is None else q * 1000}
    full = {reason.value: int(n) for reason in FullHeartbeat
            if (n := _metric_counter(metrics_text, "kernelctl_heartbeat_full_total", f'reason="{reason.value}"'))}
    if full:
        server["full_heartbeat_reasons"] = full
    stale_names = {n["name"] for n in nodes if n.get("state") == "stale"}
    stale_nodes = len(stale_names)
    stopped_names = {a.name for a in fleet.agents if a.stopped}
    stopped = len(stopped_names)
    checks = {
        "finished": not detail.get("timed_out") and bool(strata),
        "strata_as_expected": bool(strata) and all(st == sc.expected_state(s) for s, st in strata.items()),
        "no_false_rollback": not false_rb,
        "no_report_lost": not lost,
        "rolled_back_canaries_back_on_stable": all(n in stats.back_to_stable for n in back),
    }
    checks["no_node_stale_but_the_stopped"] = not (stale_names - stopped_names)
    checks["no_node_locked_out"] = not stats.locked_out
    if sc.stale_share:
        checks["stopped_agents_marked_stale"] = stopped > 0 and stopped_names <= stale_names
    out: dict[str, Any] = {
        "scenario": sc.name, "nodes": cfg.nodes, "candidate": f"{BUNDLE}@{sc.candidate}",
        "heartbeat_seconds": cfg.heartbeat_seconds, "tick_seconds": cfg.tick_seconds,
        "connections": cfg.connections, "ingest_processes": cfg.ingest_processes, "api_workers": cfg.api_workers, "cpus": os.cpu_count(),
        "wall_s": round(wall, 2),
        "phases_s": {k: round(v, 2) for k, v in phases.items()},
        "rollout": {"id": detail.get("id"), "state": detail.get("state"), "strata": strata},
        "outcome": "timeout" if detail.get("timed_out") else detail.get("state"),
        "aborted": detail.get("aborted"),
        "false_rollbacks": false_rb,
        "reports": {"sent": len(stats.sent_keys), "acknowledged": len(stats.acked), "accepted": stats.accepted,
                    "duplicates": stats.duplicates, "stored": len(stored & stats.sent_keys),
                    "refused": len(stats.refused - stored), "lost": len(lost),
                    "lost_keys": lost[:20], "unacknowledged": len(unacked),
                    "throughput_per_s": round(stats.accepted / span, 1) if span > 0 else None},
        "http": http, "server": server,
        "heartbeats_per_s": {"intended": round(cfg.nodes / cfg.heartbeat_seconds, 1),
                             "achieved": round(len(stats.latency.get("heartbeat", [])) / wall, 1) if wall else None},
        "tick": {"count": int(tick["count"]),
                 "mean_ms": round(tick["sum"] / tick["count"] * 1000, 2) if tick["count"] else None,
                 "p99_le_ms": (lambda q: None if q is None else q * 1000)(_hist_quantile(tick, 0.99))},
        "time_to_rollback_s": {"canaries": len(ttr), "p50": _r(pct(ttr, 50)), "p99": _r(pct(ttr, 99)),
                               "max": _r(max(ttr) if ttr else None)},
        "decision_to_stable_s": {"canaries": len(ttr_decision), "p50": _r(pct(ttr_decision, 50)),
                                 "p99": _r(pct(ttr_decision, 99)),
                                 "max": _r(max(ttr_decision) if ttr_decision else None)},
        "registration_s": {"first": _r(reg[0] - fleet.started) if reg else None,
                           "all": _r(reg[-1] - fleet.started) if len(reg) == cfg.nodes else None},
        "stale": {"agents_stopped": stopped, "nodes_stale": stale_nodes},
        "registered": sum(1 for a in fleet.agents if a.token),
        "registration": {"locked_out": len(stats.locked_out), "replies_lost_on_purpose": stats.lost_replies,
                         "timeout_s": 10.0},
        "downloads": {"completed": stats.downloads, "failed_and_retried": stats.download_failures,
                      "per_agent": cfg.download_per_agent},
        "report_kb": list(cfg.report_kb),
        "checks": checks, "passed": all(checks.values()),
    }
    if restart is not None:
        out["controller_restart"] = restart
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def print_table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"fleet simulation: {res['scenario']} ({res['nodes']} nodes, heartbeat "
                    f"{res['heartbeat_seconds']:g}s, {res['cpus']} CPUs)")
    t.add_column("measure")
    t.add_column("value", justify="right")
    rep, ttr = res["reports"], res["time_to_rollback_s"]
    rows = [
        ("outcome", f"{res['outcome']}  {res['rollout']['strata']}"),
        ("checks", "PASS" if res["passed"] else "FAIL " + ", ".join(k for k, v in res["checks"].items() if not v)),
        ("false rollbacks", str(len(res["false_rollbacks"]))),
        ("reports sent / stored / lost", f"{rep['sent']} / {rep['stored']} / {rep['lost']}"),
        ("report throughput", f"{rep['throughput_per_s']} reports/s accepted"),
        ("judge tick (mean, p99 bucket)", f"{res['tick']['mean_ms']} ms, <= {res['tick']['p99_le_ms']} ms"),
        ("time to rollback p50/p99/max", f"{ttr['p50']} / {ttr['p99']} / {ttr['max']} s ({ttr['canaries']} canaries)"),
        ("decision -> stable p50/p99/max", "{p50} / {p99} / {max} s".format(**res["decision_to_stable_s"])),
        ("registration (all nodes)", f"{res['registration_s']['all']} s, {res['registration']['locked_out']} "
                                     f"locked out, {res['registration']['replies_lost_on_purpose']} replies lost"),
        ("downloads", f"{res['downloads']['completed']} ({'per agent' if res['downloads']['per_agent'] else 'once'})"),
        ("nodes stale", str(res["stale"]["nodes_stale"])),
        ("wall", f"{res['wall_s']} s {res['phases_s']}"),
    ]
    for ep, h in res["http"].items():
        rows.append((f"HTTP {ep} p50/p99", f"{h['p50_ms']} / {h['p99_ms']} ms  n={h['count']} errors={h['errors']}"))
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)


