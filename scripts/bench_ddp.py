"""torch DDP over gloo on the same cluster as `reproduce.py`'s suites: the baseline a user would
run instead of minips.

The same profile (an emulated slowdown factor per rank), samples (each rank's shard and batch
order: ``data.shard_indices`` and ``batch_stream``, as minips workers), model and initial
weights (``models.build_model(name, seed)``), optimizer (SGD with momentum and weight decay,
torch's semantics, as ``reference.train``), lr schedule (``optim.lr_factor`` per step of
ranks x batch samples, with minips' linear warm-up over ``--lr-warmup`` epochs of the training
set, RunConfig's ``lr_warmup``, and its decay over the budget) and samples budget as a minips
BSP run: ``--epochs`` is the cluster's budget, epochs x the training set, all ranks together
(``budget_steps``: the rounds of ranks x batch that reach it, as minips BSP's server stops at
the first round that does), not epochs of each rank's shard. With the hook ``none`` this is
synchronous SGD, the same updates as ``reference.train`` and as minips BSP, so the rows differ
in their communication only. Hooks: ``none`` (fp32 all-reduce), ``fp16``
(``default_hooks.fp16_compress_hook``) and ``powersgd`` (``powerSGD_hook``, rank
``--powersgd-rank``, error feedback on, starting after ``--powersgd-start`` steps).

A step on rank i: forward, then a sleep so that forward + backward take at least
F_i x ``--base-step`` (minips' emulation: ``worker._stretch``; F_i may follow a schedule,
``--profile 1,1,4@0,1@60s``, and ``--throttle P,MIN-MAX,SECONDS``, both as `minips local
--slowdown` / ``--throttle``, core/slowdown.py, with T counted from the training start), then
backward, whose gradient
all-reduce waits for the slowest rank. The backward pass's own time is measured before
training (5 passes without the all-reduce, ``no_sync``), since in DDP it overlaps the
communication. Each rank records its compute time per step (forward as measured + that
backward) against the emulated one: the overrun, its median per rank (a row whose ranks
overrun by more than 5% measures the CPU, not the method).

With ``--link RATE`` every rank runs in its own network namespace behind a veth pair shaped by
``tc`` in both directions (``net/netshape.py``, as `minips local --link`), so every byte a rank
sends or receives crosses its shaped pair; ranks reach each other through this machine (IP
forwarding is switched on for the run and restored after). Needs root.

Rank 0 keeps a copy of the weights every ``--eval-every-s`` seconds (a copy only: the timed
path holds no evaluation); the copies are evaluated after the run, on the first
``--eval-limit`` test samples as minips' evaluator does, and the last (the weights once the
budget is spent, as the table takes every row's) on the whole test set:
``final_full_test``, on ``final_full_test_samples`` samples.

Printed as one JSON object: the hook, ranks, seed, steps, training seconds, time to each target
accuracy, final accuracy (eval-limit and whole test set), per-rank overrun (median achieved /
emulated compute time), bytes per rank through its link (with ``--link``), and the snapshots.

Usage: python scripts/bench_ddp.py [--hook none|fp16|powersgd] [--seed 0] [--epochs 4]
       [--profile 1,1,1.5,1.5,2,2,4,4] [--base-step 0.1] [--link 20mbit] [--lr 0.05] ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

QUICK_PROFILE = [1.0, 1.0, 1.5, 1.5, 2.0, 2.0, 4.0, 4.0]  # reproduce.py's QUICK_PROFILE
TARGETS = (0.70, 0.75, 0.80, 0.85)
LR_WARMUP = 0.3  # epochs: RunConfig.lr_warmup's default, the warm-up every minips row has


def budget_steps(epochs: float, train_size: int, ranks: int, batch_size: int) -> int:
    """Steps of ``ranks`` x ``batch_size`` samples that spend a budget of ``epochs`` x
    ``train_size`` samples, all ranks together: the first round that reaches it, as a minips
    BSP run ends (its global server stops once its samples reach the budget)."""
    return math.ceil(epochs * train_size / (ranks * batch_size))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hook", choices=("none", "fp16", "powersgd"), default="none")
    ap.add_argument("--powersgd-rank", type=int, default=2, help="PowerSGD's rank (2)")
    ap.add_argument("--powersgd-start", type=int, default=10,
                    help="steps of plain all-reduce before PowerSGD starts (10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=float, default=4.0,
                    help="the samples budget: epochs of the training set, all ranks together (4)")
    ap.add_argument("--steps", type=int, default=0, help="steps instead of --epochs (0: epochs)")
    ap.add_argument("--save-final", default="", help="write the final weights here (.npy)")
    ap.add_argument("--profile", default=",".join(map(str, QUICK_PROFILE)),
                    help="slowdown factor per rank (the quick suite's)")
    ap.add_argument("--throttle", default="", help="random throttling P,MIN-MAX,SECONDS "
                    "(minips local --throttle; seeded by --seed)")
    ap.add_argument("--base-step", type=float, default=0.1,
                    help="emulated base step seconds: rank i computes at least F_i x this (0.1)")
    ap.add_argument("--model", default="lenet5")
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--lr-schedule", default="cosine")
    ap.add_argument("--lr-warmup", type=float, default=LR_WARMUP,
                    help=f"epochs of the training set over which lr ramps up ({LR_WARMUP:g}, "
                    "minips' default; 0 = none)")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--link", default="", help="every rank's link, e.g. 20mbit (kernel-shaped)")
    ap.add_argument("--eval-every-s", type=float, default=2.0)
    ap.add_argument("--eval-limit", type=int, default=5000)
    ap.add_argument("--wall-s", type=float, default=600.0, help="stop training after this (600)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch threads per rank (1)")
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)  # a rank process
    ap.add_argument("--store", default="", help=argparse.SUPPRESS)  # host:port of the store
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)  # where a rank writes
    ap.add_argument("--ifname", default="", help=argparse.SUPPRESS)  # gloo's interface
    return ap


# ---------------------------------------------------------------------------------------------
# One rank


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from minips.core import optim
    from minips.core.slowdown import Slowdown, parse_schedules, parse_throttle
    from minips.ml import data, models
    from minips.net import lifeline

    lifeline.watch_parent()
    torch.set_num_threads(args.torch_threads)
    schedules = parse_schedules(args.profile)
    world, rank = len(schedules), args.rank
    slowdown = Slowdown(schedules[rank], parse_throttle(args.throttle) if args.throttle else None,
                        seed=args.seed, worker=rank)
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world, is_master=False, timeout=_td(120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    ds = data.load_dataset(args.dataset, "train", fallback=False)
    model = models.build_model(args.model, args.seed)
    ddp = DDP(model)
    if args.hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=args.powersgd_start, use_error_feedback=True, warm_start=True,
            random_seed=args.seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    shard = data.shard_indices(len(ds), rank, world, args.seed)
    stream = data.batch_stream(ds, shard, args.batch_size, args.seed)
    total = args.steps or budget_steps(args.epochs, len(ds), world, args.batch_size)
    per_step = world * args.batch_size
    # the schedule's samples, as minips': the budget (epochs x the training set; with --steps,
    # those steps, as reference.train) and the warm-up (lr_warmup epochs of the training set)
    budget = total * per_step if args.steps else args.epochs * len(ds)
    ramp = args.lr_warmup * len(ds)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                          weight_decay=args.weight_decay)
    emulated = schedules[rank].first * args.base_step  # at the start (reported)
    backward_s = _local_backward_s(args, ddp, ds, shard)
    computes: list[float] = []
    overruns: list[float] = []  # compute / emulated per step
    snapshots: list[tuple[float, int, np.ndarray]] = []
    dist.barrier()
    t0 = time.perf_counter()
    last_snap = -1e9
    steps = 0
    for step in range(1, total + 1):
        _, xb, yb = next(stream)
        factor = optim.lr_factor(args.lr_schedule, seen=(step - 1) * per_step, step=per_step,
                                 ramp=ramp, budget=budget)
        for group in opt.param_groups:
            group["lr"] = args.lr * factor
        t_step = time.perf_counter()
        target = slowdown.factor(t_step - t0) * args.base_step  # this step's emulated compute
        opt.zero_grad(set_to_none=True)
        loss = models.batch_loss(args.model, ddp, torch.from_numpy(xb), torch.from_numpy(yb))
        forward = time.perf_counter() - t_step
        if forward + backward_s < target:
            time.sleep(target - forward - backward_s)
        computes.append(max(target, forward + backward_s))  # this step's compute, emulated
        overruns.append(computes[-1] / target if target else 1.0)
        loss.backward()  # the all-reduce: waits for the slowest rank
        opt.step()
        steps = step
        now = time.perf_counter() - t0
        if rank == 0 and now - last_snap >= args.eval_every_s:
            snapshots.append((now, step * per_step, models.get_flat(model)))
            last_snap = now
        if step % 20 == 0:  # every rank stops at the same step
            stop = torch.tensor([1 if now > args.wall_s else 0])
            dist.all_reduce(stop)
            if int(stop):
                break
    train_s = time.perf_counter() - t0
    if rank == 0:
        snapshots.append((train_s, steps * per_step, models.get_flat(model)))
    out = Path(args.out)
    result = {"rank": rank, "steps": steps, "total_steps": total, "train_s": train_s,
              "emulated_s": emulated, "compute_median_s": float(np.median(computes)),
              "overrun": float(np.median(overruns)) if args.base_step else None}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        np.savez(out / "snapshots.npz", t=np.array([s[0] for s in snapshots]),
                 samples=np.array([s[1] for s in snapshots]),
                 w=np.stack([s[2] for s in snapshots]))
    # Every rank has written its result before any leaves. The process then ends without running
    # gloo's C++ teardown: destroy_process_group (or the interpreter's exit) can race its own
    # background threads and abort with "terminate called without an active exception".
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _local_backward_s(args: argparse.Namespace, ddp: Any, ds: Any, shard: Any) -> float:
    """Median seconds of this rank's backward pass alone (no all-reduce: ``no_sync``), over 5
    passes on one batch before training (the weights are not changed). The ranks measure one
    after another: 8 ranks measuring at once on 2 cores took each other's time slices, and a
    rank's backward measured twice its length made it skip its emulated sleep all run long."""
    import torch.distributed as dist

    measured = 0.0
    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            measured = _backward_passes_s(args, ddp, ds, shard)
        dist.barrier()
    return measured


def _backward_passes_s(args: argparse.Namespace, ddp: Any, ds: Any, shard: Any) -> float:
    """The median of 5 timed backward passes on this rank's first batch."""
    import torch

    from minips.ml import models

    idx = shard[:args.batch_size]
    x, y = torch.from_numpy(ds.x[idx]), torch.from_numpy(ds.y[idx])
    times = []
    with ddp.no_sync():
        for _ in range(5):
            loss = models.batch_loss(args.model, ddp, x, y)
            t = time.perf_counter()
            loss.backward()
            times.append(time.perf_counter() - t)
    ddp.zero_grad(set_to_none=True)
    return float(np.median(times))


def _td(seconds: float) -> Any:
    import datetime
    return datetime.timedelta(seconds=seconds)


# ---------------------------------------------------------------------------------------------
# The launcher


@contextlib.contextmanager
def _forwarding() -> Iterator[None]:
    """IPv4 forwarding on for the run (ranks in namespaces reach each other through this
    machine), set back to what it was after."""
    path = Path("/proc/sys/net/ipv4/ip_forward")
    before = path.read_text().strip()
    path.write_text("1\n")
    try:
        yield
    finally:
        path.write_text(before + "\n")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def launch(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from minips.core.slowdown import parse_schedules
    from minips.net import lifeline, links, netshape

    world = len(parse_schedules(args.profile))
    spaces = None
    if args.link:
        why = netshape.unavailable()
        if why:
            raise SystemExit(f"bench_ddp: --link: {why}")
        netshape.remove_stale()
        prof = links.parse_profile(args.link)
        spaces = netshape.create([prof.rate(i) for i in range(world)])
    with tempfile.TemporaryDirectory() as tmp, (_forwarding() if spaces else
                                                 contextlib.nullcontext()):
        try:
            host = spaces.server_host if spaces else "127.0.0.1"
            port = _free_port(host)
            store = dist.TCPStore(host, port, world, is_master=True, timeout=_td(120),
                                  wait_for_workers=False)
            before = _veth_bytes(spaces, world)
            procs = []
            for r in range(world):
                argv = [sys.executable, __file__, *_rank_argv(args), "--rank", str(r),
                        "--store", f"{host}:{port}", "--out", tmp]
                env = lifeline.child_env()
                if spaces is not None:
                    env["GLOO_SOCKET_IFNAME"] = spaces.veths(r)[1]
                    argv = spaces.command(r, argv)
                else:
                    env["GLOO_SOCKET_IFNAME"] = "lo"
                procs.append(subprocess.Popen(argv, env=env))
            deadline = time.monotonic() + args.wall_s + 300
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            failed = [r for r, p in enumerate(procs) if p.returncode]
            if failed:
                raise SystemExit(f"bench_ddp: ranks {failed} failed")
            after = _veth_bytes(spaces, world)
            del store
            ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
            snaps = np.load(Path(tmp) / "snapshots.npz")
            return _report(args, ranks, snaps, before, after)
        finally:
            for p in locals().get("procs", []):
                if p.poll() is None:
                    p.kill()
            if spaces is not None:
                spaces.remove()


def _rank_argv(args: argparse.Namespace) -> list[str]:
    skip = {"rank", "store", "out", "ifname"}
    out = []
    for k, v in vars(args).items():
        if k not in skip:
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def _veth_bytes(spaces: Any, world: int) -> list[tuple[int, int]]:
    """(bytes to the rank, bytes from it) through each rank's host-side veth so far."""
    if spaces is None:
        return []
    out = []
    for r in range(world):
        stats = Path("/sys/class/net") / spaces.veths(r)[0] / "statistics"
        out.append((int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())))
    return out


def _report(args: argparse.Namespace, ranks: list[dict[str, Any]], snaps: Any,
            before: list[tuple[int, int]], after: list[tuple[int, int]]) -> dict[str, Any]:
    from minips.ml import data, models

    test = data.load_dataset(args.dataset, "test", fallback=False)
    limited = test.subset(np.arange(min(args.eval_limit, len(test)))) if args.eval_limit else test
    curve = []
    for t, samples, w in zip(snaps["t"], snaps["samples"], snaps["w"], strict=True):
        acc, loss = models.evaluate(args.model, w, limited)
        curve.append({"t": round(float(t), 2), "samples": int(samples),
                      "accuracy": round(acc, 4), "loss": round(loss, 4)})
    full_acc, _ = models.evaluate(args.model, snaps["w"][-1], test)
    if args.save_final:
        np.save(args.save_final, snaps["w"][-1])
    reach = {f"{a:.2f}": next((c["t"] for c in curve if c["accuracy"] >= a), None)
             for a in TARGETS}
    link = {}
    if before:
        link = {"bytes_to_rank": [a[0] - b[0] for a, b in zip(after, before, strict=True)],
                "bytes_from_rank": [a[1] - b[1] for a, b in zip(after, before, strict=True)]}
        link["bytes_total"] = sum(link["bytes_from_rank"])
    overrun = [round(r["overrun"], 3) if r["overrun"] else None for r in ranks]
    return {"bench": "ddp", "hook": args.hook, "ranks": len(ranks), "seed": args.seed,
            "epochs": args.epochs, "profile": args.profile, "base_step_s": args.base_step,
            "link": args.link, "steps": ranks[0]["steps"], "total_steps": ranks[0]["total_steps"],
            "train_s": round(ranks[0]["train_s"], 2), "time_to_accuracy_s": reach,
            "final_accuracy": curve[-1]["accuracy"], "final_full_test": round(full_acc, 4),
            "final_full_test_samples": len(test), "lr_warmup": args.lr_warmup,
            "overrun_per_rank": overrun,
            "overrun_max": max((o for o in overrun if o is not None), default=None),
            **link, "curve": curve, "load_avg_1min": os.getloadavg()[0]}


def main() -> None:
    args = _parser().parse_args()
    if args.rank >= 0:
        rank_main(args)
        return
    print(json.dumps(launch(args)))


if __name__ == "__main__":
    main()
