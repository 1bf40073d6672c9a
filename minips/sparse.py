"""Gradient compression: the one module the worker and the servers import for it.

The worker builds a compressor with ``make_compressor`` and, every step, calls
``compress(grad)`` then ``encode_gradient`` for the PUSH; a server calls ``decode_gradient`` on the
PUSH and ``scatter_add`` / ``accumulate`` to apply it; the global server calls ``gdtopk_ratios``
to give each group its upload ratio. The code lives in four small modules, read in this order:

- ``sparse_codec``: ``SparseGrad``, the wire encoding (delta + varint indices, f32/f16 values,
  optional lz4) with full validation, ``scatter_add`` and ``accumulate``;
- ``sparse_select``: sampled-threshold top-k selection (exact, or DGC's approximate k);
- ``compressors``: error feedback, ``none`` / ``fp16`` / ``topk`` / ``dgc`` / ``randomk`` /
  ``gdtopk``, DGC's warm-up and the GDTopK ratio policy;
- ``losscomp``: our reconstruction of loss-voted compression.

Invariants kept across them: no torch, no I/O, no clocks; sparse indices are uint32 strictly
increasing; decoding raises ``RemoteProtocolError`` on any bad packet. docs/compression.md gives
every rule, parameter and default, and the measured speed.
"""

from __future__ import annotations

from typing import Any

from minips.compressors import (
    Compressor,
    DenseCompressor,
    DGCCompressor,
    Fp16Compressor,
    GDTopKCompressor,
    RandomKCompressor,
    TopKCompressor,
    gdtopk_ratios,
    warmup_ratio,
)
from minips.errors import ConfigError
from minips.losscomp import LossCompCompressor
from minips.sparse_codec import (
    ENCODINGS,
    SparseGrad,
    accumulate,
    average,
    decode_gradient,
    encode_gradient,
    scatter_add,
)
from minips.sparse_select import TopKSelector, kept_count

__all__ = [
    "COMPRESSORS",
    "ENCODINGS",
    "Compressor",
    "SparseGrad",
    "TopKSelector",
    "accumulate",
    "average",
    "decode_gradient",
    "encode_gradient",
    "gdtopk_ratios",
    "kept_count",
    "make_compressor",
    "scatter_add",
    "warmup_ratio",
]

COMPRESSORS: dict[str, type[Compressor]] = {
    "none": DenseCompressor,
    "fp16": Fp16Compressor,
    "topk": TopKCompressor,
    "dgc": DGCCompressor,
    "randomk": RandomKCompressor,
    "gdtopk": GDTopKCompressor,
    "losscomp": LossCompCompressor,
}


def make_compressor(
    name: str, size: int, *, ratio: float, seed: int = 0, error_feedback: bool = True, **opts: Any
) -> Compressor:
    """Build the compressor ``name`` for a flat gradient of ``size`` float32 entries.

    ``ratio`` is the kept fraction (dense compressors ignore it; for ``gdtopk`` it is the
    starting value until the server sends one; for ``losscomp`` the target mean). ``opts`` are
    the compressor's own options (see compressors.py and losscomp.py); unknown ones raise
    ConfigError.
    """
    cls = COMPRESSORS.get(name)
    if cls is None:
        raise ConfigError(f"unknown compressor {name!r}; choose one of {sorted(COMPRESSORS)}")
    if size < 0:
        raise ConfigError(f"gradient size must be >= 0, got {size}")
    try:
        return cls(size, ratio=ratio, seed=seed, error_feedback=error_feedback, **opts)
    except TypeError as exc:  # an option this compressor does not take
        raise ConfigError(f"compressor {name!r}: {exc}") from exc
