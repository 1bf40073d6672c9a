"""The vector payload (gradients, deltas, weights): the data type, its wire encoding, and how a
receiver applies it. Which entries a sparse vector holds is chosen elsewhere: by magnitude with
``compress.selection.TopKSelector``, or by a compressor's own rule.

A ``SparseVector`` is ``indices`` (k,) uint32, strictly increasing (so sorted and unique),
``values`` (k,) float32, and ``size``, the length of the dense vector it stands for. The value
type on the wire (``f32``: 4 bytes, ``f16``: 2) is the encoder's ``value_dtype``: a compressor
declares it (``compress.base.WireSpec``) and ``Compressor.encode`` passes it here.

Wire format (the buffers of a message with a payload; ``encoding`` and the ``codec`` map travel
in its msgpack header, ``fields.vector_codec`` checks the map's keys and types):

- ``dense-f32`` / ``dense-f16``: one buffer, the whole vector, little-endian float32 / float16.
  codec ``{}``.
- ``sparse-v1``: two buffers, indices then values. codec ``{"k": k, "index": "varint" | "u32",
  "value": "f32" | "f16"}``. ``u32``: raw little-endian uint32 indices. ``varint``: gap coding,
  ``g[0] = idx[0]``, ``g[i] = idx[i] - idx[i-1] - 1`` (so a run of neighbours is a run of zero
  bytes), each gap in 7-bit groups, low group first, high bit set on every byte but the last
  (1 to 5 bytes per index; about 1.3 bytes at 1% density; ``wire/varint.py``).

lz4 is one layer, the frame's (``frames.encode(msg, compress=True)``, a buffer table codec):
the payload itself is never compressed.

``unique_sorted`` and ``union_of`` are the index sets the receivers merge (a BSP round's mean, a
change log's coordinates): a sort plus an adjacent compare, since ``np.unique`` hashes under
numpy 2.x (~40 times slower for 450k indices).

Invariants: decoding trusts nothing. Every length, count, index, byte and float is checked and a
bad packet raises ``RemoteProtocolError`` naming what was wrong; never an IndexError from numpy.
Everything here is vectorised numpy: no Python loop runs per element.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from minips.errors import LocalProtocolError, RemoteProtocolError
from minips.wire.fields import INDEX_SCHEMES, Invalid, Payload, vector_codec
from minips.wire.varint import varint_decode, varint_encode

__all__ = [
    "SparseVector",
    "ENCODINGS",
    "encode_vector",
    "decode_vector",
    "add_into",
    "set_into",
    "average",
    "unique_sorted",
    "union_of",
    "union_sorted",
]


# ---------------------------------------------------------------------------- the vector

ENCODINGS = ("dense-f32", "dense-f16", "sparse-v1")
_VALUE_DTYPES: dict[str, np.dtype[Any]] = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2")}


@dataclass(frozen=True)
class SparseVector:
    """A sparse gradient: ``indices`` (k,) uint32 strictly increasing, ``values`` (k,) float32.

    The constructor checks dtypes and shapes (O(1)); ``check()`` also checks order and range
    (O(k)), which ``decode_vector`` always does for data from the network.
    """

    indices: np.ndarray
    values: np.ndarray
    size: int

    def __post_init__(self) -> None:
        i, v = self.indices, self.values
        if i.dtype != np.uint32 or v.dtype != np.float32 or i.ndim != 1 or i.shape != v.shape:
            raise LocalProtocolError(
                "SparseVector needs (k,) uint32 indices and (k,) float32 values",
                expected="uint32/float32 of one length",
                got=f"{i.dtype}{i.shape}/{v.dtype}{v.shape}",
            )
        if self.size < 0 or i.size > self.size:
            raise LocalProtocolError("SparseVector has more entries than its size", got=self.size)

    @property
    def nnz(self) -> int:
        return int(self.indices.size)

    def check(self) -> None:
        """Raise LocalProtocolError unless indices are strictly increasing and < size."""
        i = self.indices
        if i.size and (int(i[-1]) >= self.size or np.any(i[1:] <= i[:-1])):
            raise LocalProtocolError("SparseVector indices not strictly increasing below size")

    def to_dense(self) -> np.ndarray:
        """(size,) float32 with the values at their indices and zeros elsewhere."""
        out = np.zeros(self.size, dtype=np.float32)
        out[self.indices] = self.values
        return out

    @staticmethod
    def empty(size: int) -> SparseVector:
        return SparseVector(np.empty(0, np.uint32), np.empty(0, np.float32), size)


# ---------------------------------------------------------------------------- encode


def encode_vector(
    g: SparseVector | np.ndarray,
    *,
    value_dtype: str = "f32",
    index: str = "varint",
) -> Payload:
    """Encode a vector as the ``Payload`` a message carries: ``(encoding, codec, buffers)``.

    A dense float16 array is sent as ``dense-f16`` whatever ``value_dtype`` says (the fp16
    compressor already rounded it, with the error kept in its residual).
    """
    if value_dtype not in _VALUE_DTYPES or index not in INDEX_SCHEMES:
        raise LocalProtocolError("unknown value dtype or index scheme", got=(value_dtype, index))
    codec: dict[str, Any] = {}
    if isinstance(g, np.ndarray):
        half = g.dtype == np.float16 or value_dtype == "f16"
        wire = _VALUE_DTYPES["f16" if half else "f32"]  # little-endian on every host
        dense = np.ascontiguousarray(g, dtype=wire).ravel()
        return Payload("dense-f16" if half else "dense-f32", codec, (dense,))
    # on a little-endian host the packet's own arrays, not copies (as for a dense vector)
    ib = varint_encode(g.indices) if index == "varint" else g.indices.astype("<u4", copy=False)
    vb = g.values.astype(_VALUE_DTYPES[value_dtype], copy=False)
    codec.update(k=g.nnz, index=index, value=value_dtype)
    return Payload("sparse-v1", codec, (ib, vb))


# ---------------------------------------------------------------------------- decode


def _as_bytes(buf: Any) -> np.ndarray:
    """Any bytes-like object -> (m,) uint8 view, without copying."""
    try:
        return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"buffer is not bytes-like: {type(buf).__name__}") from exc


def _unpack(buffers: Sequence[Any], count: int) -> list[np.ndarray]:
    """The ``count`` buffers as uint8 arrays (their lengths are checked by the caller)."""
    if len(buffers) != count:
        raise RemoteProtocolError("wrong number of buffers", expected=count, got=len(buffers))
    return [_as_bytes(b) for b in buffers]


def _values(data: np.ndarray, dtype: np.dtype, count: int, allow_nonfinite: bool) -> np.ndarray:
    """(count,) float32 from raw bytes, length and finiteness checked."""
    if data.size != count * dtype.itemsize:
        raise RemoteProtocolError(
            "value buffer has the wrong length", expected=count * dtype.itemsize, got=data.size
        )
    vals = data.view(dtype).astype(np.float32)
    if not allow_nonfinite and not np.isfinite(vals).all():
        raise RemoteProtocolError("gradient holds NaN or inf", got=int((~np.isfinite(vals)).sum()))
    return vals


def _decode_indices(data: np.ndarray, scheme: str, k: int, size: int) -> np.ndarray:
    if scheme == "varint":
        return varint_decode(data, k, size)
    if data.size != 4 * k:
        raise RemoteProtocolError("index buffer length is not 4 k", expected=4 * k, got=data.size)
    idx = data.view("<u4").astype(np.uint32)
    if k and int(idx.max()) >= size:
        raise RemoteProtocolError("sparse index out of range", expected=size, got=int(idx.max()))
    if k > 1 and bool(np.any(idx[1:] <= idx[:-1])):
        raise RemoteProtocolError("sparse indices not strictly increasing")
    return idx


def decode_vector(
    payload: Payload,
    size: int,
    *,
    allow_nonfinite: bool = False,
) -> SparseVector | np.ndarray:
    """Decode and validate a vector ``payload`` for a model of ``size`` parameters.

    Returns a (size,) float32 array for dense encodings, a checked ``SparseVector`` otherwise.
    Raises RemoteProtocolError on anything malformed.
    """
    encoding, codec, buffers = payload
    try:
        vector_codec(codec)  # keys and types; what depends on ``size`` is checked below
    except Invalid as exc:
        raise RemoteProtocolError(str(exc), got=codec) from None
    if encoding in ("dense-f32", "dense-f16"):
        dtype = _VALUE_DTYPES["f16" if encoding == "dense-f16" else "f32"]
        (data,) = _unpack(buffers, 1)
        return _values(data, dtype, size, allow_nonfinite)
    if encoding != "sparse-v1":
        raise RemoteProtocolError("unknown gradient encoding", expected=ENCODINGS, got=encoding)
    k, scheme, value = codec.get("k"), codec.get("index"), codec.get("value")
    if k is None or scheme is None or value is None or k > size:
        raise RemoteProtocolError("sparse-v1 codec needs k <= size, index and value",
                                  expected=size, got=codec)
    vdtype = _VALUE_DTYPES[value]
    ib, vb = _unpack(buffers, 2)
    indices = _decode_indices(ib, scheme, k, size)
    return SparseVector(indices, _values(vb, vdtype, k, allow_nonfinite), size)


# ---------------------------------------------------------------------------- index sets

def unique_sorted(a: np.ndarray) -> np.ndarray:
    """(m,) the distinct values of ``a``, increasing: a sort and an adjacent compare,
    O(a log a) (numpy 2.x's ``np.unique`` / ``np.union1d`` hash: 120-260 ms for 450k
    integers against ~3 ms for this)."""
    s = np.sort(a)  # (introsort: twice as fast as the stable sort on 1.4M uint32)
    if s.size < 2:
        return s
    keep = np.empty(s.size, dtype=np.bool_)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def union_of(parts: Sequence[np.ndarray], size: int) -> np.ndarray:
    """(m,) uint32 increasing: every index any of ``parts`` (arrays of indices below ``size``)
    names, once. Merged when every part is increasing, as a push's and a log's are (a stable
    sort finds the runs: 6 ms against 60 ms of a quicksort for 1.4M and 0.4M of 11M), sorted
    when not (O(m log m)), never O(size); marked in a (size,) mask when they add up to more
    than ``size / 4`` (then the mask is the cheaper pass)."""
    total = sum(int(p.size) for p in parts)
    if total > size // 4:
        mask = np.zeros(size, dtype=np.bool_)
        for p in parts:
            mask[p] = True
        return np.flatnonzero(mask).astype(np.uint32)
    if not parts:
        return np.empty(0, np.uint32)
    if all(_increasing(p) for p in parts):
        return union_sorted(list(parts))
    return unique_sorted(np.concatenate(parts).astype(np.uint32, copy=False))


def union_sorted(parts: list[np.ndarray]) -> np.ndarray:
    """(m,) uint32 increasing: every index of ``parts`` once. Each part is best increasing
    (then the stable sort merges the runs, O(m log parts)); any order is correct."""
    if not parts:
        return np.empty(0, np.uint32)
    if len(parts) == 1 and _increasing(parts[0]):
        return parts[0].astype(np.uint32, copy=False)
    s = np.concatenate(parts).astype(np.uint32, copy=False)
    s.sort(kind="stable")  # timsort: linear in each run it finds
    if s.size < 2:
        return s
    keep = np.empty(s.size, dtype=np.bool_)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s if keep.all() else s[keep]


def _increasing(a: np.ndarray) -> bool:
    return a.size < 2 or bool((a[1:] > a[:-1]).all())


# ---------------------------------------------------------------------------- apply


def add_into(target: np.ndarray, sg: SparseVector | np.ndarray, scale: float = 1.0) -> None:
    """``target += scale * g`` in place; O(nnz) for a SparseVector."""
    if isinstance(sg, np.ndarray):
        if sg.shape != target.shape:
            raise LocalProtocolError("dense shape mismatch", expected=target.shape, got=sg.shape)
        target += np.float32(scale) * sg if scale != 1.0 else sg
        return
    if sg.size != target.size:
        raise LocalProtocolError("sparse gradient size mismatch", expected=target.size, got=sg.size)
    # np.add.at: numpy >= 1.25 has a fast path for it (1.2 ms for 117k entries, fancy-index +=
    # takes 3.3 ms as it converts the uint32 indices and gathers first).
    np.add.at(target, sg.indices, np.float32(scale) * sg.values if scale != 1.0 else sg.values)


def set_into(target: np.ndarray, v: SparseVector) -> None:
    """``target[v.indices] = v.values`` in place: entries to *set* (an exchange's or a downlink's
    answer carries the values the receiver's copy should hold), O(nnz)."""
    if v.size != target.size:
        raise LocalProtocolError("sparse vector size mismatch", expected=target.size, got=v.size)
    target[v.indices] = v.values


def average(grads: Sequence[SparseVector | np.ndarray], size: int,
            weights: Sequence[float] | None = None) -> SparseVector | np.ndarray:
    """Mean of one BSP round's gradients, dense or sparse: (size,) float32, or the gradient
    itself when the round has just one. With ``weights`` (LB-BSP: each gradient's samples) the
    weighted mean sum(w_i g_i) / sum(w_i): of per-batch mean gradients, the whole round's.
    When every gradient is sparse the mean is too (O(their entries), never O(size)): the same
    float32 values at the union of their indices."""
    if len(grads) == 1:
        return grads[0]
    if all(isinstance(g, SparseVector) for g in grads):
        return _sparse_average([g for g in grads if isinstance(g, SparseVector)], size, weights)
    total = np.zeros(size, dtype=np.float32)  # (size,) float32: rounds mix dense and sparse
    if weights is None:
        for g in grads:
            add_into(total, g)
        total /= np.float32(len(grads))
        return total
    whole = float(sum(weights))
    for g, w in zip(grads, weights, strict=True):
        add_into(total, g, w / whole)
    return total


def _sparse_average(grads: Sequence[SparseVector], size: int,
                    weights: Sequence[float] | None) -> SparseVector:
    """``average`` of sparse gradients, entry for entry the float32 operations of the dense
    one (a sum from 0 in the round's order, then the division), at their indices only."""
    idx = union_of([g.indices for g in grads], size)  # (m,) uint32 sorted
    total = np.zeros(idx.size, dtype=np.float32)
    scales = [1.0] * len(grads) if weights is None else [w / float(sum(weights))
                                                          for w in weights]
    for g, scale in zip(grads, scales, strict=True):
        at = np.searchsorted(idx, g.indices)  # (k,) positions of g's entries in idx
        np.add.at(total, at, np.float32(scale) * g.values if scale != 1.0 else g.values)
    if weights is None:
        total /= np.float32(len(grads))
    return SparseVector(idx, total, size)
