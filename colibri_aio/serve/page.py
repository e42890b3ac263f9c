"""``GET /`` and ``GET /web/*``: the engine's web page, static files shipped in the package (``serve/web``).

The page is plain HTML, CSS and JavaScript: no CDN, no build step, no
package manager at run time, so it works on a machine with no network but
the path to this server. Only the files named in :data:`ASSETS` are served
(a fixed table, no path from the request ever reaches the file system), and
only they are public when an API key is set (:data:`PAGE_PATHS`): the page
must load to ask for the key; everything it then asks of the API carries it.
"""
from __future__ import annotations

from functools import cache
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

# URL path -> (file in serve/web, media type)
ASSETS: dict[str, tuple[str, str]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/web/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/web/charts.js": ("charts.js", "text/javascript; charset=utf-8"),
    "/web/style.css": ("style.css", "text/css; charset=utf-8"),
}
PAGE_PATHS = frozenset(ASSETS)
PAGE_METHODS = frozenset({"GET", "HEAD"})

# The page shows what a model wrote, and a model can be made to write markup: the page only ever sets text
# (textContent), and this policy is the second fence: scripts, styles and connections from this server only, no
# inline script, no frames of the page elsewhere (clickjacking).
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # The files change with the package: the browser asks again (a cheap 200 on loopback) rather than keeps a stale
    # script beside a newer server.
    "Cache-Control": "no-cache",
}


@cache
def _read(name: str) -> bytes:
    return resources.files("colibri_aio.serve").joinpath("web", name).read_bytes()


async def asset(request: Request) -> Response:
    """One file of the page, by its URL path."""
    name, media = ASSETS[request.url.path]
    return Response(_read(name), media_type=media, headers=HEADERS)


def routes() -> list[Route]:
    """The page's routes (GET, and HEAD, which Starlette answers for a GET route)."""
    return [Route(path, asset, methods=["GET"]) for path in ASSETS]


def is_public(method: str, path: str) -> bool:
    """Whether a request may skip the API key: reading the page itself (not the API, not the telemetry)."""
    return method in PAGE_METHODS and path in PAGE_PATHS
