"""``randomk``: k uniform random indices per step from a seeded generator; without error feedback,
``unbiased=True`` scales the values by n/k so that the expected packet is the gradient."""

from __future__ import annotations

from typing import Any

import numpy as np

from minips.compress.base import SparseCompressor
from minips.errors import ConfigError
from minips.wire.sparse_codec import SparseGrad

__all__ = ["RandomKCompressor"]


class RandomKCompressor(SparseCompressor):
    """``randomk``: k indices drawn uniformly without replacement from a seeded generator."""

    name = "randomk"

    def __init__(self, size: int, *, unbiased: bool = False, **kw: Any) -> None:
        super().__init__(size, **kw)
        self.rng = np.random.default_rng(self.seed)
        self.unbiased = unbiased  # scale by n/k so E[sent] = grad (only without error feedback)
        if unbiased and self.error_feedback:
            raise ConfigError("randomk: unbiased scaling is for error_feedback=False only")

    def _select(self, acc: np.ndarray, k: int) -> np.ndarray:
        idx = self.rng.choice(self.size, size=k, replace=False, shuffle=False)
        idx.sort()
        return idx.astype(np.int64)

    def _compress(self, acc: np.ndarray) -> SparseGrad:
        sg = super()._compress(acc)
        if not self.unbiased or sg.nnz == 0:
            return sg
        scaled = sg.values * np.float32(self.size / sg.nnz)
        return SparseGrad(sg.indices, scaled, sg.size)
