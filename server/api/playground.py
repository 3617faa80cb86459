"""The browser playground: `GET /` serves a single static page (no build step) and its scripts and
stylesheet. The page talks to the public API only (`/info`, `/generate_stream`, `/v1/completions`, `/kv`,
`/kv/stream`), like any client."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

STATIC_DIR = Path(__file__).parent / "static"
PAGE_ASSETS = {
    name: "text/javascript"
    for name in (
        "app.js",
        "api.js",
        "sse.js",
        "attention.js",
        "tabs.js",
        "race.js",
        "itl_chart.js",
        "kvmap.js",
        "demo.js",
    )
} | {"style.css": "text/css", "favicon.svg": "image/svg+xml"}
NO_CACHE = {"Cache-Control": "no-cache"}  # a new server version is picked up on reload

router = APIRouter(include_in_schema=False)


@router.get("/")
async def playground_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=NO_CACHE)


@router.get("/favicon.ico")
async def favicon() -> FileResponse:
    """Browsers ask for it on every page (the API docs' too): the page's icon, which they render as SVG."""
    return FileResponse(
        STATIC_DIR / "favicon.svg", media_type="image/svg+xml", headers={"Cache-Control": "public, max-age=86400"}
    )


@router.get("/static/{name}")
async def playground_asset(name: str) -> FileResponse:
    if name not in PAGE_ASSETS:  # only the page's own files, never a path
        raise HTTPException(404, f"no static file {name!r}")
    return FileResponse(STATIC_DIR / name, media_type=PAGE_ASSETS[name], headers=NO_CACHE)
