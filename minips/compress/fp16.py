"""``fp16``: the whole gradient in float16 (clipped to +-65504), 2 bytes a value on the wire; the
rounding error goes to the residual."""

from __future__ import annotations

import numpy as np

from minips.compress.base import FP16_MAX, WireSpec
from minips.compress.none import DenseCompressor

__all__ = ["Fp16Compressor"]


class Fp16Compressor(DenseCompressor):
    """``fp16``: the whole gradient in float16; the rounding error stays in the residual."""

    name = "fp16"
    wire = WireSpec(sparse=False, dtype="f16")

    def _compress(self, acc: np.ndarray) -> np.ndarray:
        half = np.clip(acc, -FP16_MAX, FP16_MAX).astype(np.float16)  # (n,) float16
        self._keep_back(half)  # float16 widens exactly; no (n,) float32 copy is made
        return half
