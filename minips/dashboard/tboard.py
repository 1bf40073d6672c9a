"""TensorBoard event files, written directly: the run's series as scalars (no dependency).

An event file is a sequence of TFRecords (``u64 length, u32 masked CRC-32C of the length,
data, u32 masked CRC-32C of the data``, little-endian), each holding one ``Event`` protobuf:
``wall_time`` (field 1, double), ``step`` (2, int64), ``file_version`` (3, string) or
``summary`` (5, message) whose ``value`` (1) entries carry ``tag`` (1, string) and
``simple_value`` (2, float). These few fields are encoded here by hand, so the server needs
neither protobuf nor tensorboard; tests read the files back with TensorBoard's own reader.

``TensorBoardSink.add(source, record)`` takes the same records as ``RunState.add``:

- ``eval/accuracy``, ``eval/loss`` at step = training samples so far; ``eval_by_bytes/...``
  at step = bytes on the wire so far (up + down);
- ``group/<g>/min_clock``, ``group/<g>/max_clock`` at step = the group's merges;
- ``worker/<w>/step_time``, ``wait_s``, ``staleness``, ``bytes_per_push`` at step = its clock.

Every scalar's wall time is the run's t0 + its ``t``, so TensorBoard's "relative" axis is the
run's time axis.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["EventWriter", "TensorBoardSink", "crc32c"]


def _crc_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli polynomial, reflected
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> bytes:
    crc = crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf encodes it (two's complement)
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, *, summary: bytes = b"", version: str = "") -> bytes:
    body = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if version:
        body += _field_bytes(3, version.encode())
    if summary:
        body += _field_bytes(5, summary)
    return body


def _scalar(tag: str, value: float) -> bytes:
    value_msg = _field_bytes(1, tag.encode()) + b"\x15" + struct.pack("<f", value)
    return _field_bytes(1, value_msg)  # Summary.value


class EventWriter:
    """One ``events.out.tfevents.*`` file in ``log_dir``; ``scalar`` appends, ``flush`` writes."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = self.dir / name
        self._file: BinaryIO = open(self.path, "ab")  # noqa: SIM115 (closed in close())
        self._record(_event(time.time(), 0, version="brain.Event:2"))

    def _record(self, data: bytes) -> None:
        length = struct.pack("<Q", len(data))
        self._file.write(length + _masked(length) + data + _masked(data))

    def scalar(self, tag: str, value: float, step: int, wall_time: float) -> None:
        self._record(_event(wall_time, int(step), summary=_scalar(tag, float(value))))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Turns run records into scalars (the tags in the module docstring)."""

    def __init__(self, log_dir: str | os.PathLike[str], t0: float) -> None:
        self.writer = EventWriter(log_dir)
        self.t0 = t0
        self.merges: dict[Any, int] = {}

    def add(self, source: str, r: dict[str, Any]) -> None:
        t = r.get("t")
        if not isinstance(t, (int, float)):
            return
        wall = self.t0 + t
        if source == "eval" and isinstance(r.get("accuracy"), (int, float)):
            self._eval(r, wall)
        elif source == "global" and r.get("event") == "merge":
            g = r.get("group")
            self.merges[g] = self.merges.get(g, 0) + 1
            for k in ("min_clock", "max_clock"):
                if isinstance(r.get(k), (int, float)):
                    self.writer.scalar(f"group/{g}/{k}", r[k], self.merges[g], wall)
        elif source == "worker" and not r.get("event") and r.get("worker") is not None:
            for k, tag in (("step_time", "step_time"), ("wait_s", "wait_s"),
                           ("staleness", "staleness"), ("bytes_wire", "bytes_per_push")):
                if isinstance(r.get(k), (int, float)):
                    self.writer.scalar(f"worker/{r['worker']}/{tag}", r[k],
                                       int(r.get("clock", 0)), wall)

    def _eval(self, r: dict[str, Any], wall: float) -> None:
        nbytes = int((r.get("bytes_up") or 0) + (r.get("bytes_down") or 0))
        for k in ("accuracy", "loss"):
            if isinstance(r.get(k), (int, float)):
                self.writer.scalar(f"eval/{k}", r[k], int(r.get("samples") or 0), wall)
                self.writer.scalar(f"eval_by_bytes/{k}", r[k], nbytes, wall)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
