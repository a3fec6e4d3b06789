"""A report batch, answered: what the FastAPI route and the fast lane (``controller.api.fast_lane``) share.

:func:`accepted` counts a stored batch in the metrics and renders its reply (after
``controller.desired.writers.Writers.ingest``: admission first, then parsing, validation and storing off the
event loop, ``controller.intake``). :class:`ReportRoute` is the lane's common case: a JSON body from a cached node
token that is stored (accepted, duplicate or refused one by one) or refused for load (503 with Retry-After).
A body that does not validate, a batch from another node's token, too many reports or a failed store are the
route's: it answers them from scratch (parsing, or storing, once more: bad batches are rare, and a store that
failed stored nothing).
"""

from __future__ import annotations

from controller import intake
from controller.api.deps import AppState
from controller.api.fast_lane import Reply, overloaded
from controller.auth import Principal
from controller.errors import Overloaded
from kernelctl import wire
from kernelctl.settings import Settings

PATH = wire.API_PREFIX + "/agents/reports"


def accepted(state: AppState, out: intake.Outcome) -> bytes:
    """A stored batch's reply (``wire.ReportBatchResponse``), counted in the ingest metrics."""
    assert out.reply is not None
    m = state.metrics
    if out.reply.accepted:
        m.reports_ingested.labels("accepted").inc(out.reply.accepted)
    if out.reply.duplicates:
        m.reports_ingested.labels("duplicate").inc(out.reply.duplicates)
    for reason in out.refused_reasons:
        m.reports_refused.labels(reason).inc()
    return out.reply.model_dump_json(exclude_unset=True).encode()


class ReportRoute:
    """The fast lane's report batch: stored, or refused for load (``controller.api.fast_lane``)."""

    path = PATH

    def body_limit(self, settings: Settings) -> int:
        return settings.max_report_body_bytes

    async def answer(self, state: AppState, principal: Principal, token: str, body: bytes) -> Reply | None:
        try:
            out = await state.hub.writers.ingest(body, True, principal)
        except Overloaded as exc:
            return overloaded(exc)
        if out.invalid or out.error is not None:
            return None
        return 200, accepted(state, out), []
