"""The compressed group <-> global exchange: its kept fraction, the top-k it sends, and the
global server's replica of what each group holds of the global weights (numpy, sans-IO).

Up, a group sends ``s = topk(sent - w_sync)`` (exchange.py); what it does not send stays in its
``w - w_sync`` and goes with a later exchange (error feedback by bookkeeping). Down, the global
server keeps ``known[g]``, the exact copy group ``g`` holds of the global weights (its ``w_sync``),
and answers an exchange with the entries where the global weights ``G`` and ``known[g]`` differ
most: ``idx = topk(G - known[g])``, sent as ``G[idx]`` (values to *set*, not to add), and
``known[g][idx] = G[idx]``. What is not sent stays in ``G - known[g]`` and goes later.

Exactly once, and exact. Values to set are idempotent, so a lost reply does no harm: a group
starts a new exchange (seq) only after the reply to the last one, so the indices sent since the
last new seq (``unacked``) are the only ones the group may lack; the answer to a repeat sends
them again with their current values, together with the new top-k (after a dense answer that
may have been lost, the answer to the repeat is dense again). Either way the group's copy
equals ``known[g]`` bit for bit afterwards (copies, no arithmetic).

Dense answers (``G`` itself, the group takes it whole as ``w_sync``): when the ratio is 1 (no
replica is kept then, as before this compression), when the replica is unknown (a new group, a
global server resumed from its checkpoint: ``known`` is not saved), and when the sparse answer
would be nearly dense (``DENSE_AT``). A group process's PULL (registering, adopting, reconnecting)
answers with ``G`` dense, so the replica is reset to it (``reset``).

Invariant: when ``known`` is not None, a group that got every reply holds ``known`` exactly, and
one that lost the last replies holds ``known`` except at ``unacked``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minips.compress.registry import is_sparse
from minips.compress.sparse_select import TopKSelector, kept_count
from minips.sparse import SparseGrad

__all__ = ["DENSE_AT", "Replica", "exchange_ratio", "top_entries"]

DENSE_AT = 0.5  # an answer with more than this fraction of entries goes dense (smaller then)


def exchange_ratio(run: Any) -> float:
    """The exchange's kept fraction (both ways): ``run.xchg_ratio``, or when unset the run's
    ``ratio`` with a sparse compressor and 1.0 (dense) with a dense one (``compress.is_sparse``:
    ``none``, ``fp16``)."""
    if run.xchg_ratio is not None:
        return float(run.xchg_ratio)
    return float(run.ratio) if is_sparse(run.compressor) else 1.0


def top_entries(selector: TopKSelector, x: np.ndarray, ratio: float) -> np.ndarray:
    """(k,) int64 sorted indices of the ``ratio`` largest ``|x|`` entries, zeros left out."""
    idx = selector.select(x, kept_count(ratio, x.size))
    return idx[x[idx] != 0]


class Replica:
    """``known[g]`` of one group and the indices of the replies it may have lost."""

    def __init__(self, size: int, ratio: float) -> None:
        self.ratio = ratio
        self.known: np.ndarray | None = None  # (n,) float32; None: unknown, answer dense
        self.unacked = np.empty(0, np.int64)  # indices sent since the group's last new seq
        self.dense_unacked = False  # a dense answer went out since the group's last new seq
        self._selector = TopKSelector(size) if ratio < 1.0 else None

    def reset(self, weights: np.ndarray | None = None) -> None:
        """The group took ``weights`` whole (a dense answer or a PULL); None: unknown."""
        keep = weights is not None and self.ratio < 1.0
        self.known = np.array(weights, dtype=np.float32) if keep else None
        self.unacked = np.empty(0, np.int64)
        self.dense_unacked = False

    def answer(self, weights: np.ndarray, repeat: bool) -> np.ndarray | SparseGrad:
        """The reply to an exchange, the global weights being ``weights`` after its merge:
        a (n,) copy (dense) or the entries to set (sparse). ``repeat``: the exchange repeats
        the last one (its reply may have been lost)."""
        if self.known is None or self._selector is None or (repeat and self.dense_unacked):
            return self._dense(weights)
        diff = weights - self.known  # (n,) float32
        idx = top_entries(self._selector, diff, self.ratio)
        self.known[idx] = weights[idx]
        if repeat:
            idx = np.union1d(self.unacked, idx)
        if idx.size > DENSE_AT * weights.size:
            return self._dense(weights)
        self.unacked, self.dense_unacked = idx, False
        return SparseGrad(idx.astype(np.uint32), self.known[idx], weights.size)

    def _dense(self, weights: np.ndarray) -> np.ndarray:
        out = np.array(weights, dtype=np.float32)
        self.reset(out)
        self.dense_unacked = True  # if it is lost, the group's copy is anything: dense again
        return out
