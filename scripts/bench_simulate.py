"""How fast `minips simulate` runs: N workers x P pushes on the synthetic objective, one core.

    python scripts/bench_simulate.py --json                 # 1,000 workers x 100,000 pushes
    python scripts/bench_simulate.py --workers 64 --pushes 20000 --compressor none

Prints JSON: real seconds, pushes per real second, simulated seconds, and the run's headline
figures. The run directory goes to a temporary directory and is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from minips.core.config import RunConfig
from minips.sim.simulate import SimConfig, simulate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--pushes", type=int, default=100_000)
    p.add_argument("--compressor", default="topk")
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--mode", default="gssp")
    p.add_argument("--dim", type=int, default=1000)
    p.add_argument("--json", action="store_true", help="JSON only")
    args = p.parse_args()
    run = RunConfig(workers=args.workers, mode=args.mode, compressor=args.compressor,
                    ratio=args.ratio, lr=0.02, lr_warmup=0, dataset="synthetic",
                    epochs=1e6, base_step_s=0.04)
    slow = [1, 1, 1.5, 1.5, 2, 2, 4, 4] * max(1, args.workers // 8)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        s = simulate(SimConfig(run=run, slowdowns=slow, jitter=0.1, dim=args.dim,
                               max_pushes=args.pushes, eval_every_s=1.0, out_dir=tmp,
                               name="bench"))
        real = time.perf_counter() - started
    out = {"workers": args.workers, "pushes": s["pushes"], "real_s": round(real, 2),
           "pushes_per_real_s": round(s["pushes"] / real), "sim_s": s["sim_s"],
           "groups": s["groups"], "mean_staleness": s["mean_staleness"],
           "bytes_total": s["bytes_total"], "compressor": args.compressor, "dim": args.dim,
           "cpu_count": os.cpu_count(), "load_avg": os.getloadavg()}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
