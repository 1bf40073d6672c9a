"""On-device compression: selection time on the device and bytes copied to the host per step.

For the gradient sizes of LeNet-5 and ResNet-18 at ``--ratio`` kept, with ``topk`` (exact k)
and ``dgc`` (k to 1.1 k), on ``--device`` (default ``auto``: CUDA, then MPS, then the CPU):

- ``select_ms``: median time of the selection alone (``TorchTopK.select``) on the device;
- ``compress_ms``: median time of a whole ``compress`` of a compressor placed on the device
  (``device_compressor``): error feedback add, selection, residual update, and the copy of the
  k' indices and values to the host;
- ``numpy_compress_ms``: the host compressor (numpy, the CPU worker's default) on the same
  gradients, for comparison;
- ``host_bytes``: bytes copied device -> host per step (8 per kept entry: int32 index, float32
  value); ``dense_bytes``: the float32 gradient (4 n), what a host-side compressor would copy;
  ``fewer_x``: dense_bytes / host_bytes.

Gradients are standard normal, drawn on the device before timing. Prints one JSON object.

Usage: python scripts/bench_device_compress.py [--device auto] [--ratio 0.01] [--reps 15]
       [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from minips.compress import registry, selection
from minips.compress.device_compress import device_compressor
from minips.core import config
from minips.ml.device import pick_device

SIZES = {"lenet5": config.PARAM_COUNTS["lenet5"], "resnet18": config.PARAM_COUNTS["resnet18"]}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[int], Any], reps: int, device: torch.device) -> float:
    """Median milliseconds of ``fn(i)`` over ``reps`` calls, after one warm-up call."""
    fn(reps)
    times = []
    for i in range(reps):
        sync(device)
        t = time.perf_counter()
        fn(i)
        sync(device)
        times.append(time.perf_counter() - t)
    return round(1e3 * statistics.median(times), 3)


def one(name: str, n: int, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(n, generator=gen, device=device) for _ in range(args.reps + 1)]
    dev = device_compressor(registry.make_compressor(name, n, ratio=args.ratio), device,
                            on_device=True)
    host = registry.make_compressor(name, n, ratio=args.ratio)
    k = selection.kept_count(args.ratio, n)
    select_ms = timed(lambda i: dev.selector.select(grads[i], k), args.reps, device)
    compress_ms = timed(lambda i: dev.compress(grads[i]), args.reps, device)
    host_grads = [g.cpu().numpy() for g in grads]
    numpy_ms = timed(lambda i: host.compress(host_grads[i]), args.reps, torch.device("cpu"))
    return {"n": n, "k": k, "select_ms": select_ms, "compress_ms": compress_ms,
            "numpy_compress_ms": numpy_ms, "host_bytes": dev.host_bytes, "dense_bytes": 4 * n,
            "fewer_x": round(4 * n / dev.host_bytes, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", help="where to select (default %(default)s)")
    ap.add_argument("--ratio", type=float, default=0.01, help="kept fraction (default %(default)s)")
    ap.add_argument("--reps", type=int, default=15, help="timed calls (default %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    out: dict[str, Any] = {"device": str(device), "ratio": args.ratio, "torch": torch.__version__,
                           "load_avg": os.getloadavg()}
    for model, n in SIZES.items():
        for name in ("topk", "dgc"):
            out[f"{model}-{name}"] = one(name, n, device, args)
    out["load_avg_end"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
