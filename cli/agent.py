"""``kernelctl agent``: run the node agent in the foreground (flags override the ``KERNELCTL_*`` settings).

Exit codes (``kernelctl.console``): 0 stopped by SIGTERM/SIGINT, 2 bad flags or config files, 5 token refused,
1 other failure. The daemon itself is agents/daemon.py.
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer

from kernelctl.console import EXIT_AUTH, EXIT_ERROR, EXIT_USAGE
from kernelctl.console import fail as _fail


def _setup_logging(level: str, fmt: str) -> None:
    if fmt == "json":
        pattern = '{"at":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":%(message)r}'
    else:
        pattern = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=pattern, stream=sys.stderr,
                        force=True)


def agent_command(
    controller: Annotated[str | None, typer.Option("--controller", help="Controller URL (KERNELCTL_CONTROLLER_URL).")] = None,
    token: Annotated[str | None, typer.Option("--token", help="Enrollment or node token (KERNELCTL_AGENT_TOKEN).",
                                              show_default=False)] = None,
    node_name: Annotated[str | None, typer.Option("--node-name", help="Node name (default: hostname).")] = None,
    cache_dir: Annotated[Path | None, typer.Option("--cache-dir", help="Bundle cache, outbox and node token.")] = None,
    profile: Annotated[Path | None, typer.Option("--profile", help="Traffic profile (JSON or TOML).")] = None,
    inventory_overrides: Annotated[Path | None, typer.Option(
        "--inventory-overrides", help="JSON object overriding inventory fields (pose as another GPU).")] = None,
    trusted_keys: Annotated[Path | None, typer.Option("--trusted-keys", help="Directory of trusted *.pub keys.")] = None,
    runtime_dir: Annotated[Path | None, typer.Option("--runtime-dir", help="Where active versions are published.")] = None,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port", help="/metrics port (0: off).")] = None,
) -> None:
    """Run the node agent: register, heartbeat, stage and switch bundles, run trials, send reports."""
    from pydantic import ValidationError

    from kernelctl.settings import Settings

    try:
        settings = Settings()
    except ValidationError as exc:
        _fail(f"invalid KERNELCTL_* setting: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}", EXIT_USAGE)
        return
    _setup_logging(settings.log_level, settings.log_format)

    from agents.daemon import Agent, AgentConfig
    from agents.inventory import InventoryError, collect_inventory
    from agents.registration import AgentFatal
    from agents.trial_protocol import ProfileError, load_profile
    from kernelctl.wire import NAME_PATTERN

    url = (controller or settings.controller_url).rstrip("/")
    if not url.startswith(("http://", "https://")):
        _fail(f"invalid controller URL {url!r}: expected http(s)://HOST:PORT", EXIT_USAGE)
    tok = token or settings.agent_token
    name = node_name or settings.node_name or socket.gethostname().split(".")[0]
    import re

    if not re.match(NAME_PATTERN, name):
        _fail(f"invalid node name {name!r}: letters, digits, '.', '_' and '-' only (max 253)", EXIT_USAGE)
    keys = trusted_keys or settings.trusted_keys_dir
    if keys is None:
        _fail("no trusted keys: pass --trusted-keys DIR or set KERNELCTL_TRUSTED_KEYS_DIR", EXIT_USAGE)
        return
    if not Path(keys).is_dir():
        _fail(f"trusted-keys directory {keys} does not exist", EXIT_USAGE)
    if not any(Path(keys).glob("*.pub")):
        _fail(f"trusted-keys directory {keys} holds no *.pub key: no bundle could ever be verified", EXIT_USAGE)
    cache = cache_dir or settings.cache_dir or (settings.data_dir / "cache")
    runtime = runtime_dir or settings.runtime_dir or (settings.data_dir / "runtime")
    prof = None
    profile_path = profile or settings.profile
    if profile_path is not None:
        try:
            prof = load_profile(profile_path)
        except ProfileError as exc:
            _fail(str(exc), EXIT_USAGE)
    if not tok:
        _fail("no agent token: pass --token or set KERNELCTL_AGENT_TOKEN", EXIT_AUTH)
        return
    overrides = inventory_overrides or settings.inventory_overrides
    if overrides is not None:
        try:
            collect_inventory(overrides)  # refuse a bad file before anything starts
        except InventoryError as exc:
            _fail(str(exc), EXIT_USAGE)
    cfg = AgentConfig(
        controller_url=url, token=tok, node_name=name, cache_dir=Path(cache), runtime_dir=Path(runtime),
        trusted_keys_dir=Path(keys), profile=prof,
        inventory_overrides=overrides,
        metrics_port=settings.agent_metrics_port if metrics_port is None else metrics_port,
        duty_cycle=settings.trial_duty_cycle, memory_headroom=settings.trial_memory_headroom,
        trial_timeout_s=settings.trial_timeout_seconds, max_bundle_bytes=settings.max_bundle_bytes,
        heartbeat_seconds=settings.heartbeat_seconds,
    )
    agent = Agent(cfg)
    agent.install_signal_handlers()
    try:
        code = agent.run()
    except InventoryError as exc:
        _fail(str(exc), EXIT_USAGE)
        return
    except AgentFatal as exc:
        _fail(str(exc), EXIT_AUTH)
        return
    except OSError as exc:
        _fail(f"{exc.strerror or exc}: {getattr(exc, 'filename', '') or ''}", EXIT_ERROR)
        return
    raise typer.Exit(code)


if __name__ == "__main__":  # pragma: no cover - ``python -m cli.agent``: the agent alone
    typer.run(agent_command)
