"""Sharding and batch order: which samples a worker trains on, and in which order.

Invariants:
- Shards from ``shard_indices`` are disjoint, cover 0..n-1 and depend only on their arguments.
- ``iterate_batches(ds, idx, b, seed, epoch)`` permutes the shard ``idx`` with
  ``numpy.random.default_rng([seed, epoch])`` and yields consecutive slices of ``b`` samples,
  dropping the last partial batch, so every step sees exactly ``b`` samples. A worker's step k
  uses its own epoch-local stream: epoch 0's batches, then epoch 1's, ... (``batch_stream``).
The reference loop (reference.py) and the worker (worker.py) both call these, which is what
makes a 1-worker BSP run through minips equal to the single-process loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from minips.errors import ConfigError

__all__ = ["shard_indices", "num_batches", "iterate_batches", "batch_stream"]


def _shard_bounds(n: int, num_workers: int, weights: Sequence[float] | None) -> np.ndarray:
    """(num_workers + 1,) int64 cut points 0 = b0 <= b1 <= ... = n, sized by ``weights``."""
    w = np.ones(num_workers) if weights is None else np.asarray(weights, np.float64)
    if w.shape != (num_workers,) or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ConfigError(f"weights must be {num_workers} positive numbers, got {weights!r}")
    cuts = np.rint(np.cumsum(w) / w.sum() * n).astype(np.int64)
    return np.concatenate([[0], cuts[:-1], [n]])


def shard_indices(n: int, worker_id: int, num_workers: int, seed: int,
                  weights: Sequence[float] | None = None) -> np.ndarray:
    """Worker ``worker_id``'s shard of samples 0..n-1 -> (m,) int64, sorted.

    One permutation from ``seed`` is cut into ``num_workers`` consecutive pieces, piece sizes
    proportional to ``weights`` (e.g. measured speeds; equal when None), so shards are disjoint
    and together cover every sample.
    """
    if not 0 <= worker_id < num_workers:
        raise ConfigError(f"worker_id {worker_id} not in 0..{num_workers - 1}")
    perm = np.random.default_rng(seed).permutation(n)
    bounds = _shard_bounds(n, num_workers, weights)
    return np.sort(perm[bounds[worker_id]:bounds[worker_id + 1]]).astype(np.int64)


def num_batches(shard_size: int, batch_size: int) -> int:
    """Batches per epoch of a shard (the last partial batch is dropped)."""
    return shard_size // batch_size


def iterate_batches(ds: Any, indices: np.ndarray, batch_size: int, seed: int, epoch: int
                    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (x (b, ...) , y (b, ...)) batches of one epoch over ``indices``, in a fixed order.

    The order is ``indices[default_rng([seed, epoch]).permutation(len(indices))]`` cut into
    consecutive slices of ``batch_size``; the last partial slice is dropped.
    """
    if batch_size <= 0:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    order = indices[np.random.default_rng([seed, epoch]).permutation(len(indices))]
    for start in range(0, num_batches(len(order), batch_size) * batch_size, batch_size):
        idx = order[start:start + batch_size]  # (b,) int64
        yield ds.x[idx], ds.y[idx]


def batch_stream(ds: Any, indices: np.ndarray, batch_size: int, seed: int,
                 start_epoch: int = 0) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Endless (epoch, x, y): epoch ``start_epoch``'s batches, then the next epoch's, ..."""
    if num_batches(len(indices), batch_size) == 0:
        raise ConfigError(f"shard of {len(indices)} samples has no full batch of {batch_size}")
    epoch = start_epoch
    while True:
        for xb, yb in iterate_batches(ds, indices, batch_size, seed, epoch):
            yield epoch, xb, yb
        epoch += 1
