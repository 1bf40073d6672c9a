"""A frame larger than 64 KiB while it arrives, sans-IO: its prefix, table and message so far,
and the buffers its body is copied into (``decoder.FrameDecoder`` reads big frames stage by
stage through it).

Invariants: a buffer of the table is filled in order, exactly ``wire_len`` bytes; a raw one
lands in the memory ``allocate`` returns (no copy after it), an lz4 one in a temporary that is
decompressed into ``allocate``'s memory once whole (``frames.decompress`` checks its length).

Public API: ``PartialFrame``, ``Allocate``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from minips.wire.frames import CODEC_LZ4, KINDS, decompress
from minips.wire.messages import Kind, Message

__all__ = ["PartialFrame", "Allocate"]

Allocate = Callable[[Kind, int, int], memoryview]  # (kind, buffer index, nbytes) -> flat view


class PartialFrame:
    """A frame that arrives in pieces: what is known so far and where its body goes."""

    __slots__ = ("version", "kind", "nbuf", "head_len", "body_len", "table", "msg", "bufs",
                 "dest", "pos")

    def __init__(self, prefix: tuple[Any, ...], head_len: int) -> None:
        _, self.version, kind, self.nbuf, _, _, self.body_len = prefix
        self.kind: Kind = KINDS[kind]
        self.head_len = head_len
        self.table: tuple[int, ...] = ()  # flat (codec, wire_len, raw_len) per buffer
        self.msg: Message | None = None  # built (buffers empty) once table + meta are read
        self.bufs: list[memoryview] = []
        self.dest: memoryview | None = None  # where the current buffer's bytes go
        self.pos = 0  # bytes of dest already filled

    def fill(self, view: memoryview, lo: int, hi: int, allocate: Allocate) -> int:
        """Copy ``view[lo:hi]`` into the buffers, as far as they take it; returns the new ``lo``.
        The body is whole once ``len(bufs) == nbuf``."""
        while len(self.bufs) < self.nbuf:
            if self.dest is None:
                self._open(allocate)
            assert self.dest is not None
            take = min(self.dest.nbytes - self.pos, hi - lo)
            if take:
                self.dest[self.pos:self.pos + take] = view[lo:lo + take]
                self.pos += take
                lo += take
            if self.pos < self.dest.nbytes:
                return lo
            self._close(allocate)
        return lo

    def _open(self, allocate: Allocate) -> None:
        i = len(self.bufs)
        codec, wire, raw = self.table[3 * i:3 * i + 3]
        self.pos = 0
        if codec == CODEC_LZ4:  # compressed bytes land in a temporary, decompressed on close
            self.dest = np.empty(wire, dtype=np.uint8).data
        else:
            self.dest = allocate(self.kind, i, raw)

    def _close(self, allocate: Allocate) -> None:
        i = len(self.bufs)
        codec, raw = self.table[3 * i], self.table[3 * i + 2]
        assert self.dest is not None
        buf = self.dest
        if codec == CODEC_LZ4:
            buf = allocate(self.kind, i, raw)
            buf[:] = decompress(self.dest, raw)
        self.bufs.append(buf)
        self.dest, self.pos = None, 0
