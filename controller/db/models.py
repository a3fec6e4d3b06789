"""The changelog schema: typed SQLAlchemy 2 models for every table kernelctl writes.

Alembic migrations under ``migrations/`` are generated from and checked against this metadata
(``alembic check`` shows no drift). The ``events`` table is append-only, enforced by database triggers
that the migrations create (see ``controller.db.triggers``).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, deferred, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# BigInteger primary keys that still autoincrement on SQLite (which only does so for INTEGER).
BigId = BigInteger().with_variant(Integer(), "sqlite")
JsonDoc = JSON()


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def as_utc(t: dt.datetime) -> dt.datetime:
    """SQLite hands back naive datetimes (stored in UTC): make every datetime comparable."""
    return t.replace(tzinfo=dt.timezone.utc) if t.tzinfo is None else t.astimezone(dt.timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dt.datetime: DateTime(timezone=True), dict[str, Any]: JsonDoc}


# ---------------------------------------------------------------------------------------------- bundles
class Bundle(Base):
    """One registered, signed bundle version (the .kpack bytes are kept so every replica can serve them)."""

    __tablename__ = "bundles"
    __table_args__ = (UniqueConstraint("name", "version"), Index("ix_bundles_name_created", "name", "created_at"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    version: Mapped[str] = mapped_column(String(64))
    parent_version: Mapped[str | None] = mapped_column(String(64))
    digest: Mapped[str] = mapped_column(String(64), unique=True)
    manifest: Mapped[dict[str, Any]]
    signer_key_id: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default="registered")  # registered | revoked
    status_reason: Mapped[str | None] = mapped_column(Text)
    fault_fixture: Mapped[str | None] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    content: Mapped[bytes] = deferred(mapped_column(LargeBinary))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow, server_default=func.now())
    created_by: Mapped[str] = mapped_column(String(128))

    targets: Mapped[list[BundleTarget]] = relationship(back_populates="bundle", cascade="all, delete-orphan")

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


class BundleTarget(Base):
    """One platform a bundle was built and validated for (row of the compatibility matrix)."""

    __tablename__ = "bundle_targets"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    bundle_id: Mapped[int] = mapped_column(ForeignKey("bundles.id", ondelete="CASCADE"), index=True)
    arch: Mapped[str] = mapped_column(String(16))  # sm_80, sm_89, sm_90
    min_driver: Mapped[str] = mapped_column(String(32))
    cuda: Mapped[str] = mapped_column(String(32))
    triton: Mapped[str] = mapped_column(String(32))
    torch: Mapped[str] = mapped_column(String(64))  # version range, e.g. ">=2.9,<2.15"

    bundle: Mapped[Bundle] = relationship(back_populates="targets")


# ------------------------------------------------------------------------------------------------ nodes
class Node(Base):
    """A GPU node running an agent: its inventory and liveness."""

    __tablename__ = "nodes"
    __table_args__ = (Index("ix_nodes_arch_state", "arch", "state"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(253), unique=True)
    gpu_name: Mapped[str] = mapped_column(String(128))
    compute_capability: Mapped[str] = mapped_column(String(8))  # "9.0"
    arch: Mapped[str] = mapped_column(String(16))  # "sm_90" (or "cpu")
    driver_version: Mapped[str] = mapped_column(String(32))
    cuda_version: Mapped[str] = mapped_column(String(32))
    triton_version: Mapped[str] = mapped_column(String(32))
    torch_version: Mapped[str] = mapped_column(String(64))
    memory_total_mb: Mapped[int] = mapped_column(Integer)
    labels: Mapped[dict[str, Any]] = mapped_column(JsonDoc, default=dict)
    state: Mapped[str] = mapped_column(String(16), default="active")  # active | stale
    registered_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    last_heartbeat_at: Mapped[dt.datetime] = mapped_column(default=utcnow, index=True)
    # when its agent last registered (NULL: before migration 0008): not heartbeated since, the node has a start-up
    # grace before it is stale (controller.tick.mark_stale)
    last_registered_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    # SHA-256 of the agent's registration key: a retry whose reply was lost proves it is the same agent
    registration_key_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # when the registration attempt last taken was sent, on the agent's clock (ns): an older attempt answered
    # late is superseded (controller.enrollment)
    registration_sent_ns: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class StableVersion(Base):
    """The stable version of a bundle in one stratum (arch x driver major x Triton)."""

    __tablename__ = "stable_versions"
    __table_args__ = (UniqueConstraint("bundle_name", "stratum"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    bundle_name: Mapped[str] = mapped_column(String(128))
    stratum: Mapped[str] = mapped_column(String(96))
    bundle_id: Mapped[int] = mapped_column(ForeignKey("bundles.id"), index=True)
    since: Mapped[dt.datetime] = mapped_column(default=utcnow)
    rollout_id: Mapped[int | None] = mapped_column(ForeignKey("rollouts.id"))


class Incompatibility(Base):
    """A bundle version marked incompatible with a stratum after a rollback there."""

    __tablename__ = "incompatibilities"
    __table_args__ = (UniqueConstraint("bundle_id", "stratum"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    bundle_id: Mapped[int] = mapped_column(ForeignKey("bundles.id"))
    stratum: Mapped[str] = mapped_column(String(96))
    reason: Mapped[str] = mapped_column(Text)
    at: Mapped[dt.datetime] = mapped_column(default=utcnow)


# --------------------------------------------------------------------------------------------- rollouts
class Rollout(Base):
    """A canary rollout of one bundle version; ``row_version`` guards concurrent writers."""

    __tablename__ = "rollouts"
    __table_args__ = (Index("ix_rollouts_state", "state"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    bundle_id: Mapped[int] = mapped_column(ForeignKey("bundles.id"), index=True)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    # pending | progressing | paused | promoted | partly_promoted | rolled_back (kernelctl.vocab)
    step_index: Mapped[int] = mapped_column(Integer, default=0)
    plan: Mapped[dict[str, Any]]  # steps, blast radius, latency margin: the plan as started
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    reason: Mapped[str | None] = mapped_column(Text)
    forced: Mapped[bool] = mapped_column(Boolean, default=False)
    row_version: Mapped[int] = mapped_column(Integer, default=1)

    bundle: Mapped[Bundle] = relationship()
    steps: Mapped[list[RolloutStep]] = relationship(
        back_populates="rollout", order_by="RolloutStep.index", cascade="all, delete-orphan"
    )
    strata: Mapped[list[RolloutStratum]] = relationship(
        back_populates="rollout", order_by="RolloutStratum.stratum", cascade="all, delete-orphan"
    )

    __mapper_args__ = {"version_id_col": row_version}


class RollbackIntent(Base):
    """A rollback of a rollout in flight on some replica: while one is younger than a minute, promotes of that
    rollout are refused on every replica (``controller.rollouts.rollback_pending``). Written and committed
    before the rollback waits for the rollout's lock, deleted after it (a crashed replica's row expires). No
    foreign key: its check would lock the rollout's row (FOR KEY SHARE) and wait behind the very promote that
    the intent must stop."""

    __tablename__ = "rollback_intents"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    rollout_id: Mapped[int] = mapped_column(BigInteger, index=True)
    at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class RolloutStep(Base):
    """One step of a rollout plan: a node count or a percent of each stratum, with bake and sample rules."""

    __tablename__ = "rollout_steps"
    __table_args__ = (UniqueConstraint("rollout_id", "index"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    nodes: Mapped[int | None] = mapped_column(Integer)
    percent: Mapped[float | None] = mapped_column(Float)
    bake_seconds: Mapped[float] = mapped_column(Float)
    min_samples: Mapped[int] = mapped_column(Integer)
    deadline_seconds: Mapped[float] = mapped_column(Float)

    rollout: Mapped[Rollout] = relationship(back_populates="steps")


class RolloutStratum(Base):
    """Per-stratum progress of a rollout: verdicts are per stratum."""

    __tablename__ = "rollout_strata"
    __table_args__ = (UniqueConstraint("rollout_id", "stratum"), Index("ix_rollout_strata_state", "state"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id", ondelete="CASCADE"))
    stratum: Mapped[str] = mapped_column(String(96))
    baseline_bundle_id: Mapped[int | None] = mapped_column(ForeignKey("bundles.id"))
    state: Mapped[str] = mapped_column(String(16), default="progressing")
    # progressing | paused | promoted | rolled_back
    step_index: Mapped[int] = mapped_column(Integer, default=0)
    step_started_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    first_failure_at: Mapped[dt.datetime | None] = mapped_column()
    reason: Mapped[str | None] = mapped_column(Text)
    row_version: Mapped[int] = mapped_column(Integer, default=1)

    rollout: Mapped[Rollout] = relationship(back_populates="strata")

    __mapper_args__ = {"version_id_col": row_version}


class Assignment(Base):
    """Desired, staged and active version of one bundle on one node."""

    __tablename__ = "assignments"
    __table_args__ = (UniqueConstraint("node_id", "bundle_name"), Index("ix_assignments_rollout", "rollout_id"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    bundle_name: Mapped[str] = mapped_column(String(128))
    stable_bundle_id: Mapped[int | None] = mapped_column(ForeignKey("bundles.id"))
    desired_bundle_id: Mapped[int | None] = mapped_column(ForeignKey("bundles.id"))
    staged: Mapped[dict[str, Any]] = mapped_column(JsonDoc, default=dict)  # {"versions": [...]}
    active_bundle_id: Mapped[int | None] = mapped_column(ForeignKey("bundles.id"))
    rollout_id: Mapped[int | None] = mapped_column(ForeignKey("rollouts.id"))
    # trial before serve: a canary's candidate is "staged" (trialled, not served), "verified" (the controller
    # accepted a hard-gates-passed report from this node) then "serving" (the node reported it active);
    # None when the node runs its stable version
    phase: Mapped[str | None] = mapped_column(String(16))
    phase_at: Mapped[dt.datetime | None] = mapped_column()
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class DesiredGeneration(Base):
    """One row: the generation of the fleet's desired state, bumped by every commit that changes it.

    Replicas cache the desired state per generation and long-polling agents are woken when it moves
    (``controller.desired``); on PostgreSQL the bump also sends ``NOTIFY kernelctl_desired``.
    """

    __tablename__ = "desired_generation"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger, default=0)


class Activation(Base):
    """History of which version was active on which node when (answers "what ran on N at T")."""

    __tablename__ = "activations"
    __table_args__ = (
        Index("ix_activations_node_started", "node_id", "started_at"),
        Index("ix_activations_bundle", "bundle_id", "node_id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    bundle_id: Mapped[int] = mapped_column(ForeignKey("bundles.id"))
    bundle_name: Mapped[str] = mapped_column(String(128))
    started_at: Mapped[dt.datetime] = mapped_column()
    ended_at: Mapped[dt.datetime | None] = mapped_column()
    # set when this version served as a canary's candidate: its rollout, and when the controller accepted the
    # node's pre-serve trial (None: served before its trial, a plan with serve_before_trial)
    rollout_id: Mapped[int | None] = mapped_column(ForeignKey("rollouts.id"))
    verified_at: Mapped[dt.datetime | None] = mapped_column()


# -------------------------------------------------------------------------------------- reports, verdicts
class Report(Base):
    """One trial report from an agent (idempotency key makes a replayed batch count once)."""

    __tablename__ = "reports"
    __table_args__ = (
        Index("ix_reports_rollout_stratum", "rollout_id", "stratum", "received_at"),
        Index("ix_reports_node", "node_id", "received_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    idempotency_key: Mapped[str] = mapped_column(String(128), unique=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    rollout_id: Mapped[int | None] = mapped_column(ForeignKey("rollouts.id"))
    stratum: Mapped[str] = mapped_column(String(96))
    bundle_id: Mapped[int] = mapped_column(ForeignKey("bundles.id"))
    stable_bundle_id: Mapped[int | None] = mapped_column(ForeignKey("bundles.id"))
    outcome: Mapped[str] = mapped_column(String(24))
    # ok | numeric_error | mismatch | oom | crash | hang | compile_error | load_error
    latency_log_ratio: Mapped[float | None] = mapped_column(Float)  # median ln(candidate/stable) of the trial
    n_pairs: Mapped[int] = mapped_column(Integer, default=0)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    measured_at: Mapped[dt.datetime] = mapped_column()
    received_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    detail: Mapped[dict[str, Any]] = mapped_column(JsonDoc, default=dict)
    # the judged signals of the report (controller.signals): per-cell latency, aggregate, e2e, memory, launches
    signals: Mapped[dict[str, Any] | None] = mapped_column(JsonDoc, nullable=True)


class Verdict(Base):
    """A judge decision for one stratum of a rollout, with the evidence it was based on."""

    __tablename__ = "verdicts"
    __table_args__ = (Index("ix_verdicts_rollout_at", "rollout_id", "at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id", ondelete="CASCADE"))
    stratum: Mapped[str] = mapped_column(String(96))
    step_index: Mapped[int] = mapped_column(Integer)
    at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    decision: Mapped[str] = mapped_column(String(16))  # hold | advance | promote | rollback | pause
    gate: Mapped[str] = mapped_column(String(24))  # none | numeric | mismatch | oom | crash | ... | latency
    samples: Mapped[int] = mapped_column(Integer, default=0)
    evidence: Mapped[dict[str, Any]] = mapped_column(JsonDoc, default=dict)


# ---------------------------------------------------------------------------------------- events, tokens
class Event(Base):
    """The append-only audit log. UPDATE and DELETE are refused by database triggers."""

    __tablename__ = "events"
    __table_args__ = (
        Index("ix_events_bundle_at", "bundle", "at"),
        Index("ix_events_node_at", "node", "at"),
        Index("ix_events_actor_at", "actor", "at"),
        Index("ix_events_action_at", "action", "at"),
        Index("ix_events_rollout_at", "rollout_id", "at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    at: Mapped[dt.datetime] = mapped_column(default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64))  # e.g. bundle.registered, rollout.rolled_back
    subject: Mapped[str] = mapped_column(String(255))  # e.g. rollout:12, bundle:llm-fused@1.1.0, node:gpu-3
    reason: Mapped[str | None] = mapped_column(Text)
    payload: Mapped[dict[str, Any]] = mapped_column(JsonDoc, default=dict)
    # denormalised, indexed keys for the audit questions
    bundle: Mapped[str | None] = mapped_column(String(200))  # name@version
    node: Mapped[str | None] = mapped_column(String(253))
    rollout_id: Mapped[int | None] = mapped_column(BigInteger)


class ApiToken(Base):
    """A bearer token (stored as a SHA-256 hash) with a role; agent tokens may be bound to one node."""

    __tablename__ = "api_tokens"
    __table_args__ = (Index("ix_api_tokens_node_name", "node_name"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))  # agent | operator | viewer
    node_name: Mapped[str | None] = mapped_column(String(253))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[dt.datetime | None] = mapped_column()
    expires_at: Mapped[dt.datetime | None] = mapped_column()  # None: never expires
