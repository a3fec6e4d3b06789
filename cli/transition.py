"""``kernelctl promote|rollback|pause|resume``: an operator's transitions of a rollout (over HTTP; the state
machine itself is controller/rollouts.py). Steps are numbered from 1 here as everywhere people read them
(``--from-step 1`` promotes from the first step; 0 names a pending rollout); the API's ``from_step`` is the
0-based index."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from cli.common import JsonOption, RolloutIdArg, TokenOption, UrlOption, remote
from cli.rollout import outcome_line
from kernelctl.console import EXIT_USAGE, console, esc, fail, print_json
from kernelctl.vocab import TERMINAL_STATES, step_number


def _transition(ctx: typer.Context, rollout_id: int, action: str, body: dict[str, Any], url: str | None,
                token: str | None, json_out: bool) -> None:
    client = remote(ctx, url, token)
    r = client.request("POST", f"/v1/rollouts/{rollout_id}/{action}", json=body)
    if json_out:
        print_json(r)
        return
    # an ended rollout says what happened to each stratum ("partly_promoted: promoted on A; rolled back on B")
    ended = outcome_line(client.request("GET", f"/v1/rollouts/{rollout_id}")) if r["state"] in TERMINAL_STATES else ""
    console.print(f"rollout [bold]{r['id']}[/] {esc(r['bundle'])}: {esc(r['state'])} "
                  + (f"({esc(ended)})" if ended else f"(step {step_number(r['step_index'])})"))


def promote_cmd(ctx: typer.Context, rollout_id: RolloutIdArg,
                reason: Annotated[str, typer.Option(help="Why (recorded in the changelog).")],
                from_step: Annotated[int | None, typer.Option(
                    "--from-step", "--expected-step",
                    help="The step you promote from, as `rollout status` shows it (from 1; 0 for a pending "
                    "rollout). Required unless --full: a rollout no longer at that step is refused (exit 3), so "
                    "a repeated command promotes once.")] = None,
                full: Annotated[bool, typer.Option("--full", help="Promote every stratum to 100% now.")] = False,
                url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """Advance a rollout one step from --from-step (or fully with --full)."""
    if from_step is None and not full:
        fail(f"--from-step is required (the step rollout {rollout_id} is at now, as `rollout status` shows it; "
             "0 if pending), or use --full", EXIT_USAGE)
    if from_step is not None and from_step < 0:
        fail(f"--from-step {from_step}: steps are numbered from 1 (0: a pending rollout)", EXIT_USAGE)
    body: dict[str, Any] = {"full": full, "reason": reason}
    if from_step is not None:
        body["from_step"] = from_step - 1  # the API's 0-based index (-1: pending)
    _transition(ctx, rollout_id, "promote", body, url, token, json_out)


def rollback_cmd(ctx: typer.Context, rollout_id: RolloutIdArg,
                 reason: Annotated[str, typer.Option(help="Why (required; recorded in the changelog).")],
                 stratum: Annotated[list[str] | None, typer.Option("--stratum", help="Only this stratum (repeat).")] = None,
                 url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """Roll a rollout back (every canary node returns to stable)."""
    if not reason.strip():
        fail("--reason must not be empty", EXIT_USAGE)
    _transition(ctx, rollout_id, "rollback", {"reason": reason, "strata": stratum or None}, url, token, json_out)


def pause_cmd(ctx: typer.Context, rollout_id: RolloutIdArg,
              reason: Annotated[str | None, typer.Option(help="Why.")] = None,
              url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """Pause a rollout (no further steps until resumed)."""
    _transition(ctx, rollout_id, "pause", {"reason": reason}, url, token, json_out)


def resume_cmd(ctx: typer.Context, rollout_id: RolloutIdArg,
               reason: Annotated[str | None, typer.Option(help="Why.")] = None,
               url: UrlOption = None, token: TokenOption = None, json_out: JsonOption = False) -> None:
    """Resume a paused rollout."""
    _transition(ctx, rollout_id, "resume", {"reason": reason}, url, token, json_out)
