"""The dashboard's page in a real headless Chromium, on a run directory written by hand.

`minips dashboard RUN_DIR --speed 0` (a real process) serves a finished GSSP run: three groups
formed, a regroup that empties group 2, checkpoints, merges with their bytes and answered
PULLs, two slow workers that form a group of their own. The page must mark those two slow
(against the whole cluster, not their own group), drop group 2's line and card, chart the bytes
of every hop and each worker's SSP wait over time, show round axis ticks and a value where the
mouse is, and list the events as sentences with the checkpoints folded into one line.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import interrupt

pytest.importorskip("aiohttp", reason="the dashboard extra is not installed")

CONFIG = {"mode": "gssp", "compressor": "gdtopk", "model": "lenet5", "dataset": "fashion-mnist",
          "workers": 5, "staleness": 2, "lease_s": 10.0, "t0": 1000.0}
STEP = {0: 0.1, 1: 0.1, 2: 0.11, 3: 0.4, 4: 0.42}  # s per step: workers 3 and 4 are slow


def write_run(d: Path, wait_us: int = 5000) -> None:
    """A finished run's files: config, global.jsonl (groups, merges, checkpoints, regroup,
    done), one file per worker, eval.jsonl."""
    glob: list[dict[str, Any]] = [{"t": 1.0, "event": "groups",
                                   "assignment": {"0": 0, "1": 0, "2": 2, "3": 1, "4": 1}}]
    for i in range(1, 19):
        t = 1.0 + i / 2
        for g, ws in ((0, [0, 1]), (1, [3, 4]), (2, [2])):
            if g == 2 and t > 6:
                continue  # emptied by the regroup at 6 s
            glob.append({"t": t, "event": "merge", "group": g, "pushes": 2 * len(ws),
                         "min_clock": i * (3 - g), "max_clock": i * (3 - g) + 1,
                         "bytes_in": 40_000 * i, "bytes_out": 90_000 * i,
                         "bytes_to_global": 20_000 * i, "bytes_from_global": 30_000 * i,
                         "pull_workers": ws, "pull_leads": [1] * len(ws),
                         "pull_waits_us": [wait_us] * len(ws),
                         # group 1 (slow) misses most: 2, 4, 6, 2, 4, 6, ... other merges
                         "missed": 2 * (1 + i % 3) if g == 1 else 1, "base_age_s": 0.5})
    glob += [{"t": t, "event": "checkpoint", "bytes": 250_000, "write_s": 0.01}
             for t in (3.0, 5.0, 7.0)]
    glob += [{"t": 6.0, "event": "regroup", "moved": {"2": 0}},
             {"t": 10.5, "event": "done", "reason": "epochs"}]
    (d / "config.json").write_text(json.dumps(CONFIG))
    lines = sorted(glob, key=lambda r: r["t"])
    (d / "global.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    for w, step in STEP.items():
        group = {0: 0, 1: 0, 2: 2, 3: 1, 4: 1}[w]
        recs = [{"t": 1.0 + c * 0.5, "worker": w, "group": 0 if (w == 2 and c > 10) else group,
                 "clock": c, "step_time": step, "wait_s": 0.01, "staleness": 1,
                 "bytes_wire": 4000, "bytes_raw": 250_000} for c in range(1, 19)]
        (d / f"worker-{w}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    evals = [{"t": 1.0 + i, "accuracy": 0.1 + 0.08 * i, "loss": 2.3 - 0.2 * i, "samples": 640 * i,
              "bytes_up": 10**6 * i, "bytes_down": 2 * 10**6 * i} for i in range(1, 10)]
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))


def round_ticks(text: str) -> bool:
    """Tick labels that step by 1, 2 or 5 times a power of ten, each a multiple of the step."""
    ticks = [float(x.rstrip("%")) for x in text.split()]
    if len(ticks) < 2:
        return False
    step = ticks[1] - ticks[0]
    mantissa = step / 10 ** math.floor(math.log10(step))
    return (any(math.isclose(mantissa, m) for m in (1, 2, 5))
            and all(math.isclose(b - a, step, rel_tol=1e-6) for a, b in itertools.pairwise(ticks))
            and all(abs(t / step - round(t / step)) < 1e-6 for t in ticks))


HOVER = """
const c = document.getElementById(arguments[0]), r = c.getBoundingClientRect();
for (let y = 4; y < r.height; y += 6) {
  for (let x = 50; x < r.width; x += 12) {
    c.dispatchEvent(new MouseEvent("mousemove", {clientX: r.left + x, clientY: r.top + y}));
    if (c.dataset.hover) return c.dataset.hover;
  }
}
return "";
"""


@pytest.mark.timeout(120)
def test_page_marks_slow_workers_cluster_wide_drops_vanished_groups_and_reads_well(
        tmp_path: Path, browser: Any) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    write_run(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "minips", "dashboard", str(tmp_path),
                             "--listen", "127.0.0.1:0", "--speed", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert "replaying" in line, proc.stderr.read() if proc.stderr else line
        browser.get(line.split(" on ")[1].split()[0])
        js = browser.execute_script
        WebDriverWait(browser, 30).until(
            lambda d: d.execute_script("return document.getElementById('status').textContent")
            == "run over" and d.execute_script("return document.body.dataset.evalPoints") == "9")
        cards = js("return [...document.querySelectorAll('.group')].map((g) => g.dataset.group)")
        assert cards == ["0", "1"]  # group 2 vanished with the regroup
        slow = js("return [...document.querySelectorAll('tr.worker.slow')]"
                  ".map((r) => Number(r.dataset.worker))")
        assert sorted(slow) == [3, 4]  # slow against all workers, though alike in their group
        lines = js("return document.getElementById('c-clocks')._chart.series.map((s) => s.name)")
        assert lines == ["group 0", "group 1"]
        hops = js("return document.getElementById('c-bytes')._chart.series"
                  ".map((s) => [s.name, s.points.length, s.points.at(-1)[1]])")
        assert [h[0] for h in hops] == ["worker to group", "group to worker", "group to global",
                                        "global to group"]
        assert all(n >= 5 and last > 0 for _, n, last in hops)
        held = js("return document.getElementById('c-held')._chart.series"
                  ".map((s) => [s.name, s.points.length, s.points.at(-1)[1]])")
        assert [h[0] for h in held] == ["w0 (group 0)", "w1 (group 0)", "w2 (group 2)",
                                        "w3 (group 1)", "w4 (group 1)"]
        assert held[0][1] >= 5 and held[0][2] == pytest.approx(18 * 0.005)  # who waited, when
        colours = js("return document.getElementById('c-held')._chart.series.map((s) => s.color)")
        assert len(set(colours)) == 5  # one per worker, two of a group told apart
        missed = js("return document.getElementById('c-missed')._chart.series"
                    ".map((s) => [s.name, Math.max(...s.points.map((p) => p[1]))])")
        assert missed == [["group 0", 1], ["group 1", 6]]  # group 2 vanished here too
        card = js("return document.querySelector('.group[data-group=\"1\"] .between')"
                  ".textContent")
        assert card == " · missed 2 merges (max 6) · base 0.50 s (max 0.50 s)"  # its last, 18
        for chart, names in (("held", [h[0] for h in held]), ("bytes", [h[0] for h in hops]),
                             ("missed", [m[0] for m in missed]),
                             ("base-age", [m[0] for m in missed])):
            legend = js(f"return [...document.querySelectorAll('#l-{chart} span')]"
                        ".map((e) => e.textContent)")
            assert legend == names, chart
        for chart in ("c-acc-t", "c-loss-b", "c-clocks", "c-bytes", "c-missed"):
            for axis in ("xticks", "yticks"):
                ticks = js(f"return document.getElementById('{chart}').dataset.{axis}")
                assert round_ticks(ticks), (chart, axis, ticks)
        # training time, the run's one clock: groups at 1.0 s, done at 10.5 s of run time
        assert js("return document.getElementById('time').textContent") == "training 9.5 s"
        first = js("return document.getElementById('c-acc-t')._chart.series[0].points[0]")
        assert first == [pytest.approx(1.0), pytest.approx(0.18)]  # the eval at 2.0 s
        assert "%" in js(HOVER, "c-acc-t") and js(HOVER, "c-acc-t").endswith(" s")
        assert "group to" in js(HOVER, "c-bytes") and " MB at " in js(HOVER, "c-bytes")
        assert " s held at " in js(HOVER, "c-held") and js(HOVER, "c-acc-b").endswith(" MB")
        assert " merges at " in js(HOVER, "c-missed") and " s at " in js(HOVER, "c-base-age")
        events = js("return [...document.querySelectorAll('#events .event')]"
                    ".map((e) => e.textContent)")
        assert events[0].endswith("run over: epochs")  # the newest first
        assert any(e.endswith("regrouped: worker 2 to group 0") for e in events)
        assert any("groups formed: group 0: workers 0, 1; group 1: workers 3, 4; group 2: "
                   "workers 2" in e for e in events)
        assert not any("checkpoint" in e or "=" in e for e in events)
        assert js("return document.getElementById('checkpoints').textContent") == \
            "3 checkpoints written, the last at 6.0 s (0.3 MB)"  # of training: at 7 s run time
    finally:
        interrupt(proc, 30)


@pytest.mark.timeout(120)
def test_a_replay_of_a_servers_run_directory_fills_remote_rows_and_says_no_evaluator(
        tmp_path: Path, browser: Any) -> None:
    """The server's run directory of a run whose workers and evaluator-less cluster ran on
    other machines: no worker file, no eval.jsonl. The rows show what the servers saw (≈ for
    a group's mean), the clocks stay, and the charts say there is no evaluator."""
    from selenium.webdriver.support.ui import WebDriverWait

    write_run(tmp_path, wait_us=0)
    for f in [*tmp_path.glob("worker-*.jsonl"), tmp_path / "eval.jsonl"]:
        f.unlink()
    proc = subprocess.Popen([sys.executable, "-m", "minips", "dashboard", str(tmp_path),
                             "--listen", "127.0.0.1:0", "--speed", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        browser.get(line.split(" on ")[1].split()[0])
        WebDriverWait(browser, 30).until(lambda d: d.execute_script(
            "return document.getElementById('status').textContent") == "run over")
        cells = browser.execute_script(
            "return [...document.querySelectorAll('tr.worker')].map((r) => [r.dataset.clock, "
            "...[...r.querySelectorAll('td[data-key]')].map((c) => c.textContent)])")
        assert len(cells) == 5
        for clock, _step, _iteration, wait, stale, kb, _up in cells:
            assert int(clock) > 0 and wait == "0" and stale == "1", cells
            assert kb.startswith("≈"), cells  # the group's mean bytes per push
        hint = browser.execute_script("return document.getElementById('no-eval').hidden")
        empty = browser.execute_script("return document.getElementById('c-acc-t')._chart.empty")
        assert hint is False and empty.startswith("no evaluator")
        js = browser.execute_script
        note = js("return document.getElementById('c-held').dataset.note")
        assert note.startswith("no worker held so far")  # said, not a flat line on -0.5..0.5
        for chart in ("c-held", "c-bytes", "c-clocks"):  # sums so far: from 0, never below
            ticks = js(f"return document.getElementById('{chart}').dataset.yticks").split()
            assert float(ticks[0]) == 0 and len(ticks) >= 2, (chart, ticks)
    finally:
        interrupt(proc, 30)
