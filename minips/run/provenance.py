"""Where a run's data came from: the real files, or the synthetic stand-in ``data.load_dataset``
falls back to when they are missing (no torch, no sockets).

Every process that loads a data set records it in the run directory as ``data-<role>.json``
(each worker its train split, the evaluator its test split): ``{"role", "dataset", "split",
"synthetic", "source", "reason"}``. ``summarize`` (metrics.py) and the progress line of
`minips local` fold the records into one word with ``verdict``.

Invariant: a run counts as ``"real"`` only when every record says real; one synthetic record
makes it ``"mixed"`` (or ``"synthetic"`` when all are), so a stand-in never goes unnoticed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["record", "read", "verdict"]


def record(run_dir: str | os.PathLike[str], role: str, meta: Mapping[str, Any]) -> Path:
    """Write ``data-<role>.json`` for a data set's ``meta`` (``Dataset.meta``); return its path."""
    path = Path(run_dir) / f"data-{role}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"role": role, "dataset": meta.get("name"), "split": meta.get("split"),
             "synthetic": bool(meta.get("synthetic")), "source": meta.get("source"),
             "reason": meta.get("synthetic_reason", "")}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # a reader never sees half of it
    tmp.write_text(json.dumps(entry, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read(run_dir: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """``{role: record}`` of every ``data-*.json`` in the run directory (unreadable: skipped)."""
    out: dict[str, dict[str, Any]] = {}
    for f in sorted(Path(run_dir).glob("data-*.json")):
        try:
            rec = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict):
            out[f.stem[len("data-"):]] = rec
    return out


def verdict(records: Mapping[str, Mapping[str, Any]]) -> str | None:
    """``"real"``, ``"synthetic"`` or ``"mixed"`` over the records; None when there are none."""
    kinds = {bool(r.get("synthetic")) for r in records.values()}
    if not kinds:
        return None
    if kinds == {False}:
        return "real"
    return "synthetic" if kinds == {True} else "mixed"
