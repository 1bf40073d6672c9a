"""Worker footprint: per-step overhead as a fraction of compute, and resident memory, on the CPU.

For each model, one real run through the CLI (``minips local``: a global server process and one
worker process on loopback, BSP, ``topk`` at ``--ratio`` kept, ``--steps`` pushes, no
evaluator) and then from the worker's own records (worker-0.jsonl, worker-0.device.json):

- ``compute_s``: median forward + backward time of a step;
- ``pull_s`` (PULL until WEIGHTS arrived, wait_s), ``decode_s`` (decode the weights, load them
  into the model, take the next batch), ``compress_s``, ``encode_s``, ``push_s`` (PUSH until
  ACK): medians over the steps after the first ``--skip``;
- ``overhead_frac``: (pull + decode + compress + encode + push) / compute, of the medians;
- ``rss_mb`` / ``max_rss_mb``: the worker's resident memory at its end / at its peak (loading
  the data set makes short-lived copies);
- ``torch_rss_mb``: the peak of a bare process that imports torch and runs one small conv
  forward/backward (torch's own); ``import_rss_mb``: of one that only imports minips.worker;
- ``train_rss_mb`` / ``train_max_rss_mb``: a bare torch loop (no minips) that builds the model
  and runs 4 forward/backward steps on a random batch of 64 (torch, the model, its gradient and
  the activations), at its end / at its peak;
- ``dataset_mb``: the arrays of the training set the worker holds; ``model_mb``: one float32
  copy of the parameters;
- ``extra_mb``: what the worker holds beyond the bare loop and its data set, rss - train_rss -
  dataset (``extra_peak_mb``: the same of the peaks); ``extra_copies``: extra_mb / model_mb.

ResNet-18 trains on CIFAR-10's synthetic stand-in when the real files are absent (same shapes,
same cost per step). Prints one JSON object. Run it alone (e.g. under ``flock``): the figures are
times.

Usage: python scripts/bench_worker.py [--models lenet5,resnet18] [--steps 10] [--skip 2]
       [--ratio 0.01] [--device cpu]        (the worker uses one torch thread)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

DATASETS = {"lenet5": "fashion-mnist", "resnet18": "cifar10"}
PHASES = ("wait_s", "decode_s", "compute_s", "compress_s", "encode_s", "push_s")
# VmRSS / VmHWM of /proc/self/status, not ru_maxrss: Linux carries the parent's peak into a child
REPORT = ("; s = {l.split()[0]: float(l.split()[1]) / 1024 for l in open('/proc/self/status') "
          "if l.startswith(('VmRSS', 'VmHWM'))}; print(s['VmRSS:'], s['VmHWM:'])")
TORCH_BASELINE = ("import torch; torch.set_num_threads(1); "
                  "x = torch.randn(8, 3, 32, 32, requires_grad=True); "
                  "torch.nn.Conv2d(3, 8, 3)(x).sum().backward()" + REPORT)
TRAIN_BASELINE = ("import torch; from minips.ml import models; torch.set_num_threads(1); "
                  "m = models.build_model({model!r}, 0); x = torch.randn({batch}, {shape}); "
                  "y = torch.randint(0, 10, ({batch},)); "
                  "[(m.zero_grad(set_to_none=True), models.batch_loss({model!r}, m, x, y)"
                  ".backward()) for _ in range(4)]")  # + REPORT, after .format()
SHAPES = {"lenet5": "1, 32, 32", "resnet18": "3, 32, 32"}
BATCH = 64  # RunConfig's default batch size, which the runs use
IMPORT_BASELINE = "import minips.worker" + REPORT


def rss_of(code: str) -> list[float]:
    """The RSS figures (MiB) a fresh Python running ``code`` prints."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    return [round(float(x), 1) for x in out.stdout.split()]


def run_once(model: str, args: argparse.Namespace, out: Path) -> Path:
    """One `minips local` run; returns its run directory."""
    cmd = [sys.executable, "-m", "minips", "local", "--mode", "bsp", "--workers", "1",
           "--compressor", "topk", "--ratio", str(args.ratio), "--model", model,
           "--dataset", DATASETS[model], "--max-steps", str(args.steps), "--base-step", "0",
           "--device", args.device, "--no-eval", "--no-plot", "--no-progress",
           "--out", str(out), "--name", model, "--timeout", "1800"]
    subprocess.run(cmd, check=True, timeout=1900, stdout=subprocess.DEVNULL)
    return out / model


def figures(model: str, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from minips.ml import data, models

    lines = (run_dir / "worker-0.jsonl").read_text().splitlines()
    recs = [r for r in map(json.loads, lines) if "event" not in r][args.skip:]
    med = {p: statistics.median(r[p] for r in recs) for p in PHASES}
    overhead = sum(v for p, v in med.items() if p != "compute_s")
    info = json.loads((run_dir / "worker-0.device.json").read_text())
    ds = data.load_dataset(DATASETS[model], "train")
    n = models.param_count(model)
    return {"device": info["device"], "params": n, "steps_timed": len(recs),
            **{("pull_s" if p == "wait_s" else p): round(v, 5) for p, v in med.items()},
            "overhead_s": round(overhead, 5),
            "overhead_frac": round(overhead / med["compute_s"], 4),
            "host_bytes": recs[-1]["host_bytes"], "bytes_wire": recs[-1]["bytes_wire"],
            "rss_mb": info["rss_mb"], "max_rss_mb": info["max_rss_mb"],
            "dataset_mb": round((ds.x.nbytes + ds.y.nbytes) / 2**20, 1),
            "model_mb": round(4 * n / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    dflt = " (default %(default)s)"
    ap.add_argument("--models", default="lenet5,resnet18", help="comma list" + dflt)
    ap.add_argument("--steps", type=int, default=10, help="pushes per run" + dflt)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out" + dflt)
    ap.add_argument("--ratio", type=float, default=0.01, help="kept fraction" + dflt)
    ap.add_argument("--device", default="cpu", help="worker --device" + dflt)
    args = ap.parse_args()
    result: dict[str, Any] = {"torch_rss_mb": rss_of(TORCH_BASELINE)[1],
                              "import_rss_mb": rss_of(IMPORT_BASELINE)[1],
                              "ratio": args.ratio, "load_avg": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            fig = figures(model, run_once(model, args, Path(tmp)), args)
            code = TRAIN_BASELINE.format(model=model, batch=BATCH, shape=SHAPES[model]) + REPORT
            fig["train_rss_mb"], fig["train_max_rss_mb"] = rss_of(code)
            extra = fig["rss_mb"] - fig["train_rss_mb"] - fig["dataset_mb"]
            peak = fig["max_rss_mb"] - fig["train_max_rss_mb"] - fig["dataset_mb"]
            fig["extra_mb"], fig["extra_peak_mb"] = round(extra, 1), round(peak, 1)
            fig["extra_copies"] = round(extra / fig["model_mb"], 2)
            result[model] = fig
    result["load_avg_end"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
