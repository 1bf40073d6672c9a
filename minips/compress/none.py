"""``none``: the whole gradient in float32, nothing kept back (the dense baseline)."""

from __future__ import annotations

import numpy as np

from minips.compress.base import Compressor

__all__ = ["DenseCompressor"]


class DenseCompressor(Compressor):
    """``none``: the whole gradient in float32."""

    name = "none"

    def set_ratio(self, r: float) -> None:
        """Ignored: a dense compressor always sends everything (the server may send any ratio)."""
        self.ratio = 1.0

    def _compress(self, acc: np.ndarray) -> np.ndarray:
        out = acc.copy()
        self._keep_back(out)
        return out
