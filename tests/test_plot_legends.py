"""What a person reads on `minips plot`'s charts (minips.record.plot.figures): legends that name
the run and its workers (the top few and "others" for a thousand), a workers chart for a
server's run directory drawn from what the global server recorded, a staleness axis that says
"no staleness", and one time axis, training time, from 0 to summary.json's train_s.

Checked through matplotlib's objects (legend texts, axis limits, tick values), not pixels."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from typing import Any

import pytest

from minips.record.metrics import summarize
from minips.record.plot import LEGEND_WORKERS, figures
from minips.record.rundir import RunDir

pytest.importorskip("matplotlib")

GROUPS_T, DONE_T = 3.0, 9.0  # run time of the groups and done events (s since t0)


def legend(ax: Any) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def write_run(path: Path, *, workers: int = 3, staleness: int = 1, worker_files: bool = True,
              mode: str = "gssp", compressor: str = "none") -> Path:
    """A run as `minips local` writes it: the evaluator scores the initial weights before the
    groups are formed and the final weights after the done event."""
    rd = RunDir(path, t0=1000.0)
    rd.write_config({"mode": mode, "compressor": compressor, "workers": workers})
    with rd.writer("eval") as ev:
        for i, t in enumerate((1.5, 5.0, 7.0, 9.4)):
            ev.write({"t": t, "version": i, "accuracy": 0.1 + 0.2 * i, "bytes_up": 1000 * i})
    with rd.writer("global") as gl:
        gl.write({"t": GROUPS_T, "event": "groups",
                  "assignment": {str(w): w % 2 for w in range(workers)}})
        for k in range(1, 6):
            gl.write({"t": GROUPS_T + k, "event": "merge", "group": 0, "pushes": 2,
                      "pull_workers": [0, 1], "pull_leads": [0, staleness],
                      "pull_waits_us": [0, 500]})
        gl.write({"t": DONE_T, "event": "done", "reason": "epochs"})
    for w in range(workers if worker_files else 0):
        with rd.writer(f"worker-{w}") as wr:
            for c in range(1, 2 + w % 5):
                wr.write({"t": GROUPS_T + c * 1.5, "worker": w, "group": w % 2, "clock": c,
                          "staleness": staleness if c > 1 else 0})
            wr.write({"t": DONE_T + 0.01, "worker": w, "group": w % 2, "clock": 9,
                      "staleness": 0})  # a push in flight when the budget was spent
    return path


def test_legends_name_the_run_not_only_its_mode(tmp_path: Path) -> None:
    a = write_run(tmp_path / "first-try")
    b = write_run(tmp_path / "gssp-gdtopk-2", compressor="gdtopk")
    charts = figures([a, b])
    got = legend(charts["accuracy_vs_time.png"].axes[0])
    assert got == ["first-try (gssp/none)", "gssp-gdtopk-2"]  # a name holding both: as it is
    assert "first-try" in charts["first-try-workers.png"].axes[0].get_title()


def test_a_servers_run_directory_gets_a_workers_chart_from_its_merge_lines(tmp_path: Path) -> None:
    """Workers on other machines leave no worker file here: the chart draws each worker's
    PULLs its group answered and their lead, as the global server's merge lines say."""
    run = write_run(tmp_path / "server", worker_files=False, staleness=2)
    fig = figures([run])["server-workers.png"]
    clock, stale = fig.axes[0], fig.axes[1]
    assert legend(clock) == ["w0 (g0)", "w1 (g0)"]
    assert clock.get_ylabel() == "PULLs answered" and "global server" in clock.get_title()
    ys = {line.get_label(): list(line.get_ydata()) for line in clock.get_lines()}
    assert ys["w0 (g0)"] == [1, 2, 3, 4, 5]
    assert max(max(line.get_ydata()) for line in stale.get_lines()) == 2


def test_a_thousand_workers_get_a_short_legend_and_no_warning(tmp_path: Path) -> None:
    run = write_run(tmp_path / "big", workers=1000)
    gc.collect()  # what an earlier test left for the collector warns now, not inside the block
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = figures([run])["big-workers.png"]
        fig.savefig(tmp_path / "big.png", dpi=50)  # constrained layout runs when drawn
    names = legend(fig.axes[0])
    assert len(names) == LEGEND_WORKERS + 1
    assert names[-1] == f"{1000 - LEGEND_WORKERS} other workers"
    assert not [str(w.message) for w in caught]


def test_a_staleness_panel_with_only_zeros_starts_at_0_and_says_so(tmp_path: Path) -> None:
    fig = figures([write_run(tmp_path / "bsp", staleness=0, mode="bsp")])["bsp-workers.png"]
    stale = fig.axes[1]
    low, high = stale.get_ylim()
    assert low == 0 and high >= 1
    assert all(float(t).is_integer() for t in stale.get_yticks())
    assert any("no staleness" in t.get_text() for t in stale.texts)
    busy = figures([write_run(tmp_path / "ssp", staleness=3)])["ssp-workers.png"].axes[1]
    assert busy.get_ylim()[0] == 0 and not busy.texts


def test_every_time_axis_is_training_time_from_0_to_train_s(tmp_path: Path) -> None:
    """The initial weights' score (before the groups) is at 0, the final weights' (after done)
    and a push in flight at the end: train_s of summary.json, the same clock."""
    run = write_run(tmp_path / "r")
    train_s = summarize(run, write=False)["train_s"]
    assert train_s == pytest.approx(DONE_T - GROUPS_T)
    charts = figures([run])
    xs = list(charts["accuracy_vs_time.png"].axes[0].get_lines()[0].get_xdata())
    assert xs == pytest.approx([0.0, 5.0 - GROUPS_T, 7.0 - GROUPS_T, train_s])
    workers = [x for line in charts["r-workers.png"].axes[0].get_lines() for x in line.get_xdata()]
    assert min(workers) >= 0 and max(workers) == pytest.approx(train_s)
