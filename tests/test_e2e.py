"""End to end: `minips local` in GSSP with GDTopK, real processes on loopback, Fashion-MNIST.

Four workers with slowdowns 1,1,3,3 form two groups of two; each group runs SSP inside and
exchanges with the global server asynchronously. On real Fashion-MNIST (the run directory must
say so: no synthetic stand-in), the final weights must have 80% test accuracy after the 2-epoch
budget, the run directory must be complete, and `minips plot` must draw its PNGs.

The lr is the default, 0.05, on the demo's cosine schedule: 83.5-84.8% final in 8 runs (80% at
18.8-23.1 s). At a constant 0.1 two runs in eight collapsed to chance (loss ln 10 within the first
15k samples, before and after the in-process mirror change alike) and the rest ended 79.4-84.6%,
a final up to 4.6 points under its best.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minips.record.metrics import HOP_COUNTERS
from minips.record.rundir import read_jsonl

SUMMARY_KEYS = ("mode", "compressor", "workers", "groups", "final_accuracy", "best_accuracy",
                "wall_s", "samples", "bytes_up", "bytes_down", "time_to_accuracy", "bytes_total")


@pytest.mark.timeout(300)
def test_gssp_gdtopk_four_workers_two_groups_reaches_80_percent(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "minips", "local", "--mode", "gssp", "--compressor", "gdtopk",
           "--workers", "4", "--groups", "2", "--slowdown", "1,1,3,3", "--epochs", "2",
           "--wall-s", "150", "--lr", "0.05", "--lr-schedule", "cosine",
           "--copt", "warmup_epochs=1", "--eval-every", "4",
           "--no-progress", "--out", str(tmp_path), "--name", "gssp"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    run_dir = tmp_path / "gssp"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(run_dir) in proc.stderr and "accuracy_vs_time.png" in proc.stderr

    summary = json.loads((run_dir / "summary.json").read_text())
    for key in SUMMARY_KEYS:
        assert summary.get(key) is not None, key
    assert (summary["mode"], summary["compressor"]) == ("gssp", "gdtopk")
    assert summary["workers"] == 4 and summary["groups"] == 2
    assert summary["data"] == "real", summary["data_sources"]  # not the synthetic stand-in
    said = {k: summary.get(k) for k in ("final_accuracy", "best_accuracy", "samples", "train_s",
                                         "wall_s", "status", "regroups", "mean_staleness")}
    assert summary["final_accuracy"] >= 0.80, said  # the final weights, not the best seen
    assert summary["time_to_accuracy"]["0.80"] is not None
    assert summary["samples"] >= 2 * 60000
    assert summary["bytes_up"] > 0
    # sparse updates of the weights down: far less than a dense copy per step (bytes_raw)
    assert 0 < summary["bytes_down"] < summary["bytes_raw"] / 5  # dense would be about 1x
    hops = [summary[k] for k in HOP_COUNTERS]  # every hop counted, adding up to the total
    assert summary["bytes_total"] == sum(hops)
    assert all(h > 0 for h in hops), hops  # worker <-> group and group <-> global

    groups = {r["group"] for r in read_jsonl(run_dir / "worker-0.jsonl")}
    slow = {r["group"] for r in read_jsonl(run_dir / "worker-3.jsonl")}
    assert groups != slow  # fast and slow workers in different groups
    grouped = [r for r in read_jsonl(run_dir / "global.jsonl") if r["event"] == "groups"]
    ratios = grouped[0]["ratios"]
    assert ratios["1"] > ratios["0"]  # GDTopK: the slower group uploads more

    out = subprocess.run([sys.executable, "-m", "minips", "plot", str(run_dir), "--out",
                          str(tmp_path / "png")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pngs = sorted(p.name for p in (tmp_path / "png").glob("*.png"))
    assert {"accuracy_vs_time.png", "accuracy_vs_bytes.png", "accuracy_vs_total_bytes.png",
            "gssp-ratios.png"} <= set(pngs)
    assert all((tmp_path / "png" / p).stat().st_size > 1000 for p in pngs)
