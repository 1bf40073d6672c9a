"""The frame trace: one JSON line per frame a process sends or receives, for reading a run's
conversation frame by frame (`--trace FILE`; `minips trace` merges the files of a run).

The process has at most one tracer, ``TRACER``, opened by the command line (``open_tracer``)
and None otherwise. The one place frames are sent and received (net/channel.py) calls it
behind ``if trace.TRACER is not None``: with tracing off, that check is all a frame costs.

A line (docs: one per frame; the file opens with an ``open`` event line):

    {"t": unix s, "role": "worker-0", "dir": "send" | "recv", "kind": "PUSH", "bytes": 1234,
     "seq": 5, "local": "127.0.0.1:50412", "peer": "127.0.0.1:7071",
     "meta": {the frame's msgpack map, payload keys aside}, "payload": {"encoding": ...,
     "n": ..., "k": ..., "value": ..., "index": ..., "buffers": [bytes, ...]}}

- ``seq`` counts the frames of one connection and direction (from 0): a frame's ``send`` line
  in one file and its ``recv`` line in the peer's have the same (local, peer) swapped and the
  same ``seq``, which is how ``minips trace`` pairs them.
- ``bytes`` is the whole frame: exact on send; on receive it is rebuilt from the map and the
  buffers' raw lengths, exact unless the sender lz4-compressed buffers (minips' roles never do).
- ``role`` is the tracer's role, or the role named for the listening port the connection came
  in on (``name_port``): the group servers a global server runs in its process write into its
  file, each of their connections tagged ``group-G``. Their exchanges with the global server
  are direct calls, not frames; ``inproc`` writes them as the EXCHANGE and EXCHANGE_REPLY a
  `minips group` process would send (peer ``inproc``, bytes as ``frames.wire_size``).
- Bytes fields (a MAC, a nonce) are written as ``"<N bytes>"``, lists of more than
  ``LIST_ITEMS`` items as their length and head: lines stay short and carry no secret.

Bounded: after ``cap_bytes`` (20 MB by default) only every ``every``-th frame is written, and
nothing once the file holds twice the cap; a ``sampling`` / ``stopped`` event line says so.
The file is created at the first frame (after a server claimed its run directory); lines are
buffered and flushed at least every ``FLUSH_S`` seconds and at close (atexit).
"""

from __future__ import annotations

import atexit
import json
import os
import time
import weakref
from pathlib import Path
from typing import IO, Any

import msgpack

from minips.wire.checks import PREFIX, TABLE_ENTRY
from minips.wire.kinds import WITH_BUFFERS
from minips.wire.messages import Kind, Message

__all__ = ["TRACER", "Tracer", "open_tracer", "close_tracer", "role_of_path",
           "summarise_payload", "frame_bytes", "DEFAULT_CAP_BYTES", "SAMPLE_EVERY", "SUFFIX",
           "LIST_ITEMS", "FLUSH_S"]

DEFAULT_CAP_BYTES = 20_000_000  # bytes (20 MB) of trace written before it is sampled
SAMPLE_EVERY = 100  # past the cap, one frame in this many is written
FLUSH_S = 0.5  # s between flushes: a killed process loses at most this much of its tail
LIST_ITEMS = 16  # a list field of more items is written as its length and first 8
SUFFIX = ".trace.jsonl"  # `minips local --trace DIR` writes DIR/<role>.trace.jsonl
FORMAT = 1  # the line format's version, in the open event

TRACER: Tracer | None = None  # the process's tracer; None: tracing is off (the default)


def role_of_path(path: str | os.PathLike[str], default: str) -> str:
    """The role a trace file's name says (``worker-3.trace.jsonl`` -> ``worker-3``), else
    ``default``."""
    name = Path(path).name
    return name[: -len(SUFFIX)] if name.endswith(SUFFIX) and len(name) > len(SUFFIX) else default


def _jsonable(value: Any) -> Any:
    """A map value as JSON: bytes as their length, long lists as length and head."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{memoryview(value).nbytes} bytes>"
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if len(value) > LIST_ITEMS:
            return {"len": len(value), "head": [_jsonable(v) for v in value[:8]]}
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def summarise_payload(encoding: str, codec: dict[str, Any], buffers: list[int]) -> dict[str, Any]:
    """A vector payload in a few fields: encoding, ``n`` (a dense vector's length; None for a
    sparse one, whose model size is not on the wire), ``k`` (values carried), ``value`` (f32 or
    f16), ``index`` (sparse index coding) and the buffers' raw bytes."""
    out: dict[str, Any] = {"encoding": encoding}
    if encoding.startswith("dense-"):
        value = "f16" if encoding == "dense-f16" else "f32"
        n = (buffers[0] // (2 if value == "f16" else 4)) if buffers else 0
        out.update(n=n, k=n, value=value)
    else:
        out.update(n=None, k=codec.get("k"), value=codec.get("value", "f32"),
                   index=codec.get("index"))
    out["buffers"] = list(buffers)
    return out


def frame_bytes(meta: dict[str, Any], buffers: list[int]) -> int:
    """Bytes of the frame of a map ``meta`` and buffers of these raw lengths (no lz4)."""
    return (PREFIX.size + TABLE_ENTRY.size * len(buffers) + len(msgpack.packb(meta))
            + sum(buffers))


def _address(addr: Any) -> str:
    """A socket address as 'host:port' ('[v6]:port'); '' when there is none."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = str(addr[0])
        return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
    return str(addr or "")


class _Conn:
    """What the tracer keeps per connection: its addresses, role and frame counters."""

    __slots__ = ("local", "peer", "role", "sent", "received")

    def __init__(self, local: str, peer: str, role: str) -> None:
        self.local, self.peer, self.role = local, peer, role
        self.sent = self.received = 0


class Tracer:
    """Writes the trace lines of one process to one file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], role: str, *,
                 cap_bytes: int = DEFAULT_CAP_BYTES, every: int = SAMPLE_EVERY) -> None:
        self.path = Path(path)
        self.role = role
        self.cap_bytes, self.every = cap_bytes, max(1, every)
        # opened at the first line: a server claims its run directory first (a directory with
        # a *.jsonl in it holds a run), and a process that sends nothing leaves no file
        self.file: IO[str] | None = None
        self.closed = False
        self.written = 0  # bytes of lines written
        self.frames = 0  # frames seen (written or not)
        self.state = "full"  # full | sampling | stopped
        self.port_roles: dict[int, str] = {}  # listening port -> role (in-process groups)
        self._conns: weakref.WeakKeyDictionary[Any, _Conn] = weakref.WeakKeyDictionary()
        self._inproc: dict[tuple[str, str, str], int] = {}  # (role, peer, dir) -> next seq
        self._flushed = time.monotonic()

    def name_port(self, port: int, role: str) -> None:
        """Connections accepted on listening ``port`` belong to ``role`` (a group server
        running in this process)."""
        self.port_roles[int(port)] = role

    # -- the hooks: net/channel.py calls these ---------------------------------------------------

    def sent(self, proto: Any, msg: Message, frame: list[Any]) -> None:
        """``msg`` went out on ``proto``'s connection as ``frame`` (frames.encode's pieces)."""
        conn = self._conn(proto)
        seq, conn.sent = conn.sent, conn.sent + 1
        self._frame(conn, "send", seq, msg, sum(memoryview(p).nbytes for p in frame))

    def received(self, proto: Any, msg: Message) -> None:
        """``msg`` came in on ``proto``'s connection."""
        conn = self._conn(proto)
        seq, conn.received = conn.received, conn.received + 1
        self._frame(conn, "recv", seq, msg, None)

    def inproc(self, role: str, peer_role: str, direction: str, msg: Message,
               nbytes: int) -> None:
        """A message passed by a direct call inside this process (an in-process group's
        exchange), written as the frame it would be, ``nbytes`` long."""
        key = (role, peer_role, direction)
        seq = self._inproc.get(key, 0)
        self._inproc[key] = seq + 1
        conn = _Conn(f"inproc:{role}", f"inproc:{peer_role}", role)
        self._frame(conn, direction, seq, msg, nbytes, peer_role=peer_role)

    # -- lines -------------------------------------------------------------------------------

    def _conn(self, proto: Any) -> _Conn:
        conn = self._conns.get(proto)
        if conn is None:
            transport = proto.transport
            sock = transport.get_extra_info("sockname") if transport is not None else None
            peer = transport.get_extra_info("peername") if transport is not None else None
            port = sock[1] if isinstance(sock, tuple) and len(sock) >= 2 else -1
            conn = _Conn(_address(sock), _address(peer), self.port_roles.get(port, self.role))
            self._conns[proto] = conn
        return conn

    def _frame(self, conn: _Conn, direction: str, seq: int, msg: Message,
               nbytes: int | None, peer_role: str = "") -> None:
        self.frames += 1
        if not self._admit():
            return
        meta = msg.meta()
        payload = None
        if msg.KIND in WITH_BUFFERS:
            encoding, codec, buffers = msg.__dict__["payload"]
            sizes = [memoryview(b).nbytes for b in buffers]
            payload = summarise_payload(encoding, codec, sizes)
            if nbytes is None:
                nbytes = frame_bytes(meta, sizes)
            meta = {k: v for k, v in meta.items() if k not in ("encoding", "codec")}
        elif nbytes is None:
            nbytes = frame_bytes(meta, [])
        line: dict[str, Any] = {
            "t": time.time(), "role": conn.role, "dir": direction, "kind": Kind(msg.KIND).name,
            "bytes": nbytes, "seq": seq, "local": conn.local, "peer": conn.peer,
            "meta": _jsonable(meta)}
        if payload is not None:
            line["payload"] = payload
        if peer_role:
            line["peer_role"] = peer_role
        self._line(line)

    def _admit(self) -> bool:
        """Whether the frame just counted is written (the cap, then the sampled tail)."""
        if self.state == "full" and self.written >= self.cap_bytes:
            self.state = "sampling"
            self._line({"event": "sampling", "t": time.time(), "every": self.every,
                        "after_bytes": self.written, "frames": self.frames - 1,
                        "note": f"size cap reached: from here one frame in {self.every} is "
                                "written (seq numbers show the gaps)"})
        if self.state == "sampling" and self.written >= 2 * self.cap_bytes:
            self.state = "stopped"
            self._line({"event": "stopped", "t": time.time(), "after_bytes": self.written,
                        "frames": self.frames - 1,
                        "note": "twice the size cap reached: no more frames are written"})
        if self.state == "full":
            return True
        return self.state == "sampling" and self.frames % self.every == 0

    def _line(self, obj: dict[str, Any]) -> None:
        if self.file is None:
            if self.closed:
                return
            self._open()
            assert self.file is not None
        text = json.dumps(obj, separators=(",", ":"), allow_nan=True) + "\n"
        self.file.write(text)
        self.written += len(text)
        now = time.monotonic()
        if now - self._flushed >= FLUSH_S:
            self.file.flush()
            self._flushed = now

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 (close())
        self._line({"event": "open", "t": time.time(), "role": self.role, "pid": os.getpid(),
                    "format": FORMAT, "cap_bytes": self.cap_bytes, "every": self.every})

    def close(self) -> None:
        """Write what is buffered and close the file (later frames are dropped)."""
        self.closed = True
        if self.file is not None:
            self.file.flush()
            self.file.close()
            self.file = None


def open_tracer(path: str | os.PathLike[str], role: str, *,
                cap_bytes: int = DEFAULT_CAP_BYTES, every: int = SAMPLE_EVERY) -> Tracer:
    """Start tracing this process's frames into ``path`` (replacing a tracer already open);
    the role is the file name's (``role_of_path``) or ``role``."""
    global TRACER
    close_tracer()
    TRACER = Tracer(path, role_of_path(path, role), cap_bytes=cap_bytes, every=every)
    return TRACER


def close_tracer() -> None:
    """Stop tracing (flush and close the file); tracing is off again."""
    global TRACER
    tracer, TRACER = TRACER, None
    if tracer is not None:
        tracer.close()


atexit.register(close_tracer)
