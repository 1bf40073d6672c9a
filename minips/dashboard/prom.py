"""Prometheus metrics of a run, read from a ``RunState`` at scrape time (prometheus_client).

A custom collector, so nothing is counted twice and the training path does no extra work: the
figures are those the dashboard already holds. Names follow Prometheus' conventions (``_total``
counters, ``_seconds`` / ``_bytes`` units):

- ``minips_pushes_total{group}`` (worker pushes), ``minips_merges_total{group}`` (group
  deltas merged into the global weights), ``minips_samples_total``;
- ``minips_bytes_total{hop}``: ``worker_to_group``, ``group_to_worker``, ``group_to_global`` and
  ``global_to_group`` (the run's totals on the wire), and
  ``minips_group_bytes_total{group, direction}`` per group;
- ``minips_staleness`` and ``minips_wait_seconds`` histograms (one observation per push);
- ``minips_workers_alive{group}``, ``minips_group_clock{group, bound}`` (min / max clock);
- ``minips_checkpoint_age_seconds`` (absent until a checkpoint was written);
- ``minips_accuracy`` / ``minips_loss`` (the last evaluation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from minips.dashboard.state import Histogram, RunState

__all__ = ["RunCollector"]


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
