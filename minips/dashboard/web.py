"""The dashboard's HTTP side (aiohttp): the page, its event stream and Prometheus /metrics.

The file holds, in order: ``RunCollector``, the Prometheus metrics of a run, read from a
``RunState`` at scrape time (prometheus_client); then the web app (``Ticker``, ``make_app``,
``start_site``).

Routes: ``/`` the single static page (``static/index.html``, plain canvas charts, no build
step), ``/state`` one JSON snapshot, ``/events`` server-sent events (one ``RunState.update``
message per tick: the tables plus what the series gained), ``/metrics`` Prometheus' text format.

Invariants: every route checks the token when one is set (``?token=`` or ``Authorization:
Bearer``, compared in constant time); a client that goes away costs nothing but its handler;
this module only reads the state, the ``Monitor`` feeds it.

The collector is a custom one, so nothing is counted twice and the training path does no extra
work: the figures are those the dashboard already holds. Names follow Prometheus' conventions
(``_total`` counters, ``_seconds`` / ``_bytes`` units):

- ``minips_pushes_total{group}`` (worker pushes), ``minips_merges_total{group}`` (group
  deltas merged into the global weights), ``minips_samples_total``;
- ``minips_bytes_total{hop}``: ``worker_to_group``, ``group_to_worker``, ``group_to_global`` and
  ``global_to_group`` (the run's totals on the wire), and
  ``minips_group_bytes_total{group, direction}`` per group;
- ``minips_staleness`` and ``minips_wait_seconds`` histograms (one observation per push);
- ``minips_workers_alive{group}``, ``minips_group_clock{group, bound}`` (min / max clock);
- ``minips_checkpoint_age_seconds`` (absent until a checkpoint was written);
- ``minips_accuracy`` / ``minips_loss`` (the last evaluation).

Public API: ``RunCollector``, ``Ticker``, ``make_app``, ``start_site``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable, Iterator
from importlib import resources
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from minips.dashboard.state import Histogram, RunState

__all__ = ["RunCollector", "Ticker", "make_app", "start_site"]


# -- Prometheus metrics of a run, read from a RunState at scrape time ------------------------------

class RunCollector(Collector):
    """Yields the run's metrics as of ``now()`` (run seconds) each time it is scraped."""

    def __init__(self, state: RunState, now: Callable[[], float]) -> None:
        self.state = state
        self.now = now

    def collect(self) -> Iterator[Metric]:
        s, now = self.state, self.now()
        pushes = CounterMetricFamily("minips_pushes", "worker pushes", labels=["group"])
        for g, n in sorted(s.pushes.items()):
            pushes.add_metric([str(g)], n)
        yield pushes
        yield _counter("minips_samples", "training samples all groups reported",
                       s.totals["samples"])
        merges = CounterMetricFamily("minips_merges", "group deltas merged", labels=["group"])
        for g, n in sorted(s.merges.items()):
            merges.add_metric([str(g)], n)
        yield merges
        yield from self._bytes()
        yield _histogram("minips_staleness", "clocks a pull was ahead of its group's slowest "
                         "worker", s.staleness_hist)
        yield _histogram("minips_wait_seconds", "time a worker's pull took (SSP wait and "
                         "transfer)", s.wait_hist)
        yield from self._groups(now)
        if s.checkpoint_t is not None:
            yield GaugeMetricFamily("minips_checkpoint_age_seconds", "seconds since the last "
                                    "checkpoint was written", value=max(0.0, now - s.checkpoint_t))
        if s.eval:
            last = s.eval[-1]
            yield GaugeMetricFamily("minips_accuracy", "last test accuracy",
                                    value=last["accuracy"])
            if isinstance(last.get("loss"), (int, float)):
                yield GaugeMetricFamily("minips_loss", "last test loss", value=last["loss"])

    def _bytes(self) -> Iterator[Metric]:
        hop = CounterMetricFamily("minips_bytes", "bytes on the wire, by hop", labels=["hop"])
        hop.add_metric(["worker_to_group"], self.state.totals["bytes_up"])
        hop.add_metric(["group_to_worker"], self.state.totals["bytes_down"])
        hop.add_metric(["group_to_global"], self.state.totals["bytes_group_global"])
        hop.add_metric(["global_to_group"], self.state.totals["bytes_global_group"])
        yield hop
        per = CounterMetricFamily("minips_group_bytes", "bytes between a group server and "
                                  "its workers", labels=["group", "direction"])
        for g, c in sorted(self.state.groups.items()):
            for key, direction in (("bytes_in", "in"), ("bytes_out", "out")):
                if isinstance(c.get(key), (int, float)):
                    per.add_metric([str(g), direction], c[key])
        yield per

    def _groups(self, now: float) -> Iterator[Metric]:
        alive = GaugeMetricFamily("minips_workers_alive", "live workers", labels=["group"])
        for g, n in sorted(self.state.alive_per_group(now).items()):
            alive.add_metric([str(g)], n)
        yield alive
        clock = GaugeMetricFamily("minips_group_clock", "a group's clocks at its last merge",
                                  labels=["group", "bound"])
        for g, c in sorted(self.state.groups.items()):
            for bound in ("min", "max"):
                if isinstance(c.get(f"{bound}_clock"), (int, float)):
                    clock.add_metric([str(g), bound], c[f"{bound}_clock"])
        yield clock


def _counter(name: str, doc: str, value: float) -> Metric:
    return CounterMetricFamily(name, doc, value=value)


def _histogram(name: str, doc: str, h: Histogram) -> Metric:
    buckets: list[Any] = [[le, n] for le, n in h.cumulative()]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h.total)


# -- the web app: the page, its event stream, /state and /metrics ----------------------------------

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
