"""Train a model with the plain single-process loop (minips.ml.reference) and report the result.

    python scripts/train_reference.py --model lenet5 --epochs 3 --json
    python scripts/train_reference.py --workers 8 --epochs 5 --lr 0.05 --lr-schedule cosine \
        --lr-warmup 0.3 --eval-limit 5000 --json     # a reproduce.py suite's BSP row, in one loop

prints one JSON object: model, data set (and whether it was synthetic), epochs, steps, wall
time, test accuracy and loss on the whole test set, with ``--eval-limit N`` also on its first N
samples (what the suites' curves are scored on), and the per-epoch history. Figures come from
this one run. With a suite's workers, lr, schedule and warm-up this is synchronous SGD as
minips BSP and bench_ddp.py's DDP without a hook train it; note that ``--epochs`` here counts
epochs of each worker's shard (whole epochs), while the suites' budget is epochs of the
training set, all workers together, to the first round that reaches it (for 5 epochs of 8
shards of 7,500 samples in batches of 64: 586 rounds here are ``--steps 586``, ``--epochs 5``
585).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

import numpy as np
import torch

from minips.core import config
from minips.core.optim import SCHEDULES
from minips.ml import data, models, reference

__all__ = ["main", "run"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lenet5", choices=config.MODEL_NAMES)
    p.add_argument("--dataset", default=None, help="default: the model's own data set")
    p.add_argument("--data-dir", default=None, help="directory holding the data files")
    p.add_argument("--synthetic", action="store_true", help="use the synthetic stand-in")
    p.add_argument("--epochs", type=int, default=None, help="default 3 unless --steps is given")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--lr-schedule", choices=SCHEDULES, default="constant",
                   help="lr over the run: constant (default) or a decay to 0 at its end")
    p.add_argument("--lr-warmup", type=float, default=0.0,
                   help="epochs of the training set over which lr ramps up (0: none; the "
                   "suites' minips rows have 0.3)")
    p.add_argument("--eval-limit", type=int, default=0,
                   help="also score the final weights on the first N test samples (0: not)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="shards averaged per step")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    args = p.parse_args(argv)
    if args.epochs is None and args.steps is None:
        args.epochs = 3
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Load data, train, evaluate; returns the result record."""
    torch.set_num_threads(args.threads)
    name = args.dataset or config.DEFAULT_DATASET[args.model]
    t0 = time.perf_counter()
    train = data.load_dataset(name, "train", args.data_dir, synthetic=args.synthetic)
    test = data.load_dataset(name, "test", args.data_dir, synthetic=args.synthetic)
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    flat, history = reference.train(
        args.model, train, lr=args.lr, seed=args.seed, epochs=args.epochs, steps=args.steps,
        batch_size=args.batch_size, momentum=args.momentum, weight_decay=args.weight_decay,
        workers=args.workers, test=test, lr_schedule=args.lr_schedule,
        lr_warmup=args.lr_warmup)
    wall_s = time.perf_counter() - t1
    accuracy, loss = models.evaluate(args.model, flat, test, train_for_bn=train)
    first = {}
    if args.eval_limit > 0:
        head = test.subset(np.arange(min(args.eval_limit, len(test))))
        acc, _ = models.evaluate(args.model, flat, head, train_for_bn=train)
        first = {"eval_limit": len(head), "test_accuracy_first": acc}
    return {
        "model": args.model, "params": int(flat.size), "dataset": name,
        "synthetic": bool(train.meta["synthetic"]), "epochs": history[-1]["epoch"],
        "steps": history[-1]["step"], "batch_size": args.batch_size, "lr": args.lr,
        "workers": args.workers, "threads": args.threads, "load_s": round(load_s, 3),
        "wall_s": round(wall_s, 3), "train_s": round(history[-1]["time_s"], 3),
        "lr_schedule": args.lr_schedule, "lr_warmup": args.lr_warmup,
        "test_accuracy": accuracy, "test_loss": loss, "test_samples": len(test), **first,
        "history": history,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    result = run(args)
    if not args.json:
        for rec in result["history"]:
            print(f"epoch {rec['epoch']:.2f}  step {rec['step']}  loss {rec['train_loss']:.4f}"
                  f"  test acc {rec['test_accuracy']:.4f}  {rec['time_s']:.1f}s", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
