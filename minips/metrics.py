"""Run directories, JSON-lines metrics and the summary of a run.

Every role appends one JSON object per line to its own file in the run directory; ``summarize``
reads them back (tolerating missing files and the truncated last line a killed process leaves)
and writes ``summary.json``. No pickle anywhere: JSON only, numpy scalars and arrays are
converted to plain numbers and lists. ``t`` is seconds since the run's ``t0`` (unix time, kept in
``config.json``), so files written by different processes share one time axis.

Bytes per hop. ``summarize`` (and ``live_hop_bytes``, for the progress line) count every hop
a run's bytes travel, from the group files: worker -> group (``bytes_worker_group``, the group
servers' ``bytes_in``), group -> worker (``bytes_group_worker``, ``bytes_out``), group -> global
(``bytes_group_global``, ``bytes_to_global``) and global -> group (``bytes_global_group``,
``bytes_from_global``), and ``bytes_total``, their sum. These are running totals per group; one
that drops (a restarted group process) is added up segment by segment. ``bytes_up`` /
``bytes_down`` keep their old meaning: the worker <-> group hop only, as the evaluator saw it.

Layout of a run directory (the writers in server.py / group.py / worker.py follow it)::

    config.json          run config: mode, compressor, model, dataset, workers, groups, seed, t0
    eval.jsonl           {"t", "version", "samples", "accuracy", "loss", "bytes_up", "bytes_down"}
                         samples / bytes_* are run totals so far (all workers, all directions)
    worker-<id>.jsonl    {"t", "worker", "group", "clock", "loss", "step_time", "wait_s",
                          "waited_for": [ids], "staleness", "bytes_raw", "bytes_wire", "samples",
                          "kept_fraction", "drift"}  one line per push; bytes_* and samples of
                                                that push; drift (compressed downlink only): how
                                                far the group's weights were from those pulled
    group-<g>.jsonl      {"t", "event", "group", "version", "pushes", "samples", "bytes_in",
                          "bytes_out", ...}     counters are totals so far; "exchange" events
                         also "min_clock", "max_clock", "bytes_to_global", "bytes_from_global"
    global.jsonl         {"t", "event", ...}    events: merge, groups, joined, left, ratios, ...
                         ("ratios": {"ratios": {g: kept fraction}, "iter_time": {g: seconds}},
                         each change of the GDTopK ratios; the first ones are in "groups")
    data-<role>.json     real data or the synthetic stand-in, per process (provenance.py)
    summary.json         written by summarize()
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from minips import provenance

__all__ = [
    "DEFAULT_TARGETS",
    "JsonlWriter",
    "RunDir",
    "Run",
    "read_config",
    "read_jsonl",
    "time_to_accuracy",
    "load_run",
    "summarize",
    "HOPS",
    "HOP_COUNTERS",
    "hop_bytes",
    "total_bytes_series",
    "tail_jsonl",
    "live_hop_bytes",
]

# Accuracy targets reported by time_to_accuracy unless config.json lists its own "targets".
DEFAULT_TARGETS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9)


def _plain(obj: Any) -> Any:
    """json.dumps fallback: numpy scalars -> numbers, arrays -> lists, sets/tuples -> lists."""
    if hasattr(obj, "tolist"):  # numpy scalar or array, without importing numpy here
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot write {type(obj).__name__} to JSON")


def _dump_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write a JSON file atomically (temp file + rename): a reader never sees half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=_plain) + "\n")
    os.replace(tmp, path)


class JsonlWriter:
    """Append-only JSON-lines file; each ``write`` is one line, flushed at once.

    ``t0``: unix time the ``t`` field counts from (default: when the writer was made); ``clock``
    returns unix time and is injectable for tests. A record that has ``t`` keeps it.
    """

    def __init__(self, path: str | os.PathLike[str], t0: float | None = None,
                 *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self.t0 = clock() if t0 is None else float(t0)
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` (adding ``t`` if missing) as one line and flush it."""
        if self._file is None:
            raise ValueError(f"{self.path} is closed")
        if "t" not in record:
            record = {"t": round(self.clock() - self.t0, 6), **record}
        self._file.write(json.dumps(record, separators=(",", ":"), default=_plain) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RunDir:
    """A run directory: creates it, holds ``t0``, writes ``config.json``, opens writers.

    ``t0`` is taken from the argument, else from an existing ``config.json``, else now; so a
    worker process opening the server's run directory shares its time axis.
    """

    def __init__(self, path: str | os.PathLike[str], *, t0: float | None = None) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        saved = self.read_config().get("t0") or None
        self.t0 = float(t0 if t0 is not None else saved if saved is not None else time.time())

    def file(self, name: str) -> Path:
        """Path of ``name`` inside the run directory (``"eval"`` -> ``eval.jsonl``)."""
        return self.path / (name if "." in name else f"{name}.jsonl")

    def write_config(self, config: Mapping[str, Any]) -> Path:
        """Write ``config.json`` (with ``t0`` added when missing or 0) and return its path."""
        data = dict(config)
        if not data.get("t0"):
            data["t0"] = self.t0
        path = self.path / "config.json"
        _dump_json(path, data)
        return path

    def read_config(self) -> dict[str, Any]:
        """``config.json`` as a dict; {} when it is missing or unreadable."""
        return read_config(self.path)

    def writer(self, name: str) -> JsonlWriter:
        """A ``JsonlWriter`` for ``name`` (``"eval"``, ``"worker-3"``, ``"global"``...)."""
        return JsonlWriter(self.file(name), self.t0)


def read_config(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``<run_dir>/config.json`` as a dict; {} when it is missing or unreadable."""
    try:
        data = json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; bad lines (a truncated last one) are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records


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
        starts = [_num(r.get("t")) for r in self.events if r.get("event") == "groups"]
        return next((t for t in starts if t is not None), 0.0)

    @property
    def label(self) -> str:
        """``mode/compressor`` for legends (the directory name when the config is missing)."""
        mode, comp = self.config.get("mode"), self.config.get("compressor")
        if not mode:
            return self.path.name
        return f"{mode}/{comp}" if comp else str(mode)


def _by_t(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(records, key=lambda r: _num(r.get("t")) or 0.0)


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
    return Run(path=path, config=read_config(path),
               eval=_by_t(read_jsonl(path / "eval.jsonl")),
               workers=_numbered(path, "worker"), groups=_numbered(path, "group"),
               events=_by_t(read_jsonl(path / "global.jsonl")))


# -- summary -------------------------------------------------------------------------------------


def _num(x: Any) -> float | None:
    """``x`` as a finite float, or None (missing, null, NaN, not a number)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def _values(records: Iterable[Mapping[str, Any]], key: str) -> list[float]:
    return [v for v in (_num(r.get(key)) for r in records) if v is not None]


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
        hit = [_num(r.get("t")) for r in evals if (_num(r.get("accuracy")) or 0.0) >= target]
        t = next((t for t in hit if t is not None), None)
        out[f"{target:.2f}"] = None if t is None else max(t - start, 0.0)
    return out


def _wall_s(run: Run, pushes: list[dict[str, Any]]) -> float | None:
    done = [r for r in run.events if r.get("event") == "done"]
    if done and _num(done[-1].get("t")) is not None:
        return _num(done[-1].get("t"))
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


def _traffic(run: Run, pushes: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples and bytes: the evaluator's run totals, else the sums of per-role files."""
    group_out = [_last(recs, "bytes_out") for recs in run.groups.values()]
    fallback_down = sum(b for b in group_out if b is not None) if run.groups else None
    samples = _last(run.eval, "samples")
    up, down = _last(run.eval, "bytes_up"), _last(run.eval, "bytes_down")
    return {
        "samples": samples if samples is not None else sum(_values(pushes, "samples")),
        "bytes_up": up if up is not None else sum(_values(pushes, "bytes_wire")),
        "bytes_down": down if down is not None else fallback_down,
        "bytes_raw": sum(_values(pushes, "bytes_raw")),
    }


# bytes of each hop: the summary key and the running counter in group-<g>.jsonl that holds it
HOP_COUNTERS = {
    "bytes_worker_group": "bytes_in",  # workers -> their group server (every record)
    "bytes_group_worker": "bytes_out",  # group server -> its workers (every record)
    "bytes_group_global": "bytes_to_global",  # group -> global server ("exchange" events)
    "bytes_global_group": "bytes_from_global",  # global server -> group ("exchange" events)
}
HOPS = (*HOP_COUNTERS, "bytes_total")


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
    merged = sorted(((_num(r.get("t")) or 0.0, g, r) for g, recs in groups.items() for r in recs),
                    key=lambda x: x[0])
    running = _Running()
    for t, g, r in merged:
        for counter in HOP_COUNTERS.values():
            v = _num(r.get(counter))
            if v is not None:
                running.add((g, counter), v)
        if each is not None:
            each(t, running)
    return running


def hop_bytes(groups: Mapping[Any, list[dict[str, Any]]]) -> dict[str, int]:
    """Bytes of every hop (``HOPS``) from the group records (``{group: records}``): the
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


def tail_jsonl(path: str | os.PathLike[str], nbytes: int = 16384) -> list[dict[str, Any]]:
    """The complete records in the last ``nbytes`` of a JSON-lines file (cheap to poll)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - nbytes))
            lines = f.read().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # the first, cut line, or a half-written last one
        if isinstance(rec, dict):
            records.append(rec)
    return records


def live_hop_bytes(run_dir: str | os.PathLike[str]) -> dict[str, int] | None:
    """``hop_bytes`` of a running run from the tails of its group files (None before any); a
    restart older than the tail is not seen (a progress display's figure, not the summary's)."""
    files = sorted(Path(run_dir).glob("group-*.jsonl"))
    return hop_bytes({f.stem: tail_jsonl(f) for f in files}) if files else None


def _hops(run: Run, traffic: Mapping[str, Any]) -> dict[str, int]:
    """``hop_bytes`` of the run; without group files, worker <-> group from ``traffic``."""
    if any(run.groups.values()):
        return hop_bytes(run.groups)
    up, down = int(traffic["bytes_up"] or 0), int(traffic["bytes_down"] or 0)
    return {"bytes_worker_group": up, "bytes_group_worker": down, "bytes_group_global": 0,
            "bytes_global_group": 0, "bytes_total": up + down}


def _per_worker(run: Run) -> dict[str, dict[str, Any]]:
    """Per worker: group, steps, mean wait and staleness, and how often others waited for it."""
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

    Keys: mode, compressor, model, dataset, workers, groups, final_accuracy, best_accuracy,
    final_loss, wall_s (t0 to the end), train_start_s (t0 to the ``groups`` event), train_s,
    samples, samples_per_s (over train_s), bytes_up, bytes_down (worker <-> group only, as the
    evaluator saw them), bytes_raw, bytes_worker_group, bytes_group_worker, bytes_group_global,
    bytes_global_group, bytes_total (every hop; see the module docstring), time_to_accuracy
    (seconds from the training start), mean_staleness, max_staleness, mean_wait_s,
    mean_kept_fraction, steps, eval_points, regroups, per_worker ({id: group, steps,
    mean_step_s, mean_wait_s, mean_staleness, waited_for_by_others}), data ("real",
    "synthetic", "mixed": provenance.py) and data_sources ({role: its data-<role>.json}). A
    figure the files cannot give is None.
    """
    run = load_run(run_dir)
    pushes = [r for recs in run.workers.values() for r in recs]
    cfg = run.config
    accs = _values(run.eval, "accuracy")
    wall, start = _wall_s(run, pushes), run.start_t
    train = max(wall - start, 0.0) if wall is not None else None
    traffic = _traffic(run, pushes)
    staleness = _values(pushes, "staleness")
    sources = provenance.read(run.path)  # real files or the synthetic stand-in, per process
    summary: dict[str, Any] = {
        "mode": cfg.get("mode"), "compressor": cfg.get("compressor"),
        "model": cfg.get("model"), "dataset": cfg.get("dataset"),
        "workers": len(run.workers) or cfg.get("workers"), "groups": _groups(run),
        "final_accuracy": accs[-1] if accs else None, "best_accuracy": max(accs, default=None),
        "final_loss": _last(run.eval, "loss"), "wall_s": wall, "train_start_s": start,
        "train_s": train, **traffic, **_hops(run, traffic),
        "samples_per_s": traffic["samples"] / train if train else None,
        "time_to_accuracy": time_to_accuracy(run.eval, targets or cfg.get("targets")
                                             or DEFAULT_TARGETS, start),
        "mean_staleness": _mean(staleness), "max_staleness": max(staleness, default=None),
        "mean_wait_s": _mean(_values(pushes, "wait_s")),
        "mean_kept_fraction": _mean(_values(pushes, "kept_fraction")),
        "steps": len(pushes), "eval_points": len(run.eval),
        "regroups": sum(1 for r in run.events if r.get("event") == "regroup"),
        "per_worker": _per_worker(run),
        "data": provenance.verdict(sources), "data_sources": sources,
    }
    if write:
        _dump_json(run.path / "summary.json", summary)
    return summary
