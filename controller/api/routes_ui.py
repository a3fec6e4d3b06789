"""The browser UI under ``/ui``: one static page (HTML, JavaScript, CSS from :mod:`controller.ui`) and
``GET /v1/whoami``, the one API call the page needs that the CLI did not have (who holds this token, so the
page shows operator controls only to operators).

The page itself is public and holds no data: everything it shows it fetches from the same ``/v1`` API the
CLI uses, with the bearer token the user typed in (kept in the tab's ``sessionStorage``, sent as an
``Authorization`` header; no cookie, so no ambient credential for a cross-site request to ride on). Roles are
enforced by the API exactly as for the CLI. The static files are served from a fixed list (no path from the
request reaches the filesystem) with a strict Content-Security-Policy: scripts only from ``/ui/static``, no
inline script, no eval, no framing, ``connect-src 'self'``.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

from controller.api.deps import Viewer
from controller.errors import NotFound
from kernelctl import wire

_STATIC = resources.files("controller.ui") / "static"
# name -> media type: the only files /ui serves
ASSETS: dict[str, str] = {
    "app.js": "text/javascript; charset=utf-8",
    "plot.js": "text/javascript; charset=utf-8",
    "dom.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}

router = APIRouter()


def _asset(name: str) -> bytes:
    return (_STATIC / name).read_bytes()


@router.get("/ui", include_in_schema=False)
def ui_root() -> Response:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/ui/", include_in_schema=False)
def ui_index() -> Response:
    """The single page; which view it shows is in the URL fragment (``#/rollouts/7``)."""
    return Response(_asset("index.html"), media_type="text/html; charset=utf-8",
                    headers={**SECURITY_HEADERS, "Cache-Control": "no-store"})


@router.get("/ui/static/{name}", include_in_schema=False)
def ui_static(name: str) -> Response:
    media = ASSETS.get(name)
    if media is None:
        raise NotFound(f"no UI file {name!r}")
    return Response(_asset(name), media_type=media, headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})


@router.get(wire.API_PREFIX + "/whoami", tags=["auth"])
def whoami(principal: Viewer) -> dict[str, Any]:
    """The caller's token name and role (viewer or operator; other roles are refused with 403)."""
    return {"name": principal.name, "role": principal.role, "actor": principal.actor}
