"""Gap + LEB128 coding of a sparse vector's indices (the ``varint`` index scheme of
sparse_codec.py), vectorised numpy: no Python loop runs per element.

Gap ``g[0] = idx[0]``, ``g[i] = idx[i] - idx[i-1] - 1``, so an increasing sequence gives gaps
>= 0 (a run of neighbours is a run of zero bytes); each gap is written in 7-bit groups, low
group first, high bit set on every byte but the last (1 to 5 bytes per index; about 1.3 bytes
at 1% density). Decoding trusts nothing: a bad buffer raises ``RemoteProtocolError``.

Public API: ``varint_encode``, ``varint_decode``, ``MAX_VARINT_BYTES``.
"""

from __future__ import annotations

import numpy as np

from minips.errors import RemoteProtocolError

__all__ = ["varint_encode", "varint_decode", "MAX_VARINT_BYTES"]

MAX_VARINT_BYTES = 5  # a uint32 needs at most ceil(32 / 7) = 5 groups of 7 bits


def varint_encode(indices: np.ndarray) -> np.ndarray:
    """Gap + LEB128 code of strictly increasing (k,) uint32 indices -> (m,) uint8 bytes."""
    idx = indices.astype(np.uint32, copy=False)
    if idx.size == 0:
        return np.empty(0, np.uint8)
    gaps = np.empty(idx.size, np.uint32)  # (k,) >= 0 for increasing input
    gaps[0] = idx[0]
    np.subtract(idx[1:], idx[:-1], out=gaps[1:])
    gaps[1:] -= np.uint32(1)
    nbytes = np.ones(idx.size, np.uint8)  # (k,) bytes per gap, 1..5
    for j in range(1, MAX_VARINT_BYTES):
        nbytes += gaps >= np.uint32(1 << (7 * j))
    ends = np.cumsum(nbytes, dtype=np.int64)  # (k,) one past each gap's last byte
    out = np.empty(int(ends[-1]), np.uint8)
    # Byte j of every gap, then only the gaps that have a byte j + 1 (a shrinking subset:
    # uint32 throughout, since mixing uint64 with Python ints goes through float64 and is slow).
    group, nb, pos = gaps, nbytes, ends - nbytes
    for j in range(MAX_VARINT_BYTES):
        more = nb > j + 1  # (subset,) bool: another byte follows
        out[pos + j] = (group & np.uint32(0x7F)).astype(np.uint8) | (more.view(np.uint8) << 7)
        keep = np.flatnonzero(more)
        if keep.size == 0:
            break
        group, nb, pos = group[keep] >> np.uint32(7), nb[keep], pos[keep]
    return out


def varint_decode(data: np.ndarray, k: int, size: int) -> np.ndarray:
    """Inverse of ``varint_encode``; validates everything. Returns (k,) uint32 indices."""
    ends = np.flatnonzero(data < 0x80)  # last byte of each varint
    if ends.size != k or (k and ends[-1] != data.size - 1) or (k == 0 and data.size):
        raise RemoteProtocolError(
            "varint index buffer does not hold k whole numbers", expected=k, got=int(ends.size)
        )
    if k == 0:
        return np.empty(0, np.uint32)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lens = ends - starts + 1  # (k,) 1..5 if well formed
    if int(lens.max()) > MAX_VARINT_BYTES or int(data[ends[lens == 5]].max(initial=0)) > 0x0F:
        raise RemoteProtocolError("varint index larger than 32 bits")
    payload = data & np.uint8(0x7F)  # (m,) uint8, the 7-bit groups
    gaps = payload[starts].astype(np.uint32)  # (k,) low groups; < 2^32 checked above
    sel = np.flatnonzero(lens > 1)  # the gaps with more groups, a shrinking subset
    for j in range(1, MAX_VARINT_BYTES):
        if sel.size == 0:
            break
        gaps[sel] |= payload[starts[sel] + j].astype(np.uint32) << np.uint32(7 * j)
        sel = sel[lens[sel] > j + 1]
    # idx[i] = sum of (gap + 1) up to i, minus 1; int64 holds k * 2^32.
    idx = np.cumsum(gaps, dtype=np.int64) + np.arange(k, dtype=np.int64)  # (k,) increasing
    if int(idx[-1]) >= size:
        raise RemoteProtocolError("sparse index out of range", expected=size, got=int(idx[-1]))
    return idx.astype(np.uint32)
