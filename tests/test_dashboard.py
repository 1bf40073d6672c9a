"""The dashboard end to end: a short real `minips local` run with --dashboard and --tensorboard.

While it trains, Prometheus' own text parser reads /metrics, and a real headless Chromium
(Debian's chromium and chromium-driver through Selenium) opens the page and waits until it shows
two groups whose clocks move and an accuracy point, then saves a screenshot. After the run,
TensorBoard's reader reads the event files, and `minips dashboard RUN_DIR` replays the run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import interrupt, records, wait_for

pytest.importorskip("aiohttp", reason="the dashboard extra is not installed")
parser = pytest.importorskip("prometheus_client.parser")

RUN_FLAGS = ("local", "--mode", "gssp", "--compressor", "gdtopk", "--workers", "4", "--groups",
             "2", "--slowdown", "1,1,3,3", "--wall-s", "30", "--eval-every", "2",
             "--eval-limit", "1000", "--no-progress", "--no-plot", "--timeout", "240")


class LiveRun:
    """The `minips local` process of this module, its run directory and dashboard URL."""

    def __init__(self, tmp: Path) -> None:
        self.run_dir = tmp / "run"
        self.tb_dir = tmp / "tb"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minips", *RUN_FLAGS, "--out", str(tmp), "--name", "run",
             "--dashboard", "127.0.0.1:0", "--tensorboard", str(self.tb_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url_file = self.run_dir / "dashboard.url"
        wait_for("the dashboard's URL", lambda: url_file.exists() and url_file.read_text(),
                 120, (self.proc,))
        self.url = url_file.read_text().strip()
        self.output = ""

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url.rstrip("/") + path, timeout=10) as r:
            return bytes(r.read())

    def finish(self) -> None:
        """Wait for the run to end (at once when it already has); it must end well."""
        if self.proc.returncode is None:
            self.output, _ = self.proc.communicate(timeout=240)
        assert self.proc.returncode == 0, self.output[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:  # Ctrl-C: the launcher stops its children itself
            interrupt(self.proc, 60)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    run = LiveRun(tmp_path_factory.mktemp("dash"))
    try:
        yield run
    finally:
        run.stop()


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


@pytest.mark.timeout(300)
def test_metrics_parse_with_prometheus_text_parser_during_the_run(live: LiveRun) -> None:
    def grouped() -> dict[str, Any] | None:
        fams = _families(live.get("/metrics").decode())
        alive = fams["minips_workers_alive"].samples
        pushes = {s.labels["group"]: s.value for s in fams["minips_pushes"].samples}
        return fams if len(alive) >= 2 and len(pushes) >= 2 else None

    fams = wait_for("two groups and pushes in /metrics", grouped, 120, (live.proc,))
    alive = {s.labels["group"]: s.value for s in fams["minips_workers_alive"].samples}
    assert alive == {"0": 2, "1": 2}
    assert fams["minips_pushes"].type == "counter"
    hops = {s.labels["hop"]: s.value for s in fams["minips_bytes"].samples}
    assert set(hops) == {"worker_to_group", "group_to_worker", "group_to_global",
                         "global_to_group"}
    for name in ("minips_staleness_steps", "minips_ssp_wait_seconds"):
        assert fams[name].type == "histogram"
        buckets = [s for s in fams[name].samples if s.name.endswith("_bucket")]
        assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value > 0
        counts = [s.value for s in buckets]
        assert counts == sorted(counts)  # cumulative
    assert {s.labels["group"] for s in fams["minips_merges"].samples} <= {"0", "1"}
    # the staleness between groups of every merged exchange, per group (both merged by now)
    for name in ("minips_exchange_missed_merges", "minips_exchange_base_age_seconds"):
        assert fams[name].type == "histogram"
        merged = {s.labels["group"]: s.value for s in fams[name].samples
                  if s.name.endswith("_count")}
        assert set(merged) == {"0", "1"} and min(merged.values()) >= 1, (name, merged)
    stats = {(s.labels["group"], s.labels["stat"]) for s in fams["minips_group_missed_merges"]
             .samples}
    assert stats == {(g, st) for g in ("0", "1") for st in ("last", "max")}


@pytest.mark.timeout(300)
def test_page_in_headless_chromium_shows_two_groups_live_clocks_and_accuracy(
        live: LiveRun, browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(live.url)

    def clocks(d: Any) -> dict[str, int]:  # read in one script: the page redraws every tick
        return dict(d.execute_script(
            "return [...document.querySelectorAll(\".group:not([data-group='-1']) tr.worker\")]"
            ".map((r) => [r.dataset.worker, Number(r.dataset.clock)])"))

    def groups(d: Any) -> int:
        return int(d.execute_script(
            "return document.querySelectorAll(\".group:not([data-group='-1'])\").length"))

    WebDriverWait(browser, 120).until(lambda d: groups(d) >= 2 and sum(clocks(d).values()) > 0)
    first = clocks(browser)
    WebDriverWait(browser, 60).until(
        lambda d: all(c > first[w] for w, c in clocks(d).items() if w in first))  # live
    WebDriverWait(browser, 60).until(
        lambda d: int(d.execute_script("return document.body.dataset.evalPoints || 0")))
    assert browser.execute_script("return document.getElementById('status').textContent") == "live"
    assert "%" in browser.execute_script("return document.getElementById('acc').textContent")
    shot = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    if os.environ.get("MINIPS_SCREENSHOT"):  # keep a copy where asked
        shutil.copy(shot, os.environ["MINIPS_SCREENSHOT"])


@pytest.mark.timeout(300)
def test_tensorboard_reads_the_runs_scalars(live: LiveRun) -> None:
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    live.finish()
    acc = ea_mod.EventAccumulator(str(live.tb_dir), size_guidance={ea_mod.SCALARS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"eval/accuracy", "eval/loss", "eval_by_bytes/accuracy", "group/0/min_clock",
            "group/1/min_clock", "worker/3/step_time", "worker/0/staleness"} <= tags
    evals = [r for r in records(live.run_dir / "eval.jsonl") if "accuracy" in r]
    got = acc.Scalars("eval/accuracy")
    assert [round(e.value, 5) for e in got] == [round(r["accuracy"], 5) for r in evals]
    assert [e.step for e in got] == [r["samples"] for r in evals]
    clocks = [e.value for e in acc.Scalars("group/1/min_clock")]
    assert clocks == sorted(clocks) and clocks[-1] > 10


@pytest.mark.timeout(300)
def test_minips_dashboard_replays_the_finished_run(live: LiveRun) -> None:
    live.finish()
    proc = subprocess.Popen([sys.executable, "-m", "minips", "dashboard", str(live.run_dir),
                             "--listen", "127.0.0.1:0", "--speed", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert "replaying" in line, proc.stderr.read() if proc.stderr else line
        url = line.split(" on ")[1].split()[0]
        with urllib.request.urlopen(url + "state", timeout=10) as r:
            state = json.loads(r.read())
    finally:
        interrupt(proc, 30)
    evals = [r for r in records(live.run_dir / "eval.jsonl") if "accuracy" in r]
    assert len(state["eval"]) == len(evals) and state["done"]
    assert {w["group"] for w in state["workers"]} == {0, 1}
    assert {e["event"] for e in state["events"]} >= {"joined", "groups", "done", "left"}
    assert proc.returncode == 0
