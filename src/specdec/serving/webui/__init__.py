"""The chat page ``specdec serve`` opens at ``/``: static files shipped in this package, served as they are.

``index.html``, ``app.js``, ``style.css`` and ``icon.svg`` (package data: a wheel carries them) need no build step
and fetch nothing from elsewhere: no fonts, images, scripts or analytics from another origin. Every response
carries a strict Content-Security-Policy (``CSP``: only this origin, no inline script or style, no framing), so
even text that slipped into the page as markup could not run. The page talks to this server only: ``GET /props``
and ``/v1/models`` for the header, ``POST /v1/chat/completions`` (streamed, ``token_sources``) for the chat.
``--no-webui`` (``ServerOptions.webui``) leaves ``/`` a 404. Boundary: the files and their headers; what the page
does is app.js's.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# file -> media type; the page's own URL for each (index.html is "/")
PAGE_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
              "style.css": "text/css; charset=utf-8", "icon.svg": "image/svg+xml"}
PREFIX = "/webui/"

CSP = ("default-src 'self'; connect-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


def page_files(folder: str | Path | None = None) -> dict:
    """{file name: bytes} of the page: the packaged files, or ``folder``'s (a page being worked on)."""
    root = resources.files(__name__) if folder is None else Path(folder)
    missing = [name for name in PAGE_FILES if not (root / name).is_file()]
    if missing:
        raise ValueError(f"the web page's files are missing from {root}: {', '.join(missing)}")
    return {name: (root / name).read_bytes() for name in PAGE_FILES}


def page_paths() -> frozenset:
    """The paths ``mount`` answers: the page's own files, public even behind an API key (as llama-server's UI)."""
    return frozenset({"/", *(PREFIX + name for name in PAGE_FILES)})


def mount(app, folder: str | Path | None = None) -> None:
    """``GET /`` (the page) and ``GET /webui/<file>``, read once now."""
    from fastapi import Response

    files = page_files(folder)

    def answer(name: str):
        async def serve():
            return Response(files[name], media_type=PAGE_FILES[name], headers=HEADERS)
        return serve

    app.add_api_route("/", answer("index.html"), methods=["GET"], include_in_schema=False)
    for name in PAGE_FILES:
        app.add_api_route(PREFIX + name, answer(name), methods=["GET"], include_in_schema=False)
