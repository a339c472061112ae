"""Static web routes: the browser client (always) and the demo chat page (dev mode).

``/static/gateway-client.js`` (and its ``.d.ts``) is the JavaScript client for the wire
protocol; apps may load it straight from the gateway. ``/`` is the demo chat page, served only
in dev mode: it takes its token from ``?token=`` in the page URL, then moves it out of the
address bar (into sessionStorage) on load.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Route

STATIC_DIR = Path(__file__).parent / "static"

JS = "text/javascript; charset=utf-8"
TS = "application/typescript; charset=utf-8"
CSS = "text/css; charset=utf-8"
HTML = "text/html; charset=utf-8"

# URL path -> (file under static/, content type). Nothing else under static/ is reachable.
CLIENT_FILES = {
    "/static/gateway-client.js": ("gateway-client.js", JS),
    "/static/gateway-client.d.ts": ("gateway-client.d.ts", TS),
}
DEMO_FILES = {
    "/": ("index.html", HTML),
    "/static/app.js": ("app.js", JS),
    "/static/app.css": ("app.css", CSS),
}

_HEADERS = {
    # Small files that change with the package: revalidate every time (ETag/Last-Modified).
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}
_CLIENT_HEADERS = {
    **_HEADERS,
    # Module scripts are fetched with CORS: let apps on other origins import the client.
    "Access-Control-Allow-Origin": "*",
}
_PAGE_HEADERS = {
    **_HEADERS,
    # The page URL carries the token: keep it out of Referer headers.
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self' ws: wss:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
}


def _endpoint(name: str, media_type: str,
              headers: dict[str, str]) -> Callable[[Request], Awaitable[Response]]:
    path = STATIC_DIR / name

    async def endpoint(request: Request) -> Response:
        return FileResponse(path, media_type=media_type, headers=headers)

    return endpoint


def _routes(files: dict[str, tuple[str, str]], headers: dict[str, str]) -> list[BaseRoute]:
    return [Route(url, _endpoint(name, kind, headers), methods=["GET", "HEAD"],
                  name="static:" + name)
            for url, (name, kind) in files.items()]


def web_routes(dev: bool = False) -> list[BaseRoute]:
    """The JavaScript client's routes, plus the demo page's when ``dev`` is true.

    The app adds ``*web_routes(dev=settings.dev)`` to its routes.
    """
    routes = _routes(CLIENT_FILES, _CLIENT_HEADERS)
    if dev:
        routes += _routes(DEMO_FILES, _PAGE_HEADERS)
    return routes
