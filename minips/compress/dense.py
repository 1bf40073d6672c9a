"""``none``: the whole gradient in float32, nothing kept back (the dense baseline).

``fp16``: the whole gradient in float16 (clipped to +-65504), 2 bytes a value on the wire; the
rounding error goes to the residual.
"""

from __future__ import annotations

import numpy as np

from minips.compress.base import FP16_MAX, Compressor, WireSpec

__all__ = ["DenseCompressor", "Fp16Compressor"]


# ---------------------------------------------------------------------------- none

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


# ---------------------------------------------------------------------------- fp16

class Fp16Compressor(DenseCompressor):
    """``fp16``: the whole gradient in float16; the rounding error stays in the residual."""

    name = "fp16"
    wire = WireSpec(sparse=False, dtype="f16")

    def _compress(self, acc: np.ndarray) -> np.ndarray:
        half = np.clip(acc, -FP16_MAX, FP16_MAX).astype(np.float16)  # (n,) float16
        self._keep_back(half)  # float16 widens exactly; no (n,) float32 copy is made
        return half
