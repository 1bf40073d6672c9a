"""What the dashboard knows about a run, and how it follows a run directory's files (sans-IO,
no clocks).

The file holds, in order: ``RunState`` (with ``Histogram`` and ``WorkerView``), what is known of
a run, built from its metrics records; then ``Tail``, ``RunFollower`` and ``Replay``, which
follow a run directory's JSON-lines files, live (tail) or as a replay (by run time).

``RunState.add(source, record)`` takes one JSON-lines record of the run directory (``source``:
``eval``, ``global``, ``group``, ``worker``; see record/rundir.py for the fields), one ``probe``
record (the global server's live view of a worker: group, clock, step time, alive, waiting) or
one ``server`` record (its view of the run: whether an evaluator is connected, the model's
size). A run over without an evaluation, or a replay whose files hold none, says "no
evaluator" (``no_evaluator``), not "waiting". Live runs and
replays feed the same records, so both draw the same page; ``now`` (seconds since the run's t0)
is passed in by the caller.

The run's counters come from what the servers see, wherever the workers and groups run: the
global server's ``merge`` lines (global.jsonl) carry each exchange's pushes, the group's clocks
and worker traffic, the PULLs it answered (worker, lead, SSP wait: the staleness and wait
histograms, each worker's pulls), the group <-> global bytes the global server counted and
the exchange's staleness between groups (``missed``, ``base_age_s``: per group, the histograms
``missed_hist`` / ``base_age_hist``, the last merge's figures on its card and the ``between``
chart series, at most one point per group every ``CLOCK_POINT_S``, the most since its last). A
worker's own file, where the run directory has it, adds the columns of its last push (bytes
per push, upload ratio, its pull's duration) and its events; a worker whose file is on another
machine gets, in its row, what the servers saw (``WorkerView.row``): the lead and SSP wait of
its last answered PULL, a clock from its PULLs (one precedes each step) or its last STATS,
and its group's means over the last exchange for the bytes per push and the upload (the
model's size from a ``server`` record). Events carry a sentence
(``event_text``); checkpoints are folded into one count. A group no worker is in any more (a
regroup emptied it) is no longer shown (``shown_groups``); a worker slower than ``SLOW_FACTOR``
times the median of all live workers is marked ``slow``.

``Tail`` reads what was appended to one file since the last call, keeping a partial last line
for the next call (a writer may be in the middle of it). ``RunFollower`` tails every metrics
file of a run directory (new worker and group files appear during a run) and hands each
complete record to ``RunState.add``; ``Replay`` does the same for a finished run, releasing
the records in run-time order up to a horizon that advances ``speed`` times faster than the
wall clock. Both take the time as an argument; neither sleeps.

Byte counters are running totals per group; one that drops (a resumed server or a restarted
group process counting from 0 again) is added up segment by segment, as summary.json does
(metrics.py), so the bytes chart and the totals never go back.

Invariants: every series only grows (``since`` cursors stay valid); a worker's state is derived
from what was added, never from a clock read here:

- ``dead``: it left, its lease expired, the server lost it, or it was silent for ``lease_s``;
- ``waiting``: the SSP bound holds it (its clock is more than ``staleness`` ahead of the slowest
  live worker of its group, the rule of ssp.ClockTable.may_start);
- ``pulling``: less time since its last push than its last pull took (it is fetching weights);
- ``computing``: otherwise; ``done`` once the run is over.

Each line is handed over exactly once and only whole; a file that shrinks (a new run in the same
directory) is read again from its start.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minips.record.ledger import HOPS
from minips.record.metrics import TrainingClock
from minips.record.rundir import read_config, read_jsonl

__all__ = [
    "EVENT_KINDS",
    "HOP_LABELS",
    "SLOW_FACTOR",
    "STALENESS_BUCKETS",
    "WAIT_BUCKETS",
    "MISSED_BUCKETS",
    "BASE_AGE_BUCKETS",
    "Histogram",
    "RunState",
    "WorkerView",
    "Replay",
    "RunFollower",
    "Tail",
    "source_of",
    "event_text",
]


# -- what is known of a run, built from its metrics records ----------------------------------------

# global.jsonl / group / worker events listed on the page (merges are counted and checkpoints
# folded into one count, not listed)
EVENT_KINDS = frozenset({
    "joined", "left", "expired", "groups", "regroup", "rehomed", "calib_timeout", "resumed",
    "done", "failed", "waiting_for_workers", "workers_back", "group_lost",
    "group_adopted",  # global.jsonl and group-<g>.jsonl
    "stopped", "lease_expired", "control_lost", "control_back", "control_gave_up",
    "group_unreachable",
    "link_lost", "link_back",  # a group server saw a worker's connection go silent, then back
    "slowdown",  # a worker's own file (slowdown: its emulated factor changed, core/slowdown.py)
    "link",  # links.jsonl: `minips local --link-change` changed a worker's shaped link
})
STALENESS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0)  # clocks ahead of the slowest
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # s
# between groups, per merged exchange: the other groups' merges it missed, and the age (s) of
# the global weights its group rebased on
MISSED_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0)  # merges
BASE_AGE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # s
CLOCK_POINT_S = 0.5  # at most one group-clock (bytes) point per group this often (s of run time)
SLOW_FACTOR = 1.5  # a worker slower than this times the cluster's median step time is marked
# the page's names of the ledger's hops (ledger.HOPS), in its order
HOP_LABELS = ("worker_to_group", "group_to_worker", "group_to_global", "global_to_group")


@dataclass
class Histogram:
    """Cumulative-bucket histogram in Prometheus' sense (``le`` upper bounds, +Inf implied)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bound, not cumulative; last = +Inf
    total: float = 0.0
    n: int = 0
    top: float | None = None  # the largest value observed

    def observe(self, x: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self.counts[bisect.bisect_left(self.bounds, x)] += 1
        self.total += x
        self.n += 1
        self.top = x if self.top is None else max(self.top, x)

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    def cumulative(self) -> list[tuple[str, int]]:
        """[(le, count <= le)] ending with ("+Inf", n)."""
        out, run = [], 0
        counts = self.counts or [0] * (len(self.bounds) + 1)
        for b, c in zip([*map(str, self.bounds), "+Inf"], counts, strict=True):
            run += c
            out.append((b, run))
        return out


PUSH_BYTES_OVER = 32  # pushes a group's mean bytes per push spans (at least, once it has them)


@dataclass
class WorkerView:
    """One worker as the page shows it; per-push fields are those of its last push."""

    id: int
    group: int = -1
    clock: int = 0
    step_time: float | None = None  # s, last push (or the last STATS when only probed)
    # s, the iteration its group waits on (PUSH to PUSH less the SSP hold, as the servers
    # measure it; the grouping's figure), from the global server's probe
    iteration_s: float | None = None
    wait_s: float | None = None  # s its last pull took (SSP wait and transfer)
    staleness: int | None = None  # clocks ahead of its group's slowest worker, last pull
    bytes_wire: int | None = None  # bytes of its last push on the wire
    bytes_raw: int | None = None  # bytes the same gradient takes dense float32
    ratio: float | None = None  # GDTopK upload ratio it was given
    loss: float | None = None
    pushes: int = 0
    last_t: float | None = None  # run time of its last push
    seen_t: float | None = None  # run time the global server last saw it connected (probe)
    gone: str = ""  # "left", "expired", "lost": why it is dead ("" = alive)
    waiting: bool | None = None  # the probe's SSP answer (None: derive from clocks)
    pulls: int = 0  # PULLs its group server answered, as the merges reported them
    held_s: float = 0.0  # s the SSP bound held those PULLs, summed
    local_steps: int | None = None  # H of its last push (local steps; optimizer on the worker)
    # what its group server reported of its last answered PULL (the merges), wherever it runs
    lead: int | None = None  # clocks ahead of its group's slowest worker
    pull_wait_s: float | None = None  # s the SSP bound held that PULL
    stats_step: bool = False  # step_time is its last STATS (the probe), not a push of its own

    def row(self, state: str, slow: bool = False, group: dict[str, Any] | None = None
            ) -> dict[str, Any]:
        """The page's row; a worker without records of its own (``pushes`` 0: its files are
        on another machine) gets what the servers saw (``seen``: "servers"): its last PULL's
        lead and SSP wait, and its group's means over the last exchange (``approx``) for the
        step time (without a STATS), bytes per push and upload."""
        own = self.pushes > 0
        mean = {} if own else (group or {})  # the group's figures stand in for its own
        step = self.step_time if self.step_time is not None else mean.get("step_time")
        wire = self.bytes_wire if own else mean.get("push_bytes")
        raw = self.bytes_raw if own else mean.get("raw_bytes")
        up = (wire / raw) if wire and raw else None
        approx = [] if own else [k for k, v in (  # the columns that are its group's means
            ("step_time", step if self.step_time is None else None),
            ("bytes_per_push", wire), ("upload_ratio", up)) if v is not None]
        return {"id": self.id, "group": self.group, "clock": self.clock, "state": state,
                "step_time": step, "iteration_s": self.iteration_s,
                "wait_s": self.wait_s if own else self.pull_wait_s,
                "staleness": self.staleness if own else self.lead,
                "bytes_per_push": wire, "upload_ratio": up, "ratio": self.ratio,
                "loss": self.loss, "pushes": self.pushes, "pulls": self.pulls,
                "held_s": self.held_s, "slow": slow, "seen": "own" if own else "servers",
                "approx": approx}


class RunState:
    """Workers, groups, series and events of one run, from its records."""

    def __init__(self, config: dict[str, Any], kind: str = "live") -> None:
        self.config = config
        self.kind = kind  # what the page says while the run goes on: live, replay, following
        s = config.get("staleness", 3)
        self.staleness: int | None = {"bsp": 0, "lbbsp": 0, "asp": None}.get(
            str(config.get("mode")), s)
        self.lease_s = float(config.get("lease_s", 10.0))
        self.workers: dict[int, WorkerView] = {}
        self.groups: dict[int, dict[str, Any]] = {}  # id -> last merge's counters
        self.set_steps: dict[int, int] = {}  # group -> H the global server set (local steps auto)
        self.eval: list[dict[str, Any]] = []  # {t, accuracy, loss, bytes, samples}
        self.clocks: list[dict[str, Any]] = []  # {t, group, min_clock, max_clock}
        self.events: list[dict[str, Any]] = []
        self.staleness_hist = Histogram(STALENESS_BUCKETS)
        self.wait_hist = Histogram(WAIT_BUCKETS)
        self._counters: dict[str, float] = {"bytes_up": 0, "bytes_down": 0, "samples": 0}
        self.merges: dict[int, int] = {}  # group -> merges
        self.to_global: dict[Any, dict[str, float]] = {}  # group -> its group <-> global bytes
        self.hop_from_merges: set[Any] = set()  # groups whose hop bytes the merges carry
        self.pushes: dict[int, int] = {}  # group -> pushes its merges reported
        self.bytes: list[dict[str, Any]] = []  # {t, <hop>: bytes so far} per CLOCK_POINT_S
        self.held: list[dict[str, Any]] = []  # {t, group, held: {worker: SSP wait so far, s}}
        # between groups, per group: the other groups' merges each exchange missed (merges) and
        # the age of the global weights it rebased on (s), from the merge lines
        self.missed_hist: dict[int, Histogram] = {}
        self.base_age_hist: dict[int, Histogram] = {}
        self.between: list[dict[str, Any]] = []  # {t, group, missed, base_age_s} chart points
        self._between_at: dict[int, float] = {}  # group -> t of its last between point
        self._between_peak: dict[int, dict[str, float]] = {}  # ... the most since it
        self.checkpoint_t: float | None = None
        self.checkpoints: dict[str, Any] = {"n": 0, "t": None, "bytes": None}  # folded
        self.evaluator: bool | None = None  # an evaluator is connected (the server's view)
        self.scores_from: str | None = None  # "eval" (eval.jsonl) or "global" (its SCOREs)
        self.ledger: dict[str, float] = {}  # the last figures of the global server's ledger
        self.size: int | None = None  # the model's coordinates (``server`` records)
        self.push_bytes: dict[int, float] = {}  # group -> mean bytes per push, recent pushes
        # group -> (bytes_in, pushes so far) at its recent merges, PUSH_BYTES_OVER pushes back
        self._bytes_in: dict[int, collections.deque[tuple[float, int]]] = {}
        self._last: dict[tuple[Any, str], float] = {}  # (group, counter) -> its last value
        self._banked: dict[tuple[Any, str], float] = {}  # ... and what it held before drops
        self.done = False
        # the run's one clock (metrics.TrainingClock, summary.json's train_s): every series
        # point carries its training time ``tt``, and the page draws its charts on it
        self.clock = TrainingClock()
        self.final_eval = False  # the evaluator wrote its record of the final weights
        self._clock_at: dict[int, float] = {}  # group -> t of its last clock point
        self._bytes_at = -1e9  # t of the last bytes point
        self._held_at: dict[int, float] = {}  # group -> t of its last held point

    # -- feeding -----------------------------------------------------------------------------

    def add(self, source: str, rec: dict[str, Any]) -> None:
        """Take one record; unknown sources and malformed records are ignored."""
        handler = {"eval": self._eval, "global": self._global, "group": self._group,
                   "worker": self._worker, "probe": self._probe, "server": self._server,
                   "links": self._links}.get(source)
        if handler is not None and isinstance(rec.get("t"), (int, float)):
            handler(rec)

    def _links(self, r: dict[str, Any]) -> None:
        if r.get("event") == "link":
            self._event(r, "launcher")

    def _eval(self, r: dict[str, Any], source: str = "eval") -> None:
        """A score: from eval.jsonl (an evaluator here) or the global server's ``eval`` lines
        (its SCOREs, wherever the evaluator runs); the first source that brings one is kept,
        so no point is shown twice."""
        if self.scores_from not in (None, source):
            return
        self.scores_from = source
        self.final_eval = self.final_eval or bool(r.get("final"))
        if isinstance(r.get("accuracy"), (int, float)):
            wire = (r.get("bytes_up") or 0) + (r.get("bytes_down") or 0)  # since (re)start
            self.eval.append({"t": r["t"], "tt": self.clock.at(r["t"]),
                              "accuracy": r["accuracy"], "loss": r.get("loss"),
                              "samples": r.get("samples"),
                              "bytes": self._running(("eval", "bytes"), wire)})

    def _global(self, r: dict[str, Any]) -> None:
        ev = r.get("event")
        self.clock.feed(r)
        for k in ("bytes_up", "bytes_down", "samples"):
            if isinstance(r.get(k), (int, float)):
                self._counters[k] = r[k]
        if isinstance(r.get("bytes_total"), (int, float)):  # the ledger's figures (ledger.py)
            self._take_ledger(r)
        if ev == "eval":
            self._eval(r, "global")
        if ev == "merge":
            self._merge(r)
        elif ev == "checkpoint":  # folded into one line on the page, not one event each
            self.checkpoint_t = r["t"]
            self.checkpoints = {"n": self.checkpoints["n"] + 1, "t": r["t"],
                                "tt": self.clock.at(r["t"]), "bytes": r.get("bytes")}
            return
        elif ev in ("done", "failed"):
            self.done = True
        elif ev in ("left", "group_lost") and r.get("worker") is not None:
            self._view(r["worker"]).gone = "left"
        elif ev == "joined" and r.get("worker") is not None:
            self._view(r["worker"]).gone = ""
        if ev == "groups":
            for w, g in (r.get("assignment") or {}).items():
                self._view(w).group = int(g)
        if ev == "local_steps":  # --local-steps auto: each group's H, as the global server set it
            self.set_steps.update({int(g): int(h) for g, h in r["local_steps"].items()})
        if ev in ("regroup", "rehomed", "placed"):  # moved, or a late worker placed
            for w, g in (r.get("moved") or {}).items():
                self._view(w).group = int(g)
        if ev in EVENT_KINDS:
            self._event(r, "global")

    def _event(self, r: dict[str, Any], source: str) -> None:
        brief = _brief(r)
        started = self.clock.started and r["t"] >= self.clock.bases[0][0]
        self.events.append({"t": r["t"], "event": r["event"], "source": source, **brief,
                            "tt": self.clock.at(r["t"]) if started else None,  # None: start-up
                            "text": event_text(r["event"], source, brief)})

    def _merge(self, r: dict[str, Any]) -> None:
        """A merge line: what the global server saw of one exchange, wherever the group and its
        workers run (pushes, clocks, answered PULLs, worker traffic, the exchange's bytes)."""
        g = int(r.get("group", -1))
        self.merges[g] = self.merges.get(g, 0) + 1
        if isinstance(r.get("pushes"), int):
            self.pushes[g] = self.pushes.get(g, 0) + r["pushes"]
        known = self.groups.setdefault(g, {})
        self._push_bytes(g, r)
        for k in ("min_clock", "max_clock"):
            # a final exchange after the workers left has no clocks (None, or -1 on the wire)
            if r.get(k) is not None and r[k] >= 0:
                known[k] = r[k]
        for k in ("bytes_in", "bytes_out"):
            if isinstance(r.get(k), (int, float)):
                known[k] = self._running((g, k), r[k])
        if isinstance(r.get("step_time"), (int, float)) and r["step_time"] > 0:  # not a final
            known["step_time"] = r["step_time"]  # exchange's 0: its workers' mean step time
        if isinstance(r.get("bytes_to_global"), (int, float)):
            self.hop_from_merges.add(g)
            self.to_global[g] = {k: self._running((g, k), r[k])
                                 for k in ("bytes_to_global", "bytes_from_global")}
        self._pulls(r)
        self._between(g, known, r)
        if r["t"] - self._bytes_at >= CLOCK_POINT_S:
            self._bytes_at = r["t"]
            self.bytes.append({"t": r["t"], "tt": self.clock.at(r["t"]), **self.hops()})
        low = r.get("min_clock")
        due = r["t"] - self._clock_at.get(g, -1e9) >= CLOCK_POINT_S
        if isinstance(low, int) and low >= 0 and due:
            self._clock_at[g] = r["t"]
            self.clocks.append({"t": r["t"], "tt": self.clock.at(r["t"]), "group": g,
                                "min_clock": r.get("min_clock"),
                                "max_clock": r.get("max_clock")})

    def _between(self, g: int, known: dict[str, Any], r: dict[str, Any]) -> None:
        """A merge line's staleness between groups (none in older records, None for a group
        resumed from a checkpoint before its first answer): group ``g``'s histograms, its last
        figures (``known``, its card) and, at most every ``CLOCK_POINT_S``, a chart point with
        the most of each since the group's previous point."""
        got = {k: float(r[k]) for k in ("missed", "base_age_s")
               if isinstance(r.get(k), (int, float))}
        if len(got) < 2:
            return
        self.missed_hist.setdefault(g, Histogram(MISSED_BUCKETS)).observe(got["missed"])
        self.base_age_hist.setdefault(g, Histogram(BASE_AGE_BUCKETS)).observe(got["base_age_s"])
        known.update(missed=int(got["missed"]), base_age_s=got["base_age_s"])
        peak = self._between_peak.setdefault(g, got)
        peak.update({k: max(peak[k], v) for k, v in got.items()})
        if r["t"] - self._between_at.get(g, -1e9) >= CLOCK_POINT_S:
            self._between_at[g] = r["t"]
            self.between.append({"t": r["t"], "tt": self.clock.at(r["t"]), "group": g,
                                 **self._between_peak.pop(g)})

    def between_stats(self, g: int) -> dict[str, float | None]:
        """Group ``g``'s staleness between groups over the run: the most and the mean of the
        other groups' merges its exchanges missed, and of the age (s) of the weights they
        rebased on (None before its first merge line that has them)."""
        missed, age = self.missed_hist.get(g), self.base_age_hist.get(g)
        return {"missed_max": missed.top if missed else None,
                "missed_mean": missed.mean if missed else None,
                "base_age_max_s": age.top if age else None,
                "base_age_mean_s": age.mean if age else None}

    def _running(self, key: tuple[Any, str], value: float) -> float:
        """A running byte counter that may start again from 0 (a resumed server, a restarted
        group process): each drop banks the value before it, so the total never goes back."""
        last = self._last.get(key, 0.0)
        if value < last:
            self._banked[key] = self._banked.get(key, 0.0) + last
        self._last[key] = value
        return self._banked.get(key, 0.0) + value

    def _push_bytes(self, g: int, r: dict[str, Any]) -> None:
        """Group ``g``'s mean bytes per push over its last ``PUSH_BYTES_OVER`` pushes or more:
        what its workers sent (``bytes_in``, PULLs included: ~40 bytes each) over the pushes it
        merged. The group reads ``bytes_in`` as it sends the exchange, with a push of each
        worker perhaps half received and merged in the next one: over one exchange of 4 dense
        pushes that read 1.25 of a push each (a full test run), over 32 at most 1 + workers/32."""
        now_in, pushes = r.get("bytes_in"), r.get("pushes")
        if not isinstance(now_in, (int, float)) or not isinstance(pushes, int):
            return
        seen = self._bytes_in.setdefault(g, collections.deque())
        if seen and now_in < seen[-1][0]:  # a new group process counts from 0
            seen.clear()
        total = (seen[-1][1] if seen else 0) + pushes
        if seen and total > seen[0][1] and now_in > seen[0][0]:
            self.push_bytes[g] = (now_in - seen[0][0]) / (total - seen[0][1])
        seen.append((now_in, total))
        while len(seen) > 1 and total - seen[1][1] >= PUSH_BYTES_OVER:
            seen.popleft()

    def _pulls(self, r: dict[str, Any]) -> None:
        """The PULLs a merge's group answered since its last exchange: staleness and the SSP
        bound's wait, one observation each, and each worker's count."""
        cols = [c for k in ("pull_workers", "pull_leads", "pull_waits_us")
                if isinstance(c := r.get(k), list)]
        if len(cols) != 3 or len({len(c) for c in cols}) != 1:
            return
        for w, lead, wait_us in zip(*cols, strict=True):
            self.staleness_hist.observe(float(lead))
            self.wait_hist.observe(wait_us / 1e6)
            v = self._view(w)
            v.pulls, v.held_s = v.pulls + 1, v.held_s + wait_us / 1e6
            v.lead, v.pull_wait_s = int(lead), wait_us / 1e6
            if v.pushes == 0:  # no records of its own: a PULL precedes each step
                v.clock, v.group = max(v.clock, v.pulls - 1), int(r.get("group", v.group))
        g = int(r.get("group", -1))
        if cols[0] and r["t"] - self._held_at.get(g, -1e9) >= CLOCK_POINT_S:  # who waits, over time
            self._held_at[g] = r["t"]
            self.held.append({"t": r["t"], "tt": self.clock.at(r["t"]), "group": g,
                              "held": {str(w): round(self.workers[w].held_s, 6)
                                       for w in sorted(set(cols[0]))}})

    def _server(self, r: dict[str, Any]) -> None:
        """The global server's view of the run as a whole (the monitor's probe)."""
        if isinstance(r.get("evaluator"), bool):
            self.evaluator = r["evaluator"]
        if isinstance(r.get("size"), int) and r["size"] > 0:
            self.size = r["size"]
        if isinstance(r.get("ledger"), dict):  # the live ledger's figures (record/ledger.py)
            self._take_ledger(r["ledger"])

    def _take_ledger(self, figures: dict[str, Any]) -> None:
        """The ledger's byte figures, from a record line or the live server: never lower."""
        for k in HOPS:
            if isinstance(figures.get(k), (int, float)):
                self.ledger[k] = max(self.ledger.get(k, 0), figures[k])

    def _group(self, r: dict[str, Any]) -> None:
        g = r.get("group")
        if r.get("event") == "exchange" and g not in self.hop_from_merges:
            # a group's own running totals of its hop: from runs whose merges lack them
            hop = self.to_global.setdefault(r.get("group"), {})
            for k in ("bytes_to_global", "bytes_from_global"):
                if isinstance(r.get(k), (int, float)):
                    hop[k] = self._running((g, k), r[k])
        if r.get("event") == "expired":
            for w in r.get("workers") or []:
                self._view(w).gone = "expired"
            self._event({"t": r["t"], "event": "expired", "workers": r.get("workers")},
                        f"group {r.get('group')}")

    def _worker(self, r: dict[str, Any]) -> None:
        if r.get("worker") is None:
            return
        v = self._view(r["worker"])
        if r.get("event"):
            if r["event"] in EVENT_KINDS:
                self._event(r, f"worker {v.id}")
            return
        v.clock, v.last_t, v.pushes, v.gone = int(r.get("clock", v.clock)), r["t"], v.pushes + 1, ""
        v.stats_step = False
        if r.get("group") is not None:
            v.group = int(r["group"])
        # its own view of its last push; the run's counters come from the merges (_merge)
        for k in ("step_time", "wait_s", "staleness", "bytes_wire", "bytes_raw", "ratio", "loss",
                  "local_steps"):
            if r.get(k) is not None:
                setattr(v, k, r[k])

    def _probe(self, r: dict[str, Any]) -> None:
        v = self._view(r["worker"])
        v.group = int(r.get("group", v.group))
        v.clock = max(v.clock, int(r.get("clock") or 0))  # a worker gone reports 0: keep the last
        if r.get("step_time") and (v.step_time is None or v.stats_step):
            # its last STATS, until pushes of its own (its file in this run directory) say more
            v.step_time, v.stats_step = float(r["step_time"]), v.pushes == 0
        if isinstance(r.get("iteration_s"), (int, float)) and r["iteration_s"] > 0:
            v.iteration_s = float(r["iteration_s"])
        v.waiting = r.get("waiting")
        if not r.get("alive", True):
            v.gone = v.gone or "lost"
        else:
            v.seen_t, v.gone = r["t"], ""

    def _view(self, w: Any) -> WorkerView:
        wid = int(w)
        if wid not in self.workers:
            self.workers[wid] = WorkerView(wid)
        return self.workers[wid]

    # -- reading -----------------------------------------------------------------------------

    @property
    def totals(self) -> dict[str, float]:
        """Pushes and merges (the sums of the per-group counts the merges reported), then bytes
        and samples as of the last global line (``bytes_up`` / ``bytes_down``: worker <-> group),
        and the group <-> global bytes as of each group's last exchange."""
        hops = {k: sum(h.get(k, 0) for h in self.to_global.values())
                for k in ("bytes_to_global", "bytes_from_global")}
        return {"pushes": sum(self.pushes.values()), "merges": sum(self.merges.values()),
                **self._counters, "bytes_group_global": hops["bytes_to_global"],
                "bytes_global_group": hops["bytes_from_global"]}

    def hops(self) -> dict[str, float]:
        """Bytes so far on each hop (``HOP_LABELS``): the global server's ledger (the figures its
        lines carry), else (a run recorded before it) as the groups' merges said."""
        if self.ledger:
            return {h: float(self.ledger.get(k, 0)) for h, k in zip(HOP_LABELS, HOPS, strict=True)}
        out = dict.fromkeys(HOP_LABELS, 0.0)
        for c in self.groups.values():
            out["worker_to_group"] += c.get("bytes_in", 0)
            out["group_to_worker"] += c.get("bytes_out", 0)
        for h in self.to_global.values():
            out["group_to_global"] += h.get("bytes_to_global", 0)
            out["global_to_group"] += h.get("bytes_from_global", 0)
        return out

    def local_steps(self) -> dict[int, int]:
        """Each group's local steps H: what the global server last set (auto), else the H of
        its workers' last pushes; groups without local steps are left out."""
        out = {v.group: v.local_steps for v in self.workers.values()
               if v.group >= 0 and v.local_steps is not None}
        return {**out, **self.set_steps}

    def shown_groups(self) -> dict[int, dict[str, Any]]:
        """The groups that hold a worker (before the grouping: all known): one a regroup
        emptied leaves the cards, the clock chart and the per-group gauges."""
        held = {v.group for v in self.workers.values() if v.group >= 0}
        return {g: c for g, c in sorted(self.groups.items()) if not held or g in held}

    def slow(self, now: float) -> set[int]:
        """Workers slower than ``SLOW_FACTOR`` times the median step time of the cluster's live
        workers (all groups: under GSSP a group holds workers of one speed)."""
        live = {w: v.step_time for w, v in self.workers.items()
                if v.step_time and self.state_of(v, now) != "dead"}
        if len(live) < 2:
            return set()
        times = sorted(live.values())
        median = times[len(times) // 2]
        return {w for w, st in live.items() if st > SLOW_FACTOR * median}

    def state_of(self, v: WorkerView, now: float) -> str:
        """computing | waiting | pulling | dead | done (the rules in the module docstring)."""
        if self.done:
            return "done"
        heard = max((t for t in (v.last_t, v.seen_t) if t is not None), default=None)
        if v.gone or (heard is not None and now - heard > self.lease_s):
            return "dead"
        if v.waiting if v.waiting is not None else self._held(v):
            return "waiting"
        if v.last_t is not None and v.wait_s is not None and now - v.last_t < v.wait_s:
            return "pulling"
        return "computing"

    def _held(self, v: WorkerView) -> bool:
        mates = [m.clock for m in self.workers.values() if m.group == v.group and not m.gone]
        return self.staleness is not None and bool(mates) and v.clock - min(mates) > self.staleness

    def alive_per_group(self, now: float) -> dict[int, int]:
        out: dict[int, int] = {g: 0 for g in self.shown_groups()}
        for v in self.workers.values():
            if v.group >= 0:
                out[v.group] = out.get(v.group, 0) + (self.state_of(v, now) != "dead")
        return out

    def _group_means(self, g: int) -> dict[str, Any]:
        """What the servers saw of group ``g``'s workers on average (the last exchange): step
        time, bytes per push, and a push's dense float32 bytes when the model size is known."""
        return {"step_time": self.groups.get(g, {}).get("step_time"),
                "push_bytes": self.push_bytes.get(g),
                "raw_bytes": 4 * self.size if self.size else None}

    @property
    def no_evaluator(self) -> bool:
        """No accuracy is coming: the server says no evaluator is connected, or the run is over
        without a single evaluation."""
        return self.evaluator is False or (self.done and not self.eval)

    def update(self, now: float, since: dict[str, int] | None = None) -> dict[str, Any]:
        """The page's message: tables as of ``now`` plus the series items after ``since``
        ({} = from the start); ``cursor`` is the ``since`` of the next call."""
        since = since or {}
        series = {"eval": self.eval, "clocks": self.clocks, "events": self.events,
                  "bytes": self.bytes, "held": self.held, "between": self.between}
        slow, steps = self.slow(now), self.local_steps()
        return {
            "t": now, "done": self.done, "kind": self.kind,
            "train_t": self.clock.at(now) if self.clock.started else None,
            "config": _config_brief(self.config),
            "evaluator": False if self.no_evaluator else self.evaluator,
            "workers": [v.row(self.state_of(v, now), w in slow, self._group_means(v.group))
                        for w, v in sorted(self.workers.items())],
            "groups": {str(g): {**c, "merges": self.merges.get(g, 0), **self.between_stats(g),
                                **({"local_steps": steps[g]} if g in steps else {})}
                       for g, c in self.shown_groups().items()},
            "totals": self.totals, "hops": self.hops(), "checkpoints": self.checkpoints,
            **{k: s[since.get(k, 0):] for k, s in series.items()},
            "cursor": {k: len(s) for k, s in series.items()},
        }


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    """An event's own fields, without the counters every global line carries."""
    skip = {"t", "event", "version", "samples", "bytes_up", "bytes_down", "addresses"}
    return {k: v for k, v in r.items() if k not in skip}


SENTENCES = {  # global.jsonl events whose fields read best in a sentence of their own
    "group_lost": "group {group}: its group server is gone",
    "group_adopted": "group {group}: a new group server at {address} took it over",
    "resumed": "resumed from the checkpoint",
    "waiting_for_workers": "every worker is gone; waiting up to {wait_s} s for them ({left} left)",
    "workers_back": "workers are back",
    "link_lost": "{who}: no bytes from it at group {group} for {silent_s} s (its link is "
                 "down, or it is stopped)",
    "link_back": "{who}: its link to group {group} is back after {after_s} s",
}


def event_text(event: str, source: str, f: dict[str, Any]) -> str:
    """One event as a sentence for the page's list (``_brief``'s fields ``f``)."""
    who = f"worker {f['worker']}" if f.get("worker") is not None else source
    if event == "groups":
        by: dict[int, list[int]] = {}
        for w, g in (f.get("assignment") or {}).items():
            by.setdefault(int(g), []).append(int(w))
        return "groups formed: " + "; ".join(f"group {g}: workers {_ids(ws)}"
                                             for g, ws in sorted(by.items()))
    if event in ("regroup", "rehomed"):
        moves = ", ".join(f"worker {w} to group {g}" for w, g in (f.get("moved") or {}).items())
        return f"{'regrouped' if event == 'regroup' else 'rehomed'}: {moves or 'no move'}"
    if event == "expired":
        return f"{source}: lease expired for workers {_ids(f.get('workers') or [])}"
    if event in ("done", "failed"):
        why = f.get("reason") or f.get("code") or ""
        return f"run {'over' if event == 'done' else 'failed'}" + (f": {why}" if why else "")
    if event in SENTENCES and source == "global":
        return SENTENCES[event].format_map(collections.defaultdict(str, f, who=who))
    if event == "slowdown":
        return f"{who}: emulated slowdown {_short(f.get('was'))}x -> {_short(f.get('factor'))}x"
    if event == "link":
        up, down = (float(f.get(k) or 0) / 1e6 for k in ("up_bps", "down_bps"))
        return f"{who}: link now {up:g} mbit up, {down:g} mbit down"
    if event == "calib_timeout":
        return (f"grouping deadline passed: {len(f.get('reported') or [])} of "
                f"{f.get('expected')} workers had reported")
    detail = ", ".join(_short(v) if k == "reason" else f"{k} {_short(v)}" for k, v in f.items()
                       if k not in ("worker", "group", "text") and v not in (None, "", [], {}))
    group = f" (group {f['group']})" if f.get("group") is not None else ""
    return f"{who} {event.replace('_', ' ')}{group}" + (f": {detail}" if detail else "")


def _ids(ws: list[Any]) -> str:
    return ", ".join(str(w) for w in sorted(ws, key=int))


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))[:80]


def _config_brief(cfg: dict[str, Any]) -> dict[str, Any]:
    keys = ("mode", "compressor", "model", "dataset", "workers", "staleness", "epochs", "wall_s")
    return {k: cfg.get(k) for k in keys}


# -- following a run directory: live (tail) or as a replay (by run time) ---------------------------

MAX_READ_BYTES = 4 << 20  # per file and call: a huge backlog is taken in slices, not at once


def source_of(path: Path) -> str | None:
    """``eval`` / ``global`` / ``group`` / ``worker`` / ``links`` for a metrics file name, else
    None."""
    stem = path.stem
    if stem in ("eval", "global", "links"):
        return stem
    prefix = stem.split("-", 1)[0]
    return prefix if prefix in ("group", "worker") and "-" in stem else None


class Tail:
    """The complete lines appended to one file since the previous ``read``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:  # truncated or replaced
                    self.offset, self.partial = 0, b""
                f.seek(self.offset)
                chunk = f.read(MAX_READ_BYTES)
        except OSError:
            return []
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()  # b"" after a complete last line
        return [r for r in map(_parse, lines) if r is not None]


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


class RunFollower:
    """Feeds a ``RunState`` from a run directory that is being written."""

    def __init__(self, run_dir: str | os.PathLike[str], state: RunState | None = None) -> None:
        self.path = Path(run_dir)
        self.state = state or RunState(read_config(self.path))
        self.tails: dict[Path, tuple[str, Tail]] = {}

    def poll(self) -> list[tuple[str, dict[str, Any]]]:
        """Read what is new in every metrics file, add it to the state and return it."""
        for f in self.path.glob("*.jsonl"):
            src = source_of(f)
            if src is not None and f not in self.tails:
                self.tails[f] = (src, Tail(f))
        new = [(src, r) for src, tail in self.tails.values() for r in tail.read()]
        new.sort(key=lambda sr: _t(sr[1]))
        for src, rec in new:
            self.state.add(src, rec)
        return new


class Replay:
    """Feeds a ``RunState`` from a finished run directory, ``speed`` x real time."""

    def __init__(self, run_dir: str | os.PathLike[str], speed: float = 1.0) -> None:
        self.path = Path(run_dir)
        if not self.path.is_dir():
            raise FileNotFoundError(f"no run directory at {self.path}")
        self.state = RunState(read_config(self.path), kind="replay")
        self.speed = speed  # 0: everything at once
        self.records = sorted(((src, r) for f in self.path.glob("*.jsonl")
                               if (src := source_of(f)) is not None for r in read_jsonl(f)),
                              key=lambda sr: _t(sr[1]))
        self.next = 0
        if not any(src == "eval" for src, _ in self.records):  # no accuracy will come
            self.state.evaluator = False
        self.start_t = _t(self.records[0][1]) if self.records else 0.0  # skip the idle start
        self.end_t = _t(self.records[-1][1]) if self.records else 0.0

    def horizon(self, elapsed_s: float) -> float:
        """Run time shown ``elapsed_s`` wall seconds after the replay began."""
        if self.speed <= 0:
            return self.end_t
        return min(self.end_t, self.start_t + elapsed_s * self.speed)

    def poll(self, elapsed_s: float) -> list[tuple[str, dict[str, Any]]]:
        """Add the records up to the horizon; return them."""
        h = self.horizon(elapsed_s)
        start = self.next
        while self.next < len(self.records) and _t(self.records[self.next][1]) <= h:
            self.state.add(*self.records[self.next])
            self.next += 1
        return self.records[start:self.next]


def _t(rec: dict[str, Any]) -> float:
    t = rec.get("t")
    return float(t) if isinstance(t, (int, float)) else 0.0
