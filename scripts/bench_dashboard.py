"""What the dashboard costs a run: `minips local --preset demo` with and without --dashboard.

The runs take turns (off, on, off, on, ...) so that both see the same machine load. With the
dashboard on, a client reads the page's event stream for the whole run and /metrics is scraped
every 5 s (Prometheus' default is 15 s), so the figure includes serving them; the browser itself
is not on this machine (on a projector laptop it would not be either).

Figures (one JSON object): per run the wall time of the whole command (wall_s, start to exit,
install and data set excluded), the run's own train_s (groups formed to the end of the budget,
from summary.json), samples_per_s and final_accuracy; then per setting the median wall_s and
train_s, and overhead_pct = 100 * (median on / median off - 1) for both (and the loss of
samples_per_s, for runs that end on the wall budget rather than the epochs).

monitor_cpu: the CPU seconds the dashboard's own work (parsing the run's records, keeping its
state, one page message per tick) takes for each recorded "on" run, measured here afterwards
in one process: a figure the machine's load does not blur, as a share of one core; and the
same for writing the run's TensorBoard file (--tensorboard).

Usage: python scripts/bench_dashboard.py [--repeats 2] [--out /tmp/minips-bench-dash]
       [--tensorboard]   (also write TensorBoard files in the "on" runs)
       [--run-flags '--workers 2 --max-steps 20']   (a smaller run than the demo)
       python scripts/bench_dashboard.py --cpu-of RUN_DIR   (monitor_cpu of one run only)
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

SCRAPE_EVERY_S = 5.0


def _watch(url: str, stop: threading.Event, counts: dict[str, int]) -> None:
    """Read the event stream until the server goes away; scrape /metrics every 5 s."""
    def stream() -> None:
        try:
            with urllib.request.urlopen(url + "events", timeout=30) as r:
                for line in r:
                    counts["events"] += line.startswith(b"data: ")
        except OSError:
            pass

    threading.Thread(target=stream, daemon=True).start()
    while not stop.wait(SCRAPE_EVERY_S):
        try:
            with urllib.request.urlopen(url + "metrics", timeout=10) as r:
                counts["scrapes"] += bool(r.read())
        except OSError:
            return


def run_once(out: Path, name: str, dashboard: bool, tensorboard: bool,
             more: list[str] | None = None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "minips", "local", "--preset", "demo", "--no-plot",
           "--no-progress", "--out", str(out), "--name", name, *(more or [])]
    if dashboard:
        cmd += ["--dashboard", "127.0.0.1:0"]
    if tensorboard:
        cmd += ["--tensorboard", str(out / name / "tb")]
    counts = {"events": 0, "scrapes": 0}
    stop = threading.Event()
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url_file = out / name / "dashboard.url"
    while dashboard and proc.poll() is None and not url_file.exists():
        time.sleep(0.05)  # the launcher prints the URL once the server listens
    if dashboard and url_file.exists():
        url = url_file.read_text().strip()
        threading.Thread(target=_watch, args=(url, stop, counts), daemon=True).start()
    _, err = proc.communicate()
    wall = time.perf_counter() - t
    stop.set()
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed: {err[-2000:]}")
    s = json.loads((out / name / "summary.json").read_text())
    return {"name": name, "dashboard": dashboard, "tensorboard": tensorboard, "wall_s": wall,
            "train_s": s["train_s"], "samples_per_s": s["samples_per_s"],
            "final_accuracy": s["final_accuracy"], **(counts if dashboard else {})}


def monitor_cpu(run_dir: Path) -> dict[str, float]:
    """CPU seconds the dashboard's own work takes for a recorded run, in this process: parse
    every record, add it to the state tick by tick and encode one page message per tick, as
    the monitor does for one open page (the live monitor reads the same lines from the files)."""
    from minips.dashboard.monitor import TICK_S
    from minips.dashboard.state import Replay
    from minips.dashboard.tboard import TensorBoardSink

    t = time.process_time()
    replay = Replay(run_dir, speed=1.0)
    cursor: dict[str, int] = {}
    ticks = int((replay.end_t - replay.start_t) / TICK_S) + 2
    for k in range(ticks):
        replay.poll(k * TICK_S)
        msg = replay.state.update(replay.horizon(k * TICK_S), cursor)
        cursor = msg["cursor"]
        json.dumps(msg, separators=(",", ":"))
    cpu = time.process_time() - t
    run_s = replay.end_t - replay.start_t
    t = time.process_time()
    with tempfile.TemporaryDirectory() as tb_dir:  # what --tensorboard adds
        sink = TensorBoardSink(tb_dir, t0=0.0)
        for src, rec in replay.records:
            sink.add(src, rec)
        sink.close()
    tb_cpu = time.process_time() - t
    return {"monitor_cpu_s": cpu, "run_s": run_s, "records": len(replay.records),
            "monitor_cpu_pct_of_one_core": 100.0 * cpu / run_s, "tensorboard_cpu_s": tb_cpu,
            "tensorboard_cpu_pct_of_one_core": 100.0 * tb_cpu / run_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="runs of each setting (default 2)")
    ap.add_argument("--out", help="parent of the run directories (default: a temp dir)")
    ap.add_argument("--tensorboard", action="store_true", help="--tensorboard in the on runs")
    ap.add_argument("--cpu-of", help="only measure monitor_cpu for this run directory")
    ap.add_argument("--run-flags", default="",
                    help="more `minips local` flags after the preset's, e.g. a smaller run: "
                    "'--workers 2 --max-steps 20' (default: the demo as it is)")
    args = ap.parse_args()
    if args.cpu_of:
        print(json.dumps(monitor_cpu(Path(args.cpu_of)), indent=2))
        return
    out = Path(args.out or tempfile.mkdtemp(prefix="minips-bench-dash-"))
    runs = []
    for i in range(args.repeats):
        for on in (False, True):
            name = f"{'on' if on else 'off'}-{i}"
            runs.append(run_once(out, name, on, on and args.tensorboard,
                                 shlex.split(args.run_flags)))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    result: dict[str, Any] = {"runs": runs}
    for key in ("wall_s", "train_s"):
        off = statistics.median(r[key] for r in runs if not r["dashboard"])
        on = statistics.median(r[key] for r in runs if r["dashboard"])
        result[f"median_{key}"] = {"off": off, "on": on}
        result[f"overhead_pct_{key}"] = 100.0 * (on / off - 1.0)
    # a run that hits the demo's wall budget (180 s) shows the cost as fewer samples instead
    off = statistics.median(r["samples_per_s"] for r in runs if not r["dashboard"])
    on = statistics.median(r["samples_per_s"] for r in runs if r["dashboard"])
    result["median_samples_per_s"] = {"off": off, "on": on}
    result["overhead_pct_samples_per_s"] = 100.0 * (1.0 - on / off)
    result["monitor_cpu"] = [monitor_cpu(out / r["name"]) for r in runs if r["dashboard"]]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
