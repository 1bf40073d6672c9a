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
work: the figures are those the dashboard already holds, taken from what the servers saw
(state.py), so workers and group processes on other machines count. Names follow Prometheus'
conventions (``_total`` counters; ``_seconds``, ``_bytes``, ``_steps``, ``_ratio`` units;
docs/dashboard.md has the table):

- ``minips_run_info`` (the run's mode, compressor, model, ...), ``minips_pushes_total{group}``,
  ``minips_merges_total{group}``, ``minips_samples_total``;
- ``minips_run_bytes_total{hop}``: the run's ledger, per hop (what the console line and
  summary.json show; it never falls).
- ``minips_bytes_total{hop, group}``: ``worker_to_group``, ``group_to_worker``,
  ``group_to_global``, ``global_to_group`` (summed over the groups: the hop's run total);
- ``minips_staleness_steps`` and ``minips_ssp_wait_seconds`` histograms (one observation per
  answered PULL);
- the staleness between groups, one observation per merged exchange (the merge lines'
  ``missed`` and ``base_age_s``): ``minips_exchange_missed_merges{group}`` and
  ``minips_exchange_base_age_seconds{group}`` histograms, and at the group's last merge and
  at most over the run ``minips_group_missed_merges{group, stat}`` and
  ``minips_group_base_age_seconds{group, stat}`` (``stat`` = ``last``, ``max``);
- ``minips_workers_alive{group}``, ``minips_group_clock{group, bound}`` (min / max clock),
  ``minips_group_local_steps{group}`` (H, with local steps);
- per worker ``{worker, group}``: ``minips_worker_up``, ``minips_worker_clock``,
  ``minips_worker_step_seconds``, ``minips_worker_pulls_total``,
  ``minips_worker_ssp_wait_seconds_total``;
- ``minips_last_checkpoint_timestamp_seconds`` (absent until a checkpoint was written);
- ``minips_accuracy_ratio`` / ``minips_loss`` (the last evaluation);
- ``process_*``: prometheus_client's process collector (the serving process's CPU, memory,
  open files).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable, Iterator
from importlib import resources
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
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
        yield self._info()
        pushes = CounterMetricFamily("minips_pushes", "worker pushes the group servers "
                                     "reported with their exchanges", labels=["group"])
        for g, n in sorted(s.pushes.items()):
            pushes.add_metric([str(g)], n)
        yield pushes
        yield _counter("minips_samples", "training samples all groups reported",
                       s.totals["samples"])
        merges = CounterMetricFamily("minips_merges", "group deltas merged", labels=["group"])
        for g, n in sorted(s.merges.items()):
            merges.add_metric([str(g)], n)
        yield merges
        yield self._bytes()
        yield self._run_bytes()
        yield _histogram("minips_staleness_steps", "clocks a worker was ahead of its group's "
                         "slowest worker when its pull was answered", s.staleness_hist)
        yield _histogram("minips_ssp_wait_seconds", "time the SSP bound held a worker's pull "
                         "at its group server", s.wait_hist)
        yield _group_histogram("minips_exchange_missed_merges", "merges of other groups since "
                               "the global weights a group rebased on were sent, per merged "
                               "exchange (staleness between groups)", s.missed_hist)
        yield _group_histogram("minips_exchange_base_age_seconds", "age of the global weights "
                               "a group rebased on, per merged exchange", s.base_age_hist)
        yield from self._groups(now)
        yield from self._workers(now)
        if s.checkpoint_t is not None:
            t0 = float(s.config.get("t0") or 0.0)
            yield GaugeMetricFamily("minips_last_checkpoint_timestamp_seconds", "Unix time the "
                                    "last checkpoint was written", value=t0 + s.checkpoint_t)
        if s.eval:
            last = s.eval[-1]
            yield GaugeMetricFamily("minips_accuracy_ratio", "last test accuracy (0 to 1)",
                                    value=last["accuracy"])
            if isinstance(last.get("loss"), (int, float)):
                yield GaugeMetricFamily("minips_loss", "last test loss", value=last["loss"])

    def _info(self) -> Metric:
        c = self.state.config
        info = InfoMetricFamily("minips_run", "the run's configuration")
        info.add_metric([], {k: str(c.get(k, "")) for k in RUN_INFO})
        return info

    def _bytes(self) -> Metric:
        """Bytes per hop and group; summed over the groups, a hop's run total."""
        hop = CounterMetricFamily("minips_bytes", "bytes on the wire, by hop and group",
                                  labels=["hop", "group"])
        for g, c in sorted(self.state.groups.items()):
            for key, name in (("bytes_in", "worker_to_group"), ("bytes_out", "group_to_worker")):
                hop.add_metric([name, str(g)], c.get(key, 0))
        for g, h in sorted(self.state.to_global.items(), key=lambda gh: str(gh[0])):
            for key, name in (("bytes_to_global", "group_to_global"),
                              ("bytes_from_global", "global_to_group")):
                hop.add_metric([name, str(g)], h.get(key, 0))
        return hop

    def _run_bytes(self) -> Metric:
        """The run's bytes per hop, the ledger's figures (record/ledger.py): the numbers the
        console line and summary.json show."""
        run = CounterMetricFamily("minips_run_bytes", "bytes on the wire so far, by hop (the "
                                  "run's ledger: as the console and summary.json)",
                                  labels=["hop"])
        for name, value in self.state.hops().items():
            run.add_metric([name], value)
        return run

    def _groups(self, now: float) -> Iterator[Metric]:
        alive = GaugeMetricFamily("minips_workers_alive", "live workers", labels=["group"])
        for g, n in sorted(self.state.alive_per_group(now).items()):
            alive.add_metric([str(g)], n)
        yield alive
        clock = GaugeMetricFamily("minips_group_clock", "a group's clocks at its last merge",
                                  labels=["group", "bound"])
        for g, c in self.state.shown_groups().items():
            for bound in ("min", "max"):
                if isinstance(c.get(f"{bound}_clock"), (int, float)):
                    clock.add_metric([str(g), bound], c[f"{bound}_clock"])
        yield clock
        yield from self._between()
        steps = GaugeMetricFamily("minips_group_local_steps", "a group's local steps H: "
                                  "optimizer steps its workers run per push", labels=["group"])
        for g, h in sorted(self.state.local_steps().items()):
            steps.add_metric([str(g)], h)
        yield steps

    def _between(self) -> Iterator[Metric]:
        """Each shown group's staleness between groups: at its last merge and the most so far."""
        labels = ["group", "stat"]
        missed = GaugeMetricFamily("minips_group_missed_merges", "merges of other groups its "
                                   "exchange missed: at its last merge, the most so far",
                                   labels=labels)
        age = GaugeMetricFamily("minips_group_base_age_seconds", "age of the global weights "
                                "its exchange rebased on: at its last merge, the most so far",
                                labels=labels)
        for g, c in self.state.shown_groups().items():
            stats = self.state.between_stats(g)
            for family, last, top in ((missed, c.get("missed"), stats["missed_max"]),
                                      (age, c.get("base_age_s"), stats["base_age_max_s"])):
                if last is not None and top is not None:
                    family.add_metric([str(g), "last"], last)
                    family.add_metric([str(g), "max"], top)
        yield from (missed, age)

    def _workers(self, now: float) -> Iterator[Metric]:
        """One series per worker (labels worker, group), from what the servers saw of it."""
        labels = ["worker", "group"]
        up = GaugeMetricFamily("minips_worker_up", "1 while the worker is alive", labels=labels)
        clock = GaugeMetricFamily("minips_worker_clock", "the worker's clock (steps in its "
                                  "group)", labels=labels)
        step = GaugeMetricFamily("minips_worker_step_seconds", "the worker's last step time "
                                 "(its compute)", labels=labels)
        iteration = GaugeMetricFamily("minips_worker_iteration_seconds", "the iteration its "
                                      "group waits on (PUSH to PUSH less the SSP hold: what "
                                      "the grouping uses)", labels=labels)
        pulls = CounterMetricFamily("minips_worker_pulls", "the worker's pulls its group "
                                    "server answered", labels=labels)
        held = CounterMetricFamily("minips_worker_ssp_wait_seconds", "time the SSP bound "
                                   "held the worker's pulls", labels=labels)
        for w, v in sorted(self.state.workers.items()):
            key = [str(w), str(v.group)]
            up.add_metric(key, float(self.state.state_of(v, now) not in ("dead", "done")))
            clock.add_metric(key, v.clock)
            if v.step_time is not None:
                step.add_metric(key, v.step_time)
            if v.iteration_s is not None:
                iteration.add_metric(key, v.iteration_s)
            pulls.add_metric(key, v.pulls)
            held.add_metric(key, v.held_s)
        yield from (up, clock, step, iteration, pulls, held)


RUN_INFO = ("mode", "compressor", "model", "dataset", "workers", "staleness", "sync_every")


def _counter(name: str, doc: str, value: float) -> Metric:
    return CounterMetricFamily(name, doc, value=value)


def _histogram(name: str, doc: str, h: Histogram) -> Metric:
    buckets: list[Any] = [[le, n] for le, n in h.cumulative()]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h.total)


def _group_histogram(name: str, doc: str, per_group: dict[int, Histogram]) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=["group"])
    for g, h in sorted(per_group.items()):
        buckets: list[Any] = [[le, n] for le, n in h.cumulative()]
        family.add_metric([str(g)], buckets, sum_value=h.total)
    return family


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
    ProcessCollector(registry=registry)  # process_*: the serving process's CPU, memory, fds
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
