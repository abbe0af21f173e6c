"""The web chat page: GET / (index.html) and GET /ui/{file} (its script and stylesheet).

The files live in engine/server/static/ (shipped as package data; no build step, nothing fetched
from the network). The page itself is public; it calls the API with the key the user enters.
Must not import the engine loop.
"""

from __future__ import annotations

from pathlib import Path

import falcon

from .errors import ApiError

STATIC = Path(__file__).resolve().parent / "static"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
_FILES = ("index.html", "chat.js", "chat.css")


def _send(resp: falcon.Response, name: str) -> None:
    if name not in _FILES:
        raise ApiError(404, f"no such file /ui/{name}", code="not_found", anthropic_type="not_found_error")
    path = STATIC / name
    resp.content_type = _TYPES[path.suffix]
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("Content-Security-Policy", "default-src 'self'; style-src 'self'; script-src 'self'")
    resp.data = path.read_bytes()


class ChatPage:
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        _send(resp, "index.html")

    def on_get_file(self, req: falcon.Request, resp: falcon.Response, name: str) -> None:
        _send(resp, name)
