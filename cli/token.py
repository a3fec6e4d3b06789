"""``kernelctl token create|list|revoke``: API tokens, straight in the database (only hashes are stored)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from cli.common import DbOption, JsonOption, database_errors, resolve_db
from kernelctl.console import EXIT_NOT_FOUND, EXIT_USAGE, console, fail, print_json, safe
from kernelctl.settings import Settings

token_app = typer.Typer(help="API tokens (direct database access): create, list, revoke.", no_args_is_help=True)


def _token_db(db: str | None):  # type: ignore[no-untyped-def]
    from controller.db.engine import make_engine, session_factory
    from controller.db.migrate import check_schema_current

    engine = make_engine(resolve_db(db))
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
    db: DbOption = None,
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
    db: DbOption = None, json_out: JsonOption = False,
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


AUTH_CACHE_DEFAULT = Settings.model_fields["auth_cache_seconds"].default


@token_app.command("revoke", help=(
    "Revoke a token (or all of a node's). Effective at once on a controller's next lookup; a controller that "
    "has the token cached drops it at its next cache sweep (every few seconds, while it reaches the "
    f"database), and in any case within KERNELCTL_AUTH_CACHE_SECONDS (default {AUTH_CACHE_DEFAULT:g} s)."))
def token_revoke(
    token_id: Annotated[int | None, typer.Argument(help="Token id (see `kernelctl token list`).")] = None,
    node: Annotated[str | None, typer.Option(help="Revoke every token of this node instead.")] = None,
    reason: Annotated[str | None, typer.Option(help="Why (recorded in the changelog).")] = None,
    db: DbOption = None,
) -> None:
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
