"""`minips local`: a whole cluster on this machine, from the run directory to the summary.

One global server (`minips server`, its group servers in its process), N workers and an
evaluator, each a real process talking TCP on loopback exactly as on several machines. The
launcher owns only process management: it writes the initial weights (so every run of one seed
starts from the same point), starts the server on a free port and waits for its ready file,
starts the workers in parallel (importing torch takes seconds each), draws a progress line from
the metrics files, and when the server exits (budget spent) collects the children, writes
summary.json and the PNG charts and prints where they are.

With ``--link`` the workers' links are shaped (``netshape.plan``): by the kernel, each worker
in a network namespace of its own behind a rate-limited veth pair and the servers listening on
the host end of worker 0's pair, or by token buckets in the workers (the pacer). link.json in
the run directory (and ``link`` in summary.json) says which; the namespaces are removed when the
run ends, and those of a launcher that was killed before the next kernel-shaped run starts.

Invariants: every child runs in its own session, so Ctrl-C reaches the launcher only; the
launcher then stops the children (SIGTERM, SIGKILL after ``grace_s``) and still writes the
summary; SIGTERM does the same (status "terminated"). No child outlives ``run_local``, nor the
launcher's death by any signal, SIGKILL included (``lifeline.py``: each child watches it).

The child processes are managed by ``cluster.Cluster``, the progress line is progress.py, and
`minips server`'s process is server_process.py (``run_server``, ``serve_run``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from minips.errors import MiniPSError
from minips.net import links
from minips.run import metrics
from minips.run.cluster import Cluster, WorkersFailed
from minips.run.config import LaunchConfig
from minips.run.plot import plot_run

__all__ = ["Cluster", "Terminated", "WorkersFailed", "run_local", "make_run_dir", "write_init"]


class Terminated(MiniPSError):
    """SIGTERM reached the launcher: stop the cluster, write the summary, exit 143."""


def make_run_dir(cfg: LaunchConfig) -> Path:
    """runs/<time>-<mode>-<compressor>/ (or ``cfg.name``), created, with a unique name."""
    name = cfg.name or f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.run.mode}-{cfg.run.compressor}"
    path = Path(cfg.out_dir) / name
    n = 1
    while path.exists() and cfg.name is None:
        n += 1
        path = Path(cfg.out_dir) / f"{name}-{n}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_init(run_dir: Path, model: str, seed: int) -> Path:
    """The model's initial flat weights as init.npy (torch is imported here only)."""
    from minips.ml import models

    path = run_dir / "init.npy"
    np.save(path, models.get_flat(models.build_model(model, seed)))
    return path


def _timeout(cfg: LaunchConfig) -> float:
    if cfg.timeout_s > 0:
        return cfg.timeout_s
    return (cfg.run.wall_s or 1800.0) + 120.0


def run_local(cfg: LaunchConfig) -> dict[str, Any]:
    """Run the cluster to the end of its budget; return the summary (``status`` added)."""
    cfg.run.validate()
    run_dir = make_run_dir(cfg)
    token = os.environ.get("MINIPS_TOKEN") or secrets.token_hex(16)
    (run_dir / "launch.json").write_text(json.dumps(asdict(cfg), indent=2))
    print(f"minips local: run directory {run_dir}", file=sys.stderr, flush=True)
    cluster = Cluster(cfg, run_dir, token, links.parse_profile(cfg.link) if cfg.link else None)
    status = "done"
    previous = _on_sigterm(_terminate)
    try:
        cluster.shape()
        cluster.start_server(write_init(run_dir, cfg.run.model, cfg.run.seed))
        cluster.start_workers()
        if cfg.evaluator:
            cluster.start_evaluator()
        if cfg.dashboard:
            cluster.announce_dashboard()
        if cluster.wait(_timeout(cfg), cfg.progress) != 0:
            status = "failed"
        failed = cluster.collect()
        if failed:
            print(f"minips local: {', '.join(failed)} exited with an error; see their logs in "
                  f"{cluster.logs}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        status = "interrupted"
    except TimeoutError:
        status = "timeout"
    except Terminated:
        status = "terminated"
    except WorkersFailed as exc:
        print(f"minips local: {exc}", file=sys.stderr, flush=True)
        status = "failed"
    finally:
        cluster.stop()
        cluster.unshape()
        _on_sigterm(previous)
    return _finish(cfg, run_dir, status)


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated("terminated by SIGTERM")


def _on_sigterm(handler: Any) -> Any:
    """Install ``handler`` for SIGTERM; return the previous one (None off the main thread,
    where Python cannot set handlers: the caller's own handling applies)."""
    try:
        return signal.signal(signal.SIGTERM, handler)
    except (ValueError, TypeError):
        return None


def _finish(cfg: LaunchConfig, run_dir: Path, status: str) -> dict[str, Any]:
    summary = metrics.summarize(run_dir, write=False)
    summary.update(status=status, run_dir=str(run_dir), slowdowns=cfg.factors())
    with contextlib.suppress(OSError, ValueError):  # the link of a --link run (link.json)
        summary["link"] = json.loads((run_dir / "link.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    pngs = plot_run(run_dir, "minips local") if cfg.plot and status != "terminated" else []
    acc = summary.get("final_accuracy")
    print(f"minips local: {status} in {summary.get('wall_s') or 0:.1f} s, final accuracy "
          f"{acc if acc is None else round(acc, 4)} ({summary.get('data') or 'unknown'} data)"
          f"\n  run directory: {run_dir}\n"
          f"  summary:       {run_dir / 'summary.json'}", file=sys.stderr, flush=True)
    for p in pngs:
        print(f"  plot:          {p}", file=sys.stderr, flush=True)
    return summary
