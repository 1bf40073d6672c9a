"""Where dense GSSP loses its points behind a link: each candidate cause as its own row, in the
simulator (`minips simulate`: the real group and global cores, the real model and data, the
link as a bandwidth model), every seed.

Every row is the link suite's dense GSSP row (LeNet-5 on Fashion-MNIST, 8 workers at slowdowns
1,1,1.5,1.5,2,2,4,4 of a 40 ms step, 4 groups, staleness 3, an exchange every 4 pushes of a
group, lr 0.05 cosine, momentum 0.9, 5 epochs) with one thing changed:

- unlinked: no link (the accuracy the linked row is held to);
- link20: 20 mbit each way on every worker (a dense push or pull about 0.1 s);
- link20-1group: the same, the 8 workers in one group (SSP): is it the grouping?
- link20-sync1 / link20-sync16: an exchange after every push / every 16 pushes: the cadence
  (unlinked-sync16: the same cadence without the link);
- link20-2groups: two groups, as the grouping's rule would form them from iteration times;
- link20-constant-lr / unlinked-constant-lr: no schedule: the lr schedule's count of samples;
- unlinked-xchg-91ms: no worker link, 91 ms each way on the group <-> global exchange: the
  link's effect on the exchange alone;
- equal-pace / equal-pace-1group: no link, every worker at slowdown 2 (80 ms): the groups at
  one pace, as the link makes them (its cycle of step + 0.18 s flattens the 4x spread to 1.5x);
- equal-pace-no-momentum / equal-pace-1group-no-momentum: the same without momentum (lr 0.5,
  the same step in the long run): the groups' momentum against their merge;
- *-momentum-0.75: unlinked, link20 and equal-pace with less momentum on the groups'
  optimizers (groups that run asynchronously at one pace add momentum of their own);
  *-momentum-0.75-lr and *-momentum-0.66-lr: the same at the same long-run step
  (lr / (1 - momentum) = 0.5); 0.66 = 0.9^4, the momentum per push of a group that makes a
  quarter of the cluster's pushes, if it is to decay per push of the cluster.

Every row above keeps each group's momentum per push of the group (``--group-momentum group``,
the default). The partial fix, each group's momentum per push of the cluster from its measured
share (``--group-momentum cluster``, a setting: docs/results.md says why it is not the default):
- unlinked-cluster, link20-cluster, equal-pace-cluster;
- unlinked-cluster-sync8 / -sync16, link20-cluster-sync8 / -sync16: with it, fewer asynchronous
  merges (an exchange every 8 or 16 pushes of a group, the other lever the rows above found).

Prints one JSON object: per row its final accuracy per seed (the evaluator's 5,000 images), the
median, the gap to ``unlinked`` per seed, and the between-group staleness (mean merges of other
groups an exchange missed, per group). Runs go to --out (removed unless --keep).

    python scripts/gssp_causes.py --seeds 0,1,2 --jobs 2          # about 15 min on 2 cores
    python scripts/gssp_causes.py --rows unlinked,link20 --seeds 0 --epochs 0.2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

BASE = ["--objective", "model", "--model", "lenet5", "--dataset", "fashion-mnist",
        "--slowdown", "1,1,1.5,1.5,2,2,4,4", "--mode", "gssp", "--groups", "4",
        "--staleness", "3", "--sync-every", "4", "--base-step", "0.04", "--batch-size", "64",
        "--lr", "0.05", "--lr-schedule", "cosine", "--momentum", "0.9",
        "--weight-decay", "5e-4", "--eval-every", "2", "--eval-limit", "5000",
        "--group-momentum", "group"]  # the default, explicit; CLUSTER: the partial fix
LINK = ["--link-mbit", "20"]
EQUAL = ["--slowdown", "2,2,2,2,2,2,2,2"]
NO_MOMENTUM = ["--momentum", "0", "--lr", "0.5"]
MOMENTUM_075 = ["--momentum", "0.75", "--lr", "0.125"]
MOMENTUM_066 = ["--momentum", "0.6561", "--lr", "0.172"]
CLUSTER = ["--group-momentum", "cluster"]
ROWS: dict[str, list[str]] = {
    "unlinked": [],
    "link20": LINK,
    "link20-1group": [*LINK, "--groups", "1"],
    "link20-sync1": [*LINK, "--sync-every", "1"],
    "link20-sync16": [*LINK, "--sync-every", "16"],
    "unlinked-sync16": ["--sync-every", "16"],
    "link20-2groups": [*LINK, "--groups", "2"],
    "link20-constant-lr": [*LINK, "--lr-schedule", "constant"],
    "unlinked-constant-lr": ["--lr-schedule", "constant"],
    "unlinked-xchg-91ms": ["--xchg-latency-ms", "91"],
    "equal-pace": EQUAL,
    "equal-pace-1group": [*EQUAL, "--groups", "1"],
    "equal-pace-no-momentum": [*EQUAL, *NO_MOMENTUM],
    "equal-pace-1group-no-momentum": [*EQUAL, "--groups", "1", *NO_MOMENTUM],
    # asynchronous groups add momentum of their own: less of it on the groups' optimizers
    "unlinked-momentum-0.75": ["--momentum", "0.75"],
    "link20-momentum-0.75": [*LINK, "--momentum", "0.75"],
    "equal-pace-momentum-0.75": [*EQUAL, "--momentum", "0.75"],
    # the same at the same long-run step (lr / (1 - momentum) = 0.5, as with 0.9 and lr 0.05)
    "unlinked-momentum-0.75-lr": [*MOMENTUM_075],
    "link20-momentum-0.75-lr": [*LINK, *MOMENTUM_075],
    "equal-pace-momentum-0.75-lr": [*EQUAL, *MOMENTUM_075],
    # momentum that decays per push of the whole cluster, not of the group: 0.9^4 for a group
    # making 1/4 of the pushes, lr so that lr / (1 - momentum) stays 0.5
    "link20-momentum-0.66-lr": [*LINK, *MOMENTUM_066],
    "equal-pace-momentum-0.66-lr": [*EQUAL, *MOMENTUM_066],
    # the partial fix: each group's momentum decays per push of the cluster, from its share
    "unlinked-cluster": CLUSTER,
    "link20-cluster": [*LINK, *CLUSTER],
    "equal-pace-cluster": [*EQUAL, *CLUSTER],
    # with it, fewer asynchronous merges: an exchange every 8 or 16 pushes of a group
    "unlinked-cluster-sync8": [*CLUSTER, "--sync-every", "8"],
    "link20-cluster-sync8": [*LINK, *CLUSTER, "--sync-every", "8"],
    "unlinked-cluster-sync16": [*CLUSTER, "--sync-every", "16"],
    "link20-cluster-sync16": [*LINK, *CLUSTER, "--sync-every", "16"],
}


def run_one(row: str, seed: int, epochs: float, out: Path) -> dict[str, Any]:
    """One simulated run of ``row`` (later flags win over BASE's); its summary's figures."""
    name = f"{row}-s{seed}"
    argv = [sys.executable, "-m", "minips", "simulate", *BASE, *ROWS[row], "--seed", str(seed),
            "--epochs", str(epochs), "--no-plot", "--json", "--out", str(out), "--name", name]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"gssp_causes: {name} failed: {proc.stderr.strip()[-500:]}")
    s = json.loads((out / name / "summary.json").read_text())
    between = s.get("between_groups") or {}
    return {"final": s["final_accuracy"], "sim_s": round(s["sim_s"], 1),
            "groups": s["groups"], "pushes": s["pushes"],
            "missed": {g: round(v["mean_missed"], 2) for g, v in between.items()
                       if v.get("mean_missed") is not None}}


def table(rows: list[str], seeds: list[int], epochs: float, jobs: int,
          out: Path) -> dict[str, Any]:
    """Every row x seed, ``jobs`` at a time (simulated time: the load does not move a figure)."""
    keys = [(r, s) for r in rows for s in seeds]
    with ThreadPoolExecutor(jobs) as pool:
        done = dict(zip(keys, pool.map(lambda k: run_one(*k, epochs, out), keys), strict=True))
    result: dict[str, Any] = {}
    for r in rows:
        finals = [done[r, s]["final"] for s in seeds]
        result[r] = {"final": finals, "median": statistics.median(finals),
                     "missed_seed0": done[r, seeds[0]]["missed"],
                     "sim_s": done[r, seeds[0]]["sim_s"], "groups": done[r, seeds[0]]["groups"]}
        if "unlinked" in rows:
            result[r]["gap_vs_unlinked"] = [round(100 * (done[r, s]["final"]
                                                         - done["unlinked", s]["final"]), 2)
                                            for s in seeds]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated; default: all")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=float, default=5.0)
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (one core each)")
    p.add_argument("--out", type=Path, help="run directories (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    args = p.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; the rows: {', '.join(ROWS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = args.out or Path(tempfile.mkdtemp(prefix="gssp-causes-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    try:
        rows_out = table(rows, seeds, args.epochs, args.jobs, out)
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"rows": rows_out, "seeds": seeds, "epochs": args.epochs,
                      "base": " ".join(BASE), "real_s": round(time.time() - started, 1),
                      "cpu_count": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
