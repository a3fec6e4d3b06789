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
    fail,
    print_json,
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


token_app = typer.Typer(help="API tokens (direct database access).", no_args_is_help=True)


@token_app.command("create")
def token_create(
    role: Annotated[str, typer.Option(help="agent, operator or viewer.")],
    node: Annotated[str | None, typer.Option(help="Bind an agent token to this node.")] = None,
    name: Annotated[str | None, typer.Option(help="Token name (who holds it).")] = None,
    db: Annotated[str | None, typer.Option("--db", help="Database URL (default: KERNELCTL_DATABASE_URL).")] = None,
) -> None:
    """Create a token and print it once (only its SHA-256 is stored)."""
    from controller.auth import ROLES, create_token
    from controller.db.engine import check_schema_current, make_engine, session_factory, session_scope
    from kernelctl.settings import get_settings

    if role not in ROLES:
        fail(f"unknown role {role!r}: expected one of {', '.join(ROLES)}", EXIT_USAGE)
    if node is not None and role != "agent":
        fail("--node only applies to agent tokens", EXIT_USAGE)
    with database_errors():
        engine = make_engine(db or get_settings().database_url)
        check_schema_current(engine)
        try:
            with session_scope(session_factory(engine)) as session:
                token = create_token(session, role, name or (f"node:{node}" if node else role), node=node)
        except ValueError as exc:
            fail(str(exc), EXIT_USAGE)
    typer.echo(token)


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
        console.print(f"registered [bold]{out['ref']}[/] digest {out['digest'][:16]}… signed by {out['signer_key_id']}")


def bundle_list(ctx: typer.Context, name: Annotated[str | None, typer.Option(help="Only this bundle name.")] = None,
                url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """List registered bundle versions."""
    rows = _remote(ctx, url, token).request("GET", "/v1/bundles", params={"name": name} if name else None)
    if json_out:
        print_json(rows)
        return
    table = Table("bundle", "status", "digest", "signer", "size", "created", "by")
    for b in rows:
        table.add_row(b["ref"], b["status"], b["digest"][:12], b["signer_key_id"], str(b["size_bytes"]),
                      b["created_at"][:19], b["created_by"])
    console.print(table)


def bundle_show(ctx: typer.Context, ref: Annotated[str, typer.Argument(help="NAME@VERSION")],
                url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """Show one bundle version (targets, digest, manifest)."""
    name, version = _split_ref(ref)
    b = _remote(ctx, url, token).request("GET", f"/v1/bundles/{name}/{version}")
    if json_out:
        print_json(b)
        return
    console.print(f"[bold]{b['ref']}[/] {b['status']}  digest {b['digest']}  signer {b['signer_key_id']}")
    for t in b["targets"]:
        console.print(f"  target {t['arch']} driver>={t['min_driver']} cuda {t['cuda']} triton {t['triton']} "
                      f"torch {t['torch']}")


def register_bundle_commands(bundle_app: typer.Typer) -> None:
    """Add ``push``, ``list`` and ``show`` to the ``kernelctl bundle`` sub-app."""
    bundle_app.command("push")(bundle_push)
    bundle_app.command("list")(bundle_list)
    bundle_app.command("show")(bundle_show)


# ------------------------------------------------------------------------------------------ rollouts
rollout_app = typer.Typer(help="Start and follow rollouts.", no_args_is_help=True)


def _rollout_renderable(r: dict[str, Any]) -> Group:
    head = (f"rollout [bold]{r['id']}[/] {r['bundle']}  state [bold]{r['state']}[/]  step {r['step_index']}"
            f"  by {r['created_by']}" + (f"  reason: {r['reason']}" if r.get("reason") else ""))
    strata = Table("stratum", "state", "step", "baseline", "fleet", "assigned", "active", "latest verdict",
                   "evidence", title="strata")
    for s in r["strata"]:
        v = s.get("latest_verdict")
        ev = ""
        if v:
            keys = ("reason", "log_ratio", "ci", "lower", "upper", "margin", "n", "failures")
            ev = ", ".join(f"{k}={v['evidence'][k]}" for k in keys if k in v["evidence"])[:80]
        strata.add_row(
            s["stratum"], s["state"], str(s["step_index"]), s.get("baseline") or "-",
            str(s["nodes"].get("fleet", 0)), str(s["nodes"].get("assigned", 0)), str(s["nodes"].get("active", 0)),
            f"{v['decision']}/{v['gate']} ({v['samples']} samples)" if v else "-", ev,
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
    url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False,
) -> None:
    """Start a canary rollout of a registered bundle version."""
    _split_ref(ref)
    body: dict[str, Any] = {"bundle": ref, "force": force, "reason": reason}
    if plan is not None:
        body["plan"] = _read_plan(plan)
    r = _remote(ctx, url, token).request("POST", "/v1/rollouts", json=body)
    if json_out:
        print_json(r)
    else:
        console.print(f"rollout [bold]{r['id']}[/] of {r['bundle']} started ({r['state']}, "
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
        table.add_row(str(r["id"]), r["bundle"], r["state"], str(r["step_index"]), r["created_at"][:19],
                      r["created_by"], r.get("reason") or "")
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


def _transition(ctx: typer.Context, rollout_id: int, action: str, body: dict[str, Any], url: str | None,
                token: str | None, json_out: bool) -> None:
    r = _remote(ctx, url, token).request("POST", f"/v1/rollouts/{rollout_id}/{action}", json=body)
    if json_out:
        print_json(r)
    else:
        console.print(f"rollout [bold]{r['id']}[/] {r['bundle']}: {r['state']} (step {r['step_index']})")


def promote_cmd(ctx: typer.Context, rollout_id: Annotated[int, typer.Argument(help="Rollout id.")],
                reason: Annotated[str, typer.Option(help="Why (recorded in the changelog).")],
                full: Annotated[bool, typer.Option("--full", help="Promote every stratum to 100% now.")] = False,
                url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """Advance a rollout one step (or fully with --full)."""
    _transition(ctx, rollout_id, "promote", {"full": full, "reason": reason}, url, token, json_out)


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
    """List nodes: stratum, liveness, active versions."""
    rows = _remote(ctx, url, token).request("GET", "/v1/nodes", params={"state": state} if state else None)
    if json_out:
        print_json(rows)
        return
    table = Table("node", "state", "stratum", "gpu", "last heartbeat", "active", "desired")
    for n in rows:
        table.add_row(n["name"], n["state"], n["stratum"], n["gpu_name"], n["last_heartbeat_at"][:19],
                      ", ".join(f"{k}@{v}" for k, v in n["active"].items()),
                      ", ".join(f"{k}@{v}" for k, v in n["desired"].items()))
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
    table = Table("bundle", *strata, title="compatibility")
    for b in bundles:
        out = []
        for s in strata:
            c = cells.get((b, s))
            if c is None:
                out.append("-")
                continue
            label = c["state"] + (f" (step {c['step']})" if c.get("step") is not None else "")
            out.append(f"[{STATE_STYLE.get(c['state'], 'white')}]{label}[/] {c['eligible_nodes']}/{c['nodes']}")
        table.add_row(b, *out)
    console.print(table)


def mount(app: typer.Typer, *, bundle_app: typer.Typer | None = None) -> None:
    """Add the controller commands to the root ``kernelctl`` app (and bundle push/list/show)."""
    if app.registered_callback is None:
        app.callback()(remote_callback)
    app.command("serve")(serve_cmd)
    app.add_typer(token_app, name="token")
    app.add_typer(rollout_app, name="rollout")
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
