"""``topk``: exactly the k = round(ratio * n) largest |acc| (acc = residual + gradient), found by
``selection.TopKSelector`` (sampled threshold + exact partition of the candidates).

``dgc``: Deep Gradient Compression's sampled threshold, keeping the largest k to
k * (1 + tolerance) (``tolerance=0.1``), and DGC's warm-up: by the worker's epochs
(``warmup_epochs=4`` turns it on) or over a fraction of the run (``warmup_fraction=0.05``:
the first 5% of the run's samples budget, as the group server reports it). DGC's other pieces
(momentum correction, momentum-factor masking, local gradient clipping) are the worker's
optimizer's (``core/worker_opt.py``, ``RunConfig.optimizer_at`` ``worker``); the compressor
then compresses the optimizer's update, with error feedback as always.

``warmup_ratio(epoch, final, start=0.25, decay=0.25, epochs=4)``: the kept fraction
``max(final, start * decay ** floor(epoch))`` for epoch < epochs (25%, 6.25%, 1.56%, 0.39%),
then ``final``.

``fraction_warmup_ratio(progress, final, fraction, start=0.25)``: the kept fraction falls
geometrically from ``start`` at progress 0 to ``final`` at ``fraction`` of the run
(``start * (final / start) ** (progress / fraction)``: the sparsity rises exponentially),
then stays at ``final``.

``dense_end_ratio(progress, fraction, factor)``: the multiplier of a denser final phase: 1
until the last ``fraction`` of the run, then rising geometrically to ``factor`` at its end
(``factor ** ((progress - (1 - fraction)) / fraction)``). ``dgc`` and ``gdtopk`` apply it
on top of their ratio (and warm-up) when ``dense_end_fraction > 0``
(``dense_end_factor=4``: four times the kept fraction at the end of the run), so that as the
learning rate decays to zero less of each step waits in the residual.

``gdtopk``: DGC selection at the ratio the global server sets for this worker's group, with
DGC's warm-up on by default. Its server-side part is ``ratio_policy``: the global server's
``ratios.RatioPolicy`` turns each group's measured iteration time into its ratio (the rule is
in ``compress/ratios.py`` and docs/compression.md).

``randomk``: k uniform random indices per step from a seeded generator; without error feedback,
``unbiased=True`` scales the values by n/k so that the expected packet is the gradient.

``topk``, ``dgc`` and ``gdtopk`` touch no array but through ``arrays`` (their selector and the
residual), so they run on a device as well (``compress.device_compress``); ``randomk`` draws its
indices with numpy and stays on the host.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from minips.compress.base import Arrays, SparseCompressor
from minips.compress.ratios import RatioPolicy
from minips.errors import ConfigError
from minips.sparse import SparseVector

__all__ = [
    "TopKCompressor",
    "DGCCompressor",
    "warmup_ratio",
    "fraction_warmup_ratio",
    "dense_end_ratio",
    "GDTopKCompressor",
    "RandomKCompressor",
]


# ---------------------------------------------------------------------------- topk

class TopKCompressor(SparseCompressor):
    """``topk``: exactly the k largest |acc| (sampled threshold + exact partition of candidates)."""

    name = "topk"
    tolerance = 0.0

    def __init__(self, size: int, **kw: Any) -> None:
        super().__init__(size, **kw)
        self.selector = self.arrays.selector(size, self.seed, self.tolerance)

    @property
    def device_ready(self) -> bool:
        return True  # the selector and the residual are all the arrays it touches

    def place(self, arrays: Arrays) -> None:
        super().place(arrays)
        self.selector = arrays.selector(self.size, self.seed, self.tolerance)

    def _select(self, acc: np.ndarray, k: int) -> np.ndarray:
        return self.selector.select(acc, k)  # ranks by |acc|


# ---------------------------------------------------------------------------- dgc

def warmup_ratio(
    epoch: float, final: float, *, start: float = 0.25, decay: float = 0.25, epochs: int = 4
) -> float:
    """DGC warm-up: kept fraction for ``epoch`` (float) falling from ``start`` to ``final``."""
    if epoch >= epochs:
        return final
    return max(final, start * decay ** math.floor(max(epoch, 0.0)))


def fraction_warmup_ratio(progress: float, final: float, fraction: float, *,
                          start: float = 0.25) -> float:
    """DGC warm-up over the first ``fraction`` of the run: the kept fraction at ``progress``
    (0..1 of the run), geometric from ``start`` to ``final`` (never below ``final``)."""
    if fraction <= 0 or progress >= fraction or start <= final:
        return final
    return max(final, start * (final / start) ** (max(progress, 0.0) / fraction))


def dense_end_ratio(progress: float, fraction: float, factor: float) -> float:
    """The multiplier of the kept fraction at ``progress`` (0..1 of the run): 1 before the last
    ``fraction`` of the run, then geometric to ``factor`` at its end."""
    start = 1.0 - fraction
    if fraction <= 0 or progress <= start:
        return 1.0
    return float(factor) ** (min(progress - start, fraction) / fraction)


class DGCCompressor(TopKCompressor):
    """``dgc``: DGC's sampled threshold, keeping k to k * (1 + tolerance); optional warm-up,
    by epochs (``warmup_epochs``) or over a fraction of the run (``warmup_fraction``); optional
    denser final phase (``dense_end_fraction``, ``dense_end_factor``)."""

    name = "dgc"

    def __init__(self, size: int, *, tolerance: float = 0.1, warmup_epochs: int = 0,
                 warmup_fraction: float = 0.0, warmup_start: float = 0.25,
                 dense_end_fraction: float = 0.0, dense_end_factor: float = 4.0,
                 **kw: Any) -> None:
        if not 0.0 <= tolerance < 1.0:
            raise ConfigError(f"tolerance must be in [0, 1), got {tolerance}")
        if not 0.0 <= warmup_fraction <= 1.0 or not 0.0 < warmup_start <= 1.0:
            raise ConfigError(f"warmup_fraction must be in [0, 1] and warmup_start in (0, 1], "
                              f"got {warmup_fraction}, {warmup_start}")
        if warmup_fraction > 0 and warmup_epochs > 0:
            raise ConfigError("give warmup_epochs or warmup_fraction, not both")
        if not 0.0 <= dense_end_fraction <= 1.0 or not 1.0 <= dense_end_factor < math.inf:
            raise ConfigError(f"dense_end_fraction must be in [0, 1] and dense_end_factor "
                              f">= 1, got {dense_end_fraction}, {dense_end_factor}")
        self.tolerance = tolerance
        self.warmup_epochs = warmup_epochs  # 0: no warm-up by epochs
        self.warmup_fraction = float(warmup_fraction)  # of the run's samples; 0: none
        self.warmup_start = float(warmup_start)  # kept fraction at the start of either warm-up
        self.dense_end_fraction = float(dense_end_fraction)  # last part of the run; 0: none
        self.dense_end_factor = float(dense_end_factor)  # ratio multiplier at the run's end
        super().__init__(size, **kw)

    def current_ratio(self) -> float:
        boost = dense_end_ratio(self.progress, self.dense_end_fraction, self.dense_end_factor)
        return min(1.0, boost * self._warm_ratio())

    def _warm_ratio(self) -> float:
        if self.warmup_fraction > 0:
            return fraction_warmup_ratio(self.progress, self.ratio, self.warmup_fraction,
                                         start=self.warmup_start)
        if self.warmup_epochs <= 0:
            return self.ratio
        return warmup_ratio(self.epoch, self.ratio, start=self.warmup_start,
                            epochs=self.warmup_epochs)


# ---------------------------------------------------------------------------- gdtopk

class GDTopKCompressor(DGCCompressor):
    """``gdtopk``: DGC selection at the ratio the global server sets for this worker's group."""

    name = "gdtopk"

    def __init__(self, size: int, *, ratio: float = 0.004, warmup_epochs: int | None = None,
                 **kw: Any) -> None:
        if warmup_epochs is None:  # DGC's 4 epochs, unless a warm-up by fraction is asked for
            warmup_epochs = 0 if kw.get("warmup_fraction") else 4
        super().__init__(size, ratio=ratio, warmup_epochs=warmup_epochs, **kw)

    @classmethod
    def ratio_policy(cls, target: float, *, direction: str, alpha: float) -> RatioPolicy:
        """Per-group ratios whose push-weighted mean is ``target`` (``ratios.RatioPolicy``)."""
        return RatioPolicy(target, direction=direction, alpha=alpha)


# ---------------------------------------------------------------------------- randomk

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

    def _compress(self, acc: np.ndarray) -> SparseVector:
        sg = super()._compress(acc)
        if not self.unbiased or sg.nnz == 0:
            return sg
        scaled = sg.values * np.float32(self.size / sg.nnz)
        return SparseVector(sg.indices, scaled, sg.size)
