"""A run directory and its files: ``RunDir``, ``JsonlWriter``, and reading them back.

Every role appends one JSON object per line to its own file in the run directory. No pickle
anywhere: JSON only, numpy scalars and arrays are converted to plain numbers and lists. Readers
tolerate missing files and the truncated last line a killed process leaves.

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
                         ("merge": one group's exchange merged, its counters, and how stale
                         between groups it was: "missed", other groups' merges since the
                         global weights it rebased on were sent, "base_age_s", their age)
                         ("ratios": {"ratios": {g: kept fraction}, "iter_time": {g: seconds}},
                         each change of the GDTopK ratios; the first ones are in "groups")
    data-<role>.json     real data or the synthetic stand-in, per process (metrics.py)
    summary.json         written by summarize()

One run, one directory: ``claim`` refuses a directory that holds another run (``holds_run``)
unless the run is resumed or the old one is moved aside, and a worker joining a run
(``join_run``) moves another run's files aside, so no file ever mixes two runs.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from minips.errors import ConfigError

__all__ = ["JsonlWriter", "RunDir", "holds_run", "claim", "join_run", "read_config", "read_jsonl",
           "tail_jsonl", "dump_json", "num"]


def _plain(obj: Any) -> Any:
    """json.dumps fallback: numpy scalars -> numbers, arrays -> lists, sets/tuples -> lists."""
    if hasattr(obj, "tolist"):  # numpy scalar or array, without importing numpy here
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot write {type(obj).__name__} to JSON")


def dump_json(path: Path, data: Mapping[str, Any]) -> None:
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
        dump_json(path, data)
        return path

    def read_config(self) -> dict[str, Any]:
        """``config.json`` as a dict; {} when it is missing or unreadable."""
        return read_config(self.path)

    def writer(self, name: str) -> JsonlWriter:
        """A ``JsonlWriter`` for ``name`` (``"eval"``, ``"worker-3"``, ``"global"``...)."""
        return JsonlWriter(self.file(name), self.t0)


# -- one run, one directory ------------------------------------------------------------------------

RUN_MARKS = ("config.json", "checkpoint.npz", "summary.json")  # a directory with one holds a run


def holds_run(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` holds (part of) a run: a config, checkpoint, summary or metrics file."""
    p = Path(path)
    return p.is_dir() and (any((p / m).exists() for m in RUN_MARKS)
                           or next(p.glob("*.jsonl"), None) is not None)


def claim(path: str | os.PathLike[str], *, option: str = "--run-dir", resume: bool = False,
          force: bool = False) -> Path | None:
    """Make ``path`` a directory for one new run (or, with ``resume``, the run it holds).

    A directory that holds another run is refused (``ConfigError``: a rerun would append to
    its files and overwrite its config and checkpoint) unless ``resume`` continues it or
    ``force`` moves it aside to ``<path>.old-N``; returns where it went (None: not moved)."""
    p = Path(path)
    if resume or not holds_run(p):
        return None
    if not force:
        raise ConfigError(f"{option} {p}: it holds an earlier run; pass --resume to continue "
                          f"it, --force to move it aside ({p}.old-N), or name a new directory")
    n = 1
    while p.with_name(f"{p.name}.old-{n}").exists():
        n += 1
    aside = p.with_name(f"{p.name}.old-{n}")
    p.rename(aside)
    return aside


def join_run(path: str | os.PathLike[str], config: Mapping[str, Any]) -> Path | None:
    """A process joining the run ``config`` (named by its ``t0``) writes into ``path``: when
    the directory holds another run (another ``t0``, or files without a config), that run is
    moved aside to ``<path>.old-N`` first; ``config.json`` is written when missing. Returns
    where the other run went (None: nothing moved; a rejoin of the same run appends)."""
    p = Path(path)
    saved = read_config(p).get("t0")
    aside = None
    if holds_run(p) and saved != config.get("t0"):
        aside = claim(p, force=True)
    if not (p / "config.json").exists():
        RunDir(p, t0=config.get("t0")).write_config(config)
    return aside


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


def t_key(rec: Mapping[str, Any]) -> float:
    return num(rec.get("t")) or 0.0  # records sort by t, stably; a record without one first


def by_t(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(records, key=t_key)


# the start of a line JsonlWriter writes: its t (a JSON number) comes first
_T_FIRST = re.compile(r'\{"t":\s*(-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)\s*[,}]')


def _jsonl_lines(path: Path) -> Iterator[str]:
    """The lines of a file as read_jsonl splits them (str.splitlines), one at a time."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                yield from line.splitlines()
    except OSError:
        return


def stream_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """read_jsonl's records, one at a time."""
    for piece in _jsonl_lines(path):
        try:
            rec = json.loads(piece)
        except ValueError:
            continue
        if isinstance(rec, dict):
            yield rec


def in_time_order(path: Path) -> bool:
    """Whether the file's lines come by ``t`` (a line that turns out unreadable counts too: it
    can only say no). Cheap: the t at the start of a JsonlWriter line is read without json."""
    last = float("-inf")
    for piece in _jsonl_lines(path):
        if m := _T_FIRST.match(piece):
            t = float(m.group(1))
            key = t if math.isfinite(t) else 0.0
        else:
            try:
                rec = json.loads(piece)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            key = t_key(rec)
        if key < last:
            return False
        last = key
    return True


def ordered_jsonl(path: Path) -> Iterable[dict[str, Any]]:
    """A file's records in load_run's order, one at a time when the file is in it."""
    return stream_jsonl(path) if in_time_order(path) else by_t(read_jsonl(path))


def num(x: Any) -> float | None:
    """``x`` as a finite float, or None (missing, null, NaN, not a number)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None
