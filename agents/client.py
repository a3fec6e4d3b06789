"""HTTP client of the agent: register, heartbeat, bundle download, report batches (httpx + tenacity).

Retries (exponential backoff with jitter, tenacity) only on transport errors (connect, read and write
timeouts, a dropped connection: every call is safe to repeat, registration included thanks to its registration
key), 429 and 5xx answers (never sooner than the controller's ``Retry-After``, with jitter on top); any other
error is raised at once as :class:`ControllerError` with the controller's ``detail``. The node token the
controller hands out at registration is persisted (mode 0600, atomic write) in the cache dir and used from
then on; the enrollment token is only needed again if the controller no longer knows the node token. The
registration key (:meth:`TokenStore.registration_key`) is generated and persisted before the first attempt:
a retry of a registration whose reply was lost gets the same node.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import random
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from agents.trial_protocol import write_json_atomic
from kernelctl.wire import (
    API_PREFIX,
    BundleRef,
    HeartbeatRequest,
    HeartbeatResponse,
    RegisterRequest,
    RegisterResponse,
    ReportBatch,
    ReportBatchResponse,
    TrialReport,
)

log = logging.getLogger("kernelctl.agent.client")

T = TypeVar("T", bound=BaseModel)
DIGEST_HEADER = "X-Kernelctl-Digest"


class ControllerError(Exception):
    """The controller answered with an error (status and its ``detail``), or could not be reached."""

    def __init__(self, message: str, status: int | None = None,
                 refusals: frozenset[tuple[str, str]] = frozenset()) -> None:
        super().__init__(message)
        self.status = status
        self.refusals = refusals  # a 422's (field, error type) pairs: what the controller refused, by type


class Unreachable(ControllerError):
    """Connect errors / 5xx persisted through every retry."""


class DownloadError(ControllerError):
    """A bundle download was cut short, too large, or its digest differs from the one asked for."""


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, httpx.TransportError):  # connect/read/write timeouts, refused or dropped connections
        return True
    return isinstance(exc, httpx.HTTPStatusError) and (exc.response.status_code >= 500
                                                       or exc.response.status_code == 429)


MAX_RETRY_AFTER_S = 60.0


def retry_after_seconds(exc: BaseException | None) -> float:
    """The ``Retry-After`` (seconds) of an overloaded controller's 429/503 answer; 0 when absent."""
    if not isinstance(exc, httpx.HTTPStatusError):
        return 0.0
    try:
        return min(MAX_RETRY_AFTER_S, max(0.0, float(exc.response.headers.get("retry-after", "0"))))
    except ValueError:
        return 0.0


def backoff_wait(initial: float, maximum: float) -> Any:
    """Exponential backoff from ``initial`` doubling up to ``maximum``, plus up to ``initial`` of jitter; never
    sooner than the controller's ``Retry-After`` (plus up to half of it again as jitter, so that a fleet told
    to come back in 2 s does not come back in the same instant)."""
    params = inspect.signature(wait_exponential_jitter.__init__).parameters
    start = {"multiplier": initial} if "multiplier" in params else {"initial": initial}  # tenacity >= 9.1
    base = wait_exponential_jitter(**start, max=maximum, jitter=initial)

    def wait(retry_state: Any) -> float:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        after = retry_after_seconds(exc)
        return max(base(retry_state), after * (1.0 + 0.5 * random.random()))

    return wait


def _detail(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500] or resp.reason_phrase
    if isinstance(body, dict) and "detail" in body:
        d = body["detail"]
        return d if isinstance(d, str) else json.dumps(d)[:1000]
    return json.dumps(body)[:500]


def _refusals(resp: httpx.Response) -> frozenset[tuple[str, str]]:
    """(field, error type) of each item of a 422's ``detail`` list (FastAPI's validation answer)."""
    try:
        detail = resp.json().get("detail")
    except (ValueError, AttributeError):
        return frozenset()
    if not isinstance(detail, list):
        return frozenset()
    return frozenset((str(e["loc"][-1]), str(e.get("type"))) for e in detail
                     if isinstance(e, dict) and isinstance(e.get("loc"), list) and e["loc"])


def _write_private(path: Path, doc: dict[str, str]) -> None:
    """Write ``doc`` as JSON to ``path``: mode 0600, atomically (a crash leaves the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, doc, mode=0o600)


class TokenStore:
    """The node token on disk: ``<dir>/node-token.json`` (0600) keyed by controller URL and node name."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / "node-token.json"

    def load(self, controller_url: str, node_name: str) -> str | None:
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if doc.get("controller_url") == controller_url and doc.get("node_name") == node_name:
            tok = doc.get("token")
            return tok if isinstance(tok, str) and tok else None
        return None

    def save(self, controller_url: str, node_name: str, token: str) -> None:
        _write_private(self.path, {"controller_url": controller_url, "node_name": node_name, "token": token})

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    def registration_key(self, controller_url: str, node_name: str) -> str:
        """This node's registration key for ``controller_url``: read, or generated and persisted (0600, atomic)
        before it is first sent, so a retry after a lost reply proves it is the same agent."""
        path = self.path.with_name("registration-key.json")
        try:
            doc = json.loads(path.read_text())
            if doc.get("controller_url") == controller_url and doc.get("node_name") == node_name \
                    and isinstance(doc.get("key"), str) and len(doc["key"]) >= 16:
                return str(doc["key"])
        except (OSError, ValueError, AttributeError):
            pass
        key = secrets.token_urlsafe(32)
        _write_private(path, {"controller_url": controller_url, "node_name": node_name, "key": key})
        return key


class ControllerClient:
    """Talks to one controller on behalf of one node."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = 10.0,
        max_attempts: int = 5,
        max_retry_seconds: float = 30.0,
        backoff_initial: float = 0.2,
        backoff_max: float = 5.0,
        stop_event: threading.Event | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._stop = stop_event or threading.Event()
        self._retry_kwargs: dict[str, Any] = {
            "retry": retry_if_exception(_retryable),
            "wait": backoff_wait(backoff_initial, backoff_max),
            "stop": stop_after_attempt(max_attempts) | stop_after_delay(max_retry_seconds) | self._stopped,
            "sleep": self._sleep,
            "reraise": True,
            "before_sleep": self._log_retry,
        }
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, transport=transport)
        self.report_columns = True  # send reports' tables as columns (False once the controller refused them)

    # tenacity hooks -------------------------------------------------------------------------------
    def _stopped(self, retry_state: Any) -> bool:
        return self._stop.is_set()

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)  # interruptible by shutdown

    @staticmethod
    def _log_retry(retry_state: Any) -> None:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        log.info("controller call failed (%s); retry %d", exc, retry_state.attempt_number)

    def close(self) -> None:
        self._http.close()

    # request plumbing -----------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def _call(self, fn: Callable[[], httpx.Response]) -> httpx.Response:
        def attempt() -> httpx.Response:
            resp = fn()
            if resp.status_code >= 500 or resp.status_code == 429:
                resp.raise_for_status()
            return resp

        try:
            resp = Retrying(**self._retry_kwargs)(attempt)
        except httpx.TransportError as exc:
            raise Unreachable(f"controller {self.base_url} unreachable: {type(exc).__name__}: {exc}") from exc
        except httpx.HTTPStatusError as exc:
            raise Unreachable(
                f"controller {self.base_url} answered {exc.response.status_code}: {_detail(exc.response)}",
                exc.response.status_code,
            ) from exc
        except RetryError as exc:  # pragma: no cover - reraise=True normally unwraps
            raise Unreachable(f"controller {self.base_url}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise ControllerError(f"request to {self.base_url} failed: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 400:
            raise ControllerError(
                f"{resp.request.method} {resp.request.url.path} -> {resp.status_code}: {_detail(resp)}",
                resp.status_code, _refusals(resp),
            )
        return resp

    def _post(self, path: str, body: BaseModel, model: type[T], timeout: float | None = None) -> T:
        payload = body.model_dump_json().encode()
        headers = {**self._headers(), "Content-Type": "application/json"}
        kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        resp = self._call(lambda: self._http.post(API_PREFIX + path, content=payload, headers=headers, **kw))
        return model.model_validate_json(resp.content)

    # API ---------------------------------------------------------------------------------------------
    def register(self, request: RegisterRequest) -> RegisterResponse:
        """Register (or re-register) the node; afterwards this client uses the node token. Every attempt (a
        retry included) is stamped with the time it is sent (``sent_at_ns``): the controller then never lets an
        earlier attempt answered late revoke the token a later one got."""
        headers = {**self._headers(), "Content-Type": "application/json"}

        def send() -> httpx.Response:
            body = request.model_copy(update={"sent_at_ns": time.time_ns()}).model_dump_json().encode()
            return self._http.post(API_PREFIX + "/agents/register", content=body, headers=headers)

        reply = RegisterResponse.model_validate_json(self._call(send).content)
        self.token = reply.node_token
        return reply

    def heartbeat(self, request: HeartbeatRequest) -> HeartbeatResponse:
        """A heartbeat; with ``wait_seconds`` it is a watch the controller may hold that long."""
        timeout = None if not request.wait_seconds else request.wait_seconds + self.timeout
        return self._post("/agents/heartbeat", request, HeartbeatResponse, timeout=timeout)

    def send_reports(self, node_name: str, reports: list[TrialReport]) -> ReportBatchResponse:
        """One report request; its tables as columns (``kernelctl.wire_columns``) unless this controller once
        refused them (a controller that predates them: lists from then on, the same reports)."""
        if self.report_columns:
            try:
                return self._post("/agents/reports", ReportBatch(node_name=node_name,
                                                                 reports=[r.compact() for r in reports]),
                                  ReportBatchResponse)
            except ControllerError as exc:
                if exc.status != 422 or ("columns", "extra_forbidden") not in exc.refusals:
                    raise
                log.warning("the controller does not read report columns: sending reports as lists")
                self.report_columns = False
        return self._post("/agents/reports", ReportBatch(node_name=node_name, reports=[r.expanded() for r in reports]),
                          ReportBatchResponse)

    def download_bundle(self, ref: BundleRef, dest_dir: Path, max_bytes: int) -> Path:
        """Stream ``ref``'s .kpack into a new temp file in ``dest_dir``; check size and digest; return the path.

        A download cut short is resumed where it stopped (``Range``, the retry of a transport error), and the
        bytes already received are kept only while the controller answers for the same digest (``ETag``). When
        the controller stays unreachable (:class:`Unreachable`) the partial file (``.dl-<digest>.part``) is
        kept, and the next call for the same digest resumes it; any other failure deletes it. The caller still
        verifies signature and trusted key (``agents.cache``) before anything uses it.
        """
        dest_dir.mkdir(parents=True, exist_ok=True)
        url = f"{API_PREFIX}/bundles/{ref.name}/{ref.version}/content"
        tmp = str(dest_dir / f".dl-{ref.digest}.part")
        with open(tmp, "ab"):  # a partial file of an earlier attempt is resumed
            pass

        def fetch() -> httpx.Response:
            have = Path(tmp).stat().st_size
            headers = {**self._headers(), **({"Range": f"bytes={have}-", "If-Range": f'"{ref.digest}"'}
                                               if have else {})}
            with open(tmp, "r+b") as f, self._http.stream("GET", url, headers=headers) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    return resp
                size = have if resp.status_code == 206 else 0  # 200: the whole body again
                f.seek(size)
                f.truncate()
                for chunk in resp.iter_bytes(1 << 16):
                    size += len(chunk)
                    if size > max_bytes:
                        raise DownloadError(
                            f"bundle {ref.name}@{ref.version} is larger than the cap of {max_bytes} bytes"
                        )
                    f.write(chunk)
                return resp

        try:
            resp = self._call(fetch)
        except Unreachable:
            raise  # kept: the next attempt resumes it
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        sha = hashlib.sha256()
        with open(tmp, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                sha.update(chunk)
        got = sha.hexdigest()
        header = resp.headers.get(DIGEST_HEADER)
        if got != ref.digest or (header is not None and header != ref.digest):
            Path(tmp).unlink(missing_ok=True)
            raise DownloadError(
                f"bundle {ref.name}@{ref.version}: downloaded bytes have sha256 {got}, expected {ref.digest}"
                + (f" (controller says {header})" if header and header != ref.digest else "")
            )
        return Path(tmp)
