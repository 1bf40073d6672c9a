"""`minips local`'s progress line: time, epochs, merges, test accuracy and the MB of every hop,
read from the tails of the run directory's files (redrawn in place on a terminal, a line every
10 s in a log).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from minips.errors import MiniPSError
from minips.ml.model_table import dataset_train_size
from minips.run import metrics, provenance
from minips.run.config import LaunchConfig
from minips.run.rundir import tail_jsonl

__all__ = ["ProgressLine"]


class ProgressLine:
    """One self-overwriting status line: time, samples / epochs, accuracy, and the MB of every
    hop: up (worker -> group), down (group -> worker), to-global, from-global, total."""

    def __init__(self, run_dir: Path, cfg: LaunchConfig) -> None:
        self.run_dir = run_dir
        self.cfg = cfg
        self.t0 = time.monotonic()
        self.last = 0.0  # when the line was last drawn
        self.train_size = max(1, _train_size(cfg))  # samples per epoch, for the epochs figure
        self.tty = sys.stderr.isatty()  # a terminal: redraw in place; a log: a line every 10 s

    def draw(self, final: bool = False) -> None:
        if not (final or self.tty or time.monotonic() - self.last >= 10.0):
            return  # in a log file: one line every 10 s
        self.last = time.monotonic()
        ev = _last_record(self.run_dir / "eval.jsonl")
        gl = _last_record(self.run_dir / "global.jsonl")
        samples = int(gl.get("samples", 0) or 0)
        epochs = samples / self.train_size
        acc = ev.get("accuracy")
        acc_s = f"{100 * acc:5.1f}%" if isinstance(acc, (int, float)) else "  -  "
        hops = metrics.live_hop_bytes(self.run_dir) or {  # before any group file: the server's
            "bytes_worker_group": gl.get("bytes_up", 0) or 0,
            "bytes_group_worker": gl.get("bytes_down", 0) or 0}
        mb = {k: hops.get(k, 0) / 1e6 for k in metrics.HOP_COUNTERS}
        kind = provenance.verdict(provenance.read(self.run_dir))  # None until a process loaded
        data_s = "SYNTHETIC DATA" if kind in ("synthetic", "mixed") else f"data {kind or '?'}"
        text = (f"[{time.monotonic() - self.t0:6.1f} s] {self.cfg.run.mode}/"
                f"{self.cfg.run.compressor}  {data_s}  epochs {epochs:5.2f}  merges "
                f"{gl.get('version', 0):>5}  test acc {acc_s}  MB up {mb['bytes_worker_group']:.1f}"
                f" down {mb['bytes_group_worker']:.1f} to-global {mb['bytes_group_global']:.1f} "
                f"from-global {mb['bytes_global_group']:.1f} total {sum(mb.values()):.1f}")
        print("\r" + text if self.tty else text, end="\n" if final or not self.tty else "",
              flush=True, file=sys.stderr)


def _train_size(cfg: LaunchConfig) -> int:
    try:
        return dataset_train_size(cfg.run.dataset, cfg.run.train_size)
    except MiniPSError:
        return 1


def _last_record(path: Path) -> dict[str, Any]:
    """The last complete JSON line of a file ({} when none), reading only its tail."""
    return (tail_jsonl(path, 8192) or [{}])[-1]
