"""The dashboard's HTTP side (aiohttp): the page, its event stream and Prometheus /metrics.

Routes: ``/`` the single static page (``static/index.html``, plain canvas charts, no build
step), ``/state`` one JSON snapshot, ``/events`` server-sent events (one ``RunState.update``
message per tick: the tables plus what the series gained), ``/metrics`` Prometheus' text format.

Invariants: every route checks the token when one is set (``?token=`` or ``Authorization:
Bearer``, compared in constant time); a client that goes away costs nothing but its handler;
this module only reads the state, the ``Monitor`` feeds it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from minips.dashboard.prom import RunCollector
from minips.dashboard.state import RunState

__all__ = ["Ticker", "make_app", "start_site"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Ticker:
    """Wakes every SSE client once per tick (``tick()`` is called by the monitor)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.closed = False

    def tick(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self) -> None:
        await self._event.wait()


def _page() -> bytes:
    return resources.files("minips.dashboard").joinpath("static/index.html").read_bytes()


def _authorized(request: web.Request, token: str) -> bool:
    if not token:
        return True
    got = request.query.get("token", "")
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        got = auth[len("Bearer "):]
    return hmac.compare_digest(got.encode(), token.encode())


def make_app(state: RunState, now: Callable[[], float], ticker: Ticker,
             token: str = "") -> web.Application:
    """The aiohttp application serving ``state``; ``now()`` is the run time shown."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(RunCollector(state, now))
    page = _page()

    @web.middleware
    async def check_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not _authorized(request, token):
            raise web.HTTPUnauthorized(text="minips dashboard: missing or wrong token\n")
        return await handler(request)

    async def index(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html", charset="utf-8")

    async def snapshot(request: web.Request) -> web.Response:
        return web.json_response(state.update(now()))

    async def metrics(request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def events(request: web.Request) -> web.StreamResponse:
        return await _stream(request, state, now, ticker)

    app = web.Application(middlewares=[check_token])
    app.router.add_get("/", index)
    app.router.add_get("/state", snapshot)
    app.router.add_get("/events", events)
    app.router.add_get("/metrics", metrics)
    return app


async def _stream(request: web.Request, state: RunState, now: Callable[[], float],
                  ticker: Ticker) -> web.StreamResponse:
    """Server-sent events: a full message first, then what changed at every tick."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    cursor: dict[str, int] = {}
    try:
        while True:
            msg = state.update(now(), cursor)
            cursor = msg["cursor"]
            await resp.write(f"data: {json.dumps(msg, separators=(',', ':'))}\n\n".encode())
            if ticker.closed:
                break
            await ticker.wait()
    except ConnectionError:  # the browser went away
        pass
    return resp


async def start_site(app: web.Application, host: str, port: int) -> tuple[Any, int]:
    """Listen on ``host:port`` (0 = any free port); return (runner, bound port)."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, int(runner.addresses[0][1])  # (host, port[, ...]) of the bound socket
