"""`minips ray` flags: the run flags of `minips local` plus where each role goes on Ray.

Kept apart from cli.py so the Ray options read in one place; ``cli`` calls ``add_parser`` and
``command``. Nothing here imports ray: ``minips ray --help`` works without it installed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from minips.errors import ConfigError
from minips.run.config import RunConfig, parse_slowdowns

__all__ = ["add_parser", "command"]

ROLES = ("server", "group", "worker", "evaluator")
DEFAULT_RESOURCES = {"server": "", "group": "", "worker": "CPU=1", "evaluator": ""}


def add_parser(sub: Any, add_run_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    """The `ray` sub-command with every option and its default."""
    p = sub.add_parser("ray", help="run the cluster on Ray: roles as Ray actors (minips[ray])",
                       description="Global server, group servers, evaluator and workers as Ray "
                       "actors, each running its normal `minips` role as a process (minips' "
                       "TCP protocol and MINIPS_TOKEN as always); Ray places them by resources "
                       "and node labels and restarts those that die.")
    add_run_flags(p)
    p.add_argument("--address", help="Ray cluster to join: 'auto' or HOST:PORT of its head "
                   "(default: start a Ray instance on this machine)")
    p.add_argument("--port", type=int, default=7070,
                   help="global server port on its node (fixed, so a restarted server is "
                   "found at the same address)")
    for role in ROLES:
        p.add_argument(f"--{role}-resources", default=DEFAULT_RESOURCES[role],
                       help=f"Ray resources each {role} actor asks for, NAME=AMOUNT,... "
                       "(CPU and GPU are Ray's; others are custom node resources such as "
                       "jetson=1)" + ("" if DEFAULT_RESOURCES[role] else " (default: none)"))
        p.add_argument(f"--{role}-labels", default="",
                       help=f"node labels a {role} actor's node must carry, KEY=VALUE,... "
                       "(default: any node)")
    p.add_argument("--external-groups", type=int, default=0,
                   help="group servers as their own actors (placed by --group-*); 0 = in the "
                   "global server's process")
    p.add_argument("--slowdown", type=parse_slowdowns, help="emulated factor F per worker: 1,1,2x2")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="times Ray restarts a role that died (the server resumes from its "
                   "checkpoint, a worker rejoins)")
    p.add_argument("--checkpoint-every", type=float, default=10.0,
                   help="global server checkpoint period, s (what a restart resumes from)")
    p.add_argument("--no-eval", action="store_true", help="do not start the evaluator")
    p.add_argument("--out", default="runs", help="parent of the run directory on this machine")
    p.add_argument("--name", help="run directory name (default: time-mode-compressor)")
    p.add_argument("--timeout", type=float, default=0.0,
                   help="hard stop, s (0 = the wall budget, or 30 min, + 2 min)")


def command(args: argparse.Namespace, run: RunConfig) -> int:
    """Build the RayConfig from the flags and run; exit status 0 when the run finished."""
    try:
        from minips.run.ray_launch import RayConfig, parse_placement, run_ray
    except ImportError as exc:  # ray missing: say how to get it
        raise ConfigError(f"minips ray needs Ray: pip install 'minips[ray]' ({exc})") from None
    places = {r: parse_placement(getattr(args, f"{r}_resources"), getattr(args, f"{r}_labels"))
              for r in ROLES}
    slowdowns = args.slowdown or []
    if args.workers is None and slowdowns:
        run.workers = len(slowdowns)
    cfg = RayConfig(run=run, address=args.address, server_port=args.port,
                    server=places["server"], groups=places["group"],
                    workers=places["worker"], evaluator=places["evaluator"],
                    external_groups=args.external_groups, evaluate=not args.no_eval,
                    slowdowns=slowdowns, max_restarts=args.max_restarts,
                    checkpoint_every_s=args.checkpoint_every, out_dir=args.out,
                    name=args.name, timeout_s=args.timeout)
    return 0 if run_ray(cfg).get("status") == "done" else 1
