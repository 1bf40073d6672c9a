"""Bytes per hop of a run, from its group files.

Bytes per hop. ``summarize`` (and ``live_hop_bytes``, for the progress line) count every hop
a run's bytes travel, from the group files: worker -> group (``bytes_worker_group``, the group
servers' ``bytes_in``), group -> worker (``bytes_group_worker``, ``bytes_out``), group -> global
(``bytes_group_global``, ``bytes_to_global``) and global -> group (``bytes_global_group``,
``bytes_from_global``), and ``bytes_total``, their sum. These are running totals per group; one
that drops (a restarted group process) is added up segment by segment. ``bytes_up`` /
``bytes_down`` keep their old meaning: the worker <-> group hop only, as the evaluator saw it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from minips.run.rundir import num, tail_jsonl

__all__ = ["HOP_COUNTERS", "HOPS", "hop_bytes", "total_bytes_series", "live_hop_bytes"]


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


def live_hop_bytes(run_dir: str | os.PathLike[str]) -> dict[str, int] | None:
    """``hop_bytes`` of a running run from the tails of its group files (None before any); a
    restart older than the tail is not seen (a progress display's figure, not the summary's)."""
    files = sorted(Path(run_dir).glob("group-*.jsonl"))
    return hop_bytes({f.stem: tail_jsonl(f) for f in files}) if files else None
