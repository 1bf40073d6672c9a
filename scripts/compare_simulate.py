"""Does `minips simulate` reproduce a real run? A real `minips local` run against the simulator
with the same settings and the real model (LeNet-5 on Fashion-MNIST), compared on per-group
clocks, mean staleness, accuracy vs samples and time to each accuracy target.

    python scripts/compare_simulate.py                     # the quick profile (gssp, 4 epochs)
    python scripts/compare_simulate.py --epochs 1          # a shorter run
    python scripts/compare_simulate.py --real runs/quick4  # compare with a run already made

The real run is reproduce.py's quick profile (fmnist8: 8 workers at slowdowns 1,1,1.5,1.5,2,2,
4,4, base step 0.1 s, lr 0.05 cosine, GSSP 4 groups, staleness 3, dense) unless ``--real``
names one. The simulator takes the real run's config.json and its measured times, in one of
two calibrations (both are run and printed):

- ``median``: each worker's step time is the median of what its steps took in the real run
  (the time between two of its records less four one-way latencies, and less the PULL's
  wait when SSP held it: the simulator adds those itself), unchanging; the one-way latency
  is half the median PUSH round trip;
- ``trace``: the same, step by step (the k-th simulated step of a worker takes the time its
  k-th real step took, the first from the group assignment), so the real run's start
  offsets and hiccups (a step slowed by the shared CPUs) are replayed.

A run behind links (link.json: ``--link``) is simulated behind the same rate, and a push of
H local steps is calibrated as H steps of 1/H its time each.

Prints JSON: per calibration, time to each accuracy target (real: seconds from the training
start; sim: simulated seconds), per-group clocks (each group's highest final worker clock),
mean staleness, accuracy at the real evaluations' sample counts (the simulator's curve
interpolated in samples), and whether each is within 10% / 1 point.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from minips.core.config import RunConfig
from minips.net.links import read_link_record
from minips.record.metrics import Run, load_run, summarize
from minips.sim.simulate import SimConfig, simulate

QUICK = ["--model", "lenet5", "--dataset", "fashion-mnist", "--workers", "8",
         "--slowdown", "1,1,1.5,1.5,2,2,4,4", "--mode", "gssp", "--groups", "4",
         "--staleness", "3", "--sync-every", "4", "--base-step", "0.1", "--lr", "0.05",
         "--lr-schedule", "cosine", "--eval-every", "2", "--eval-limit", "5000",
         "--wall-s", "400", "--device", "cpu", "--no-progress", "--no-plot"]


def run_real(out: Path, epochs: float) -> Path:
    """A real `minips local` run of the quick profile for ``epochs``; its run directory."""
    cmd = [sys.executable, "-m", "minips", "local", *QUICK, "--epochs", str(epochs),
           "--out", str(out), "--name", "real"]
    subprocess.run(cmd, check=True, timeout=1800)
    return out / "real"


def worker_records(run: Run, n: int) -> list[list[dict[str, Any]]]:
    """Each worker's pushes (its records with a clock)."""
    return [[r for r in run.workers.get(w, []) if "clock" in r] for w in range(n)]


def link_rate(run_dir: Path) -> float:
    """The real run's link, bytes per second each way (link.json; the slowest worker's when
    they differ, the simulator having one rate for all); 0 without a link."""
    rates = (read_link_record(run_dir) or {}).get("rates") or []
    bps = [min(r["up_bps"], r["down_bps"]) for r in rates if r.get("up_bps")]
    return min(bps) / 8 if bps else 0.0


def calibration(run: Run, n: int, rate: float = 0.0) -> dict[str, Any]:
    """Step traces, medians and the one-way latency measured in the real run. Behind a link
    of ``rate`` bytes/s the latency is the PUSH round trip less its frame's time on the link
    (the simulator adds that itself); a push of H local steps gives H steps of 1/H its time."""
    start = run.start_t  # the groups event: training starts
    recs_all = worker_records(run, n)
    pushes = [r["push_s"] - (r.get("bytes_wire", 0) / rate if rate else 0.0)
              for recs in recs_all for r in recs if "push_s" in r]
    lat = max(0.0, float(np.median(pushes)) / 2) if pushes else 0.0
    traces = []
    for recs in recs_all:
        ts = [start] + [r["t"] for r in recs]
        # the channel's byte counts are the connection's so far: a push's are the differences
        ups = np.diff([0] + [r.get("link_bytes_up", 0) for r in recs])
        downs = np.diff([0] + [r.get("link_bytes_down", 0) for r in recs])
        trace: list[float] = []
        # what a step took besides the simulator's own four message latencies and, when SSP
        # held its PULL (waited_for), the wait the simulator makes itself; behind a link also
        # the push's and the answer's time on it
        for a, b, r, up, down in zip(ts, ts[1:], recs, ups, downs, strict=False):
            up_s, down_s = (max(0, up) / rate, max(0, down) / rate) if rate else (0.0, 0.0)
            took = b - a - 2 * lat - up_s - (r["wait_s"] if r["waited_for"]
                                             else 2 * lat + down_s)
            h = max(1, int(r.get("local_steps") or 1))
            trace += [max(0.0, took) / h] * h
        traces.append(trace)
    return {"traces": traces, "medians": [float(np.median(t[1:] or t)) for t in traces],
            "latency_s": lat}


def group_clocks(run: Run, n: int) -> dict[str, int]:
    """Each group's highest final worker clock (groups as the workers' last records say)."""
    out: dict[str, int] = {}
    for recs in worker_records(run, n):
        if recs:
            g = str(recs[-1]["group"])
            out[g] = max(out.get(g, 0), int(recs[-1]["clock"]))
    return dict(sorted(out.items()))


def accuracy_at(evals: list[dict[str, Any]], samples: list[float]) -> list[float]:
    pts = sorted((float(e["samples"]), float(e["accuracy"])) for e in evals if "accuracy" in e)
    return list(np.interp(samples, [p[0] for p in pts], [p[1] for p in pts]))


def _round(x: float | None) -> float | None:
    return None if x is None else round(float(x), 2)


def compare(real_dir: Path, sim_dir: Path, n: int) -> dict[str, Any]:
    real_s = summarize(real_dir, write=False)  # the real run's summary.json stays as it is
    sim_s = summarize(sim_dir)
    real, sim = load_run(real_dir), load_run(sim_dir)
    rc, sc = group_clocks(real, n), group_clocks(sim, n)
    clock_err = {g: abs(sc.get(g, 0) - c) / max(1, c) for g, c in rc.items()}
    rst, sst = real_s["mean_staleness"] or 0.0, sim_s["mean_staleness"] or 0.0
    evals = [e for e in real.eval if "accuracy" in e]
    samples = [float(e["samples"]) for e in evals if e["samples"] > 0]
    real_acc = [float(e["accuracy"]) for e in evals if e["samples"] > 0]
    sim_acc = accuracy_at(sim.eval, samples)
    gap = [100 * (s - r) for s, r in zip(sim_acc, real_acc, strict=True)]
    late = [g for x, g in zip(samples, gap, strict=True) if x >= samples[-1] / 2]
    tta = {}
    for target, t_real in real_s["time_to_accuracy"].items():
        t_sim = sim_s["time_to_accuracy"].get(target)
        tta[target] = {"real": _round(t_real), "sim": _round(t_sim),
                       "rel_err": round(abs(t_sim - t_real) / t_real, 4)
                       if t_real and t_sim is not None else None}
    return {
        "time_to_accuracy": tta,
        "group_clocks": {"real": rc, "sim": sc,
                         "rel_err": {g: round(e, 4) for g, e in clock_err.items()},
                         "within_10pct": bool(max(clock_err.values()) <= 0.10)},
        "mean_staleness": {"real": round(rst, 4), "sim": round(sst, 4),
                           "rel_err": round(abs(sst - rst) / rst, 4) if rst else None,
                           "within_10pct": bool(abs(sst - rst) <= 0.10 * rst)},
        "accuracy_vs_samples": {
            "points": [{"samples": int(x), "real": round(r, 4), "sim": round(float(s), 4)}
                       for x, r, s in zip(samples, real_acc, sim_acc, strict=True)],
            "max_abs_gap_points": round(float(max(map(abs, gap))), 2),
            "mean_abs_gap_points": round(float(np.mean(np.abs(gap))), 2),
            "max_abs_gap_second_half": round(float(max(map(abs, late))), 2),
            "final": {"real": real_s["final_accuracy"], "sim": sim_s["final_accuracy"]},
            "within_1pt": bool(max(map(abs, gap)) <= 1.0)},
        "sim_real_s": None, "sim_s": None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--real", type=Path, help="a `minips local` run directory to compare with")
    p.add_argument("--epochs", type=float, default=4.0, help="the real run's budget (default 4, "
                   "the quick profile's)")
    p.add_argument("--out", type=Path, help="where the runs go (default: a temporary directory)")
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="minips-compare-"))
    real_dir = args.real or run_real(out, args.epochs)
    real = load_run(real_dir)
    run = RunConfig.from_info(real.config)
    rate = link_rate(real_dir)
    cal = calibration(real, run.workers, rate)
    report: dict[str, Any] = {"real_run": str(real_dir), "epochs": run.epochs,
                              "link_bytes_per_s": rate,
                              "latency_s": round(cal["latency_s"], 5),
                              "step_medians_s": [round(m, 4) for m in cal["medians"]]}
    for name in ("median", "trace"):
        sim_run = RunConfig.from_info({**run.to_info(), "t0": 0.0})
        cfg = SimConfig(run=sim_run, real=True, step_times=cal["medians"],
                        step_traces=cal["traces"] if name == "trace" else [],
                        latency_s=cal["latency_s"], rate=rate,
                        eval_every_s=run.eval_every_s / 4,
                        out_dir=str(out), name=f"sim-{name}")
        started = time.perf_counter()
        s = simulate(cfg)
        report[name] = compare(real_dir, Path(s["run_dir"]), run.workers)
        report[name].update(sim_real_s=round(time.perf_counter() - started, 1),
                            sim_s=round(s["sim_s"], 1))
    report.update(cpu_count=os.cpu_count(), load_avg=os.getloadavg())
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
