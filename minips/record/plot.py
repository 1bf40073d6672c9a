"""PNG charts from run directories (matplotlib, Agg backend, imported only when drawing).

``figures(run_dirs)`` builds the charts (``{file name: Figure}``); ``plot_runs(run_dirs,
out_dir)`` writes them as PNGs:

- ``accuracy_vs_time.png``: test accuracy against training time, one line per run;
- ``accuracy_vs_bytes.png``: test accuracy against the bytes workers uploaded (log axis when
  the runs span more than 100x, as dense and sparse runs do);
- ``accuracy_vs_total_bytes.png``: test accuracy against the bytes of every hop so far (worker
  <-> group and group <-> global, ``metrics.total_bytes_series`` from the group files; runs
  without group files are left out);
- ``<run>-ratios.png`` for each GDTopK run: each group's kept fraction over time (the
  ``groups`` event's ratios, then every ``ratios`` event) above the smoothed iteration times
  the policy followed;
- ``<run>-workers.png`` for each run: every worker's clock and staleness over time, which
  shows who waited for whom and how far apart the groups drifted. From the workers' own files;
  a server's run directory without them (workers on other machines) draws what the global
  server recorded instead: each worker's PULLs its group answered and their lead, from the
  ``merge`` lines. When a worker's emulated slowdown changed during the run (a ``--slowdown``
  schedule, ``--throttle``: the step records' ``slowdown``), a third panel with each worker's
  factor, and with ``--mode lbbsp`` one with each worker's samples per step.

Time is the run's one clock (docs/dashboard.md, "Times"; ``metrics.TrainingClock``):
training time, seconds from the ``groups`` event (the workers assigned to groups: training
starts) to the ``done`` event (the budget spent), as summary.json's ``train_s`` counts it; a
resumed server's downtime is not training. A point before the start (the evaluator scores
the initial weights) is drawn at 0, one after the end (the final weights' score, the last
pushes in flight) at the end, so every chart's time axis runs from 0 to ``train_s``.

Legends name the run: its directory name, with ``mode/compressor`` where the name does not
already hold both. A workers chart with more than ``LEGEND_WORKERS`` workers names that many
(spread from the most steps to the fewest) and draws the others in grey as one entry. A
staleness panel starts at 0 with integer ticks, and says "no staleness" when every value was 0.

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

from minips.record.metrics import Run, TrainingClock, load_run, total_bytes_series
from minips.record.rundir import num

__all__ = ["DPI", "LEGEND_WORKERS", "figures", "plot_runs", "plot_run", "run_label",
           "training_clock"]


DPI = 100  # keeps a chart around 30-80 KB
SIZE = (7.0, 4.5)  # inches
LEGEND_WORKERS = 8  # a workers chart names at most this many workers; the rest are "others"
OTHERS_COLOR = "0.75"  # grey: the workers the legend does not name


def _figure(rows: int = 1, height: float = SIZE[1]) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure  # lazy: servers never need matplotlib

    fig = Figure(figsize=(SIZE[0], height), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, list(axes)


def run_label(run: Run) -> str:
    """The run's name in a legend: its directory name, and ``mode/compressor`` unless the name
    holds both already (``gssp-gdtopk-...``)."""
    name = run.path.resolve().name or "run"
    parts = [str(run.config.get(k) or "") for k in ("mode", "compressor")]
    if not parts[0] or all(p and p in name for p in parts):
        return name
    return f"{name} ({run.label})"


def _labels(runs: Sequence[Run]) -> list[str]:
    """``run_label`` per run, numbered where two would read the same."""
    plain = [run_label(r) for r in runs]
    return [f"{i}: {lab}" if plain.count(lab) > 1 else lab for i, lab in enumerate(plain)]


def training_clock(run: Run) -> TrainingClock:
    """The run's clock (metrics.TrainingClock) from its global.jsonl events."""
    clock = TrainingClock()
    for r in run.events:
        clock.feed(r)
    return clock


def _series(records: list[dict[str, Any]], x: str, y: str,
            clock: TrainingClock | None = None) -> tuple[list[float], list[float]]:
    """The (x, y) pairs of records that have both as numbers; with ``clock``, x (run time) as
    training time."""
    pairs = [(num(r.get(x)), num(r.get(y))) for r in records]
    ok = [(a, b) for a, b in pairs if a is not None and b is not None]
    xs = [a if clock is None else clock.at(a) for a, _ in ok]
    return xs, [b for _, b in ok]


def _accuracy_chart(runs: Sequence[Run], x: str, xlabel: str) -> Any | None:
    fig, (ax,) = _figure()
    drawn: list[float] = []
    for run, label in zip(runs, _labels(runs), strict=True):
        xs, ys = _series(run.eval, x, "accuracy", training_clock(run) if x == "t" else None)
        if x.startswith("bytes"):
            xs = [v / 1e6 for v in xs]  # MB
        if xs:
            ax.plot(xs, ys, marker=".", label=label)
            drawn += xs
    return _finish_accuracy(fig, ax, drawn, xlabel, f"Accuracy vs {xlabel.split(' (')[0]}")


def _total_bytes_chart(runs: Sequence[Run]) -> Any | None:
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
                            "Accuracy vs total bytes")


def _finish_accuracy(fig: Any, ax: Any, drawn: list[float], xlabel: str, title: str) -> Any | None:
    """Label an accuracy chart (None when nothing was drawn); a log x axis when the x values
    span more than 100x (dense and sparse runs side by side)."""
    if not drawn:
        return None
    positive = [v for v in drawn if v > 0]
    if positive and max(positive) > 100 * min(positive):
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel="test accuracy", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def _event_points(run: Run, key: str) -> dict[str, tuple[list[float], list[float]]]:
    """``{group: (training times, values)}`` of the ``{group: value}`` map ``key`` of the
    ``groups`` and ``ratios`` events."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    clock = training_clock(run)
    for r in run.events:
        if r.get("event") not in ("groups", "ratios"):
            continue
        for g, v in (r.get(key) or {}).items():
            xs, ys = _series([{"t": r.get("t"), "v": v}], "t", "v", clock)
            if xs:
                got = out.setdefault(str(g), ([], []))
                got[0].extend(xs)
                got[1].extend(ys)
    return out


def _ratios_chart(run: Run, label: str) -> Any | None:
    """GDTopK ratio per group over time, and the iteration times it followed (only for runs
    whose ratios the GDTopK policy set)."""
    ratios = _event_points(run, "ratios")
    if not ratios or run.config.get("compressor") != "gdtopk":
        return None
    fig, (ax_r, ax_t) = _figure(rows=2, height=6.0)
    end = max([x for xs, _ in ratios.values() for x in xs]
              + _series(run.eval, "t", "accuracy", training_clock(run))[0])
    for g, (xs, ys) in sorted(ratios.items()):
        ax_r.step(xs + [end], [100 * y for y in ys + ys[-1:]], where="post", label=f"group {g}")
    for g, (xs, ys) in sorted(_event_points(run, "iter_time").items()):
        ax_t.plot(xs, ys, marker=".", label=f"group {g}")
    ax_r.set(ylabel="kept fraction (%)", title=f"GDTopK ratio per group over time: {label}")
    ax_t.set(ylabel="iteration time (s, smoothed)", xlabel="training time (s)")
    for ax in (ax_r, ax_t):
        ax.grid(alpha=0.3)
    ax_r.legend(fontsize="small")
    return fig


def _changing(workers: dict[Any, list[dict[str, Any]]], key: str) -> bool:
    """Some worker's step records hold more than one value of ``key``."""
    return any(len({r[key] for r in recs if key in r}) > 1 for recs in workers.values())


def _seen_by_server(run: Run) -> dict[Any, list[dict[str, Any]]]:
    """Per worker, what the global server's ``merge`` lines say of it (a run directory without
    worker files): one record per PULL its group answered, ``clock`` = PULLs so far,
    ``staleness`` = its lead over the group's slowest worker, ``t`` = the merge's time."""
    out: dict[Any, list[dict[str, Any]]] = {}
    for r in run.events:
        cols = [r.get(k) for k in ("pull_workers", "pull_leads")]
        if r.get("event") != "merge" or not all(isinstance(c, list) for c in cols):
            continue
        for w, lead in zip(*cols, strict=False):
            recs = out.setdefault(w, [])
            recs.append({"t": r.get("t"), "clock": len(recs) + 1, "staleness": lead,
                         "group": r.get("group")})
    return out


def _named(workers: dict[Any, list[dict[str, Any]]]) -> list[Any]:
    """The workers a legend names: all of them up to ``LEGEND_WORKERS``, else that many spread
    over the ranking by steps (the most, the fewest and evenly between)."""
    ranked = sorted(workers, key=lambda w: (-len(workers[w]), str(w)))
    if len(ranked) <= LEGEND_WORKERS:
        return ranked
    step = (len(ranked) - 1) / (LEGEND_WORKERS - 1)
    return [ranked[round(i * step)] for i in range(LEGEND_WORKERS)]


def _workers_chart(run: Run, label: str) -> Any | None:
    workers, source = run.workers, "clock (pushes)"
    if not any(workers.values()):
        workers, source = _seen_by_server(run), "PULLs answered"
    if not any(workers.values()):
        return None
    extra = [k for k in ("slowdown", "samples") if _changing(workers, k)]
    fig, axes = _figure(rows=2 + len(extra), height=6.0 + 2.5 * len(extra))
    named, clock = _named(workers), training_clock(run)
    for w, records in sorted(workers.items(), key=lambda kv: str(kv[0])):
        _draw_worker(axes, extra, w, records, clock, w in named)
    ax_clock, ax_stale = axes[0], axes[1]
    seen = " (as the global server saw them)" if source == "PULLs answered" else ""
    ax_clock.set(ylabel=source, title=f"Workers of {label}{seen}")
    _staleness_axis(ax_stale, workers)
    names = {"slowdown": "emulated slowdown F", "samples": "samples per step (LB-BSP)"}
    for ax, key in zip(axes[2:], extra, strict=True):
        ax.set(ylabel=names[key])
    axes[-1].set(xlabel="training time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    _workers_legend(ax_clock, len(workers) - len(named))
    return fig


def _draw_worker(axes: list[Any], extra: list[str], w: Any, records: list[dict[str, Any]],
                 clock: TrainingClock, named: bool) -> None:
    """One worker's lines on every panel: in its own colour when the legend names it, else
    thin and grey."""
    group = next((r.get("group") for r in records if r.get("group") is not None), None)
    style: dict[str, Any] = {"lw": 1.2} if named else {"lw": 0.6, "color": OTHERS_COLOR,
                                                         "zorder": 1}
    name = f"w{w}" + (f" (g{group})" if group is not None else "")
    (line,) = axes[0].plot(*_series(records, "t", "clock", clock), label=name if named else None,
                           **style)
    style["color"] = line.get_color()  # the same colour on every panel
    for ax, key in zip(axes[1:], ["staleness", *extra], strict=True):
        ax.plot(*_series(records, "t", key, clock), drawstyle="steps-post", **style)


def _staleness_axis(ax: Any, workers: dict[Any, list[dict[str, Any]]]) -> None:
    """From 0, integer ticks; "no staleness" said when every value was 0."""
    from matplotlib.ticker import MaxNLocator

    top = max((v for recs in workers.values() for v in _series(recs, "t", "staleness")[1]),
              default=0.0)
    ax.set_ylim(0, max(1.0, top) * 1.05)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(ylabel="staleness (steps)")
    if top == 0:
        ax.text(0.5, 0.5, "no staleness: every pull was at its group's slowest clock",
                transform=ax.transAxes, ha="center", va="center", color="0.35")


def _workers_legend(ax: Any, others: int) -> None:
    """The named workers, then one grey entry for the others."""
    from matplotlib.lines import Line2D

    handles, labels = ax.get_legend_handles_labels()
    if others:
        handles.append(Line2D([], [], color=OTHERS_COLOR, lw=1.0))
        labels.append(f"{others} other workers")
    ax.legend(handles, labels, fontsize="x-small", ncol=min(3, len(labels)), loc="upper left")


def _unique_names(runs: Sequence[Run]) -> list[str]:
    names = [r.path.resolve().name or "run" for r in runs]
    return [f"{i}-{n}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def figures(run_dirs: Iterable[str | os.PathLike[str]]) -> dict[str, Any]:
    """The charts of the module docstring, ``{PNG file name: matplotlib Figure}``; a chart with
    nothing to draw is left out."""
    runs = [load_run(d) for d in run_dirs]
    if not runs:
        return {}
    out = {
        "accuracy_vs_time.png": _accuracy_chart(runs, "t", "training time (s)"),
        "accuracy_vs_bytes.png": _accuracy_chart(runs, "bytes_up", "bytes uploaded (MB)"),
        "accuracy_vs_total_bytes.png": _total_bytes_chart(runs),
    }
    for run, label, name in zip(runs, _labels(runs), _unique_names(runs), strict=True):
        out[f"{name}-ratios.png"] = _ratios_chart(run, label)
        out[f"{name}-workers.png"] = _workers_chart(run, label)
    return {k: f for k, f in out.items() if f is not None}


def plot_runs(run_dirs: Iterable[str | os.PathLike[str]],
              out_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Write ``figures`` as PNGs; return their paths.

    ``out_dir`` defaults to the first run directory; it is created if needed.
    """
    dirs = list(run_dirs)
    charts = figures(dirs)
    if not dirs:
        return []
    out = Path(out_dir) if out_dir is not None else Path(dirs[0])
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in charts.items():
        fig.savefig(out / name, dpi=DPI)
        written.append(out / name)
    return written


def plot_run(run_dir: str | os.PathLike[str], who: str) -> list[str]:
    """The charts `minips local` and `minips simulate` draw at the end of a run: their paths,
    or none (said on stderr, as ``who``) without matplotlib, the `plot` extra."""
    try:
        return [str(p) for p in plot_runs([run_dir])]
    except ImportError as exc:
        print(f"{who}: no plots ({exc})", file=sys.stderr)
        return []
