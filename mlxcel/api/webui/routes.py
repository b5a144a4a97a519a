"""The chat page at `/`: the built-in page shipped in static/, or the directory --path names.

b10621 serves its web UI at `/` and `/index.html` (under --api-prefix, like every route) unless
--no-ui, and serves --path's directory there instead when one is given. This is an ASGI layer
in front of the API app, behind the API-key gate (which has already removed the prefix): a GET
or HEAD for the page or one of its files is answered here, anything else goes on to the API.

The built-in page is plain HTML, CSS and JavaScript modules, no build step. Every answer
carries a Content-Security-Policy that allows scripts, styles and requests from this origin
only (no inline script, no eval), images and audio also from data: and blob: URLs (the
attachments the page builds), and no framing. The page's own files are public, like `/`: they
hold no data, and a browser cannot attach the API key to a <script src>.
"""

from __future__ import annotations

import mimetypes
from pathlib import Path
from typing import Any

STATIC = Path(__file__).parent / "static"
ASSET_PREFIX = "/webui/"
PAGE_PATHS = ("/", "/index.html")
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "media-src 'self' data: blob:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
       "form-action 'self'; frame-ancestors 'none'")
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".json": "application/json", ".svg": "image/svg+xml"}
SECURITY_HEADERS = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer"),
                    (b"cache-control", b"no-cache")]


def builtin_assets() -> frozenset[str]:
    """The built-in page's own files, as paths under ASSET_PREFIX."""
    return frozenset(ASSET_PREFIX + p.name for p in STATIC.iterdir() if p.is_file() and p.name != "index.html")


def public_paths(settings: Any) -> frozenset[str]:
    """The paths of the built-in page the gate lets through without a key, as sent.

    Its files, and under --api-prefix the prefixed page itself: b10621 matches its public set
    (/ among it) against the path as sent, so there its page under a prefix answers 401 and
    never gets to ask for the key. This page holds no data and asks for the key itself, so it
    stays reachable; the prefixed /health and the API keep needing the key as in b10621.
    """
    server = settings.server
    if not server.webui or server.static_path:
        return frozenset()
    return frozenset(server.api_prefix + p for p in (*builtin_assets(), *PAGE_PATHS))


class WebUI:
    """ASGI: answers GET/HEAD for the page and its files, passes everything else to `app`."""

    def __init__(self, app: Any, root: Path, builtin: bool) -> None:
        self.app, self.root, self.builtin = app, root.resolve(), builtin

    def file_for(self, path: str) -> Path | None:
        if path in PAGE_PATHS:
            path = "/index.html"
        elif self.builtin:
            if not path.startswith(ASSET_PREFIX):
                return None
            path = "/" + path[len(ASSET_PREFIX):]
        if "\x00" in path:
            return None
        try:
            target = (self.root / path.lstrip("/")).resolve()
            # the page's directory only: a `..` or a symlink leading out of it serves nothing
            if not target.is_relative_to(self.root) or not target.is_file():
                return None
        except OSError:  # a name the filesystem refuses (too long, say) names no file of the page
            return None
        return target

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        target = None
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD"):
            target = self.file_for(scope["path"])
        if target is None:
            await self.app(scope, receive, send)
            return
        body = target.read_bytes()
        kind = TYPES.get(target.suffix) or mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        headers = [(b"content-type", kind.encode()), (b"content-length", str(len(body)).encode()), *SECURITY_HEADERS]
        if self.builtin:
            headers.append((b"content-security-policy", CSP.encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})


def with_webui(app: Any, settings: Any) -> Any:
    """`app` behind the page --ui / --path ask for (unchanged under --no-ui)."""
    server = settings.server
    if server.static_path:
        return WebUI(app, Path(server.static_path), builtin=False)
    if server.webui:
        return WebUI(app, STATIC, builtin=True)
    return app
