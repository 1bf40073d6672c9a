"""A run read back, and its summary: ``load_run`` -> ``Run``, ``summarize`` -> summary.json.

Every role appends one JSON object per line to its own file in the run directory; ``summarize``
reads them back (tolerating missing files and the truncated last line a killed process leaves)
and writes ``summary.json``. ``t`` is seconds since the run's ``t0`` (unix time, kept in
``config.json``), so files written by different processes share one time axis. The files and
their writers are in rundir.py, whose docstring shows the layout of a run directory.

The file holds, in order:

- Where a run's data came from: the real files, or the synthetic stand-in
  ``data.load_dataset`` falls back to when they are missing (no torch, no sockets). Every
  process that loads a data set records it in the run directory as ``data-<role>.json`` (each
  worker its train split, the evaluator its test split): ``{"role", "dataset", "split",
  "synthetic", "source", "reason"}`` (``record``, ``read``). ``summarize`` and the progress line
  of `minips local` fold the records into one word with ``verdict``. A worker on another
  machine writes its file there; its first STATS carries the same record (``origin``) to the
  global server, which logs it as a ``data`` event in global.jsonl, and ``read`` takes it from
  there.
- Bytes per hop. The global server's ledger (record/ledger.py) counts them as the run goes and
  every global.jsonl line carries its figures: ``summarize`` takes the last ones. For a run
  recorded before the ledger, the group files give every hop a run's bytes travel: worker -> group
  (``bytes_worker_group``, the group servers' ``bytes_in``), group -> worker
  (``bytes_group_worker``, ``bytes_out``), group -> global (``bytes_group_global``,
  ``bytes_to_global``) and global -> group (``bytes_global_group``, ``bytes_from_global``), and
  ``bytes_total``, their sum; a group that writes on another machine is counted from the
  global server's merge lines, which carry its counters. These are running totals per group;
  one that drops (a restarted group process) is added up segment by segment. ``bytes_up`` /
  ``bytes_down`` keep their old meaning: the worker <-> group hop only, as the evaluator saw
  it.
- The run read back (``Run``, ``load_run``), then the summary (``time_to_accuracy``,
  ``summarize``).

Invariant: a run counts as ``"real"`` only when every record says real; one synthetic record
makes it ``"mixed"`` (or ``"synthetic"`` when all are), so a stand-in never goes unnoticed.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minips.record.ledger import HOPS
from minips.record.rundir import dump_json, num, read_config, read_jsonl

__all__ = [
    "origin",
    "record",
    "read",
    "verdict",
    "HOP_COUNTERS",
    "BYTE_FIGURES",
    "hop_bytes",
    "total_bytes_series",
    "DataWatch",
    "TrainingClock",
    "DEFAULT_TARGETS",
    "Run",
    "time_to_accuracy",
    "load_run",
    "summarize",
]


# -- where a run's data came from: one data-<role>.json per process --------------------------------

def origin(meta: Mapping[str, Any]) -> dict[str, Any]:
    """What a data set's ``meta`` (``Dataset.meta``) says of where it came from: dataset, split,
    synthetic, source, reason (also what a worker's first STATS carries as ``data``)."""
    return {"dataset": str(meta.get("name") or ""), "split": str(meta.get("split") or ""),
            "synthetic": bool(meta.get("synthetic")), "source": str(meta.get("source") or ""),
            "reason": str(meta.get("synthetic_reason") or "")}


def record(run_dir: str | os.PathLike[str], role: str, meta: Mapping[str, Any]) -> Path:
    """Write ``data-<role>.json`` for a data set's ``meta`` (``Dataset.meta``); return its path."""
    path = Path(run_dir) / f"data-{role}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"role": role, **origin(meta)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # a reader never sees half of it
    tmp.write_text(json.dumps(entry, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read(run_dir: str | os.PathLike[str],
         events: Iterable[Mapping[str, Any]] = ()) -> dict[str, dict[str, Any]]:
    """``{role: record}`` of every ``data-*.json`` in the run directory (unreadable: skipped),
    and of the global server's ``data`` events (``events``: what each worker's first STATS said,
    wherever it runs) for workers without a file here."""
    out: dict[str, dict[str, Any]] = {}
    for f in sorted(Path(run_dir).glob("data-*.json")):
        try:
            rec = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict):
            out[f.stem[len("data-"):]] = rec
    for e in events:
        if e.get("event") == "data" and isinstance(e.get("worker"), int):
            role = f"worker-{e['worker']}"
            keep = {k: e[k] for k in ("dataset", "split", "synthetic", "source", "reason")
                    if k in e}
            out.setdefault(role, {"role": role, **keep, "reported": True})
    return out


def verdict(records: Mapping[str, Mapping[str, Any]]) -> str | None:
    """``"real"``, ``"synthetic"`` or ``"mixed"`` over the records; None when there are none."""
    kinds = {bool(r.get("synthetic")) for r in records.values()}
    if not kinds:
        return None
    if kinds == {False}:
        return "real"
    return "synthetic" if kinds == {True} else "mixed"


# -- bytes per hop, from the group files -----------------------------------------------------------

# bytes of each hop (ledger.HOPS, in its order) and the running counter in group-<g>.jsonl that
# holds it
HOP_COUNTERS = {
    "bytes_worker_group": "bytes_in",  # workers -> their group server (every record)
    "bytes_group_worker": "bytes_out",  # group server -> its workers (every record)
    "bytes_group_global": "bytes_to_global",  # group -> global server ("exchange" events)
    "bytes_global_group": "bytes_from_global",  # global server -> group ("exchange" events)
}
BYTE_FIGURES = (*HOPS, "bytes_total")  # the byte figures of a summary: every hop, then their sum


class _Running:
    """The total of running counters that may start again from 0 (a restarted `minips group`
    process, a new channel): each drop banks the value before it."""

    def __init__(self) -> None:
        self.banked: dict[Any, float] = {}
        self.last: dict[Any, float] = {}

    def add(self, key: Any, value: float) -> None:
        if value < self.last.get(key, 0.0):
            self.banked[key] = self.banked.get(key, 0.0) + self.last[key]
        self.last[key] = value

    def total(self, match: Callable[[Any], bool] = lambda k: True) -> int:
        return int(sum(self.banked.get(k, 0.0) + v for k, v in self.last.items() if match(k)))


def _replay(groups: Mapping[Any, list[dict[str, Any]]],
            each: Callable[[float, _Running], None] | None = None) -> _Running:
    """The running hop counters of the group records (``{group: records}``), all groups merged
    in time order; ``each(t, totals so far)`` is called after every record."""
    merged = sorted(((num(r.get("t")) or 0.0, g, r) for g, recs in groups.items() for r in recs),
                    key=lambda x: x[0])
    running = _Running()
    for t, g, r in merged:
        for counter in HOP_COUNTERS.values():
            v = num(r.get(counter))
            if v is not None:
                running.add((g, counter), v)
        if each is not None:
            each(t, running)
    return running


def hop_bytes(groups: Mapping[Any, list[dict[str, Any]]]) -> dict[str, int]:
    """Bytes of every hop (``ledger.HOPS``) from the group records (``{group: records}``): the
    worker <-> group hop from the group servers' ``bytes_in`` / ``bytes_out``, the group <->
    global hop from the ``bytes_to_global`` / ``bytes_from_global`` of their exchange events
    (0 where the records lack them), summed over the groups; ``bytes_total`` is their sum."""
    running = _replay(groups)
    out = {hop: running.total(lambda k, c=counter: k[1] == c)  # type: ignore[misc]
           for hop, counter in HOP_COUNTERS.items()}
    return {**out, "bytes_total": sum(out.values())}


def total_bytes_series(groups: Mapping[Any, list[dict[str, Any]]]) -> list[tuple[float, int]]:
    """(t, bytes of all hops so far) after each group record, in time order (for charts)."""
    out: list[tuple[float, int]] = []
    _replay(groups, lambda t, running: out.append((t, running.total())))
    return out


class DataWatch:
    """Where a running run's data comes from (``verdict``), for a progress line: the
    data-*.json files here and the ``data`` events the global server logs for workers on
    other machines, read from global.jsonl as it grows (each byte once)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir)
        self.offset = 0  # bytes of global.jsonl read so far (whole lines)
        self.events: list[dict[str, Any]] = []  # its data events so far

    def verdict(self) -> str | None:
        """``verdict`` of every record so far (None before any process loaded its data)."""
        self._read_new()
        return verdict(read(self.path, self.events))

    def _read_new(self) -> None:
        try:
            with open(self.path / "global.jsonl", "rb") as f:
                if f.seek(0, os.SEEK_END) < self.offset:  # a new file: from its start
                    self.offset, self.events = 0, []
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        whole = chunk.rfind(b"\n") + 1  # a half-written last line waits for the next call
        self.offset += whole
        for line in chunk[:whole].splitlines():
            if b'"data"' not in line:  # cheap: most lines are merges
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("event") == "data":
                self.events.append(rec)


class TrainingClock:
    """The run's one clock: the training time at a run time ``t``, as summary.json's
    ``train_s`` counts it. 0 until the ``groups`` event (the workers assigned: training
    starts), then seconds since it; after a ``resumed`` event, the checkpoint's training time
    (its ``train_s``) plus seconds since the resume, so a server's downtime is not training; at
    the ``done`` event it stops, at the ``train_s`` it carries (the server's own clock).

    ``feed`` takes global.jsonl's records in time order (the charts, the dashboard); ``text``
    follows a run directory's global.jsonl as it grows, each byte once (a progress line)."""

    def __init__(self, run_dir: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(run_dir) if run_dir is not None else None
        self._reset()

    def _reset(self) -> None:
        self.offset = 0  # bytes of global.jsonl read so far (whole lines)
        self.bases: list[tuple[float, float]] = []  # (run time, training time there), sorted
        self.done_t: float | None = None  # run time of the done event
        self.end: float | None = None  # training time at it

    @property
    def started(self) -> bool:
        return bool(self.bases)

    def feed(self, rec: Mapping[str, Any]) -> None:
        """One global.jsonl record; only groups, resumed and done move the clock."""
        ev, t, train = rec.get("event"), num(rec.get("t")), num(rec.get("train_s"))
        if t is None:
            return
        if ev == "groups" and not self.bases:
            self.bases.append((t, 0.0))
        elif ev == "resumed" and train is not None:
            self.bases.append((t, train))
            self.done_t = self.end = None
        elif ev == "done" and self.bases:
            end = train if train is not None else self.at(t)
            self.done_t, self.end = t, end

    def at(self, t: float) -> float:
        """Training time at run time ``t``: 0 before the start, ``end`` from the done on."""
        if self.done_t is not None and self.end is not None and t >= self.done_t:
            return self.end
        earlier = [b for b in self.bases if b[0] <= t]
        if not earlier:
            return 0.0
        since, train = earlier[-1]
        return max(0.0, train + t - since)

    def text(self, now: float) -> str:
        """"training 4.9 s" (or "start-up 3.2 s") at unix time ``now``."""
        assert self.path is not None
        self._read_new()
        t0 = num(read_config(self.path).get("t0")) or now
        if not self.started:
            return f"start-up {max(now - t0, 0.0):.1f} s"
        return f"training {self.at(now - t0):.1f} s"

    def _read_new(self) -> None:
        assert self.path is not None
        try:
            with open(self.path / "global.jsonl", "rb") as f:
                if f.seek(0, os.SEEK_END) < self.offset:  # a new file: from its start
                    self._reset()
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        whole = chunk.rfind(b"\n") + 1  # a half-written last line waits for the next call
        self.offset += whole
        for line in chunk[:whole].splitlines():
            if not any(k in line for k in (b'"groups"', b'"resumed"', b'"done"')):
                continue  # cheap: most lines are merges
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                self.feed(rec)


# -- the run read back -----------------------------------------------------------------------------

# Accuracy targets reported by time_to_accuracy unless config.json lists its own "targets".
DEFAULT_TARGETS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9)


@dataclass
class Run:
    """Everything a run directory holds, read back; each list is sorted by ``t``."""

    path: Path
    config: dict[str, Any]
    eval: list[dict[str, Any]] = field(default_factory=list)
    workers: dict[Any, list[dict[str, Any]]] = field(default_factory=dict)  # id -> pushes
    groups: dict[Any, list[dict[str, Any]]] = field(default_factory=dict)  # id -> records
    events: list[dict[str, Any]] = field(default_factory=list)  # global.jsonl

    @property
    def start_t(self) -> float:
        """``t`` when training started: the first ``groups`` event (workers assigned), else 0.

        Start-up (process spawn, imports, calibration) differs from run to run and says
        nothing about the training mode, so times-to-accuracy and charts count from here.
        """
        starts = [num(r.get("t")) for r in self.events if r.get("event") == "groups"]
        return next((t for t in starts if t is not None), 0.0)

    @property
    def label(self) -> str:
        """``mode/compressor`` for legends (the directory name when the config is missing)."""
        mode, comp = self.config.get("mode"), self.config.get("compressor")
        if not mode:
            return self.path.name
        return f"{mode}/{comp}" if comp else str(mode)


def _by_t(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(records, key=lambda r: num(r.get("t")) or 0.0)


def _numbered(path: Path, prefix: str) -> dict[Any, list[dict[str, Any]]]:
    """``{id: records}`` for the files ``<prefix>-<id>.jsonl`` (int ids when they are ints)."""
    out: dict[Any, list[dict[str, Any]]] = {}
    for f in sorted(path.glob(f"{prefix}-*.jsonl")):
        key = f.stem[len(prefix) + 1:]
        out[int(key) if re.fullmatch(r"\d+", key) else key] = _by_t(read_jsonl(f))
    return out


def load_run(run_dir: str | os.PathLike[str]) -> Run:
    """Read every metrics file of a run directory (missing files read as empty)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"no run directory at {path}")
    events = _by_t(read_jsonl(path / "global.jsonl"))
    # an evaluator on another machine writes its eval.jsonl there: its SCOREs are here
    scores = [r for r in events if r.get("event") == "eval"]
    return Run(path=path, config=read_config(path),
               eval=_by_t(read_jsonl(path / "eval.jsonl")) or scores,
               workers=_numbered(path, "worker"), groups=_numbered(path, "group"),
               events=events)


# -- summary -------------------------------------------------------------------------------------


def _values(records: Iterable[Mapping[str, Any]], key: str) -> list[float]:
    return [v for v in (num(r.get(key)) for r in records) if v is not None]


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _last(records: list[dict[str, Any]], key: str) -> float | None:
    vals = _values(records, key)
    return vals[-1] if vals else None


def time_to_accuracy(evals: list[dict[str, Any]], targets: Iterable[float],
                     start: float = 0.0) -> dict[str, Any]:
    """``{"0.80": seconds from start to the first accuracy >= 0.80, or None}`` per target."""
    out: dict[str, Any] = {}
    for target in targets:
        hit = [num(r.get("t")) for r in evals if (num(r.get("accuracy")) or 0.0) >= target]
        t = next((t for t in hit if t is not None), None)
        out[f"{target:.2f}"] = None if t is None else max(t - start, 0.0)
    return out


def _wall_s(run: Run, pushes: list[dict[str, Any]]) -> float | None:
    done = [r for r in run.events if r.get("event") == "done"]
    if done and num(done[-1].get("t")) is not None:
        return num(done[-1].get("t"))
    ts = _values(run.eval + pushes + run.events, "t")
    ts += _values([r for g in run.groups.values() for r in g], "t")
    return max(ts) if ts else None


def _groups(run: Run) -> int | None:
    """Number of groups: the group files, else the workers' group fields, else the config."""
    if run.groups:
        return len(run.groups)
    seen = {r.get("group") for recs in run.workers.values() for r in recs} - {None}
    if seen:
        return len(seen)
    groups = run.config.get("groups")
    return groups if isinstance(groups, int) and groups > 0 else None


def _ledger(run: Run) -> dict[str, Any] | None:
    """The global server's last figures (record/ledger.py: every line carries them), or None
    for a run recorded before the ledger."""
    return next((r for r in reversed(run.events) if "bytes_total" in r), None)


def _traffic(run: Run, pushes: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples and bytes: the ledger's worker <-> group bytes, else the evaluator's run totals,
    else the sums of per-role files; the samples, without an evaluator (a server whose workers
    write on their own machines), as of the global server's last merge."""
    group_out = [_last(recs, "bytes_out") for recs in run.groups.values()]
    fallback_down = sum(b for b in group_out if b is not None) if run.groups else None
    samples = _last(run.eval, "samples")
    if samples is None and not pushes:
        samples = _last([r for r in run.events if r.get("event") == "merge"], "samples")
    up, down = _last(run.eval, "bytes_up"), _last(run.eval, "bytes_down")
    if (ledger := _ledger(run)) is not None:
        up, down = ledger.get("bytes_worker_group"), ledger.get("bytes_group_worker")
    return {
        "samples": samples if samples is not None else sum(_values(pushes, "samples")),
        "bytes_up": up if up is not None else sum(_values(pushes, "bytes_wire")),
        "bytes_down": down if down is not None else fallback_down,
        "bytes_raw": sum(_values(pushes, "bytes_raw")),
    }


def _merges(run: Run) -> dict[Any, list[dict[str, Any]]]:
    """The global server's merge lines, per group: what it saw of every exchange (pushes, the
    PULLs answered, the group's running byte counters), wherever the group and workers ran."""
    out: dict[Any, list[dict[str, Any]]] = {}
    for r in run.events:
        if r.get("event") == "merge":
            out.setdefault(r.get("group"), []).append(r)
    return out


def _hops(run: Run, traffic: Mapping[str, Any],
          merges: Mapping[Any, list[dict[str, Any]]]) -> dict[str, int]:
    """``hop_bytes`` of the run: the ledger's (the global server's last figures), else (a run
    recorded before it) from the group files, else from the global server's merge lines
    (groups that write on other machines), else worker <-> group from ``traffic``."""
    if (ledger := _ledger(run)) is not None:
        return {k: int(ledger.get(k) or 0) for k in BYTE_FIGURES}
    if any(run.groups.values()):
        return hop_bytes(run.groups)
    if merges:
        return hop_bytes(merges)
    up, down = int(traffic["bytes_up"] or 0), int(traffic["bytes_down"] or 0)
    return {"bytes_worker_group": up, "bytes_group_worker": down, "bytes_group_global": 0,
            "bytes_global_group": 0, "bytes_total": up + down}


def _seen_by_servers(merges: Mapping[Any, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per worker, from the merge lines' answered PULLs (a run whose workers write on their own
    machines): its last group, steps (one PULL a step), mean SSP wait and staleness (its lead)."""
    seen: dict[str, dict[str, Any]] = {}
    for g, recs in merges.items():
        for r in recs:
            cols = [r.get(k) for k in ("pull_workers", "pull_leads", "pull_waits_us")]
            if not all(isinstance(c, list) for c in cols):
                continue
            for w, lead, wait_us in zip(*cols, strict=False):
                v = seen.setdefault(str(w), {"group": g, "steps": 0, "leads": [], "waits": []})
                v["group"] = g
                v["steps"] += 1
                v["leads"].append(float(lead))
                v["waits"].append(float(wait_us) / 1e6)
    return {w: {"group": v["group"], "steps": v["steps"], "mean_step_s": None,
                "mean_wait_s": _mean(v["waits"]), "mean_staleness": _mean(v["leads"]),
                "waited_for_by_others": None, "from": "servers"}
            for w, v in sorted(seen.items(), key=lambda kv: int(kv[0]))}


def _between_groups(merges: Mapping[Any, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per group, its staleness between groups over the run, from the merge lines (rundir.py):
    the mean and the most of ``missed`` (other groups' merges an exchange was computed without)
    and of ``base_age_s`` (the age of the global weights it rebased on); None where no line has
    them (records older than the figures, a group resumed before its first answer)."""
    out: dict[str, dict[str, Any]] = {}
    for g, recs in sorted(merges.items(), key=lambda kv: str(kv[0])):
        missed, age = _values(recs, "missed"), _values(recs, "base_age_s")
        out[str(g)] = {"mean_missed": _mean(missed), "max_missed": max(missed, default=None),
                       "mean_base_age_s": _mean(age), "max_base_age_s": max(age, default=None)}
    return out


def _compute_share(run: Run, train: float | None) -> float | None:
    """The share of the workers' training time spent in their steps: the step times their
    records report (``step_time`` x ``local_steps``: an emulated step, or the measured compute)
    over workers x ``train_s``. The rest went to waits, pushes and pulls: a mode whose workers
    never waited and whose messages took no time would reach its samples ``1 / share`` times
    sooner. None without worker files."""
    if not run.workers or not train:
        return None
    busy = sum((num(r.get("step_time")) or 0.0) * (num(r.get("local_steps")) or 1)
               for recs in run.workers.values() for r in recs if num(r.get("step_time")))
    return busy / (len(run.workers) * train)


def _per_worker(run: Run, merges: Mapping[Any, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per worker: group, steps, mean wait and staleness, and how often others waited for it;
    without worker files, what the servers saw (``_seen_by_servers``)."""
    if not run.workers:
        return _seen_by_servers(merges)
    blamed: dict[str, int] = {}
    for recs in run.workers.values():
        for r in recs:
            for v in r.get("waited_for") or []:
                blamed[str(v)] = blamed.get(str(v), 0) + 1
    out = {}
    for w, recs in run.workers.items():
        groups = [r.get("group") for r in recs if r.get("group") is not None]
        out[str(w)] = {"group": groups[-1] if groups else None, "steps": len(recs),
                       "mean_step_s": _mean(_values(recs, "step_time")),
                       "mean_wait_s": _mean(_values(recs, "wait_s")),
                       "mean_staleness": _mean(_values(recs, "staleness")),
                       "waited_for_by_others": blamed.get(str(w), 0)}
    return out


def summarize(run_dir: str | os.PathLike[str], *, targets: Iterable[float] | None = None,
              write: bool = True) -> dict[str, Any]:
    """Headline figures of a run; also written to ``<run_dir>/summary.json`` when ``write``.

    Keys: mode, compressor, model, dataset, workers, groups, final_accuracy (the evaluator's
    final point: the final weights on every test sample), final_test_samples, best_accuracy,
    final_loss, wall_s (t0 to the end), train_start_s (t0 to the ``groups`` event), train_s
    (the server's training clock at ``done``: a resume's downtime is not training), samples,
    samples_per_s (over train_s), bytes_up, bytes_down (worker <-> group only, as the
    evaluator saw them), bytes_raw, bytes_worker_group, bytes_group_worker, bytes_group_global,
    bytes_global_group, bytes_total (every hop; see the module docstring), time_to_accuracy
    (seconds from the training start), mean_staleness, max_staleness (inside a group),
    between_groups ({group: mean_missed, max_missed, mean_base_age_s, max_base_age_s}: the
    staleness between groups of its merged exchanges, ``_between_groups``), mean_wait_s,
    compute_share (the workers' step times over workers x train_s, ``_compute_share``),
    mean_kept_fraction, steps, eval_points, regroups, per_worker ({id: group, steps,
    mean_step_s, mean_wait_s, mean_staleness, waited_for_by_others}; without worker files in
    the run directory, from the global server's merge lines: steps are the PULLs its group
    answered, ``from`` is "servers"), data ("real",
    "synthetic", "mixed": ``verdict``) and data_sources ({role: its data-<role>.json}). A
    figure the files cannot give is None.
    """
    run = load_run(run_dir)
    pushes = [r for recs in run.workers.values() for r in recs]
    cfg = run.config
    accs = _values(run.eval, "accuracy")
    wall, start = _wall_s(run, pushes), run.start_t
    train = max(wall - start, 0.0) if wall is not None else None
    # the server's own training clock at `done`: a resumed run's downtime is not training
    clocked = [num(r.get("train_s")) for r in run.events if r.get("event") == "done"]
    train = clocked[-1] if clocked and clocked[-1] is not None else train
    traffic = _traffic(run, pushes)
    merges = _merges(run)  # what the global server saw of each exchange
    staleness = _values(pushes, "staleness")
    sources = read(run.path, run.events)  # real files or the synthetic stand-in, per process
    summary: dict[str, Any] = {
        "mode": cfg.get("mode"), "compressor": cfg.get("compressor"),
        "model": cfg.get("model"), "dataset": cfg.get("dataset"),
        "workers": len(run.workers) or cfg.get("workers"), "groups": _groups(run),
        "final_accuracy": accs[-1] if accs else None, "best_accuracy": max(accs, default=None),
        "final_test_samples": _last(run.eval, "test_samples") or _last(run.eval, "tested"),
        "final_loss": _last(run.eval, "loss"), "wall_s": wall, "train_start_s": start,
        "train_s": train, **traffic, **_hops(run, traffic, merges),
        "samples_per_s": traffic["samples"] / train if train else None,
        "time_to_accuracy": time_to_accuracy(run.eval, targets or cfg.get("targets")
                                             or DEFAULT_TARGETS, start),
        "mean_staleness": _mean(staleness), "max_staleness": max(staleness, default=None),
        "between_groups": _between_groups(merges),
        "mean_wait_s": _mean(_values(pushes, "wait_s")),
        "compute_share": _compute_share(run, train),
        "mean_kept_fraction": _mean(_values(pushes, "kept_fraction")),
        "steps": len(pushes) or sum(int(r.get("pushes") or 0)
                                    for recs in merges.values() for r in recs),
        "eval_points": len(run.eval),
        "regroups": sum(1 for r in run.events if r.get("event") == "regroup"),
        "per_worker": _per_worker(run, merges),
        "data": verdict(sources), "data_sources": sources,
    }
    if write:
        dump_json(run.path / "summary.json", summary)
    return summary
