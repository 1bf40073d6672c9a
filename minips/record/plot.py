"""PNG charts from run directories (matplotlib, Agg backend, imported only when drawing).

``plot_runs(run_dirs, out_dir)`` reads each run with ``metrics.load_run`` and writes:

- ``accuracy_vs_time.png``: test accuracy against wall time since training started (the
  ``groups`` event; start-up is left out), one line per run, labelled ``mode/compressor``;
- ``accuracy_vs_bytes.png``: test accuracy against the bytes workers uploaded (log axis when
  the runs span more than 100x, as dense and sparse runs do);
- ``accuracy_vs_total_bytes.png``: test accuracy against the bytes of every hop so far (worker
  <-> group and group <-> global, ``metrics.total_bytes_series`` from the group files; runs
  without group files are left out);
- ``<run>-ratios.png`` for each GDTopK run: each group's kept fraction over time (the
  ``groups`` event's ratios, then every ``ratios`` event) above the smoothed iteration times
  the policy followed;
- ``<run>-workers.png`` for each run: every worker's clock and staleness over time, which
  shows who waited for whom and how far apart the groups drifted; when a worker's emulated
  slowdown changed during the run (a ``--slowdown`` schedule, ``--throttle``: the step
  records' ``slowdown``), a third panel with each worker's factor, and with ``--mode lbbsp``
  one with each worker's samples per step.

A chart with nothing to draw is not written. Figures are built with ``matplotlib.figure.Figure``
(no pyplot global state), small (dpi 100), so a server process can draw without a display.
"""

from __future__ import annotations

import bisect
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from minips.record.metrics import Run, load_run, total_bytes_series

__all__ = ["plot_runs", "plot_run", "DPI"]


DPI = 100  # keeps a chart around 30-80 KB
SIZE = (7.0, 4.5)  # inches


def _figure(rows: int = 1, height: float = SIZE[1]) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure  # lazy: servers never need matplotlib

    fig = Figure(figsize=(SIZE[0], height), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, list(axes)


def _labels(runs: Sequence[Run]) -> list[str]:
    """``mode/compressor`` per run, with the directory name added where two would clash."""
    plain = [r.label for r in runs]
    return [f"{lab} ({r.path.name})" if plain.count(lab) > 1 else lab
            for lab, r in zip(plain, runs, strict=True)]


def _series(records: list[dict[str, Any]], x: str, y: str,
            x0: float = 0.0) -> tuple[list[float], list[float]]:
    """The (x - x0, y) pairs of records that have both as numbers."""
    pairs = [(r.get(x), r.get(y)) for r in records]
    ok = [(a, b) for a, b in pairs if isinstance(a, (int, float)) and isinstance(b, (int, float))]
    return [float(a) - x0 for a, _ in ok], [float(b) for _, b in ok]


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    return path


def _accuracy_chart(runs: Sequence[Run], x: str, xlabel: str, path: Path) -> Path | None:
    fig, (ax,) = _figure()
    drawn: list[float] = []
    for run, label in zip(runs, _labels(runs), strict=True):
        xs, ys = _series(run.eval, x, "accuracy", run.start_t if x == "t" else 0.0)
        if x.startswith("bytes"):
            xs = [v / 1e6 for v in xs]  # MB
        if xs:
            ax.plot(xs, ys, marker=".", label=label)
            drawn += xs
    return _finish_accuracy(fig, ax, drawn, xlabel, f"Accuracy vs {xlabel.split(' (')[0]}", path)


def _total_bytes_chart(runs: Sequence[Run], path: Path) -> Path | None:
    """Accuracy against the MB of every hop so far, read off each evaluation's time."""
    fig, (ax,) = _figure()
    drawn: list[float] = []
    for run, label in zip(runs, _labels(runs), strict=True):
        series = total_bytes_series(run.groups)
        if not series:
            continue
        times = [t for t, _ in series]
        ts, accs = _series(run.eval, "t", "accuracy")
        xs = [series[i - 1][1] / 1e6 if (i := bisect.bisect_right(times, t)) else 0.0
              for t in ts]
        ax.plot(xs, accs, marker=".", label=label)
        drawn += xs
    return _finish_accuracy(fig, ax, drawn, "MB on every hop (worker <-> group, group <-> global)",
                            "Accuracy vs total bytes", path)


def _finish_accuracy(fig: Any, ax: Any, drawn: list[float], xlabel: str, title: str,
                     path: Path) -> Path | None:
    """Label an accuracy chart and save it (None when nothing was drawn); a log x axis when
    the x values span more than 100x (dense and sparse runs side by side)."""
    if not drawn:
        return None
    positive = [v for v in drawn if v > 0]
    if positive and max(positive) > 100 * min(positive):
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel="test accuracy", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def _event_points(run: Run, key: str) -> dict[str, tuple[list[float], list[float]]]:
    """``{group: (times since the training start, values)}`` of the ``{group: value}`` map
    ``key`` of the ``groups`` and ``ratios`` events."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for r in run.events:
        t = r.get("t")
        if r.get("event") in ("groups", "ratios") and isinstance(t, (int, float)):
            for g, v in (r.get(key) or {}).items():
                if isinstance(v, (int, float)):
                    xs, ys = out.setdefault(str(g), ([], []))
                    xs.append(float(t) - run.start_t)
                    ys.append(float(v))
    return out


def _ratios_chart(run: Run, label: str, path: Path) -> Path | None:
    """GDTopK ratio per group over time, and the iteration times it followed (only for runs
    whose ratios the GDTopK policy set)."""
    ratios = _event_points(run, "ratios")
    if not ratios or run.config.get("compressor") != "gdtopk":
        return None
    fig, (ax_r, ax_t) = _figure(rows=2, height=6.0)
    end = max([x for xs, _ in ratios.values() for x in xs]
              + _series(run.eval, "t", "accuracy", run.start_t)[0])
    for g, (xs, ys) in sorted(ratios.items()):
        ax_r.step(xs + [end], [100 * y for y in ys + ys[-1:]], where="post", label=f"group {g}")
    for g, (xs, ys) in sorted(_event_points(run, "iter_time").items()):
        ax_t.plot(xs, ys, marker=".", label=f"group {g}")
    ax_r.set(ylabel="kept fraction (%)", title=f"GDTopK ratio per group over time: {label}")
    ax_t.set(ylabel="iteration time (s, smoothed)", xlabel="training time (s)")
    for ax in (ax_r, ax_t):
        ax.grid(alpha=0.3)
    ax_r.legend(fontsize="small")
    return _save(fig, path)


def _changing(run: Run, key: str) -> bool:
    """Some worker's step records hold more than one value of ``key``."""
    return any(len({r[key] for r in recs if key in r}) > 1 for recs in run.workers.values())


def _workers_chart(run: Run, label: str, path: Path) -> Path | None:
    if not any(run.workers.values()):
        return None
    extra = [k for k in ("slowdown", "samples") if _changing(run, k)]
    fig, axes = _figure(rows=2 + len(extra), height=6.0 + 2.5 * len(extra))
    ax_clock, ax_stale = axes[0], axes[1]
    for w, records in sorted(run.workers.items(), key=lambda kv: str(kv[0])):
        group = next((r.get("group") for r in records if r.get("group") is not None), None)
        name = f"w{w}" + (f" (g{group})" if group is not None else "")
        ax_clock.plot(*_series(records, "t", "clock", run.start_t), label=name, lw=1.2)
        ax_stale.plot(*_series(records, "t", "staleness", run.start_t), lw=1.0,
                      drawstyle="steps-post")
        for ax, key in zip(axes[2:], extra, strict=True):
            ax.plot(*_series(records, "t", key, run.start_t), lw=1.0, drawstyle="steps-post")
    ax_clock.set(ylabel="clock (pushes)", title=f"Workers of {label}")
    ax_stale.set(ylabel="staleness (steps)")
    names = {"slowdown": "emulated slowdown F", "samples": "samples per step (LB-BSP)"}
    for ax, key in zip(axes[2:], extra, strict=True):
        ax.set(ylabel=names[key])
    axes[-1].set(xlabel="training time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    ax_clock.legend(fontsize="x-small", ncol=4)
    return _save(fig, path)


def _unique_names(runs: Sequence[Run]) -> list[str]:
    names = [r.path.resolve().name or "run" for r in runs]
    return [f"{i}-{n}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def plot_runs(run_dirs: Iterable[str | os.PathLike[str]],
              out_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Draw the charts of the module docstring; return the paths of the PNGs written.

    ``out_dir`` defaults to the first run directory; it is created if needed.
    """
    runs = [load_run(d) for d in run_dirs]
    if not runs:
        return []
    out = Path(out_dir) if out_dir is not None else runs[0].path
    out.mkdir(parents=True, exist_ok=True)
    written = [
        _accuracy_chart(runs, "t", "training time (s)", out / "accuracy_vs_time.png"),
        _accuracy_chart(runs, "bytes_up", "bytes uploaded (MB)", out / "accuracy_vs_bytes.png"),
        _total_bytes_chart(runs, out / "accuracy_vs_total_bytes.png"),
    ]
    labels = _labels(runs)
    for run, label, name in zip(runs, labels, _unique_names(runs), strict=True):
        written.append(_ratios_chart(run, label, out / f"{name}-ratios.png"))
        written.append(_workers_chart(run, label, out / f"{name}-workers.png"))
    return [p for p in written if p is not None]


def plot_run(run_dir: str | os.PathLike[str], who: str) -> list[str]:
    """The charts `minips local` and `minips simulate` draw at the end of a run: their paths,
    or none (said on stderr, as ``who``) without matplotlib, the `plot` extra."""
    try:
        return [str(p) for p in plot_runs([run_dir])]
    except ImportError as exc:
        print(f"{who}: no plots ({exc})", file=sys.stderr)
        return []
