"""Every kernelctl setting in one place: ``KERNELCTL_*`` environment variables, read with pydantic-settings.

CLI flags override these per invocation (e.g. ``--db`` for ``database_url``). ``kernelctl config show``
prints the table below with current values; docs/configuration.md is generated from the same fields.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import platformdirs
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

APP_NAME = "kernelctl"


def default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir(APP_NAME))


def default_database_url() -> str:
    return f"sqlite:///{default_data_dir() / 'kernelctl.db'}"


class Settings(BaseSettings):
    """kernelctl configuration (environment prefix ``KERNELCTL_``)."""

    model_config = SettingsConfigDict(env_prefix="KERNELCTL_", extra="ignore")

    # --- database -------------------------------------------------------------------------------
    database_url: str = Field(
        default_factory=default_database_url,
        description="SQLAlchemy URL of the changelog database; default: an SQLite file in the user data dir. "
        "PostgreSQL: postgresql+psycopg://user:pass@host:5432/db",
    )
    data_dir: Path = Field(default_factory=default_data_dir, description="Where embedded state lives.")

    # --- controller ---------------------------------------------------------------------------
    listen_host: str = Field("127.0.0.1", description="Address `kernelctl serve` binds.")
    listen_port: int = Field(8080, ge=0, le=65535, description="Port `kernelctl serve` binds (0: any free).")
    tick_seconds: float = Field(2.0, gt=0, description="Judge tick period (leader only).")
    tick_incremental: bool = Field(
        True, description="The leader keeps each live stratum's evidence between ticks and reads only the reports "
        "new since the last tick (false: every report of every live stratum, every tick).")
    stale_after_seconds: float = Field(60.0, gt=0, description="A node without heartbeat this long is stale.")
    node_startup_grace_seconds: float = Field(
        60.0, gt=0, description="A node that has not heartbeated since its agent registered is stale only after "
        "this long (at least stale_after_seconds): its registration reply may have been lost and its retries "
        "queued behind a cold start of the fleet (as Kubernetes' --node-startup-grace-period).")
    heartbeat_seconds: float = Field(
        15.0, gt=0, description="Heartbeat period the controller asks agents for; agents hold each heartbeat "
        "open this long as a watch (desired state is pushed the moment it changes).")
    watch_poll_seconds: float = Field(
        2.0, gt=0, le=60, description="Each replica checks the desired-state generation this often (besides "
        "PostgreSQL LISTEN/NOTIFY and its own commits).")
    liveness_flush_seconds: float = Field(
        1.0, gt=0, le=30, description="Heartbeat times are written in one statement per this period.")
    max_pending_writes: int = Field(
        64, gt=0, description="Most report batches waiting at once per replica (on their own worker threads); more "
        "are answered 503 with Retry-After. Heartbeats and registrations are group-committed (max_queued_writes).")
    ingest_processes: int = Field(
        0, ge=0, le=64, description="Report batches are parsed, validated and stored in this many worker processes "
        "per replica, past the API process's GIL (controller.intake); 0: in two threads of the API process.")
    max_queued_writes: int = Field(
        16384, gt=0, description="Most group-committed agent writes (registrations, version switches) and heartbeats "
        "that need the full transaction queued at "
        "once per replica; more are answered 503 with Retry-After.")
    queue_deadline_seconds: float = Field(
        5.0, gt=0, le=600, description="A group-committed agent write (registration, version switch) still queued "
        "this long is answered 503 with Retry-After instead of written, and while the oldest waits longer than "
        "this, new ones are refused at once: its agent (request timeout 10 s) has given up or soon will, and "
        "writing abandoned requests is how an overloaded controller falls further behind. Keep it under the "
        "agents' request timeout.")
    max_watches_per_node: int = Field(
        4, gt=0, le=1000, description="Most heartbeat watches one node holds open at once per replica (an agent "
        "holds one); more are answered 429.")
    api_workers: int = Field(
        1, ge=1, le=64, description="API worker processes of `kernelctl serve` (uvicorn's workers, a listening socket "
        "each: SO_REUSEPORT), each with its own desired-state snapshot woken by LISTEN/NOTIFY; exactly one of them leads. "
        "PostgreSQL only (more than 1 on SQLite is refused). The per-replica limits apply to each worker.")
    trusted_keys_dir: Path | None = Field(None, description="Directory of trusted ed25519 public keys (*.pub).")
    bootstrap_tokens_file: Path | None = Field(
        None, description="File of `role name token` lines hashed into the database at start-up."
    )
    max_bundle_bytes: int = Field(64 * 1024 * 1024, gt=0, description="Largest bundle upload accepted.")
    max_report_batch: int = Field(1000, gt=0, description="Most reports accepted in one batch.")
    max_bundle_uncompressed_bytes: int = Field(
        128 * 1024 * 1024, gt=0, description="Most bytes a bundle upload may decompress to (checked while "
        "decompressing: a gzip bomb is refused at this size).")
    max_bundle_files: int = Field(2000, gt=0, description="Most files (archive members) in an uploaded bundle.")
    max_request_bytes: int = Field(
        1024 * 1024, gt=0, description="Largest JSON request body (every route but report batches and bundles).")
    max_report_body_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="Largest report-batch request body (POST /v1/agents/reports).")
    header_timeout_seconds: float = Field(
        10.0, gt=0, le=3600, description="A client must send its request line and headers within this time.")
    body_timeout_seconds: float = Field(
        60.0, gt=0, le=3600, description="A client must send the whole request body within this time (408).")
    keepalive_timeout_seconds: float = Field(5.0, gt=0, le=3600, description="Idle keep-alive connections close "
                                             "after this time.")
    max_header_bytes: int = Field(16 * 1024, ge=1024, le=1024 * 1024, description="Largest request line plus "
                                  "headers; larger is refused with 431 (or 400 from h11 while still arriving).")
    max_connections: int = Field(
        32768, gt=0, description="Most concurrent connections, and requests in flight, per replica (503 over): every "
        "agent holds a watch open, and a fleet-wide change briefly doubles the requests in flight (replies going "
        "out while the next watches come in). The file-descriptor limit is raised to its hard limit at start; this is "
        "lowered to 256 below it, so a connection over it is still accepted and answered 503.")
    listen_backlog: int = Field(
        4096, gt=0, le=1 << 20, description="Connections the kernel queues for accept on the listening socket (Linux "
        "caps it at net.core.somaxconn: raise that too). 10,000 agents starting together overflowed a queue of 2,048 "
        "(SYNs dropped: connect timeouts, requests answered late, connections closed before a reply).")
    http_impl: str = Field("auto", pattern="^(auto|httptools|h11)$", description="HTTP/1.1 parser of `kernelctl "
                           "serve`: httptools (C, the default when installed) or h11 (pure Python); auto picks "
                           "httptools when it is installed. Both enforce the header deadline and size limit.")
    auth_cache_seconds: float = Field(
        60.0, ge=0, le=300, description="How long an authenticated token is cached: a revocation or expiry made on "
        "another replica (or with `kernelctl token revoke`) takes effect within this time.")
    heartbeat_lane: bool = Field(True, description="Serve the common heartbeat outside the framework "
                                 "(controller.api.fast_lane: same answers, a fraction of the CPU); off: every "
                                 "heartbeat goes through the FastAPI route.")
    report_lane: bool = Field(True, description="Serve the common report batch outside the framework "
                              "(controller.api.fast_lane: same answers, 10-20% less of the API process's CPU a "
                              "report); off: every report batch goes through the FastAPI route.")
    api_docs: bool = Field(False, description="Serve /docs and /openapi.json (without a token). Off by default.")

    # --- notifications (controller/notify.py) ------------------------------------------------------
    notify_urls: str = Field(
        "", description="Comma-separated webhook URLs the leader POSTs rollout notifications to (Slack-"
        "compatible JSON); secrets in them are never logged.", repr=False,
    )
    notify_timeout_seconds: float = Field(5.0, gt=0, description="Timeout of one webhook delivery attempt.")
    notify_attempts: int = Field(4, ge=1, le=20, description="Delivery attempts per notification (backoff).")
    public_url: str | None = Field(
        None, pattern=r"^https?://[^\s/]+(/\S*)?$", description="The controller's URL as people reach it (e.g. "
        "https://kernelctl.example.com); notifications link to the rollout's page there. Default: the address "
        "`kernelctl serve` listens on, unless that is a wildcard (0.0.0.0, ::).")

    # --- CLI client -----------------------------------------------------------------------------
    url: str = Field("http://127.0.0.1:8080", description="Controller URL used by the operator CLI.")
    token: str | None = Field(None, description="Bearer token used by the operator CLI.")

    # --- agent ------------------------------------------------------------------------------------
    controller_url: str = Field("http://127.0.0.1:8080", description="Controller URL the agent talks to.")
    agent_token: str | None = Field(None, description="Agent enrollment or node token.")
    node_name: str | None = Field(None, description="Node name the agent registers as (default: hostname).")
    cache_dir: Path | None = Field(None, description="Agent bundle cache (default: <data_dir>/cache).")
    runtime_dir: Path | None = Field(
        None, description="Where the agent publishes active versions for kernelpack.runtime."
    )
    profile: Path | None = Field(None, description="Traffic profile file (batch sizes, traffic weights, numerics "
                                 "and e2e options) for trials; fields in `docs/judge.md`.")
    inventory_overrides: Path | None = Field(
        None, description="JSON file overriding inventory fields (pose as another GPU in tests/demos)."
    )
    agent_metrics_port: int = Field(9400, ge=0, le=65535, description="Agent /metrics port (0: disabled).")
    trial_duty_cycle: float = Field(0.1, gt=0, le=1, description="Max share of wall time spent in trials.")
    trial_memory_headroom: float = Field(
        0.2, ge=0, lt=1, description="Share of GPU memory that must stay free before a trial starts."
    )
    trial_timeout_seconds: float = Field(600.0, gt=0, description="A trial running longer is killed (hang).")

    # --- logging ----------------------------------------------------------------------------------
    log_level: str = Field("INFO", description="Log level.")
    log_format: str = Field("text", pattern="^(text|json)$", description="Log format: text or json.")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
