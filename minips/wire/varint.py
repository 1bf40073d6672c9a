"""The varint index scheme of a sparse payload (``sparse-v1`` with ``"index": "varint"``,
``minips/sparse.py`` has the whole format): gap coding, ``g[0] = idx[0]``, ``g[i] = idx[i] -
idx[i-1] - 1`` (so a run of neighbours is a run of zero bytes), each gap in 7-bit groups, low
group first, high bit set on every byte but the last (1 to 5 bytes per index; about 1.3 bytes
at 1% density).

Decoding trusts nothing: a buffer that does not hold k whole numbers, a number over 32 bits or
an index out of range raises ``RemoteProtocolError``. Vectorised numpy, no Python loop per index.
"""

from __future__ import annotations

import numpy as np

from minips.errors import RemoteProtocolError

__all__ = ["MAX_VARINT_BYTES", "VARINT_TABLE_MAX", "varint_decode", "varint_encode"]

MAX_VARINT_BYTES = 5  # a uint32 needs at most ceil(32 / 7) = 5 groups of 7 bits
# Up to this many indices varint_encode lays the bytes out as a (k, width) table, a few
# whole-column numpy calls (11-17 us for 617 indices where the shrinking subsets take 28-31:
# per-call costs dominate); past it the subsets, which touch only the gaps that have a byte j
# (the two cross between 16k and 32k indices at 1% density)
VARINT_TABLE_MAX = 1 << 14
# Past the table, when at most one gap in this many takes more than a byte (the changes of a
# few pushes, 3-5% of a model: a PULL of the exact downlink), every gap's low byte is laid out
# at once and the rest of the long ones inserted after theirs: 0.5 ms for 560k indices at 5%
# against 4.9 ms by subsets, which do better once long gaps are common (1%: 0.7 ms against 1.4)
FEW_LONG = 8


def varint_encode(indices: np.ndarray) -> np.ndarray:
    """Gap + LEB128 code of strictly increasing (k,) uint32 indices -> (m,) uint8 bytes."""
    idx = indices.astype(np.uint32, copy=False)
    if idx.size == 0:
        return np.empty(0, np.uint8)
    gaps = np.empty(idx.size, np.uint32)  # (k,) >= 0 for increasing input
    gaps[0] = idx[0]
    np.subtract(idx[1:], idx[:-1], out=gaps[1:])
    gaps[1:] -= np.uint32(1)
    top, width = int(gaps.max()), 1  # width: bytes of the largest gap
    while width < MAX_VARINT_BYTES and top >> (7 * width):
        width += 1
    if width == 1:  # every gap under 128: one byte each, the gap itself
        return gaps.astype(np.uint8)
    if idx.size <= VARINT_TABLE_MAX:
        return _varint_table(gaps, width)
    long = np.flatnonzero(gaps >= np.uint32(0x80))  # (l,) the gaps of more than one byte
    if long.size <= gaps.size // FEW_LONG:
        return _varint_few_long(gaps, long)
    return _varint_subsets(gaps)


def _varint_few_long(gaps: np.ndarray, long: np.ndarray) -> np.ndarray:
    """``varint_encode``'s bytes of (k,) uint32 ``gaps`` of which only those at ``long``
    ((l,) increasing positions) take more than one byte: each gap's low 7 bits (the
    continuation bit set at ``long``), then after each long gap the bytes of the rest of it,
    ``gap >> 7``, which are themselves its varint (one insert, O(k + l))."""
    out = (gaps & np.uint32(0x7F)).astype(np.uint8)  # (k,) every gap's first byte
    out[long] |= np.uint8(0x80)
    rest = gaps[long] >> np.uint32(7)  # (l,) >= 1
    return np.insert(out, np.repeat(long + 1, _byte_counts(rest)), _varint_subsets(rest))


def _byte_counts(values: np.ndarray) -> np.ndarray:
    """(k,) uint8: the bytes each of (k,) uint32 ``values`` takes as a varint, 1..5."""
    nbytes = np.ones(values.size, np.uint8)
    for j in range(1, MAX_VARINT_BYTES):
        nbytes += values >= np.uint32(1 << (7 * j))
    return nbytes


def _varint_table(gaps: np.ndarray, width: int) -> np.ndarray:
    """``varint_encode``'s bytes of (k,) uint32 ``gaps`` whose largest takes ``width`` bytes:
    row i of a (k, width) table holds gap i's bytes, kept where the gap has them."""
    out = np.empty((gaps.size, width), np.uint8)  # (k, width) byte j of gap i
    has = np.empty((gaps.size, width), np.bool_)  # (k, width) gap i has a byte j
    has[:, 0] = True
    rest = gaps
    for j in range(width - 1):
        nxt = rest >> np.uint32(7)
        more = nxt != 0  # (k,) bool: another byte follows
        has[:, j + 1] = more
        out[:, j] = (rest & np.uint32(0x7F)).astype(np.uint8) | (more.view(np.uint8) << 7)
        rest = nxt
    out[:, width - 1] = rest  # under 128 where the gap has this byte
    return out[has]


def _varint_subsets(gaps: np.ndarray) -> np.ndarray:
    """``varint_encode``'s bytes of (k,) uint32 ``gaps``, byte j of every gap that has one."""
    nbytes = _byte_counts(gaps)  # (k,) bytes per gap, 1..5
    ends = np.cumsum(nbytes, dtype=np.int64)  # (k,) one past each gap's last byte
    out = np.empty(int(ends[-1]), np.uint8)
    # Byte j of every gap, then only the gaps that have a byte j + 1 (a shrinking subset:
    # uint32 throughout, since mixing uint64 with Python ints goes through float64 and is slow).
    group: np.ndarray = gaps  # (plain ndarray: the subsets below narrow the shape types)
    nb: np.ndarray = nbytes
    pos = ends - nbytes
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
    if data.size == k:  # every gap under 128: one byte each, the gap itself
        return _indices_of(data.astype(np.uint32), size)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lens = ends - starts + 1  # (k,) 1..5 if well formed
    longest = int(lens.max())
    if longest > MAX_VARINT_BYTES or (longest == MAX_VARINT_BYTES
                                      and int(data[ends[lens == MAX_VARINT_BYTES]].max()) > 0x0F):
        raise RemoteProtocolError("varint index larger than 32 bits")
    payload = data & np.uint8(0x7F)  # (m,) uint8, the 7-bit groups
    gaps = payload[starts].astype(np.uint32)  # (k,) low groups; < 2^32 checked above
    sel = np.flatnonzero(lens > 1)  # the gaps with more groups, a shrinking subset
    for j in range(1, MAX_VARINT_BYTES):
        if sel.size == 0:
            break
        gaps[sel] |= payload[starts[sel] + j].astype(np.uint32) << np.uint32(7 * j)
        sel = sel[lens[sel] > j + 1]
    return _indices_of(gaps, size)


def _indices_of(gaps: np.ndarray, size: int) -> np.ndarray:
    """(k,) uint32 indices from their (k,) uint32 gaps, each below ``size``."""
    # idx[i] = sum of (gap + 1) up to i, minus 1; int64 holds k * 2^32.
    idx = np.cumsum(gaps, dtype=np.int64) + np.arange(gaps.size, dtype=np.int64)  # increasing
    if int(idx[-1]) >= size:
        raise RemoteProtocolError("sparse index out of range", expected=size, got=int(idx[-1]))
    return idx.astype(np.uint32)
