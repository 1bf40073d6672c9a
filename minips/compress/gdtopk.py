"""``gdtopk``: DGC selection at the ratio the global server sets for this worker's group, with
DGC's warm-up on by default. Its server-side part is ``ratio_policy``: the global server's
``ratios.RatioPolicy`` turns each group's measured iteration time into its ratio (the rule is
in ``compress/ratios.py`` and docs/compression.md)."""

from __future__ import annotations

from typing import Any

from minips.compress.dgc import DGCCompressor
from minips.compress.ratios import RatioPolicy

__all__ = ["GDTopKCompressor"]


class GDTopKCompressor(DGCCompressor):
    """``gdtopk``: DGC selection at the ratio the global server sets for this worker's group."""

    name = "gdtopk"

    def __init__(self, size: int, *, ratio: float = 0.004, warmup_epochs: int = 4,
                 **kw: Any) -> None:
        super().__init__(size, ratio=ratio, warmup_epochs=warmup_epochs, **kw)

    @classmethod
    def ratio_policy(cls, target: float, *, direction: str, alpha: float) -> RatioPolicy:
        """Per-group ratios whose push-weighted mean is ``target`` (``ratios.RatioPolicy``)."""
        return RatioPolicy(target, direction=direction, alpha=alpha)
