"""Following a run directory's JSON-lines files: live (tail) or as a replay (by run time).

``Tail`` reads what was appended to one file since the last call, keeping a partial last line
for the next call (a writer may be in the middle of it). ``RunFollower`` tails every metrics
file of a run directory (new worker and group files appear during a run) and hands each
complete record to ``RunState.add``; ``Replay`` does the same for a finished run, releasing
the records in run-time order up to a horizon that advances ``speed`` times faster than the
wall clock. Both take the time as an argument; neither sleeps.

Invariants: each line is handed over exactly once and only whole; a file that shrinks (a new
run in the same directory) is read again from its start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from minips.dashboard.state import RunState
from minips.run.metrics import read_config, read_jsonl

__all__ = ["Replay", "RunFollower", "Tail", "source_of"]

MAX_READ_BYTES = 4 << 20  # per file and call: a huge backlog is taken in slices, not at once


def source_of(path: Path) -> str | None:
    """``eval`` / ``global`` / ``group`` / ``worker`` for a metrics file name, else None."""
    stem = path.stem
    if stem in ("eval", "global"):
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
