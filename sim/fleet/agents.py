"""The simulated agents: one coroutine per node speaking the real wire models over HTTP.

Each agent registers as the real agent does (``agents.daemon``): with the enrollment token and a registration key
it keeps before its first attempt, a 10 s timeout, and retries with exponential backoff and jitter after a
timeout, a dropped connection or a 429/503 (never giving up); a share of the replies is lost on purpose
(``lost_reply_share``: the controller committed, the agent never hears it) and the retry must get the same
node. A 409 at registration is a node locked out (counted). Then it keeps one heartbeat open at a time as a
watch (``wire.HeartbeatRequest`` with the ``generation`` it applied and ``wait_seconds``): the controller
answers when the node's desired state changes, or after the heartbeat period. A reply is applied at once
among the staged versions (stable and candidate side by side, so a switch is instant); every agent downloads
each version it does not hold yet itself (``download_per_agent``; digest checked), as a real canary does, and
as the real agent does (``agents.downloader``) in a task of its own, off the heartbeat path: one version at a
time, after a random delay (``DOWNLOAD_JITTER_S``), a failed download tried again with exponential backoff and
jitter (tenacity, the agent's ``backoff_wait``); until the desired active version is staged the agent serves
its stable version (or what it served), and when it is staged the agent applies the desired state again and
reports it at once (``heartbeat_now``: a watch sent on its other connection, as the agent's downloader does). Heartbeats go on while it downloads.
While the reply carries a trial spec and the candidate is staged, a trial coroutine produces one
``wire.TrialReport`` per trial interval (latencies from the judge's
noise model, :mod:`sim.judge.noise`), real-sized (``report_kb``: 6-46 KB, a real agent's report on CPU: many
latency pairs), kept in the agent's outbox and sent as the agent sends them (``agents.outbox``: what is waiting
in one request, bounded by bytes; the cell tables as columns), until a 200 acknowledges it. 429/503 answers are retried after their ``Retry-After`` with jitter; nothing leaves the
outbox unacknowledged.

HTTP: :mod:`sim.fleet.http` (h11 on asyncio, a fraction of httpx's CPU per request, so the simulator measures
the controller and not itself). Each agent keeps its own persistent connection for its watch, re-issued on it
as soon as a reply arrives, and a second one for its writes (registration, report batches, the bundle
download), opened when needed and dropped when idle before the controller's keep-alive timeout.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import math
import random
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel
from tenacity import AsyncRetrying, retry_if_exception_type

from agents.client import backoff_wait
from kernelctl import wire
from sim.fleet import http
from sim.fleet.config import BUNDLE, NOISE_TICKS, FleetConfig
from sim.fleet.scenarios import FLEET_KINDS, TRITON_VERSION, stratum_of

MAX_TRIALS_PER_ROUND = 8
REGISTER_TIMEOUT_S = 10.0  # the real agent's HTTP timeout (agents.daemon: AgentConfig.http_timeout_s)
REGISTER_BACKOFF_S = 1.25  # first retry after about this long (the agent: REGISTER_RETRY_S / 4), doubling
REGISTER_BACKOFF_MAX_S = 120.0
JSON = (b"content-type", b"application/json")
DOWNLOAD_JITTER_S = 2.0  # the agent's default (agents.daemon: AgentConfig.download_jitter_s)
DOWNLOAD_BACKOFF_S = 1.0  # first retry of a failed download after about this long, doubling ...
DOWNLOAD_BACKOFF_MAX_S = 30.0  # ... up to this long
PAIR_BYTES = 110  # one wire.LatencyPair in a report's JSON
REPORT_BYTES = 1024  # a report's JSON but its latency pairs (about)


class DownloadFailed(Exception):
    """A simulated bundle download failed (no answer, an error status, or bytes of another digest)."""


class Stats:
    """Client-side measurements shared by all simulated agents."""

    def __init__(self) -> None:
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.acked: set[str] = set()  # report keys acknowledged with 200 (accepted or duplicate)
        self.refused: set[str] = set()  # keys answered 200 but refused (the node was no longer a canary, ...)
        self.sent_keys: set[str] = set()
        self.accepted = 0
        self.duplicates = 0
        self.first_report_at: float | None = None
        self.last_report_at: float | None = None
        self.first_offending: dict[str, float] = {}  # stratum -> monotonic time the first offending report was sent
        self.back_to_stable: dict[str, float] = {}  # node -> monotonic time it switched back to stable
        self.back_to_stable_wall: dict[str, float] = {}  # the same, wall clock (vs the controller's verdict time)
        self.canary_strata: dict[str, str] = {}  # node -> stratum, every node that ever ran the candidate
        self.registered_at: dict[str, float] = {}  # node -> its first registration (monotonic)

        self.locked_out: set[str] = set()  # nodes answered 409 at registration (already registered, not theirs)
        self.lost_replies = 0  # registration replies dropped on purpose
        self.downloads = 0  # bundle downloads completed (digest checked)
        self.download_failures = 0  # download attempts that failed and were tried again

    def observe(self, endpoint: str, seconds: float, status: int | str) -> None:
        self.latency[endpoint].append(seconds)
        if not (isinstance(status, int) and status < 400):
            self.errors[endpoint][str(status)] += 1


@dataclass
class SimAgent:
    index: int
    name: str
    kind: tuple[str, str, str, str]
    token: str | None = None
    generation: int | None = None
    active: wire.BundleRef | None = None
    staged: dict[str, wire.BundleRef] = field(default_factory=dict)  # version -> ref
    desired: wire.DesiredBundle | None = None
    outbox: list[wire.TrialReport] = field(default_factory=list)
    offending: set[str] = field(default_factory=set)  # outbox keys of offending reports
    trials: int = 0
    stopped: bool = False
    trial_task: asyncio.Task[None] | None = None
    download_task: asyncio.Task[None] | None = None
    hb_key: tuple[Any, ...] | None = None  # what the cached heartbeat body was built from
    hb_body: bytes = b""
    registration_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))  # kept before the 1st try

    def heartbeat_body(self, wait_seconds: float) -> bytes:
        """The ``wire.HeartbeatRequest`` JSON, built again only when what it reports changed."""
        key = (self.generation, len(self.staged), self.active)
        if key != self.hb_key:
            self.hb_body = wire.HeartbeatRequest(
                node_name=self.name, staged=list(self.staged.values()), active=[self.active] if self.active else [],
                generation=self.generation, wait_seconds=wait_seconds if self.generation is not None else 0.0,
            ).model_dump_json().encode()
            self.hb_key = key
        return self.hb_body

    @property
    def stratum(self) -> str:
        return stratum_of(self.kind)

    def inventory(self) -> wire.Inventory:
        arch, cc, driver, gpu = self.kind
        return wire.Inventory(gpu_name=gpu, compute_capability=cc, arch=arch, driver_version=driver,
                              cuda_version="12.4", triton_version=TRITON_VERSION, torch_version="2.13.0",
                              memory_total_mb=81920, labels={"cluster": f"sim-{self.index % 4}"})


def retry_after(resp: http.Response | None, default: float) -> float:
    """Seconds to wait after a 429/503 (its ``Retry-After``, with up to 50% jitter on top)."""
    base = default
    if resp is not None:
        try:
            base = float(resp.headers.get("retry-after", default))
        except ValueError:
            base = default
    return base * (1.0 + 0.5 * random.random())


class Fleet:
    """The simulated agents and the coroutines that drive them."""

    def __init__(self, cfg: FleetConfig, tokens: dict[str, str], stats: Stats, candidate: str) -> None:
        from sim.judge.noise import simulate_reports

        self.cfg, self.tokens, self.stats, self.candidate = cfg, tokens, stats, candidate
        self.rng = np.random.default_rng(cfg.seed)
        self.agents = [SimAgent(i, f"sim-{i:05d}", FLEET_KINDS[i % len(FLEET_KINDS)]) for i in range(cfg.nodes)]
        noise = simulate_reports(self.rng, runs=1, ticks=NOISE_TICKS, nodes=cfg.nodes, log_effect=0.0)
        self.ratio = noise.ratio[0]  # (ticks, nodes) ln(candidate/stable) without the candidate's true effect
        self.stable = noise.stable[0]
        self.running = True
        self.gate = asyncio.Semaphore(cfg.connections)  # registrations, reports, downloads in flight at once
        self.fetched: set[str] = set()
        self.base_url = ""
        self.started = time.monotonic()  # when the agents were started (registration is timed from here)
        self.restart: dict[str, float] | None = None  # controller-restart scenario: when and how long
        self.http: http.Client | None = None  # opened by the first request (``base_url`` is set by then)

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.aclose()

    def agent(self, name: str) -> SimAgent:
        return self.agents[int(name.rsplit("-", 1)[1])]

    async def request(self, a: SimAgent, endpoint: str, method: str, path: str, token: str,
                      body: BaseModel | bytes | None = None, *, timeout: float = 30.0,
                      gated: bool = True, watch: bool = False) -> http.Response | None:
        """One agent request; its latency includes any wait for the gate (what an agent sees). ``watch``: on
        the agent's watch connection (its heartbeats), otherwise on its connection for writes."""
        client = self.http
        if client is None:
            client = self.http = http.Client(self.base_url)
        headers = [(b"authorization", b"Bearer " + token.encode())]
        content: bytes | None = None
        if body is not None:
            content = body if isinstance(body, bytes) else body.model_dump_json().encode()
            headers.append(JSON)
        lane = (a.index, watch)
        t0 = time.perf_counter()
        try:
            if gated:
                async with self.gate:
                    r = await client.request(lane, method, path, headers, content, timeout=timeout)
            else:
                r = await client.request(lane, method, path, headers, content, timeout=timeout)
        except http.HTTPError as exc:
            self.stats.observe(endpoint, time.perf_counter() - t0, type(exc).__name__)
            return None
        self.stats.observe(endpoint, time.perf_counter() - t0, r.status_code)
        return r

    # ------------------------------------------------------------------------------ one agent
    async def run_agent(self, a: SimAgent, start_delay: float) -> None:
        await asyncio.sleep(start_delay)
        await self.register(a)
        while self.running and not a.stopped:
            await self.heartbeat_round(a)

    async def register(self, a: SimAgent) -> None:
        """Register as ``agents.daemon`` does (see the module docstring)."""
        attempt = 0
        while self.running and a.token is None:  # each attempt stamped when sent, as the agent's client does
            req = wire.RegisterRequest(node_name=a.name, inventory=a.inventory(), registration_key=a.registration_key,
                                       sent_at_ns=time.time_ns())
            r = await self.request(a, "register", "POST", "/v1/agents/register", self.tokens["enroll"], req,
                                   timeout=REGISTER_TIMEOUT_S, gated=False)  # agents do not coordinate
            if r is not None and r.status_code == 200:
                if random.random() < self.cfg.lost_reply_share and attempt == 0:
                    self.stats.lost_replies += 1  # committed by the controller, never heard by the agent
                else:
                    a.token = wire.RegisterResponse.model_validate_json(r.content).node_token
                    self.stats.registered_at.setdefault(a.name, time.monotonic())  # a re-registration: not again
                    return
            elif r is not None and r.status_code == 409:
                self.stats.locked_out.add(a.name)
            attempt += 1
            after = retry_after(r, 1.0) if r is not None and r.status_code in (429, 503) else 0.0
            backoff = min(REGISTER_BACKOFF_MAX_S, REGISTER_BACKOFF_S * 2 ** min(attempt, 10))
            await asyncio.sleep(max(after, backoff * random.random() + REGISTER_BACKOFF_S))

    def heartbeat_now(self, a: SimAgent) -> bytes:
        """The heartbeat reporting what the agent stages and serves now (after a download): a watch like the
        others (written on arrival; a switch that leaves the desired state as it is held while it commits)."""
        return wire.HeartbeatRequest(
            node_name=a.name, staged=list(a.staged.values()), active=[a.active] if a.active else [],
            generation=a.generation,
            wait_seconds=self.cfg.heartbeat_seconds if a.generation is not None else 0.0).model_dump_json().encode()

    async def heartbeat_round(self, a: SimAgent) -> None:
        assert a.token is not None
        hb = self.cfg.heartbeat_seconds
        r = await self.request(a, "heartbeat", "POST", "/v1/agents/heartbeat", a.token, a.heartbeat_body(hb),
                               timeout=hb + 60, gated=False, watch=True)
        if r is not None and r.status_code == 401:  # its token was superseded: register again, as the agent does
            a.token = None
            await self.register(a)
            return
        if r is None or r.status_code != 200:
            if r is not None and r.status_code in (429, 503):
                await asyncio.sleep(retry_after(r, 2.0))
            else:
                await asyncio.sleep(min(hb, 5.0) * (0.5 + random.random()))  # controller down: retry soon
            return
        self.apply_reply(a, wire.HeartbeatResponse.model_validate_json(r.content))

    def apply_reply(self, a: SimAgent, reply: wire.HeartbeatResponse) -> None:
        a.generation = reply.generation
        for d in reply.desired:
            if d.name == BUNDLE:
                self.apply(a, d)

    @staticmethod
    def missing(a: SimAgent) -> wire.BundleRef | None:
        """The first version of the desired state the agent does not stage yet (what serves first)."""
        d = a.desired
        if d is None:
            return None
        for ref in (d.active, d.stable, d.trial.candidate if d.trial else None):
            if ref is not None and ref.version not in a.staged:
                return ref
        return None

    def apply(self, a: SimAgent, desired: wire.DesiredBundle) -> None:
        """Serve what is staged (as ``agents.daemon``: the desired active version, else the stable one, else
        what serves) and hand what is missing to the agent's download task; never waits for bytes."""
        a.desired = desired
        want = desired.active  # None: a first version before its pre-serve trial passed (serve none)
        if self.missing(a) is not None and (a.download_task is None or a.download_task.done()):
            a.download_task = asyncio.create_task(self.download_loop(a))
        serve = a.active
        if want is not None and want.version in a.staged:
            serve = want
        elif desired.stable is not None and desired.stable.version in a.staged:
            serve = desired.stable
        if serve is not None and (a.active is None or a.active.digest != serve.digest):
            was_candidate = a.active is not None and a.active.version == self.candidate
            a.active = serve  # staged: switching is instant
            if serve.version == self.candidate and desired.role == "candidate":
                self.stats.canary_strata.setdefault(a.name, a.stratum)
            elif was_candidate and a.name not in self.stats.back_to_stable:
                self.stats.back_to_stable[a.name] = time.monotonic()
                self.stats.back_to_stable_wall[a.name] = time.time()
        if desired.trial is not None and desired.role == "candidate" and desired.trial.candidate.version in a.staged \
                and (a.trial_task is None or a.trial_task.done()):
            a.trial_task = asyncio.create_task(self.trial_loop(a))

    async def download_loop(self, a: SimAgent) -> None:
        """The agent's download task: stage what its desired state lacks, one version at a time, after a
        random delay; apply the desired state again and report it at once after each."""
        await asyncio.sleep(random.random() * DOWNLOAD_JITTER_S)
        while self.running and not a.stopped:
            ref = self.missing(a)
            if ref is None:
                return
            try:
                async for attempt in AsyncRetrying(
                        retry=retry_if_exception_type(DownloadFailed), reraise=True,
                        wait=backoff_wait(DOWNLOAD_BACKOFF_S, DOWNLOAD_BACKOFF_MAX_S),
                        before_sleep=self.count_download_failure):
                    with attempt:
                        if not self.running or a.stopped or self.missing(a) != ref:
                            break  # stopped, or the desired state moved on: look again
                        await self.fetch_once(a, ref)
            except DownloadFailed:  # pragma: no cover - retried until it is not wanted any more
                return
            if ref.version not in a.staged:
                continue
            if a.desired is not None:
                self.apply(a, a.desired)
            await self.report_now(a)

    def count_download_failure(self, _retry_state: Any) -> None:
        self.stats.download_failures += 1

    async def report_now(self, a: SimAgent) -> None:
        """The report after a download, sent at once (on the agent's connection for writes: its watch is held),
        as ``agents.daemon`` does from its downloader's thread; its reply is applied unless the watch applied a
        newer desired state meanwhile."""
        if a.token is None:
            return
        r = await self.request(a, "heartbeat_now", "POST", "/v1/agents/heartbeat", a.token, self.heartbeat_now(a),
                               timeout=self.cfg.heartbeat_seconds + 60, gated=False)
        if r is None or r.status_code != 200:
            return  # the watch after the one in flight reports it
        reply = wire.HeartbeatResponse.model_validate_json(r.content)
        if a.generation is None or reply.generation is None or reply.generation >= a.generation:
            self.apply_reply(a, reply)

    async def fetch_once(self, a: SimAgent, ref: wire.BundleRef) -> None:
        """Download a version's bundle: by every agent that lacks it (``download_per_agent``, as real agents
        do), else once for the whole simulated fleet; digest checked; staged on success, else
        :class:`DownloadFailed`."""
        once = not self.cfg.download_per_agent
        if once and ref.version in self.fetched:
            a.staged[ref.version] = ref
            return
        self.fetched.add(ref.version)
        r = await self.request(a, "bundle_content", "GET", f"/v1/bundles/{ref.name}/{ref.version}/content",
                               a.token or "", timeout=120)
        if r is None or r.status_code != 200 or hashlib.sha256(r.content).hexdigest() != ref.digest:
            self.fetched.discard(ref.version)
            raise DownloadFailed(f"{ref.name}@{ref.version}: {r.status_code if r is not None else 'no answer'}")
        self.stats.downloads += 1
        a.staged[ref.version] = ref

    # ------------------------------------------------------------------------------ trials
    async def trial_loop(self, a: SimAgent) -> None:
        """One simulated trial per trial interval while the desired state asks for one; the first after a
        random fraction of the interval (at most 30 s), so the fleet's reports do not arrive in one burst."""
        first = True
        while self.running and not a.stopped:
            d = a.desired
            if d is None or d.trial is None or d.role != "candidate":
                return
            interval = max(d.trial.interval_seconds, 0.05)
            await asyncio.sleep(random.random() * min(interval, 30.0) if first else interval)
            first = False
            d = a.desired
            if not self.running or a.stopped or d is None or d.trial is None:
                return
            a.outbox.append(self.trial_report(a, d.trial))
            await self.flush(a)

    def trial_report(self, a: SimAgent, trial: wire.TrialSpec) -> wire.TrialReport:
        sc = self.cfg.scenario
        t = a.trials % NOISE_TICKS
        a.trials += 1
        faulty = trial.candidate.version == self.candidate  # the baseline's own trials are clean
        numeric_bad = faulty and a.stratum in sc.numeric_error_strata
        ratio = float(self.ratio[t, a.index]) + (sc.log_effect if faulty else 0.0)
        stable_s = 1e-4 * float(self.stable[t, a.index])
        key = f"sim-{a.name}-{a.trials}-{secrets.token_hex(4)}"
        if numeric_bad or (faulty and sc.log_effect > 0):
            a.offending.add(key)
        # a real agent's report: pairs interleaved per (op, batch size) after a warm-up; the first carries the
        # noise model's ratio, the others the same ratio with a little per-call jitter (the judge reads them all)
        pairs = [wire.LatencyPair(op="bias_gelu", tokens=8, stable_s=stable_s, candidate_s=stable_s * math.exp(ratio))]
        for i in range(self.pairs_per_report(a) - 1):
            jitter = 1.0 + 0.01 * ((i * 7919 + a.trials) % 13 - 6) / 6.0
            pairs.append(wire.LatencyPair(op="bias_gelu", tokens=8, stable_s=stable_s * jitter,
                                          candidate_s=stable_s * jitter * math.exp(ratio)))
        return wire.TrialReport(
            idempotency_key=key, rollout_id=trial.rollout_id, stratum=trial.stratum, candidate=trial.candidate,
            stable=trial.stable, outcome="numeric_error" if numeric_bad else "ok",
            measured_at=dt.datetime.now(dt.timezone.utc), duration_s=0.5, latency=pairs,
            numerics=[wire.NumericCheck(op="bias_gelu", dtype="fp16", shape={"M": 8, "N": 4096},
                                        max_abs_err=0.5 if numeric_bad else 2e-4,
                                        max_rel_err=0.3 if numeric_bad else 1e-3, within_tolerance=not numeric_bad)],
            detail="simulated trial" + (" (numeric drift)" if numeric_bad else ""))

    def pairs_per_report(self, a: SimAgent) -> int:
        """Latency pairs in one report, for a report of about ``report_kb`` (6-46 KB drawn per agent: a real
        CPU agent's); one pair serialises to about 110 bytes."""
        lo, hi = self.cfg.report_kb
        kb = lo + (hi - lo) * ((a.index * 2654435761) % 1000) / 1000.0
        return max(1, int(kb * 1024 / PAIR_BYTES))

    async def flush(self, a: SimAgent) -> None:
        """Send the outbox as the agent does (what is waiting, at most ``MAX_REPORT_BATCH_BYTES`` of reports in one
        request); keep each until a 200 acknowledges it (retried after 429/503)."""
        while a.outbox and a.token is not None and self.running:
            batch, size = [], 0
            for r in a.outbox[:100]:
                size += REPORT_BYTES + PAIR_BYTES * len(r.latency)
                if batch and size > wire.MAX_REPORT_BATCH_BYTES:
                    break
                batch.append(r.compact())
            now = time.monotonic()
            for r in batch:
                self.stats.sent_keys.add(r.idempotency_key)
                if r.idempotency_key in a.offending:
                    self.stats.first_offending.setdefault(a.stratum, now)
            resp = await self.request(a, "reports", "POST", "/v1/agents/reports", a.token,
                                      wire.ReportBatch(node_name=a.name, reports=batch))
            if resp is None or resp.status_code >= 500 or resp.status_code == 429:
                if a.stopped:
                    return
                await asyncio.sleep(retry_after(resp, 2.0) if resp is not None else 2.0 * (0.5 + random.random()))
                continue
            sent = {r.idempotency_key for r in batch}
            a.outbox = [r for r in a.outbox if r.idempotency_key not in sent]
            a.offending -= sent
            if resp.status_code != 200:
                return  # 4xx: refused for good (counted as an error of the endpoint), never resent
            body = wire.ReportBatchResponse.model_validate_json(resp.content)
            self.stats.accepted += body.accepted
            self.stats.duplicates += body.duplicates
            self.stats.refused.update(body.refused)  # late reports (not a canary any more): not stored
            self.stats.acked.update(k for k in sent if k not in body.refused)
            t = time.monotonic()
            self.stats.first_report_at = self.stats.first_report_at or t
            self.stats.last_report_at = t

    async def final_flush(self, timeout: float = 60.0) -> None:
        """Send what is left in the outboxes (the agents' loops have ended)."""
        self.running = True
        try:
            await asyncio.wait_for(asyncio.gather(*(self.flush(a) for a in self.agents if a.outbox
                                                    and not a.stopped)), timeout)
        except TimeoutError:
            pass
        finally:
            self.running = False
