"""One clock for a run's times: training time, from the global server's ``groups`` event (the
workers assigned: training starts) to its ``done`` event (the budget spent). The progress line,
`minips local`'s last line, summary.json's ``train_s`` and the charts' time axes all read it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minips.record.metrics import TrainingClock

pytest.importorskip("matplotlib")


def test_the_clock_counts_start_up_then_training_and_stops_at_done(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"t0": 1000.0}))
    clock = TrainingClock(tmp_path)
    assert clock.text(1002.5) == "start-up 2.5 s"
    with open(tmp_path / "global.jsonl", "w") as f:
        f.write(json.dumps({"t": 3.0, "event": "groups"}) + "\n")
        f.write('{"t": 4.0, "event": "mer')  # half a line: read once whole
    assert clock.text(1005.0) == "training 2.0 s"
    with open(tmp_path / "global.jsonl", "a") as f:
        f.write('ge"}\n' + json.dumps({"t": 9.04, "event": "done"}) + "\n")
    assert clock.text(1020.0) == "training 6.0 s"  # stopped at done, not the wall clock


def test_a_resumes_downtime_is_not_training() -> None:
    """A server killed at 12 s of run time (its last checkpoint at 8 s: 5 s of training) and
    resumed at 20 s: the training time goes on from the checkpoint's, and stops at the done
    event's own clock."""
    clock = TrainingClock()
    for rec in ({"t": 3.0, "event": "groups"}, {"t": 20.0, "event": "resumed", "train_s": 5.0},
                {"t": 30.0, "event": "done", "train_s": 15.0}):
        clock.feed(rec)
    assert [clock.at(t) for t in (1.0, 3.0, 8.0, 12.0, 20.0, 25.0, 30.0, 99.0)] == \
        [0.0, 0.0, 5.0, 9.0, 5.0, 10.0, 15.0, 15.0]


@pytest.mark.timeout(240)
def test_progress_line_done_line_summary_and_charts_agree(tmp_path: Path) -> None:
    from minips.record.plot import figures

    cmd = [sys.executable, "-m", "minips", "local", "--workers", "2", "--slowdown", "1,2",
           "--mode", "ssp", "--epochs", "0.05", "--out", str(tmp_path), "--name", "run"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=200, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    train_s = summary["train_s"]
    progress = re.findall(r"^\[training (\d+\.\d) s\]", out.stderr, re.M)
    done = re.search(r"minips local: done after (\d+\.\d) s of training \(start-up "
                     r"(\d+\.\d) s before it\)", out.stderr)
    assert progress and done, out.stderr[-3000:]
    assert progress[-1] == done.group(1) == f"{train_s:.1f}"
    assert done.group(2) == f"{summary['train_start_s']:.1f}"
    assert summary["wall_s"] == pytest.approx(summary["train_start_s"] + train_s, abs=0.01)
    charts = figures([tmp_path / "run"])
    for name in ("accuracy_vs_time.png", "run-workers.png"):
        xs = [x for line in charts[name].axes[0].get_lines() for x in line.get_xdata()]
        assert min(xs) >= 0 and max(xs) <= train_s + 1e-9, name
    evals = charts["accuracy_vs_time.png"].axes[0].get_lines()[0].get_xdata()
    assert evals[0] == 0 and evals[-1] == pytest.approx(train_s)  # initial and final weights


def test_the_charts_of_a_resumed_run_leave_its_downtime_out(tmp_path: Path) -> None:
    from minips.record.plot import figures
    from minips.record.rundir import RunDir

    rd = RunDir(tmp_path / "resumed", t0=1000.0)
    rd.write_config({"mode": "ssp", "compressor": "none"})
    with rd.writer("global") as gl:
        for rec in ({"t": 3.0, "event": "groups"},
                    {"t": 20.0, "event": "resumed", "train_s": 5.0},
                    {"t": 30.0, "event": "done", "train_s": 15.0}):
            gl.write(rec)
    with rd.writer("eval") as ev:
        for t, acc in ((2.0, 0.1), (7.0, 0.4), (25.0, 0.6), (31.0, 0.7)):
            ev.write({"t": t, "accuracy": acc})
    line = figures([tmp_path / "resumed"])["accuracy_vs_time.png"].axes[0].get_lines()[0]
    assert list(line.get_xdata()) == [0.0, 4.0, 10.0, 15.0]  # 15: summary.json's train_s
