"""``kernelctl promote|rollback|pause|resume``: an operator's transitions of a rollout (over HTTP; the state
machine itself is controller/rollouts.py)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from cli.common import JsonOption, TokenOption, UrlOption, remote
from kernelctl.console import EXIT_USAGE, console, esc, fail, print_json


def _transition(ctx: typer.Context, rollout_id: int, action: str, body: dict[str, Any], url: str | None,
                token: str | None, json_out: bool) -> None:
    r = remote(ctx, url, token).request("POST", f"/v1/rollouts/{rollout_id}/{action}", json=body)
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
