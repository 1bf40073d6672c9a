"""Gradient compressors with error feedback, and the ratio schedules that drive them.

A compressor is built once per worker (``make_compressor``) and called every step:
``compress(grad (n,) float32) -> SparseGrad | np.ndarray``. With error feedback (the default)
it keeps a residual r (n,) float32: ``acc = r + grad``; it sends part of ``acc`` and keeps the
rest, ``r = acc - sent``. Hence the invariant the tests check: the sum over steps of what was sent
plus the final residual equals the sum of the gradients (up to float32 rounding).

Compressors (``ratio`` = kept fraction, k = round(ratio * n)):

- ``none``: dense float32, nothing kept back. ``fp16``: dense float16 (clipped to +-65504); the
  rounding error goes to the residual.
- ``topk``: exactly the k largest |acc|. ``dgc``: DGC's sampled threshold, the largest k to
  1.1 k (``tolerance=0.1``); ``warmup_epochs=4`` turns on DGC's warm-up. ``randomk``: k
  uniform random indices (without error feedback, ``unbiased=True`` scales values by n/k).
- ``gdtopk``: ``dgc`` whose ratio the global server sets per group (``set_ratio``, computed by
  ``gdtopk_ratios``), with DGC's warm-up on by default.
- ``losscomp``: see ``minips.losscomp``.

Schedules (pure functions):

- ``warmup_ratio(epoch, final, start=0.25, decay=0.25, epochs=4)``: DGC's warm-up, kept fraction
  ``max(final, start * decay ** floor(epoch))`` for epoch < epochs (25%, 6.25%, 1.56%, 0.39%),
  then ``final``.
- ``gdtopk_ratios(times, floor=0.004, alpha=1.0, direction="slower-more", lo=0.001, hi=0.05)``:
  ``slower-more`` (the authors' released code): ``floor * (t_g / t_fastest) ** alpha``, so the
  fastest group gets ``floor`` and slower groups, which push less often, send more.
  ``slower-less`` (narrow the speed gap): ``floor * (t_slowest / t_g) ** alpha``, so the slowest
  group gets ``floor``. Both are clamped to ``[lo, hi]``.

Sparse compressors also take ``value_dtype="f16"``: values are rounded to float16 before they
are sent and the rounding error stays in the residual, so encoding them as f16 loses nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from minips.errors import ConfigError, LocalProtocolError
from minips.sparse_codec import SparseGrad
from minips.sparse_select import TopKSelector, kept_count

__all__ = [
    "Compressor",
    "DenseCompressor",
    "Fp16Compressor",
    "TopKCompressor",
    "DGCCompressor",
    "RandomKCompressor",
    "GDTopKCompressor",
    "warmup_ratio",
    "gdtopk_ratios",
]

FP16_MAX = 65504.0  # largest finite float16


def warmup_ratio(
    epoch: float, final: float, *, start: float = 0.25, decay: float = 0.25, epochs: int = 4
) -> float:
    """DGC warm-up: kept fraction for ``epoch`` (float) falling from ``start`` to ``final``."""
    if epoch >= epochs:
        return final
    return max(final, start * decay ** math.floor(max(epoch, 0.0)))


def gdtopk_ratios(
    group_step_times: Sequence[float],
    *,
    floor: float = 0.004,
    alpha: float = 1.0,
    direction: str = "slower-more",
    lo: float = 0.001,
    hi: float = 0.05,
) -> list[float]:
    """Per-group kept fraction from each group's step time (seconds); see the module docstring."""
    times = [float(t) for t in group_step_times]
    if any(not math.isfinite(t) or t <= 0.0 for t in times):
        raise ConfigError(f"group step times must be finite and > 0, got {times}")
    if not 0.0 < lo <= hi <= 1.0 or alpha < 0.0:
        raise ConfigError(f"need 0 < lo <= hi <= 1 and alpha >= 0, got {lo=}, {hi=}, {alpha=}")
    if direction == "slower-more":
        rel = [t / min(times) for t in times] if times else []
    elif direction == "slower-less":
        rel = [max(times) / t for t in times]
    else:
        raise ConfigError(f"direction must be 'slower-more' or 'slower-less', got {direction!r}")
    return [min(hi, max(lo, floor * r**alpha)) for r in rel]


class Compressor:
    """Base class: error-feedback memory and the common knobs; subclasses choose what to send."""

    name = "base"

    def __init__(self, size: int, *, ratio: float = 1.0, seed: int = 0,
                 error_feedback: bool = True) -> None:
        self.size = size
        self.seed = seed
        self.error_feedback = error_feedback
        self.residual = np.zeros(size, np.float32) if error_feedback else None  # (n,) float32
        self.ratio = 1.0
        self.set_ratio(ratio)
        self.epoch = 0.0
        self.kept_fraction = 1.0  # fraction of coordinates sent by the last compress()

    def set_ratio(self, r: float) -> None:
        """Target kept fraction (GDTopK: from the server; a dense compressor ignores it)."""
        if not 0.0 < r <= 1.0:
            raise ConfigError(f"ratio must be in (0, 1], got {r}")
        self.ratio = float(r)

    def set_epoch(self, e: float) -> None:
        """Training progress in epochs (fractional), for warm-up and vote decay."""
        self.epoch = float(e)

    def observe_loss(self, loss: float) -> None:
        """The training loss of the step about to be compressed (LossComp uses it)."""

    def compress(self, grad: np.ndarray) -> SparseGrad | np.ndarray:
        """Compress one (n,) float32 gradient; error feedback keeps what is not sent."""
        if grad.shape != (self.size,):
            raise LocalProtocolError("gradient has the wrong shape", expected=self.size,
                                     got=grad.shape)
        if self.residual is None:
            return self._compress(np.asarray(grad, dtype=np.float32))
        self.residual += grad
        return self._compress(self.residual)

    def _compress(self, acc: np.ndarray) -> SparseGrad | np.ndarray:
        raise NotImplementedError

    def _keep_back(self, sent: np.ndarray, where: Any = slice(None)) -> None:
        """Remove what was sent from the residual (no-op without error feedback)."""
        if self.residual is not None:
            self.residual[where] -= sent


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


class Fp16Compressor(DenseCompressor):
    """``fp16``: the whole gradient in float16; the rounding error stays in the residual."""

    name = "fp16"

    def _compress(self, acc: np.ndarray) -> np.ndarray:
        half = np.clip(acc, -FP16_MAX, FP16_MAX).astype(np.float16)  # (n,) float16
        self._keep_back(half.astype(np.float32))
        return half


class _SparseCompressor(Compressor):
    """Shared part of the sparse compressors: pick indices, send ``acc`` there, keep the rest."""

    def __init__(self, size: int, *, ratio: float = 0.01, seed: int = 0,
                 error_feedback: bool = True, value_dtype: str = "f32") -> None:
        super().__init__(size, ratio=ratio, seed=seed, error_feedback=error_feedback)
        if value_dtype not in ("f32", "f16"):
            raise ConfigError(f"value_dtype must be 'f32' or 'f16', got {value_dtype!r}")
        self.value_dtype = value_dtype

    def current_ratio(self) -> float:
        """The kept fraction the next compress() will use."""
        return self.ratio

    def _compress(self, acc: np.ndarray) -> SparseGrad:
        k = kept_count(self.current_ratio(), self.size)
        idx = self._select(acc, k)  # (k',) int64, strictly increasing
        values = acc[idx]  # (k',) float32, a copy
        if self.value_dtype == "f16":
            values = np.clip(values, -FP16_MAX, FP16_MAX).astype(np.float16).astype(np.float32)
        self._keep_back(values, idx)
        self.kept_fraction = idx.size / self.size if self.size else 0.0
        return SparseGrad(idx.astype(np.uint32), values, self.size)

    def _select(self, acc: np.ndarray, k: int) -> np.ndarray:
        raise NotImplementedError


class TopKCompressor(_SparseCompressor):
    """``topk``: exactly the k largest |acc| (sampled threshold + exact partition of candidates)."""

    name = "topk"
    tolerance = 0.0

    def __init__(self, size: int, **kw: Any) -> None:
        super().__init__(size, **kw)
        self.selector = TopKSelector(size, self.seed, tolerance=self.tolerance)

    def _select(self, acc: np.ndarray, k: int) -> np.ndarray:
        return self.selector.select(acc, k)  # ranks by |acc|


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


class GDTopKCompressor(DGCCompressor):
    """``gdtopk``: DGC selection at the ratio the global server sets for this worker's group."""

    name = "gdtopk"

    def __init__(self, size: int, *, ratio: float = 0.004, warmup_epochs: int = 4,
                 **kw: Any) -> None:
        super().__init__(size, ratio=ratio, warmup_epochs=warmup_epochs, **kw)


class RandomKCompressor(_SparseCompressor):
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
