"""`minips simulate` flags: the run flags of `minips local` plus the simulation's models.

Kept apart from cli.py, as cli_ray.py is: ``cli`` calls ``add_parser`` and ``command``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from minips.errors import ConfigError
from minips.run.cli_checks import at_least, slowdown_factors
from minips.run.config import RunConfig
from minips.sim.sim_timing import Failure, parse_failures

__all__ = ["add_parser", "command"]


def add_parser(sub: Any, add_run_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    """The `simulate` sub-command with every option and its default."""
    p = sub.add_parser("simulate", help="the cluster as a discrete-event simulation (seconds "
                       "for thousands of workers)",
                       description="The global server's and the group servers' own rules "
                       "(global_core.py, group_core.py) driven by an event queue in simulated "
                       "time: workers with compute times, links and failures, gradients of a "
                       "synthetic objective or of the run's real model. Writes a run directory "
                       "like `minips local`.")
    add_run_flags(p)
    p.add_argument("--slowdown", type=slowdown_factors, help="factors F per worker: 1,1,2x2,4 (a "
                   "step takes F x --base-step; the last repeats; default 1)")
    p.add_argument("--jitter", type=at_least(0), default=0.0,
                   help="relative spread of a step's compute time (default 0)")
    p.add_argument("--link-mbit", type=at_least(0), default=0.0,
                   help="each worker's link, mbit/s each way (default 0: no limit)")
    p.add_argument("--latency-ms", type=at_least(0), default=0.0,
                   help="one-way latency of each message, ms (default 0)")
    p.add_argument("--latency-jitter-ms", type=at_least(0), default=0.0,
                   help="plus this times |N(0,1)| on each message, ms (default 0)")
    p.add_argument("--fail", type=failures, default=[],
                   help="workers that drop: W@T (worker W at T simulated s, for good) or "
                   "W@T+D (rejoins D s later), comma separated (default none)")
    p.add_argument("--objective", choices=("synthetic", "model"), default="synthetic",
                   help="gradients of a synthetic quadratic (cheap, thousands of workers) or "
                   "of the run's --model on its --dataset, as real workers (torch; default "
                   "synthetic)")
    p.add_argument("--xchg-latency-ms", type=at_least(0), default=0.0,
                   help="delay of a group's exchange with the global server, ms (default 0)")
    p.add_argument("--dim", type=int, default=1000,
                   help="coordinates of the synthetic objective (default 1000)")
    p.add_argument("--noise", type=at_least(0), default=1.0,
                   help="gradient noise of one sample per coordinate (default 1)")
    p.add_argument("--max-pushes", type=int, default=0,
                   help="stop after this many pushes (default 0: the --epochs budget)")
    p.add_argument("--no-plot", action="store_true", help="do not draw PNGs at the end")
    p.add_argument("--out", default="runs", help="parent directory of the run directory")
    p.add_argument("--name", help="run directory name (default: time-sim-mode-compressor)")


def failures(text: str) -> list[Failure]:
    """Type of --fail (``sim_timing.parse_failures``)."""
    try:
        return parse_failures(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def command(args: argparse.Namespace, run: RunConfig) -> int:
    """Run the simulation; print its summary's headline as JSON."""
    from minips.run.plot import plot_run
    from minips.sim.simulate import SimConfig, simulate

    if args.dim < 1 or args.max_pushes < 0:
        raise ConfigError(f"--dim {args.dim} / --max-pushes {args.max_pushes}: expected "
                          "--dim >= 1 and --max-pushes >= 0")
    slowdowns = args.slowdown or [1.0]
    if args.workers is None and args.slowdown:
        run.workers = len(slowdowns)
    real = args.objective == "model"
    if not real and run.dataset != "synthetic" and not run.train_size:
        run.dataset = "synthetic"  # the objective is synthetic: so are its samples
    cfg = SimConfig(run=run, slowdowns=slowdowns, jitter=args.jitter,
                    rate=args.link_mbit * 1e6 / 8, latency_s=args.latency_ms / 1e3,
                    latency_jitter_s=args.latency_jitter_ms / 1e3, failures=args.fail,
                    real=real, xchg_latency_s=args.xchg_latency_ms / 1e3, dim=args.dim,
                    noise=args.noise,
                    max_pushes=args.max_pushes, eval_every_s=run.eval_every_s,
                    out_dir=args.out, name=args.name or "")
    summary = simulate(cfg)
    keys = ("run_dir", "mode", "compressor", "workers", "groups", "pushes", "samples",
            "sim_s", "real_s", "mean_staleness", "mean_wait_s", "bytes_total",
            "final_accuracy")
    headline = {k: summary.get(k) for k in keys}
    if not args.no_plot:
        headline["plots"] = plot_run(summary["run_dir"], "minips simulate")
    json.dump(headline, sys.stdout)
    print()
    return 0
