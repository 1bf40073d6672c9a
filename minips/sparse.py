"""Gradient compression: the one module the worker and the servers import for it.

The worker builds a compressor with ``make_compressor`` and, every step, calls
``compress(grad)`` then the compressor's ``encode`` (the wire encoding it declares) for the PUSH;
a server calls ``decode_gradient`` on the PUSH and ``scatter_add`` / ``accumulate`` to apply it;
the global server asks ``ratio_policy`` for GDTopK's per-group upload ratios. The code lives in:

- ``sparse_codec``: ``SparseGrad``, the wire encoding (delta + varint indices, f32/f16 values;
  lz4 is the frame's) with full validation, ``scatter_add`` and ``accumulate``;
- the package ``compress``: ``base`` (``Compressor``, error feedback, ``WireSpec``), one file per
  compressor (``none``, ``fp16``, ``topk``, ``dgc``, ``randomk``, ``gdtopk``, ``losscomp``),
  ``registry`` (``make_compressor``), ``sparse_select`` (sampled-threshold top-k) and ``ratios``
  (GDTopK's ratio policy).

Invariants kept across them: no torch, no I/O, no clocks; sparse indices are uint32 strictly
increasing; decoding raises ``RemoteProtocolError`` on any bad packet. docs/compression.md gives
every rule, parameter and default, and the measured speed.
"""

from __future__ import annotations

from minips.compress.base import Compressor, WireSpec
from minips.compress.dgc import warmup_ratio
from minips.compress.ratios import gdtopk_ratios
from minips.compress.registry import COMPRESSORS, make_compressor, ratio_policy
from minips.compress.sparse_select import TopKSelector, kept_count
from minips.wire.sparse_codec import (
    ENCODINGS,
    SparseGrad,
    accumulate,
    average,
    decode_gradient,
    encode_gradient,
    scatter_add,
)

__all__ = [
    "COMPRESSORS",
    "ENCODINGS",
    "Compressor",
    "SparseGrad",
    "TopKSelector",
    "WireSpec",
    "accumulate",
    "average",
    "decode_gradient",
    "encode_gradient",
    "gdtopk_ratios",
    "kept_count",
    "make_compressor",
    "ratio_policy",
    "scatter_add",
    "warmup_ratio",
]
