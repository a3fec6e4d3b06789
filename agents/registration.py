"""Registration of a node with the controller, retried until it succeeds or the agent stops.

A retryable answer (the controller unreachable or busy, a reply lost on the way back) or a refused inventory
(a 422: reported, the inventory collected again) is retried with exponential backoff and jitter, never
fatal; a refusal the agent cannot fix (a token that may not register this node) is :class:`AgentFatal`. The
registration key is persisted before the first attempt, so a retry whose earlier reply was lost gets the same
node back (controller.enrollment).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tenacity import Retrying, retry_if_exception_type

from agents.client import ControllerClient, ControllerError, TokenStore, Unreachable, backoff_wait
from agents.inventory import InventoryError, NodeInventory, collect_inventory
from kernelctl.wire import RegisterRequest

log = logging.getLogger("kernelctl.agent")

REGISTER_RETRY_S = 5.0  # first registration retry after about this long (exponential backoff, jitter)
REGISTER_BACKOFF_MAX_S = 120.0


class AgentFatal(Exception):
    """The agent cannot continue (e.g. its token is refused); the CLI exits non-zero with this message."""


class InventoryRefused(Exception):
    """The controller refused a field of the node's inventory (422): reported, collected again, retried."""


class AgentConfig(Protocol):
    """What registration reads of ``agents.daemon.AgentConfig``."""

    controller_url: str
    token: str
    node_name: str
    cache_dir: Path
    inventory_overrides: Path | None
    http_timeout_s: float


@dataclass
class Registered:
    client: ControllerClient  # holds the node token
    heartbeat_seconds: float
    node: NodeInventory  # as registered (collected again after a refusal)


def _log_retry(retry_state: Any) -> None:
    exc = retry_state.outcome.exception() if retry_state.outcome else None
    log.warning("registration failed (%s); retry %d in %.1fs", exc, retry_state.attempt_number,
                retry_state.next_action.sleep if retry_state.next_action else 0.0)


def register(cfg: AgentConfig, node: NodeInventory, stop_event: threading.Event) -> Registered | None:
    """Register until it succeeds (the registration) or ``stop_event`` is set (None)."""
    store = TokenStore(cfg.cache_dir)
    if not (store.load(cfg.controller_url, cfg.node_name) or cfg.token):
        raise AgentFatal("no agent token: pass --token (an enrollment token) or set KERNELCTL_AGENT_TOKEN")
    key = store.registration_key(cfg.controller_url, cfg.node_name)  # persisted before the first attempt
    current = [node]
    retrying = Retrying(retry=retry_if_exception_type((Unreachable, InventoryRefused)),
                        wait=backoff_wait(REGISTER_RETRY_S / 4, REGISTER_BACKOFF_MAX_S),
                        stop=lambda _rs: stop_event.is_set(), sleep=stop_event.wait,
                        before_sleep=_log_retry, reraise=True)
    with contextlib.suppress(Unreachable, InventoryRefused):  # only when stopped meanwhile
        return retrying(_register_once, cfg, current, store, key, stop_event)
    return None


def _register_once(cfg: AgentConfig, current: list[NodeInventory], store: TokenStore, key: str,
                   stop_event: threading.Event) -> Registered:
    node = current[0]
    saved = store.load(cfg.controller_url, cfg.node_name)
    req = RegisterRequest(node_name=cfg.node_name, inventory=node.inventory, registration_key=key)
    for token in [t for t in (saved, cfg.token) if t]:
        client = ControllerClient(cfg.controller_url, token, timeout=cfg.http_timeout_s, stop_event=stop_event)
        try:
            reply = client.register(req)
        except ControllerError as exc:
            client.close()
            if isinstance(exc, Unreachable):
                raise
            if exc.status in (401, 403) and token is saved:
                log.warning("saved node token refused (%s); registering with the enrollment token", exc)
                continue
            if exc.status == 422:  # a bad inventory field: reported, collected again, retried
                log.error("registration refused, inventory collected again before the retry: %s", exc)
                try:
                    current[0] = collect_inventory(cfg.inventory_overrides)
                except InventoryError as bad:  # still wrong here: reported, the retry waits for a fix
                    log.error("%s", bad)
                raise InventoryRefused(str(exc)) from exc
            raise AgentFatal(f"registration refused: {exc}") from exc
        store.save(cfg.controller_url, cfg.node_name, reply.node_token)
        log.info("registered as %s (arch %s); heartbeat every %.1fs", reply.node_name, node.arch,
                 reply.heartbeat_seconds)
        return Registered(client, reply.heartbeat_seconds, node)
    raise AgentFatal("registration refused: no token left to try")
