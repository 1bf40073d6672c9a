"""``dgc``: Deep Gradient Compression's sampled threshold, keeping the largest k to
k * (1 + tolerance) (``tolerance=0.1``), and DGC's warm-up (``warmup_epochs=4`` turns it on).

``warmup_ratio(epoch, final, start=0.25, decay=0.25, epochs=4)``: the kept fraction
``max(final, start * decay ** floor(epoch))`` for epoch < epochs (25%, 6.25%, 1.56%, 0.39%),
then ``final``.
"""

from __future__ import annotations

import math
from typing import Any

from minips.compress.topk import TopKCompressor
from minips.errors import ConfigError

__all__ = ["DGCCompressor", "warmup_ratio"]


def warmup_ratio(
    epoch: float, final: float, *, start: float = 0.25, decay: float = 0.25, epochs: int = 4
) -> float:
    """DGC warm-up: kept fraction for ``epoch`` (float) falling from ``start`` to ``final``."""
    if epoch >= epochs:
        return final
    return max(final, start * decay ** math.floor(max(epoch, 0.0)))


class DGCCompressor(TopKCompressor):
    """``dgc``: DGC's sampled threshold, keeping k to k * (1 + tolerance); optional warm-up."""

    name = "dgc"

    def __init__(self, size: int, *, tolerance: float = 0.1, warmup_epochs: int = 0,
                 **kw: Any) -> None:
        if not 0.0 <= tolerance < 1.0:
            raise ConfigError(f"tolerance must be in [0, 1), got {tolerance}")
        self.tolerance = tolerance
        self.warmup_epochs = warmup_epochs  # 0: no warm-up
        super().__init__(size, **kw)

    def current_ratio(self) -> float:
        if self.warmup_epochs <= 0:
            return self.ratio
        return warmup_ratio(self.epoch, self.ratio, epochs=self.warmup_epochs)
