"""The browser playground: GET / and its script, style sheet and vendored Markdown renderer,
served from files inside the package (server/playground/), so the page works offline.

These paths stay reachable without the API key (the page asks for the key and sends it with
its API calls); everything they serve is static.
"""

from functools import cache
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import Response

# Served path -> (file under server/playground/, media type).
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/playground/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/playground/app.css": ("app.css", "text/css; charset=utf-8"),
    "/playground/vendor/markdown-it.min.js": ("vendor/markdown-it.min.js", "text/javascript; charset=utf-8"),
    "/playground/vendor/markdown-it.LICENSE.txt": ("vendor/markdown-it.LICENSE.txt", "text/plain; charset=utf-8"),
}
PATHS = frozenset(ASSETS)

# Scripts and styles from this server only, no inline script, requests to this server only: an
# injection that got past the renderer could still run nothing.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


@cache
def _read(name: str) -> bytes:
    return files(__package__).joinpath("playground", name).read_bytes()


def _route(path: str, name: str, media_type: str) -> None:
    async def serve() -> Response:
        return Response(_read(name), media_type=media_type, headers=HEADERS)
    router.add_api_route(path, serve, methods=["GET", "HEAD"], name=f"playground:{name}")


for _path, (_name, _media_type) in ASSETS.items():
    _route(_path, _name, _media_type)
