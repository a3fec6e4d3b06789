"""The one operator HTTP client of the controller's API (``/v1``), with typed errors.

Every operator CLI verb, the demo and the simulators talk to a controller through :class:`OperatorClient`
(or :class:`AsyncOperatorClient`); an error answer becomes an :class:`ApiError` subclass chosen by its HTTP
status (never by its message text), a connection failure :class:`Unreachable` and a timeout
:class:`TimedOut`. The CLI turns them into one line and an exit code (``kernelctl.console.exit_code``).

    with OperatorClient(url, token) as api:
        api.push_bundle(path)
        rollout = api.start_rollout("llm-fused@1.1.0", plan=plan, reason="canary")
        final = api.wait_rollout(rollout["id"], timeout=300)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from kernelctl.vocab import TERMINAL_STATES


class OperatorError(Exception):
    """Base of every failure of an operator call; ``str()`` is one line."""


class Unreachable(OperatorError):
    """The controller could not be reached (connection refused, DNS, TLS, reset)."""


class TimedOut(Unreachable):
    """The controller did not answer in time (or a wait on it ran out)."""


class NotController(OperatorError):
    """The URL answered, but not as a kernelctl controller's API (an HTML page, say): a wrong ``--url``."""


class ApiError(OperatorError):
    """The controller answered with an HTTP error; ``status`` and ``detail`` say which and why."""

    def __init__(self, method: str, path: str, status: int, detail: str) -> None:
        super().__init__(f"{method} {path} -> {status}: {detail}")
        self.method, self.path, self.status, self.detail = method, path, status, detail


class BadRequest(ApiError):
    """400: a malformed request (bad filter value, bad flags)."""


class AuthError(ApiError):
    """401 or 403: no, a wrong, or an insufficient token."""


class NotFound(ApiError):
    """404: the named bundle, rollout, node or stratum does not exist."""


class Conflict(ApiError):
    """409: invalid in the current state, or another writer changed the same rollout first (retryable)."""


class Refused(ApiError):
    """413 or 422: the controller refused the input (too large, failed validation or verification)."""


class ServerError(ApiError):
    """5xx: the controller failed."""


class Unavailable(ServerError):
    """503: not ready, not the leader, or the database is down (retryable)."""


_BY_STATUS: dict[int, type[ApiError]] = {400: BadRequest, 401: AuthError, 403: AuthError, 404: NotFound,
                                         409: Conflict, 413: Refused, 422: Refused, 503: Unavailable}


def error_detail(resp: httpx.Response) -> str:
    """The one-line reason of an error answer: FastAPI's ``detail`` (validation errors name their fields)."""
    try:
        detail = resp.json().get("detail")
    except (ValueError, AttributeError):
        detail = (resp.text.strip().splitlines() or [""])[0][:300] or resp.reason_phrase
    if isinstance(detail, list):  # FastAPI validation errors: name the fields
        detail = "; ".join(
            (f"{field}: {d.get('msg')}" if (field := ".".join(str(x) for x in d.get("loc", [])[1:]))
             else str(d.get("msg")))
            for d in detail[:5] if isinstance(d, dict)
        )
    return str(detail)


def api_error(method: str, path: str, resp: httpx.Response) -> ApiError:
    """The typed error for an error answer (>= 400)."""
    status = resp.status_code
    cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else ApiError)
    return cls(method, path, status, error_detail(resp))


@contextmanager
def _transport_errors(url: str) -> Iterator[None]:
    """httpx's transport failures as :class:`TimedOut` / :class:`Unreachable`."""
    try:
        yield
    except httpx.TimeoutException:
        raise TimedOut(f"controller at {url} did not answer in time") from None
    except httpx.HTTPError as exc:
        raise Unreachable(f"cannot reach the controller at {url}: {exc}") from None


_NOT_API = ("text/html", "application/xhtml+xml")  # what no /v1 route answers: a web page, not this API


def _answer(method: str, path: str, resp: httpx.Response) -> Any:
    """The decoded JSON (bytes for other content, None for none), or the typed error of an error answer; a web
    page (another server at that URL) is :class:`NotController`, one line, never its markup."""
    if resp.headers.get("content-type", "").split(";")[0].strip().lower() in _NOT_API:
        where = f"{resp.url.scheme}://{resp.url.netloc.decode('ascii', 'replace')}"
        raise NotController(f"{where} is not a kernelctl controller: {method} {path} answered HTTP "
                            f"{resp.status_code} with a web page (check --url or KERNELCTL_URL)")
    if resp.status_code >= 400:
        raise api_error(method, path, resp)
    if resp.headers.get("content-type", "").startswith("application/json"):
        return resp.json()
    return resp.content or None


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class OperatorClient:
    """A synchronous operator client on one controller (a pooled ``httpx.Client``)."""

    def __init__(self, url: str, token: str | None, *, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, headers=_headers(token), timeout=timeout)

    def request(self, method: str, path: str, **kw: Any) -> Any:
        """One call: the decoded JSON (bytes for other content, None for none); a typed error otherwise."""
        with _transport_errors(self.url):
            resp = self.http.request(method, path, **kw)
        return _answer(method, path, resp)

    def get_all(self, path: str, params: dict[str, Any] | None = None) -> Any:
        """GET ``path``; a list is paged (controller.paging): follow its ``Link rel="next"`` cursors to the
        last page and return every row. Anything else as :meth:`request`."""
        rows = None
        while True:
            with _transport_errors(self.url):
                resp = self.http.get(path, params=params)
            data = _answer("GET", path, resp)
            if not isinstance(data, list):
                return data
            rows = data if rows is None else rows + data
            if "next" not in resp.links:
                return rows
            path, params = resp.links["next"]["url"], None

    # ------------------------------------------------------------------------------------ verbs
    def push_bundle(self, file: Path | bytes) -> dict[str, Any]:
        data = file if isinstance(file, bytes) else Path(file).read_bytes()
        return self.request("POST", "/v1/bundles", content=data, headers={"Content-Type": "application/octet-stream"})

    def start_rollout(self, ref: str, *, plan: Any = None, reason: str | None = None, force: bool = False,
                      accept_contract_change: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"bundle": ref, "force": force, "reason": reason}
        if plan is not None:
            body["plan"] = plan
        if accept_contract_change is not None:
            body["accept_contract_change"] = accept_contract_change
        return self.request("POST", "/v1/rollouts", json=body)

    def rollout(self, rollout_id: int) -> dict[str, Any]:
        return self.request("GET", f"/v1/rollouts/{rollout_id}")

    def transition(self, rollout_id: int, action: str, body: dict[str, Any]) -> dict[str, Any]:
        """``action`` is promote, rollback, pause or resume."""
        return self.request("POST", f"/v1/rollouts/{rollout_id}/{action}", json=body)

    def nodes(self, state: str | None = None) -> list[dict[str, Any]]:
        """Every node (all pages)."""
        return self.get_all("/v1/nodes", params={"state": state} if state else None)

    def wait_rollout(self, rollout_id: int, *, timeout: float, poll: float = 0.5,
                     on_update: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Poll until the rollout is promoted or rolled back, or ``timeout`` passed: its last detail."""
        deadline = time.monotonic() + timeout
        while True:
            detail = self.rollout(rollout_id)
            if on_update:
                on_update(detail)
            if detail["state"] in TERMINAL_STATES or time.monotonic() > deadline:
                return detail
            time.sleep(poll)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> OperatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncOperatorClient:
    """The asyncio twin of :class:`OperatorClient` over a caller's ``httpx.AsyncClient`` (a shared pool);
    ``retry=True`` retries :class:`Conflict` and :class:`Unavailable` answers (tenacity, jittered backoff)."""

    def __init__(self, http: httpx.AsyncClient, url: str, token: str | None, *, timeout: float = 60.0) -> None:
        self.http, self.url, self.token, self.timeout = http, url.rstrip("/"), token, timeout

    async def request(self, method: str, path: str, *, retry: bool = False, attempts: int = 8, **kw: Any) -> Any:
        policy = AsyncRetrying(retry=retry_if_exception_type((Conflict, Unavailable)),
                               stop=stop_after_attempt(attempts if retry else 1),
                               wait=wait_random_exponential(0.2, max=3), reraise=True)
        async for attempt in policy:
            with attempt:
                return await self._once(method, path, **kw)
        raise AssertionError("unreachable")  # pragma: no cover

    async def get_all(self, path: str, *, retry: bool = False, **kw: Any) -> Any:
        """GET a paged list to its last page (see :meth:`OperatorClient.get_all`); each page retried as
        :meth:`request`."""
        rows: list[Any] = []
        while True:
            data, links = await self.request("GET", path, retry=retry, with_links=True, **kw)
            if not isinstance(data, list):
                return data
            rows.extend(data)
            if "next" not in links:
                return rows
            path, kw = links["next"]["url"], {k: v for k, v in kw.items() if k != "params"}

    async def _once(self, method: str, path: str, *, with_links: bool = False, **kw: Any) -> Any:
        with _transport_errors(self.url):
            resp = await self.http.request(method, self.url + path, headers=_headers(self.token),
                                           timeout=kw.pop("timeout", self.timeout), **kw)
        data = _answer(method, path, resp)
        return (data, resp.links) if with_links else data
