"""What the server's console says of a run whose groups and workers are on other machines: the
progress line's bytes and data columns filled from what the global server counts, a regroup as
a sentence, and a worker that refused to start without its data named as such, not as a lost
connection."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import minips_server, records, wait_for

from minips.core.config import RunConfig
from minips.core.global_core import GlobalCore
from minips.net import lifeline
from minips.record.metrics import summarize
from minips.run.launch import ProgressLine
from minips.server import console_line

TOKEN = "console-secret-0123456789abcdef"


def write_lines(path: Path, recs: list[dict]) -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))


def merge(t: float, g: int, to_global: float, from_global: float) -> dict:
    """A merge line of the global server for group ``g`` (a `minips group` elsewhere): the
    group's running counters of both hops, as its EXCHANGE carried them, and the ledger's
    figures every line of the global server carries (one group: the same numbers)."""
    figures = {"bytes_worker_group": int(1e6 * t), "bytes_group_worker": int(3e6 * t),
               "bytes_group_global": int(to_global), "bytes_global_group": int(from_global)}
    return {"t": t, "event": "merge", "group": g, "version": int(t), "samples": int(640 * t),
            "bytes_in": int(1e6 * t), "bytes_out": int(3e6 * t),
            "bytes_to_global": int(to_global), "bytes_from_global": int(from_global),
            **figures, "bytes_total": sum(figures.values())}


def remote_run(root: Path) -> Path:
    """A server's run directory with one external group: no group file, no data file here."""
    (root / "config.json").write_text(json.dumps({"t0": 0.0, "mode": "gssp",
                                                  "compressor": "none", "workers": 2}))
    write_lines(root / "global.jsonl", [
        {"t": 0.5, "event": "joined", "worker": 0},
        {"t": 1.0, "event": "groups", "assignment": {"0": 0, "1": 0}}])
    return root


def progress(line: ProgressLine, capsys: pytest.CaptureFixture[str]) -> str:
    line.draw(final=True)
    return capsys.readouterr().err


def test_progress_line_reads_the_figures_the_servers_last_line_carries(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The group writes its file on its own machine: the line said to-global 0.0 from-global
    0.0 all run (the server's /metrics had 92.9 MB), then counted the merges' tail and fell
    after a reconnect; now it shows the ledger's figures (record/ledger.py), as summary.json."""
    run_dir = remote_run(tmp_path)
    line = ProgressLine(run_dir, RunConfig(mode="gssp", compressor="none"), tty=False)
    write_lines(run_dir / "global.jsonl", [merge(2.0, 0, 40e6, 50e6), merge(4.0, 0, 80e6, 92.9e6)])
    text = progress(line, capsys)
    assert "to-global 80.0 from-global 92.9" in text, text
    assert "MB up 4.0 down 12.0" in text and "total 188.9" in text, text
    s = summarize(run_dir, write=False)
    assert (s["bytes_group_global"], s["bytes_total"]) == (80_000_000, 188_900_000)


def test_the_runs_last_line_is_not_drawn_twice(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`make demo` ended with two identical `[training 45.2 s] ...` lines: the line of the
    last period, then the final one. The final one is drawn only when it says something new."""
    run_dir = remote_run(tmp_path)
    line = ProgressLine(run_dir, RunConfig(mode="gssp", compressor="none"), tty=False)
    write_lines(run_dir / "global.jsonl", [merge(2.0, 0, 40e6, 50e6)])
    line.draw()
    first = capsys.readouterr().err
    assert "to-global 40.0" in first, first
    assert progress(line, capsys) == ""
    write_lines(run_dir / "global.jsonl", [merge(4.0, 0, 80e6, 92.9e6)])
    assert "to-global 80.0" in progress(line, capsys)


def test_the_data_column_says_what_remote_workers_reported(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It read `data ?` all run for workers on other machines (their data-*.json is there,
    their report in global.jsonl was not read): now 'loading' until a report, then what the
    reports say, also once the report is far behind the file's tail."""
    run_dir = remote_run(tmp_path)
    line = ProgressLine(run_dir, RunConfig(), tty=False)
    assert "data loading" in progress(line, capsys)
    write_lines(run_dir / "global.jsonl", [
        {"t": 1.2, "event": "data", "worker": w, "dataset": "fashion-mnist", "split": "train",
         "synthetic": False, "source": "/data", "reason": ""} for w in (0, 1)])
    write_lines(run_dir / "global.jsonl", [merge(2.0 + i, 0, 1e5 * i, 1e5 * i)
                                           for i in range(2000)])  # reports long past the tail
    assert "data real" in progress(line, capsys)
    write_lines(run_dir / "global.jsonl", [
        {"t": 9.0, "event": "data", "worker": 2, "dataset": "fashion-mnist", "split": "train",
         "synthetic": True, "source": "", "reason": "no files"}])
    assert "SYNTHETIC DATA" in progress(line, capsys)


def test_a_regroup_reads_as_a_sentence() -> None:
    """It read `regroup: worker -> group {'1': 1}`."""
    core = GlobalCore(RunConfig(workers=2), None, regroup=True, wall=lambda: 0.0)
    assert console_line(core, "regroup", {"moved": {"1": 1}}) == \
        "regrouped by speed: worker 1 moves to group 1"
    assert console_line(core, "rehomed", {"group": 2, "moved": {"3": 0, "5": 1}}) == \
        "group 2 lost: worker 3 moves to group 0, worker 5 moves to group 1"


@pytest.mark.timeout(120)
def test_a_worker_without_its_data_is_named_on_the_server_as_refused(tmp_path: Path) -> None:
    """A worker whose data set is not on its machine refuses to start (exit 2); the server's
    record and console line said only 'left (connection lost)': now its LEAVE carries why."""
    env = lifeline.child_env({**os.environ, "MINIPS_TOKEN": TOKEN,
                              "MINIPS_CACHE_DIR": str(tmp_path / "cache"),  # nothing there
                              "MINIPS_DATA_MIRROR": (tmp_path / "no-mirror").as_uri() + "/"})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with minips_server(run_dir, TOKEN, "--workers", "1", "--dataset", "mnist",
                       "--data-dir", str(tmp_path / "none"), "--max-steps", "1") as (
            server, _, port):
        worker = subprocess.run(
            [sys.executable, "-m", "minips", "worker", "--connect", f"127.0.0.1:{port}",
             "--run-dir", str(tmp_path / "w"), "--device", "cpu"],
            env=env, capture_output=True, text=True, timeout=90)
        assert worker.returncode == 2, worker.stderr
        assert "--data synthetic" in worker.stderr
        (left,) = wait_for("the server logs the worker's leaving", lambda: records(
            run_dir / "global.jsonl", event="left"), 30, (server,))
    assert left["reason"].startswith("refused to start: "), left
    assert "--data synthetic" in left["reason"]
    core = GlobalCore(RunConfig(workers=1), None, regroup=True, wall=lambda: 0.0)
    said = console_line(core, "left", left)
    assert said is not None and re.match(r"worker 0 left \(refused to start: .*mnist", said), said
    assert "connection lost" not in said
