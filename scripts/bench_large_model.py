"""A real training run on a large model, to show where its time goes: is the server the limit?

Runs `minips local` (a real global server, its group servers as `minips group` processes for a
model of 10M parameters or more, real PyTorch workers on Fashion-MNIST padded to 32x32, an
evaluator) and, while it runs, reads every child's CPU time from /proc once a second. At the
end it prints one JSON document measured in that one run:

  worker_step_s p50/p99        a worker's step as it recorded it (compute, or its emulated step)
  worker_compute_s p50         the forward/backward part of it
  push_ack_ms p50/p99          PUSH sent -> ACK received, as the workers saw it
  pull_wait_ms p50/p99         PULL sent -> WEIGHTS in hand (the worker's ``wait_s``)
  server_cpu                   CPU seconds per second of training, global server + group
                               processes (1.0 = one core busy), and per process
  workers_cpu                  the same for all workers together
  server_share_of_step         server CPU per push / a worker's median step: far under 1 means
                               the server is not what the workers wait on

Usage (about 5 minutes on a 2-core CPU machine; torch needed):
  python scripts/bench_large_model.py --model resnet18 --workers 4 --max-steps 75
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_server import cpu_seconds

POLL_S = 1.0  # how often the children's CPU times are read


def children_cpu(parent: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system, ``bench_server.cpu_seconds``) of each child of ``parent``
    (the launcher starts them from its main thread), with its role: the `minips` subcommand
    and its run-dir name (server, group-0, worker-1, ...)."""
    try:
        pids = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:  # the launcher is gone
        return {}
    out: dict[int, tuple[str, float]] = {}
    for pid in map(int, pids):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            out[pid] = (_role(argv), cpu_seconds(pid))
        except OSError:  # gone between the listing and the read
            continue
    return out


def _role(argv: list[bytes]) -> str:
    """'server', 'group-0', 'worker-3', 'evaluator' from a `python -m minips ...` command."""
    words = [a.decode(errors="replace") for a in argv]
    if "-m" not in words or len(words) <= words.index("-m") + 2:
        return "other"
    command = words[words.index("-m") + 2]
    if command == "worker" and "--id" in words:
        return f"worker-{words[words.index('--id') + 1]}"
    if command == "group" and "--run-dir" in words:
        return Path(words[words.index("--run-dir") + 1]).name
    return command


def run(args: argparse.Namespace, out_dir: Path) -> tuple[Path, dict[str, float]]:
    """`minips local` to the end, its children's last CPU times by role."""
    cmd = [sys.executable, "-m", "minips", "local", "--model", args.model, "--mode", "gssp",
           "--groups", str(args.groups), "--compressor", args.compressor,
           "--workers", str(args.workers), "--max-steps", str(args.max_steps),
           "--batch-size", str(args.batch_size), "--eval-every", str(args.eval_every),
           "--eval-limit", str(args.eval_limit), "--no-progress", "--no-plot",
           "--out", str(out_dir), "--name", "run", *args.extra]
    log = open(out_dir / "local.log", "w")  # noqa: SIM115 (closed below; a pipe could fill up)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    roles: dict[int, str] = {}  # pid -> role, from the first reading that names it
    last: dict[int, float] = {}  # pid -> CPU seconds at the last reading
    while proc.poll() is None:
        for pid, (role, seconds) in children_cpu(proc.pid).items():
            if role != "other":  # an exited child's (a zombie's) command line reads empty
                roles.setdefault(pid, role)
            last[pid] = seconds
        time.sleep(POLL_S)
    log.close()
    if proc.returncode != 0:
        raise SystemExit(f"bench_large_model: minips local failed ({proc.returncode}):\n"
                         f"{(out_dir / 'local.log').read_text()}")
    cpu: dict[str, float] = {}
    for pid, seconds in last.items():
        role = roles.get(pid, "other")
        cpu[role] = cpu.get(role, 0.0) + seconds
    return out_dir / "run", cpu


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def figures(run_dir: Path, cpu: dict[str, float]) -> dict[str, Any]:
    """The JSON document: the workers' records and the processes' CPU over training."""
    steps = [json.loads(line) for f in sorted(run_dir.glob("worker-*.jsonl"))
             for line in f.read_text().splitlines() if '"step_time"' in line]
    summary = json.loads((run_dir / "summary.json").read_text())
    train_s = float(summary["train_s"])
    step = [r["step_time"] for r in steps]
    server = {r: s for r, s in cpu.items() if r == "server" or r.startswith("group-")}
    workers = sum(s for r, s in cpu.items() if r.startswith("worker-"))
    server_per_push = sum(server.values()) / max(len(steps), 1)
    return {
        "model": summary["model"], "workers": summary["workers"], "groups": summary["groups"],
        "compressor": summary["compressor"], "pushes": len(steps), "train_s": train_s,
        "final_accuracy": summary.get("final_accuracy"),
        "worker_step_s": {"p50": pct(step, 50), "p99": pct(step, 99)},
        "worker_compute_s": {"p50": pct([r.get("compute_s", 0.0) for r in steps], 50)},
        "push_ack_ms": {q: _ms(pct([r["push_s"] for r in steps], n))
                        for q, n in (("p50", 50), ("p99", 99))},
        "pull_wait_ms": {q: _ms(pct([r["wait_s"] for r in steps], n))
                         for q, n in (("p50", 50), ("p99", 99))},
        "server_cpu": {"total": sum(server.values()) / train_s,
                       **{r: s / train_s for r, s in sorted(server.items())}},
        "workers_cpu": workers / train_s,
        "server_cpu_per_push_s": server_per_push,
        "server_share_of_step": server_per_push / pct(step, 50) if step else None,
        "process_cpu_s": {r: round(c, 2) for r, c in sorted(cpu.items())},
        "note": "CPU from start-up to exit, divided by training seconds (an upper bound)",
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet18", help="model name (default resnet18)")
    ap.add_argument("--workers", type=int, default=4, help="workers (default 4)")
    ap.add_argument("--groups", type=int, default=2, help="GSSP groups (default 2)")
    ap.add_argument("--compressor", default="dgc", help="the workers' compressor (default dgc)")
    ap.add_argument("--max-steps", type=int, default=75, help="pushes per worker (default 75)")
    ap.add_argument("--batch-size", type=int, default=64, help="samples a step (default 64)")
    ap.add_argument("--eval-every", type=float, default=60.0, help="s between evaluations")
    ap.add_argument("--eval-limit", type=int, default=1000, help="test samples an evaluation")
    ap.add_argument("--out", help="keep the run directory here (default: a temporary one)")
    ap.add_argument("extra", nargs="*", help="more `minips local` flags, after --")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-large-") as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        run_dir, cpu = run(args, out)
        print(json.dumps(figures(run_dir, cpu), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
