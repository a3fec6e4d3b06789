"""Controller CLI: ``serve``, ``token create`` (direct DB), and the operator CLI over HTTP (httpx).

Remote commands use ``--url``/``--token`` (root flags or per command) or ``KERNELCTL_URL``/``KERNELCTL_TOKEN``.
Exit codes: 0 ok, 1 server/other error, 2 usage, 3 refused/conflict (409, 413, 422), 4 not found,
5 auth (401/403); failures print one line on stderr, never a traceback. ``mount(app)`` adds every command
to the root ``kernelctl`` app; ``register_bundle_commands(bundle_app)`` adds ``push``/``list``/``show``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from kernelctl.console import (
    EXIT_AUTH,
    EXIT_ERROR,
    EXIT_NOT_FOUND,
    EXIT_REFUSED,
    EXIT_USAGE,
    console,
    database_errors,
    esc,
    fail,
    print_json,
    safe,
)

UrlOption = Annotated[str | None, typer.Option("--url", help="Controller URL (default: KERNELCTL_URL).")]
TokenOption = Annotated[
    str | None, typer.Option("--token", help="Bearer token (default: KERNELCTL_TOKEN).", show_default=False)
]
JsonOption = Annotated[bool, typer.Option("--json", help="JSON output.")]
TERMINAL = ("promoted", "rolled_back")
STATUS_EXIT = {400: EXIT_USAGE, 401: EXIT_AUTH, 403: EXIT_AUTH, 404: EXIT_NOT_FOUND, 409: EXIT_REFUSED,
               413: EXIT_REFUSED, 422: EXIT_REFUSED}


# ------------------------------------------------------------------------------------------ client
def remote_callback(ctx: typer.Context, url: UrlOption = None, token: TokenOption = None) -> None:
    """Root options shared by the remote commands."""
    ctx.ensure_object(dict)
    if url:
        ctx.obj["url"] = url
    if token:
        ctx.obj["token"] = token


class Remote:
    """A thin httpx client that turns every failure into one line and the CLI's exit code."""

    def __init__(self, url: str, token: str | None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    @classmethod
    def from_ctx(cls, ctx: typer.Context | None, url: str | None, token: str | None) -> Remote:
        from kernelctl.settings import Settings

        obj = {}
        if ctx is not None:
            root = ctx.find_root()
            obj = root.obj if isinstance(root.obj, dict) else {}
        from pydantic import ValidationError

        try:
            settings = Settings()
        except ValidationError as exc:
            e = exc.errors()[0]
            fail(f"invalid KERNELCTL_{str(e['loc'][0]).upper()}: {e['msg']}", EXIT_USAGE)
        url = url or obj.get("url") or settings.url
        token = token or obj.get("token") or settings.token
        if not url.startswith(("http://", "https://")):
            fail(f"invalid controller URL {url!r}: expected http(s)://HOST:PORT", EXIT_USAGE)
        if not token:
            fail("no token: pass --token or set KERNELCTL_TOKEN", EXIT_AUTH)
        return cls(url, token)

    def request(self, method: str, path: str, **kw: Any) -> Any:
        try:
            resp = self.client.request(method, path, **kw)
        except httpx.TimeoutException:
            fail(f"controller at {self.url} did not answer in time")
        except httpx.HTTPError as exc:
            fail(f"cannot reach the controller at {self.url}: {exc}")
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail")
            except ValueError:
                detail = resp.text.strip()[:300] or resp.reason_phrase
            if isinstance(detail, list):  # FastAPI validation errors: name the fields
                detail = "; ".join(
                    (f"{field}: {d.get('msg')}" if (field := ".".join(str(x) for x in d.get("loc", [])[1:]))
                     else str(d.get("msg")))
                    for d in detail[:5]
                )
            fail(f"{resp.status_code} {detail}", STATUS_EXIT.get(resp.status_code, EXIT_ERROR))
        ctype = resp.headers.get("content-type", "")
        return resp.json() if ctype.startswith("application/json") else resp.content


def _remote(ctx: typer.Context, url: str | None, token: str | None) -> Remote:
    return Remote.from_ctx(ctx, url, token)


def _split_ref(ref: str) -> tuple[str, str]:
    name, sep, version = ref.partition("@")
    if not sep or not name or not version:
        fail(f"bad bundle reference {ref!r}: expected NAME@VERSION", EXIT_USAGE)
    return name, version


# ------------------------------------------------------------------------------------------ serve/token
def serve_cmd(
    host: Annotated[str | None, typer.Option(help="Listen address (default: KERNELCTL_LISTEN_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port, 0 for any free (default: KERNELCTL_LISTEN_PORT).")] = None,
    db: Annotated[str | None, typer.Option("--db", help="Database URL (default: KERNELCTL_DATABASE_URL).")] = None,
    trusted_keys: Annotated[Path | None, typer.Option(help="Directory of trusted *.pub keys.")] = None,
    bootstrap_tokens: Annotated[Path | None, typer.Option(help="File of `role name token [node]` lines.")] = None,
    tick_seconds: Annotated[float | None, typer.Option(help="Judge tick period.")] = None,
    port_file: Annotated[Path | None, typer.Option(help="Write the bound port here once listening.")] = None,
) -> None:
    """Run the controller (HTTP API + leader-only scheduler) until SIGTERM."""
    from pydantic import ValidationError

    from controller.server import serve
    from kernelctl.settings import Settings

    overrides = {
        k: v
        for k, v in {
            "listen_host": host, "listen_port": port, "database_url": db, "trusted_keys_dir": trusted_keys,
            "bootstrap_tokens_file": bootstrap_tokens, "tick_seconds": tick_seconds,
        }.items()
        if v is not None
    }
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        e = exc.errors()[0]
        fail(f"invalid setting {'.'.join(str(x) for x in e['loc'])}: {e['msg']}", EXIT_USAGE)
    with database_errors():
        try:
            serve(settings, port_file=port_file)
        except (OSError, ValueError) as exc:
            fail(str(exc))
        except Exception as exc:  # kernelpack key errors and the like: one line
            fail(f"{type(exc).__name__}: {exc}")


token_app = typer.Typer(help="API tokens (direct database access): create, list, revoke.", no_args_is_help=True)
DbFlag = Annotated[str | None, typer.Option("--db", help="Database URL (default: KERNELCTL_DATABASE_URL).")]


def _token_db(db: str | None):  # type: ignore[no-untyped-def]
    from controller.db.engine import check_schema_current, make_engine, session_factory
    from kernelctl.settings import get_settings

    engine = make_engine(db or get_settings().database_url)
    check_schema_current(engine)
    return session_factory(engine)


def _expiry(value: str | None):  # type: ignore[no-untyped-def]
    """``--expires-in``: an age like 30d / 12h / 90m (at most 100 years) from now."""
    if value is None:
        return None
    import datetime as dt

    from controller.audit import AuditQueryError, parse_time

    try:
        now = dt.datetime.now(dt.timezone.utc)
        return now + (now - parse_time(value, now=now))
    except AuditQueryError as exc:
        fail(f"--expires-in: {exc}", EXIT_USAGE)


@token_app.command("create")
def token_create(
    role: Annotated[str, typer.Option(help="agent, operator or viewer.")],
    node: Annotated[str | None, typer.Option(help="Bind an agent token to this node (revokes its earlier tokens: "
                                             "this is how an operator approves a node's re-registration).")] = None,
    name: Annotated[str | None, typer.Option(help="Token name (who holds it).")] = None,
    expires_in: Annotated[str | None, typer.Option("--expires-in", help="Expire after this long (30d, 12h).")] = None,
    db: DbFlag = None,
) -> None:
    """Create a token and print it once (only its SHA-256 is stored)."""
    from controller.auth import ROLES, create_token
    from controller.db.engine import session_scope

    if role not in ROLES:
        fail(f"unknown role {role!r}: expected one of {', '.join(ROLES)}", EXIT_USAGE)
    if node is not None and role != "agent":
        fail("--node only applies to agent tokens", EXIT_USAGE)
    expires_at = _expiry(expires_in)
    with database_errors():
        try:
            with session_scope(_token_db(db)) as session:
                token = create_token(session, role, name or (f"node:{node}" if node else role), node=node,
                                     expires_at=expires_at)
        except ValueError as exc:
            fail(str(exc), EXIT_USAGE)
    typer.echo(token)


@token_app.command("list")
def token_list(
    all_: Annotated[bool, typer.Option("--all", help="Include revoked tokens.")] = False,
    node: Annotated[str | None, typer.Option(help="Only tokens of this node.")] = None,
    db: DbFlag = None, json_out: JsonOption = False,
) -> None:
    """List tokens (never their values): id, name, role, node, created, expires, state."""
    from controller.auth import list_tokens

    with database_errors(), _token_db(db)() as session:
        rows = [r for r in list_tokens(session, include_revoked=all_) if node is None or r["node"] == node]
    if json_out:
        print_json(rows)
        return
    table = Table("id", "name", "role", "node", "created", "expires", "state")
    for r in rows:
        table.add_row(str(r["id"]), safe(r["name"]), safe(r["role"]), safe(r["node"] or "-"),
                      safe(str(r["created_at"])[:19]), safe(str(r["expires_at"] or "never")[:19]), safe(r["state"]))
    console.print(table)


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[int | None, typer.Argument(help="Token id (see `kernelctl token list`).")] = None,
    node: Annotated[str | None, typer.Option(help="Revoke every token of this node instead.")] = None,
    reason: Annotated[str | None, typer.Option(help="Why (recorded in the changelog).")] = None,
    db: DbFlag = None,
) -> None:
    """Revoke a token (or all of a node's). Effective at once on a controller's next lookup, and within
    KERNELCTL_AUTH_CACHE_SECONDS (default 5 s) where the controller has it cached."""
    from controller.auth import revoke_node_tokens, revoke_token
    from controller.db.engine import session_scope

    if (token_id is None) == (node is None):
        fail("give a token id or --node NAME (not both)", EXIT_USAGE)
    if token_id is not None and not 1 <= token_id <= 2**63 - 1:
        fail(f"token id {token_id} is out of range", EXIT_USAGE)
    with database_errors():
        try:
            with session_scope(_token_db(db)) as session:
                if node is not None:
                    ids = revoke_node_tokens(session, node, actor="cli", reason=reason or "revoked by operator")
                    message = f"revoked {len(ids)} token(s) of node {node}"
                else:
                    assert token_id is not None
                    done = revoke_token(session, token_id, actor="cli", reason=reason)
                    message = f"token {token_id} " + ("revoked" if done else "was already revoked")
        except LookupError as exc:
            fail(str(exc).strip("'\""), EXIT_NOT_FOUND)
    console.print(safe(message))


# ------------------------------------------------------------------------------------------ bundles
def bundle_push(ctx: typer.Context, file: Annotated[Path, typer.Argument(help="The .kpack file.")],
                url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """Upload a signed bundle to the controller (verified there with its trusted keys)."""
    try:
        data = file.read_bytes()
    except OSError as exc:
        fail(f"cannot read {file}: {exc.strerror or exc}", EXIT_USAGE)
    out = _remote(ctx, url, token).request(
        "POST", "/v1/bundles", content=data, headers={"Content-Type": "application/octet-stream"}
    )
    if json_out:
        print_json(out)
    else:
        console.print(f"registered [bold]{esc(out['ref'])}[/] digest {esc(out['digest'][:16])}… signed by "
                      f"{esc(out['signer_key_id'])}")


def bundle_list(ctx: typer.Context, name: Annotated[str | None, typer.Option(help="Only this bundle name.")] = None,
                url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """List registered bundle versions."""
    rows = _remote(ctx, url, token).request("GET", "/v1/bundles", params={"name": name} if name else None)
    if json_out:
        print_json(rows)
        return
    table = Table("bundle", "status", "digest", "signer", "size", "created", "by")
    for b in rows:
        table.add_row(safe(b["ref"]), safe(b["status"]), safe(b["digest"][:12]), safe(b["signer_key_id"]),
                      str(b["size_bytes"]), safe(b["created_at"][:19]), safe(b["created_by"]))
    console.print(table)


def bundle_show(ctx: typer.Context, ref: Annotated[str, typer.Argument(help="NAME@VERSION")],
                url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """Show one bundle version (targets, digest, manifest)."""
    name, version = _split_ref(ref)
    b = _remote(ctx, url, token).request("GET", f"/v1/bundles/{name}/{version}")
    if json_out:
        print_json(b)
        return
    console.print(f"[bold]{esc(b['ref'])}[/] {esc(b['status'])}  digest {esc(b['digest'])}  signer "
                  f"{esc(b['signer_key_id'])}")
    for t in b["targets"]:
        console.print(safe(f"  target {t['arch']} driver>={t['min_driver']} cuda {t['cuda']} triton {t['triton']} "
                           f"torch {t['torch']}"))


def register_bundle_commands(bundle_app: typer.Typer) -> None:
    """Add ``push``, ``list`` and ``show`` to the ``kernelctl bundle`` sub-app."""
    bundle_app.command("push")(bundle_push)
    bundle_app.command("list")(bundle_list)
    bundle_app.command("show")(bundle_show)


# ------------------------------------------------------------------------------------------ rollouts
rollout_app = typer.Typer(help="Start and follow rollouts.", no_args_is_help=True)


def _rollout_renderable(r: dict[str, Any]) -> Group:
    head = (f"rollout [bold]{esc(r['id'])}[/] {esc(r['bundle'])}  state [bold]{esc(r['state'])}[/]  step "
            f"{esc(r['step_index'])}  by {esc(r['created_by'])}" + (f"  reason: {esc(r['reason'])}" if r.get("reason")
                                                                   else ""))
    strata = Table("stratum", "state", "step", "baseline", "fleet", "assigned", "active",
                   "staged/verified/serving", "latest verdict", "deciding metric", "evidence", title="strata")
    for s in r["strata"]:
        v = s.get("latest_verdict")
        ev = ""
        if v:
            keys = ("reason", "log_ratio", "ci", "lower", "upper", "margin", "n", "failures")
            ev = ", ".join(f"{k}={v['evidence'][k]}" for k in keys if k in v["evidence"])[:80]
        strata.add_row(
            safe(s["stratum"]), safe(s["state"]), str(s["step_index"]), safe(s.get("baseline") or "-"),
            str(s["nodes"].get("fleet", 0)), str(s["nodes"].get("assigned", 0)), str(s["nodes"].get("active", 0)),
            "/".join(str(s["nodes"].get(p, 0)) for p in ("staged", "verified", "serving")),
            safe(f"{v['decision']}/{v['gate']} ({v['samples']} samples)") if v else "-",
            safe(v["evidence"].get("deciding_metric") or "-") if v else "-", safe(ev),
        )
    steps = Table("step", "size", "bake s", "min samples", "deadline s", title="plan")
    for st in r["steps"]:
        size = f"{st['nodes']} node(s)" if st["nodes"] is not None else f"{st['percent']:g}%"
        steps.add_row(str(st["index"]), size, f"{st['bake_seconds']:g}", str(st["min_samples"]),
                      f"{st['deadline_seconds']:g}")
    return Group(Panel(head), strata, steps)


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
    _split_ref(ref)
    body: dict[str, Any] = {"bundle": ref, "force": force, "reason": reason}
    if accept_contract_change is not None:
        body["accept_contract_change"] = accept_contract_change
    if plan is not None:
        body["plan"] = _read_plan(plan)
    r = _remote(ctx, url, token).request("POST", "/v1/rollouts", json=body)
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
    rows = _remote(ctx, url, token).request("GET", "/v1/rollouts", params={"state_filter": state} if state else None)
    if json_out:
        print_json(rows)
        return
    table = Table("id", "bundle", "state", "step", "created", "by", "reason")
    for r in rows:
        table.add_row(str(r["id"]), safe(r["bundle"]), safe(r["state"]), str(r["step_index"]),
                      safe(r["created_at"][:19]), safe(r["created_by"]), safe(r.get("reason") or ""))
    console.print(table)


@rollout_app.command("status")
def rollout_status(
    ctx: typer.Context,
    rollout_id: Annotated[int, typer.Argument(help="Rollout id.")],
    watch: Annotated[bool, typer.Option("--watch", help="Refresh until the rollout ends (Ctrl-C stops).")] = False,
    interval: Annotated[float, typer.Option(help="Refresh period with --watch.")] = 2.0,
    url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False,
) -> None:
    """Show a rollout: strata, step, nodes per state, latest verdicts with evidence."""
    remote = _remote(ctx, url, token)
    r = remote.request("GET", f"/v1/rollouts/{rollout_id}")
    if not watch:
        if json_out:
            print_json(r)
        else:
            console.print(_rollout_renderable(r))
        return
    try:
        if json_out:  # no live view: wait quietly, print the final state as JSON
            while r["state"] not in TERMINAL:
                time.sleep(max(0.2, interval))
                r = remote.request("GET", f"/v1/rollouts/{rollout_id}")
        else:
            with Live(_rollout_renderable(r), console=console, refresh_per_second=4) as live:
                while r["state"] not in TERMINAL:
                    time.sleep(max(0.2, interval))
                    r = remote.request("GET", f"/v1/rollouts/{rollout_id}")
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


def explain_renderable(doc: dict[str, Any]) -> Group:
    """metric x stratum: value, bounds, margin, n, decision, and which metric decided."""
    parts: list[Any] = [Panel(f"rollout [bold]{doc['rollout_id']}[/] {doc['bundle']}  state [bold]{doc['state']}[/]")]
    for s in doc["strata"]:
        title = (f"{s['stratum']}  {s['state']} step {s['step_index']}  verdict {s['decision']}/{s['gate']}"
                 f"  deciding: {s.get('deciding_metric') or '-'}")
        t = Table("metric", "kind", "value", "lower", "upper", "margin", "n", "decision", "decided", title=title,
                  caption=s.get("reason") or None)
        for m in s["metrics"]:
            margin = m["margin"]
            if m["unit"] == "ratio" and margin is not None:
                margin_s = f"+{margin:.0%}"
            elif m["unit"] == "log_ratio":
                margin_s = _fmt_metric("log_ratio", margin)
            else:
                margin_s = "-" if margin is None else f"{margin:g}"
            upper = m["upper"]
            upper_s = (f"{upper:g} (stable)" if m["kind"] == "launches" and upper is not None
                       else _fmt_metric(m["unit"], upper))
            t.add_row(m["metric"], m["kind"], _fmt_metric(m["unit"], m["value"]), _fmt_metric(m["unit"], m["lower"]),
                      upper_s, margin_s, str(m["n"]), m["decision"], "[bold]yes[/]" if m["deciding"] else "")
        parts.append(t)
    return Group(*parts)


@rollout_app.command("explain")
def rollout_explain(
    ctx: typer.Context,
    rollout_id: Annotated[int, typer.Argument(help="Rollout id.")],
    stratum: Annotated[str | None, typer.Option(help="Only this stratum.")] = None,
    url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False,
) -> None:
    """Explain the judge's verdicts: every metric per stratum (value, bounds, margin, decision, which decided)."""
    params = {"stratum": stratum} if stratum else None
    doc = _remote(ctx, url, token).request("GET", f"/v1/rollouts/{rollout_id}/explain", params=params)
    if json_out:
        print_json(doc)
    else:
        console.print(explain_renderable(doc))


def _transition(ctx: typer.Context, rollout_id: int, action: str, body: dict[str, Any], url: str | None,
                token: str | None, json_out: bool) -> None:
    r = _remote(ctx, url, token).request("POST", f"/v1/rollouts/{rollout_id}/{action}", json=body)
    if json_out:
        print_json(r)
    else:
        console.print(f"rollout [bold]{r['id']}[/] {esc(r['bundle'])}: {esc(r['state'])} (step {r['step_index']})")


def promote_cmd(ctx: typer.Context, rollout_id: Annotated[int, typer.Argument(help="Rollout id.")],
                reason: Annotated[str, typer.Option(help="Why (recorded in the changelog).")],
                from_step: Annotated[int | None, typer.Option(
                    "--from-step", "--expected-step",
                    help="The step you promote from (`rollout status` shows it; -1 for a pending rollout). "
                    "Required unless --full: a rollout no longer at that step is refused (exit 3), so a "
                    "repeated command promotes once.")] = None,
                full: Annotated[bool, typer.Option("--full", help="Promote every stratum to 100% now.")] = False,
                url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """Advance a rollout one step from --from-step (or fully with --full)."""
    if from_step is None and not full:
        fail(f"--from-step is required (the step rollout {rollout_id} is at now; -1 if pending), or use --full",
             EXIT_USAGE)
    body: dict[str, Any] = {"full": full, "reason": reason}
    if from_step is not None:
        body["from_step"] = from_step
    _transition(ctx, rollout_id, "promote", body, url, token, json_out)


def rollback_cmd(ctx: typer.Context, rollout_id: Annotated[int, typer.Argument(help="Rollout id.")],
                 reason: Annotated[str, typer.Option(help="Why (required; recorded in the changelog).")],
                 stratum: Annotated[list[str] | None, typer.Option("--stratum", help="Only this stratum (repeat).")] = None,
                 url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """Roll a rollout back (every canary node returns to stable)."""
    if not reason.strip():
        fail("--reason must not be empty", EXIT_USAGE)
    _transition(ctx, rollout_id, "rollback", {"reason": reason, "strata": stratum or None}, url, token, json_out)


def pause_cmd(ctx: typer.Context, rollout_id: Annotated[int, typer.Argument(help="Rollout id.")],
              reason: Annotated[str | None, typer.Option(help="Why.")] = None,
              url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """Pause a rollout (no further steps until resumed)."""
    _transition(ctx, rollout_id, "pause", {"reason": reason}, url, token, json_out)


def resume_cmd(ctx: typer.Context, rollout_id: Annotated[int, typer.Argument(help="Rollout id.")],
               reason: Annotated[str | None, typer.Option(help="Why.")] = None,
               url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """Resume a paused rollout."""
    _transition(ctx, rollout_id, "resume", {"reason": reason}, url, token, json_out)


# ------------------------------------------------------------------------------------------ fleet
def nodes_cmd(ctx: typer.Context, state: Annotated[str | None, typer.Option(help="active or stale.")] = None,
              url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """List nodes: stratum, liveness, active versions, a canary's phase (staged, verified, serving)."""
    rows = _remote(ctx, url, token).request("GET", "/v1/nodes", params={"state": state} if state else None)
    if json_out:
        print_json(rows)
        return
    table = Table("node", "state", "stratum", "gpu", "last heartbeat", "active", "desired", "phase")
    for n in rows:  # every cell is node-supplied or stored text: printed literally, never as markup
        table.add_row(safe(n["name"]), safe(n["state"]), safe(n["stratum"]), safe(n["gpu_name"]),
                      safe(str(n["last_heartbeat_at"])[:19]),
                      safe(", ".join(f"{k}@{v}" for k, v in n["active"].items())),
                      safe(", ".join(f"{k}@{v}" for k, v in n["desired"].items())),
                      safe(", ".join(f"{k}: {v}" for k, v in n.get("phases", {}).items()) or "-"))
    console.print(table)


STATE_STYLE = {"stable": "green", "candidate": "yellow", "rolled_back": "red", "revoked": "red",
               "eligible": "cyan", "ineligible": "dim"}


def compat_cmd(ctx: typer.Context, bundle: Annotated[str | None, typer.Option(help="Only this bundle name.")] = None,
               url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """The compatibility matrix: bundle versions x strata, the state in each cell."""
    rows = _remote(ctx, url, token).request("GET", "/v1/compat", params={"bundle": bundle} if bundle else None)
    if json_out:
        print_json(rows)
        return
    strata = sorted({r["stratum"] for r in rows})
    bundles = list(dict.fromkeys(r["bundle"] for r in rows))
    cells = {(r["bundle"], r["stratum"]): r for r in rows}
    table = Table("bundle", title="compatibility")
    for s in strata:
        table.add_column(safe(s))  # strata are built from node inventories: literal text
    for b in bundles:
        out = []
        for s in strata:
            c = cells.get((b, s))
            if c is None:
                out.append("-")
                continue
            label = esc(c["state"]) + (f" (step {esc(c['step'])})" if c.get("step") is not None else "")
            phases = ", ".join(f"{esc(n)} {esc(p)}" for p, n in (c.get("phases") or {}).items() if n)
            label += f" ({phases})" if phases else ""  # canaries staged / verified / serving
            style = STATE_STYLE.get(c["state"], "white")
            out.append(f"[{style}]{label}[/] {esc(c['eligible_nodes'])}/{esc(c['nodes'])}")
        table.add_row(safe(b), *out)
    console.print(table)


# ------------------------------------------------------------------------------------------ notify
notify_app = typer.Typer(help="Webhook notifications (KERNELCTL_NOTIFY_URLS).", no_args_is_help=True)


@notify_app.command("test")
def notify_test(
    url: Annotated[list[str] | None, typer.Option("--url", help="Send to this URL instead of "
                                                  "KERNELCTL_NOTIFY_URLS (repeatable).", show_default=False)] = None,
    json_out: JsonOption = False,
) -> None:
    """Send one test notification to every configured webhook; exit 1 if any delivery failed."""
    from controller.notify import NotifyConfigError, parse_targets, send_test
    from kernelctl.settings import Settings

    try:
        settings = Settings()
        targets = parse_targets(",".join(url) if url else settings.notify_urls)
    except NotifyConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    if not targets:
        fail("no webhook configured: set KERNELCTL_NOTIFY_URLS or pass --url", EXIT_USAGE)
    results = send_test(targets, timeout=settings.notify_timeout_seconds)
    rows = [{"target": t.shown, "ok": o.ok, "status": o.status, "attempts": o.attempts, "error": o.error,
             "seconds": o.seconds} for t, o in results]
    if json_out:
        print_json(rows)
    else:
        for r in rows:
            console.print(f"{r['target']}: " + (f"[green]delivered[/] (HTTP {r['status']}, {r['seconds']}s)"
                          if r["ok"] else f"[red]failed[/] after {r['attempts']} attempt(s): {r['error']}"))
    if not all(r["ok"] for r in rows):
        raise typer.Exit(EXIT_ERROR)


def mount(app: typer.Typer, *, bundle_app: typer.Typer | None = None) -> None:
    """Add the controller commands to the root ``kernelctl`` app (and bundle push/list/show)."""
    if app.registered_callback is None:
        app.callback()(remote_callback)
    app.command("serve")(serve_cmd)
    app.add_typer(token_app, name="token")
    app.add_typer(rollout_app, name="rollout")
    app.add_typer(notify_app, name="notify")
    app.command("promote")(promote_cmd)
    app.command("rollback")(rollback_cmd)
    app.command("pause")(pause_cmd)
    app.command("resume")(resume_cmd)
    app.command("nodes")(nodes_cmd)
    app.command("compat")(compat_cmd)
    if bundle_app is not None:
        register_bundle_commands(bundle_app)





def standalone_app() -> typer.Typer:
    """A root app with only the controller commands (``python -m controller.cli``), until/besides the root."""
    root = typer.Typer(name="kernelctl", no_args_is_help=True, pretty_exceptions_enable=False)
    bundle_app = typer.Typer(help="Bundles on the controller.", no_args_is_help=True)
    root.add_typer(bundle_app, name="bundle")
    mount(root, bundle_app=bundle_app)
    return root


if __name__ == "__main__":  # pragma: no cover
    standalone_app()()
