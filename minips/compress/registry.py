"""The compressors by name: ``make_compressor(name, size, ...)`` and ``ratio_policy(name, ...)``.

Adding a compressor: write one file in ``minips/compress/`` with a ``Compressor`` (dense) or
``SparseCompressor`` (sparse) subclass, and add one line to ``COMPRESSORS`` below (or call
``register`` from your own code). ``--compressor`` and ``RunConfig`` take the names listed here.
"""

from __future__ import annotations

import inspect
from typing import Any

from minips.compress.base import Compressor
from minips.compress.dense import DenseCompressor, Fp16Compressor
from minips.compress.losscomp import LossCompCompressor
from minips.compress.ratios import RatioPolicy
from minips.compress.topk import DGCCompressor, GDTopKCompressor, RandomKCompressor, TopKCompressor
from minips.errors import ConfigError

__all__ = ["COMPRESSORS", "compressor_options", "is_sparse", "make_compressor", "ratio_policy",
           "register"]

COMPRESSORS: dict[str, type[Compressor]] = {
    "none": DenseCompressor,
    "fp16": Fp16Compressor,
    "topk": TopKCompressor,
    "dgc": DGCCompressor,
    "randomk": RandomKCompressor,
    "gdtopk": GDTopKCompressor,
    "losscomp": LossCompCompressor,
}


def register(cls: type[Compressor]) -> type[Compressor]:
    """Add ``cls`` under ``cls.name`` (usable as a class decorator); a taken name is refused."""
    if cls.name in COMPRESSORS and COMPRESSORS[cls.name] is not cls:
        raise ConfigError(f"compressor name {cls.name!r} is taken")
    COMPRESSORS[cls.name] = cls
    return cls


def _lookup(name: str) -> type[Compressor]:
    cls = COMPRESSORS.get(name)
    if cls is None:
        raise ConfigError(f"unknown compressor {name!r}; choose one of {sorted(COMPRESSORS)}")
    return cls


def make_compressor(
    name: str, size: int, *, ratio: float, seed: int = 0, error_feedback: bool = True, **opts: Any
) -> Compressor:
    """Build the compressor ``name`` for a flat gradient of ``size`` float32 entries.

    ``ratio`` is the kept fraction (dense compressors ignore it; for ``gdtopk`` it is the
    starting value until the server sends one; for ``losscomp`` the target mean). ``opts`` are
    the compressor's own options (each plug-in file lists them; sparse ones all take
    ``value_dtype``); unknown ones raise ConfigError.
    """
    cls = _lookup(name)
    if size < 0:
        raise ConfigError(f"gradient size must be >= 0, got {size}")
    try:
        return cls(size, ratio=ratio, seed=seed, error_feedback=error_feedback, **opts)
    except TypeError as exc:  # an option this compressor does not take
        raise ConfigError(f"compressor {name!r}: {exc}") from exc


def compressor_options(name: str) -> set[str]:
    """The keyword options compressor ``name`` takes (its own and its base classes'), less
    those ``make_compressor`` sets itself (ratio, seed, error_feedback)."""
    names: set[str] = set()
    for klass in _lookup(name).__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        names |= {p.name for p in inspect.signature(init).parameters.values()
                  if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return names - {"ratio", "seed", "error_feedback"}


def is_sparse(name: str) -> bool:
    """Whether compressor ``name`` sends sparse packets (then the exchange and the downlink are
    sparse too by default: ``exchange.exchange_ratio``, ``RunConfig.downlink_ratio``)."""
    return _lookup(name).wire.sparse


def ratio_policy(name: str, target: float, *, direction: str = "slower-more",
                 alpha: float = 1.0) -> RatioPolicy | None:
    """The global server's per-group ratio policy of compressor ``name`` (GDTopK), or None."""
    return _lookup(name).ratio_policy(target, direction=direction, alpha=alpha)
