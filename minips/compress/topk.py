"""``topk``: exactly the k = round(ratio * n) largest |acc| (acc = residual + gradient), found by
``sparse_select.TopKSelector`` (sampled threshold + exact partition of the candidates)."""

from __future__ import annotations

from typing import Any

import numpy as np

from minips.compress.base import SparseCompressor
from minips.compress.sparse_select import TopKSelector

__all__ = ["TopKCompressor"]


class TopKCompressor(SparseCompressor):
    """``topk``: exactly the k largest |acc| (sampled threshold + exact partition of candidates)."""

    name = "topk"
    tolerance = 0.0

    def __init__(self, size: int, **kw: Any) -> None:
        super().__init__(size, **kw)
        self.selector = TopKSelector(size, self.seed, tolerance=self.tolerance)

    def _select(self, acc: np.ndarray, k: int) -> np.ndarray:
        return self.selector.select(acc, k)  # ranks by |acc|
