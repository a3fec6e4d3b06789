"""Bundle endpoints: push (raw .kpack, verified, size-capped while streaming), list, show, content download."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response
from sqlalchemy import select
from sqlalchemy.orm import selectinload
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from controller import registry
from controller.api.deps import CurrentPrincipal, Operator, State, Viewer
from controller.api.pages import Cursor, Limit, keyset_page
from controller.api.schemas import BundleOut
from controller.auth import Forbidden, require_role
from controller.bundle_bytes import byte_range
from controller.db.models import Bundle
from controller.errors import Conflict, NotFound
from controller.paging import PAGE_MAX
from kernelctl import wire

router = APIRouter(prefix=wire.API_PREFIX + "/bundles", tags=["bundles"])
# path parameters are bounded before they reach the database (a NUL byte or a megabyte name is a 422)
BundleNamePath = Annotated[str, Path(max_length=128, pattern=r"^[ -~]+$")]
VersionPath = Annotated[str, Path(max_length=64, pattern=r"^[ -~]+$")]


def bundle_out(b: Bundle, *, manifest: bool = False) -> BundleOut:
    return BundleOut(
        name=b.name,
        version=b.version,
        ref=b.ref,
        digest=b.digest,
        status=b.status,
        status_reason=b.status_reason,
        parent_version=b.parent_version,
        signer_key_id=b.signer_key_id,
        size_bytes=b.size_bytes,
        created_at=b.created_at,
        created_by=b.created_by,
        targets=[
            {"arch": t.arch, "min_driver": t.min_driver, "cuda": t.cuda, "triton": t.triton, "torch": t.torch}
            for t in b.targets
        ],
        manifest=b.manifest if manifest else None,
    )


async def _read_capped(request: Request, limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise HTTPException(413, f"bundle is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


@router.post("", status_code=201, response_model=BundleOut, responses={413: {"model": wire.ErrorBody}},
             openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": {
                 "schema": {"type": "string", "format": "binary"}}}}})
async def push(request: Request, principal: Operator, state: State) -> BundleOut:
    """Register a signed bundle: the raw .kpack bytes, verified with the controller's trusted keys."""
    data = await _read_capped(request, state.settings.max_bundle_bytes)
    if not data:
        raise HTTPException(422, "empty body: send the .kpack bytes (Content-Type: application/octet-stream)")
    if state.trusted_keys is None:
        raise Conflict("the controller has no trusted keys (set KERNELCTL_TRUSTED_KEYS_DIR): it cannot verify bundles")

    cfg = state.settings
    limits = registry.upload_limits(max_bundle_bytes=cfg.max_bundle_bytes, max_files=cfg.max_bundle_files,
                                    max_uncompressed_bytes=cfg.max_bundle_uncompressed_bytes)

    def work() -> BundleOut:
        with state.tx() as session:
            bundle = registry.register_bundle(session, data, actor=principal.actor, trusted_keys=state.trusted_keys,
                                              limits=limits)
            session.flush()
            return bundle_out(bundle, manifest=True)

    return await run_in_threadpool(work)


@router.get("", response_model=list[BundleOut])
def list_bundles(_p: Viewer, state: State, request: Request, response: Response,
                 name: str | None = Query(None, max_length=128, pattern=r"^[ -~]*$"),
                 limit: int = Limit(PAGE_MAX), cursor: str | None = Cursor()) -> list[BundleOut]:
    """Registered bundle versions (optionally of one name) by name, oldest first, a page at a time."""
    stmt = select(Bundle).options(selectinload(Bundle.targets))
    if name:
        stmt = stmt.where(Bundle.name == name)
    with state.read() as session:
        return [bundle_out(b) for b in keyset_page(session, stmt, "bundles", (Bundle.name, Bundle.id), cursor=cursor,
                                                   limit=limit, request=request, response=response)]


def _get(session, name: str, version: str) -> Bundle:  # type: ignore[no-untyped-def]
    b = session.scalars(select(Bundle).where(Bundle.name == name, Bundle.version == version)).first()
    if b is None:
        raise NotFound(f"no bundle {name}@{version} is registered")
    return b


def _get_digest(session, name: str, version: str) -> str:  # type: ignore[no-untyped-def]
    digest = session.scalar(select(Bundle.digest).where(Bundle.name == name, Bundle.version == version))
    if digest is None:
        raise NotFound(f"no bundle {name}@{version} is registered")
    return str(digest)


@router.get("/{name}/{version}", response_model=BundleOut)
def show(name: BundleNamePath, version: VersionPath, _p: Viewer, state: State) -> BundleOut:
    with state.read() as session:
        return bundle_out(_get(session, name, version), manifest=True)


@router.get("/{name}/{version}/content", response_class=Response,
            responses={200: {"content": {"application/octet-stream": {}}}})
def content(name: BundleNamePath, version: VersionPath, principal: CurrentPrincipal, state: State,
            request: Request) -> Response:
    """The .kpack bytes (agents with a node token, operators, viewers); header X-Kernelctl-Digest.

    Served from this replica's cache by digest (``controller.bundle_bytes``; the database is read once per
    version), in a worker thread; ``Range`` resumes a cut download, ``If-None-Match`` with the digest is 304."""
    require_role(principal, "agent", "viewer")
    if principal.is_enrollment:
        raise Forbidden("an enrollment token may only register; use the node token returned by register")
    with state.read() as session:
        digest = _get_digest(session, name, version)
    headers = {"X-Kernelctl-Digest": digest, "ETag": f'"{digest}"', "Accept-Ranges": "bytes",
               "Cache-Control": "private, max-age=31536000, immutable",
               "Content-Disposition": f'attachment; filename="{name}-{version}.kpack"'}
    if request.headers.get("if-none-match", "").strip('" ') == digest:
        return Response(status_code=304, headers=headers)

    def load() -> bytes:
        with state.read() as s:
            return s.scalar(select(Bundle.content).where(Bundle.digest == digest))  # type: ignore[return-value]

    data = state.bundle_bytes.get(digest, load)
    if_range = request.headers.get("if-range")
    try:  # a Range for other bytes than these (If-Range names another digest) gets the whole body
        part = byte_range(request.headers.get("range") if if_range in (None, f'"{digest}"') else None, len(data))
    except ValueError as exc:
        return Response(str(exc), status_code=416, headers={**headers, "Content-Range": f"bytes */{len(data)}"})
    if part is None:
        return Response(data, media_type="application/octet-stream", headers=headers)
    start, end = part
    return Response(data[start:end + 1], status_code=206, media_type="application/octet-stream",
                    headers={**headers, "Content-Range": f"bytes {start}-{end}/{len(data)}"})
