"""Webhook notifications for rollout transitions, driven by the append-only changelog.

The leader reads the events that matter to people (rollout started, step advanced, paused, a stratum
promoted, a stratum rolled back, the rollout promoted or partly promoted) after a per-target cursor and POSTs
one JSON document per event to every URL of ``KERNELCTL_NOTIFY_URLS``: a Slack-compatible ``text`` line plus
structured fields (rollout, bundle, the rollout's state when the event happened, stratum, step numbered from 1
as everywhere people read it, gate, reason, the deciding verdict's evidence summary, what a numeric failure
was, and ``url``: the rollout's page under ``KERNELCTL_PUBLIC_URL``). Nothing in the transition code knows
about notifications: a tick or an API call only appends its event, and delivery happens later on the
notifier's own thread, so a slow or dead webhook can never block or fail a transition.

Delivery is retried with exponential backoff (tenacity); the outcome, delivered or finally failed, is
itself appended to the changelog (``notify.delivered`` / ``notify.failed``, subject ``notify:<target id>``).
Those events are the cursor: after a restart or a leadership change the notifier resumes after the last
event it recorded for each target, so nothing is delivered twice (except an event whose delivery
succeeded in the instant before a crash, before its record committed: at least once, never lost). A
target seen for the first time is subscribed at the changelog's head (``notify.subscribed``): history from
before it was configured is not replayed.

Secrets in webhook URLs (user:password, query tokens, the path of a Slack/Teams hook) never reach a log
line or an event: targets are shown as ``redact(url)`` and identified by a hash of the URL.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from controller.changelog import record_event
from controller.db.models import Event, Rollout, Verdict, as_utc, utcnow
from kernelctl.vocab import PARTLY_PROMOTED, PENDING, PROGRESSING, PROMOTED, step_number

log = logging.getLogger("kernelctl.notify")

SETTING = "KERNELCTL_NOTIFY_URLS"
ACTOR = "notifier"
DELIVERED, FAILED, SUBSCRIBED = "notify.delivered", "notify.failed", "notify.subscribed"
# changelog action -> notification kind
KINDS: dict[str, str] = {
    "rollout.started": "started",
    "rollout.advanced": "step_advanced",
    "rollout.paused": "paused",
    "rollout.stratum_paused": "paused",
    "rollout.stratum_promoted": "stratum_promoted",
    "rollout.promoted": "promoted",
    "rollout.partly_promoted": "partly_promoted",
    "rollout.stratum_rolled_back": "rolled_back",
}
# the rollout's state right after an event written before events carried it (``rollout_state``)
_LEGACY_STATE = {"started": PENDING, "step_advanced": PROGRESSING, "promoted": PROMOTED,
                 "partly_promoted": PARTLY_PROMOTED}
# An event is delivered once it is this old: a concurrent transaction may still commit a smaller event id.
SETTLE_SECONDS = 1.0
BATCH = 50


class NotifyConfigError(ValueError):
    """``KERNELCTL_NOTIFY_URLS`` holds something that is not an http(s) URL (message names the setting)."""


class DeliveryError(RuntimeError):
    """One delivery attempt failed; ``retry`` says whether another attempt can help."""

    def __init__(self, message: str, *, status: int | None = None, retry: bool = True) -> None:
        super().__init__(message)
        self.status = status
        self.retry = retry


class _Retryable(DeliveryError):
    pass


# ------------------------------------------------------------------------------------------- targets
def redact(url: str) -> str:
    """``url`` safe to log: scheme, host and port, the first path segment; userinfo, the rest of the path
    (Slack and Teams hooks carry their secret there) and the query replaced by ``***``."""
    try:
        parts = urlsplit(url.strip())
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<unparseable URL>"
    if ":" in host:
        host = f"[{host}]"
    user = "***@" if parts.username or parts.password else ""
    segments = [s for s in parts.path.split("/") if s]
    path = ("/" + segments[0]) if segments else ""
    if len(segments) > 1:
        path += "/***"
    query = "?***" if parts.query else ""
    return f"{parts.scheme}://{user}{host}{port}{path}{query}"


@dataclass(frozen=True)
class Target:
    """One webhook URL; ``id`` (a hash of the URL) and ``shown`` (redacted) are safe to log and record."""

    url: str

    @property
    def id(self) -> str:
        return hashlib.sha256(self.url.encode()).hexdigest()[:12]

    @property
    def shown(self) -> str:
        return redact(self.url)

    @property
    def subject(self) -> str:
        return f"notify:{self.id}"


def parse_targets(value: str | None) -> list[Target]:
    """The targets of a comma-separated ``KERNELCTL_NOTIFY_URLS``; NotifyConfigError on any bad entry."""
    targets: list[Target] = []
    for i, raw in enumerate((value or "").split(","), start=1):
        url = raw.strip()
        if not url:
            continue
        try:
            parts = urlsplit(url)
            port_ok = parts.port is None or parts.port > 0
        except ValueError:
            parts, port_ok = None, False
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
            raise NotifyConfigError(
                f"{SETTING}: entry {i} ({redact(url)}) is not an http:// or https:// URL with a host")
        if all(t.url != url for t in targets):
            targets.append(Target(url))
    return targets


# ------------------------------------------------------------------------------------------ messages
def _scalar_summary(evidence: dict[str, Any], limit: int = 12) -> dict[str, Any]:
    """The evidence's top-level numbers and strings (nested detail stays in the changelog)."""
    out: dict[str, Any] = {}
    for k, v in evidence.items():
        if isinstance(v, bool | int | float | str) or v is None:
            out[k] = v
            if len(out) >= limit:
                break
    return out


def _deciding_verdict(session: Session, rollout_id: int | None, stratum: str | None,
                      decision: str) -> Verdict | None:
    if rollout_id is None:
        return None
    stmt = select(Verdict).where(Verdict.rollout_id == rollout_id, Verdict.decision == decision)
    if stratum is not None:
        stmt = stmt.where(Verdict.stratum == stratum)
    return session.scalar(stmt.order_by(Verdict.id.desc()).limit(1))


def page_url(public_url: str | None, rollout_id: int | None) -> str | None:
    """The rollout's page in the controller's UI (``KERNELCTL_PUBLIC_URL``); None without either."""
    if not public_url or rollout_id is None:
        return None
    return f"{public_url.rstrip('/')}/ui/#/rollouts/{rollout_id}"


def build_message(session: Session, event: Event, *, public_url: str | None = None) -> dict[str, Any]:
    """The JSON document for one changelog event: Slack's ``text`` plus structured fields.

    ``rollout_state`` is the rollout's state right after the event (stored in the event), not when it is sent;
    ``step`` counts from 1 (:func:`kernelctl.vocab.step_number`), in the text and in the JSON."""
    kind = KINDS[event.action]
    p = event.payload or {}
    stratum: str | None = p.get("stratum")
    if stratum is None and isinstance(p.get("strata"), list) and len(p["strata"]) == 1:
        stratum = p["strata"][0]
    gate: str | None = p.get("gate")
    step = step_number(p["step"]) if isinstance(p.get("step"), int) else None
    rollout = session.get(Rollout, event.rollout_id) if event.rollout_id is not None else None
    state = p.get("rollout_state") or _LEGACY_STATE.get(kind) or (rollout.state if rollout is not None else None)
    evidence: dict[str, Any] | None = None
    failure: dict[str, Any] | None = None
    reason_is_judge = (event.reason or "").startswith("judge:")  # an operator's action has no verdict
    if kind in ("rolled_back", "paused"):
        v = _deciding_verdict(session, event.rollout_id, stratum, "rollback" if kind == "rolled_back" else "pause")
        if v is not None and reason_is_judge:
            gate = gate or v.gate
            step = step or step_number(v.step_index)
            evidence = {"gate": v.gate, "samples": v.samples, **_scalar_summary(v.evidence or {}),
                        "step": step_number(v.step_index)}
            failure = ((v.evidence or {}).get("hard_gate") or {}).get("numeric")
    who = f"rollout {event.rollout_id}" if event.rollout_id is not None else event.subject
    bundle = event.bundle or "?"
    reason = event.reason or ""
    if kind == "started":
        strata = sorted((p.get("strata") or {}).keys()) if isinstance(p.get("strata"), dict) else []
        text = f"{who}: {bundle} started on {', '.join(strata) or 'no strata'} by {event.actor}"
    elif kind == "step_advanced":
        text = f"{who}: {bundle} advanced to step {step or '?'}" + (f" in {stratum}" if stratum else "")
    elif kind == "paused":
        text = f"{who}: {bundle} paused" + (f" in {stratum}" if stratum else "")
    elif kind == "stratum_promoted":
        text = f"{who}: {bundle} promoted in {stratum or '?'}" + (f" (at step {step})" if step else "")
    elif kind == "promoted":
        text = f"{who}: {bundle} promoted on {', '.join(p.get('promoted') or []) or 'every stratum'}"
    elif kind == "partly_promoted":
        text = (f"{who}: {bundle} PARTLY PROMOTED: promoted on {', '.join(p.get('promoted') or []) or '-'}; "
                f"rolled back on {', '.join(p.get('rolled_back') or []) or '-'}")
        reasons = p.get("reasons") or {}
        backs = [f"{s}: {reasons[s]}" for s in p.get("rolled_back") or [] if reasons.get(s)]
        reason = "; ".join(backs)  # why each stratum was rolled back (the event's reason is the last action's)
    else:
        text = f"{who}: {bundle} ROLLED BACK in {stratum or ', '.join(p.get('strata') or [])}" + (
            f" (gate {gate})" if gate else "")
    if reason:
        text += f": {reason}"
    url = page_url(public_url, event.rollout_id)
    if url:
        text += f" <{url}>"
    return {
        "text": text,
        "kind": kind,
        "event": event.action,
        "event_id": event.id,
        "at": as_utc(event.at).isoformat(),
        "actor": event.actor,
        "rollout_id": event.rollout_id,
        "bundle": event.bundle,
        "rollout_state": state,
        "stratum": stratum,
        "step": step,
        "gate": gate,
        "reason": event.reason,
        "evidence": evidence,
        "failure": failure,
        "promoted": p.get("promoted") if kind in ("promoted", "partly_promoted") else None,
        "rolled_back": p.get("rolled_back") if kind in ("promoted", "partly_promoted") else None,
        "url": url,
    }


# ------------------------------------------------------------------------------------------ delivery
@dataclass
class Outcome:
    ok: bool
    attempts: int
    status: int | None = None
    error: str | None = None
    seconds: float = 0.0


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def deliver(client: httpx.Client, target: Target, doc: dict[str, Any], *, attempts: int = 4,
            backoff: float = 0.5, max_backoff: float = 8.0) -> Outcome:
    """POST ``doc`` to ``target`` with retries (5xx, 429, network errors, timeouts); never raises."""
    started = time.monotonic()
    tries = 0

    def once() -> int:
        nonlocal tries
        tries += 1
        try:
            r = client.post(target.url, json=doc)
        except httpx.HTTPError as exc:  # connect/read timeouts, refused, DNS: the URL is never in the text
            raise _Retryable(_short(exc).replace(target.url, target.shown)) from None
        if r.status_code >= 500 or r.status_code == 429:
            raise _Retryable(f"HTTP {r.status_code}", status=r.status_code)
        if r.status_code >= 400:
            raise DeliveryError(f"HTTP {r.status_code} (not retried)", status=r.status_code, retry=False)
        return r.status_code

    retrying = Retrying(stop=stop_after_attempt(max(1, attempts)),
                        wait=wait_exponential(multiplier=backoff, max=max_backoff),
                        retry=retry_if_exception_type(_Retryable), reraise=True)
    try:
        status = retrying(once)
    except DeliveryError as exc:
        return Outcome(False, tries, exc.status, str(exc), round(time.monotonic() - started, 3))
    except RetryError as exc:  # pragma: no cover - reraise=True hands back the last DeliveryError
        return Outcome(False, tries, None, _short(exc), round(time.monotonic() - started, 3))
    return Outcome(True, tries, status, None, round(time.monotonic() - started, 3))


class _RedactTargets(logging.Filter):
    """httpx logs every request's full URL at INFO: rewrite our targets' URLs in those records."""

    def __init__(self, targets: list[Target]) -> None:
        super().__init__()
        self.pairs = [(form, t.shown) for t in targets for form in {t.url, str(httpx.URL(t.url))}]

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a malformed record is not ours to fix
            return True
        if any(form in text for form, _ in self.pairs):
            for form, shown in sorted(self.pairs, key=lambda p: -len(p[0])):
                text = text.replace(form, shown)
            record.msg, record.args = text, ()
        return True


class Notifier:
    """Delivers the notifiable changelog events to each target after its own cursor (leader only).

    ``run_once(target)`` handles one batch synchronously (tests call it directly); ``start()`` runs one
    daemon thread per target that calls it every ``period`` seconds while ``is_leader()`` is true.
    """

    def __init__(self, factory: sessionmaker[Session], targets: list[Target], *,
                 is_leader: Callable[[], bool] = lambda: True, timeout: float = 5.0, attempts: int = 4,
                 backoff: float = 0.5, period: float = 1.0, settle: float = SETTLE_SECONDS,
                 public_url: str | None = None) -> None:
        self.factory = factory
        self.public_url = public_url
        self.targets = targets
        self.is_leader = is_leader
        self.attempts = attempts
        self.backoff = backoff
        self.period = period
        self.settle = settle
        self._cursor: dict[str, int | None] = {t.id: None for t in targets}
        self._since = utcnow()  # a target seen for the first time is subscribed at the head as of now
        self._locks = {t.id: threading.Lock() for t in targets}
        self._client = httpx.Client(timeout=httpx.Timeout(timeout), follow_redirects=False,
                                    headers={"User-Agent": "kernelctl-notifier"})
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._redact = _RedactTargets(targets)
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).addFilter(self._redact)

    # -------------------------------------------------------------------------------- cursor
    def _load_cursor(self, target: Target) -> int:
        """The last event handled for ``target``, from its own changelog records. A target seen for the first
        time is subscribed at the head (one ``notify.subscribed`` event): older history is not replayed, and
        a leader that takes over later resumes from there even if nothing was delivered yet. The head is taken as
        of this notifier's creation: an event committed after it (a rollback in the controller's first second,
        before leadership or the first batch) is delivered."""
        with self.factory() as session, session.begin():
            last = session.scalar(select(Event).where(Event.action.in_((DELIVERED, FAILED, SUBSCRIBED)),
                                                      Event.subject == target.subject)
                                  .order_by(Event.id.desc()).limit(1))
            if last is not None and isinstance(last.payload.get("event_id"), int):
                return int(last.payload["event_id"])
            head = int(session.scalar(select(func.max(Event.id)).where(Event.at <= self._since)) or 0)
            record_event(session, actor=ACTOR, action=SUBSCRIBED, subject=target.subject,
                         payload={"event_id": head, "target": target.shown, "target_id": target.id})
            return head

    # ------------------------------------------------------------------------------ one batch
    def run_once(self, target: Target, *, settle: float | None = None, deadline: float | None = None) -> int:
        """Deliver the pending events for ``target``; return how many were handled (delivered or failed).

        ``settle`` overrides the age an event must have; ``deadline`` (monotonic) stops the batch early."""
        lock = self._locks[target.id]  # one batch per target at a time (its thread, or the shutdown drain)
        if not lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            return 0
        try:
            return self._run_locked(target, settle, deadline)
        finally:
            lock.release()

    def _run_locked(self, target: Target, settle: float | None, deadline: float | None) -> int:
        if not self.is_leader():
            self._cursor[target.id] = None  # re-read from the changelog when leadership comes back
            return 0
        cursor = self._cursor.get(target.id)
        if cursor is None:
            cursor = self._cursor[target.id] = self._load_cursor(target)
        with self.factory() as session:
            settled = utcnow() - dt.timedelta(seconds=self.settle if settle is None else settle)
            events = list(session.scalars(
                select(Event).where(Event.id > cursor, Event.action.in_(tuple(KINDS)), Event.at <= settled)
                .order_by(Event.id).limit(BATCH)))
            docs = [(e.id, e.action, e.rollout_id, e.bundle, build_message(session, e, public_url=self.public_url))
                    for e in events]
        handled = 0
        for event_id, action, rollout_id, bundle, doc in docs:
            if (deadline is None and self._stop.is_set()) or not self.is_leader():
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            attempts = 1 if deadline is not None else self.attempts  # a shutdown drain does not wait on retries
            out = deliver(self._client, target, doc, attempts=attempts, backoff=self.backoff)
            payload = {"event_id": event_id, "event_action": action, "kind": doc["kind"], "target": target.shown,
                       "target_id": target.id, "attempts": out.attempts, "status": out.status,
                       "seconds": out.seconds}
            if not out.ok:
                payload["error"] = out.error
                log.warning("notification of event %d (%s) to %s failed after %d attempt(s): %s",
                            event_id, action, target.shown, out.attempts, out.error)
            with self.factory() as session, session.begin():
                record_event(session, actor=ACTOR, action=DELIVERED if out.ok else FAILED, subject=target.subject,
                             reason=None if out.ok else out.error, payload=payload, bundle=bundle,
                             rollout_id=rollout_id)
            self._cursor[target.id] = event_id
            handled += 1
        return handled

    # ------------------------------------------------------------------------------- threads
    def _loop(self, target: Target) -> None:
        # the first batch runs at once: a target seen for the first time is subscribed at the head when the
        # notifier starts, not a period later (a rollback decided in that first second was never sent)
        while True:
            try:
                self.run_once(target)
            except Exception:  # the database is away, say: try again next period
                self._cursor[target.id] = None
                log.exception("notifier for %s: batch failed (will retry)", target.shown)
            if self._stop.wait(self.period):
                return

    def start(self) -> None:
        for t in self.targets:
            th = threading.Thread(target=self._loop, args=(t,), name=f"notify-{t.id}", daemon=True)
            th.start()
            self._threads.append(th)
        if self.targets:
            log.info("notifications to %s", ", ".join(t.shown for t in self.targets))

    def stop(self, timeout: float = 5.0, *, drain_seconds: float = 5.0) -> None:
        """Stop the threads, then deliver what is still pending (everything committed so far, for at most
        ``drain_seconds``) so that the last transitions before a shutdown are not left for the next leader."""
        self._stop.set()
        for th in self._threads:
            th.join(timeout)
        deadline = time.monotonic() + drain_seconds
        for t in self.targets:
            try:
                self.run_once(t, settle=0.0, deadline=deadline)
            except Exception:
                log.exception("notifier for %s: final delivery failed", t.shown)
        self._client.close()
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).removeFilter(self._redact)


# ------------------------------------------------------------------------------------------ test message
def sample_message() -> dict[str, Any]:
    """The document ``kernelctl notify test`` sends."""
    now = dt.datetime.now(dt.timezone.utc).isoformat()
    return {"text": "kernelctl: test notification (webhook configured correctly)", "kind": "test",
            "event": "notify.test", "event_id": None, "at": now, "actor": "operator", "rollout_id": None,
            "bundle": None, "rollout_state": None, "stratum": None, "step": None, "gate": None,
            "reason": "kernelctl notify test", "evidence": None, "failure": None, "promoted": None,
            "rolled_back": None, "url": None}


def send_test(targets: list[Target], *, timeout: float = 5.0, attempts: int = 2) -> list[tuple[Target, Outcome]]:
    with httpx.Client(timeout=httpx.Timeout(timeout), follow_redirects=False,
                      headers={"User-Agent": "kernelctl-notifier"}) as client:
        return [(t, deliver(client, t, sample_message(), attempts=attempts)) for t in targets]
