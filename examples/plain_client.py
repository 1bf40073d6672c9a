"""A minips client written from docs/protocol.md alone: Python's standard library and msgpack
(lz4 only if the server compresses), no minips import. It is what a student porting minips to
another language writes first, and the test suite runs it against a real `minips server`.

As an evaluator (the default) it opens a session (HELLO, CHALLENGE, AUTH, WELCOME: section 5),
PULLs the global weights once (GLOBAL_WEIGHTS, section 3), checks the frame and the table
(section 1), writes the weights' raw little-endian float32 bytes to --out, prints one JSON
line and says LEAVE.

With --worker it follows a worker's sessions (section 9): STATS on the global server's control
channel until ASSIGN, then on its group server one step: PULL, a PUSH of a made-up sparse-v1
gradient of --k coordinates, ACK, and a second PULL to see which weights moved.

Usage: MINIPS_TOKEN=secret python examples/plain_client.py HOST PORT [--out weights.f32]
       MINIPS_TOKEN=secret python examples/plain_client.py HOST PORT --worker [--k 50]
Exit status: 0 done; 1 refused or an ERROR from the server (reason printed); 2 the server broke
the protocol; 3 the connection failed.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import sys
from array import array
from typing import Any

import msgpack

PREFIX = struct.Struct("<4sBBBBII")  # magic, version, kind, nbuf, flags, meta_len, body_len
TABLE_ENTRY = struct.Struct("<B3xII")  # codec, padding, wire_len, raw_len
MAGIC, VERSION = b"MNPS", 4
HELLO, CHALLENGE, AUTH, WELCOME, REFUSE, ASSIGN, STATS = 1, 2, 3, 4, 5, 6, 7
PUSH, ACK, PULL, WEIGHTS, HEARTBEAT, LEAVE, ERROR = 8, 9, 10, 11, 12, 13, 14
GLOBAL_WEIGHTS = 17  # the global server's answer to a PULL (EXCHANGE 15, its reply 16 and
# INIT_WEIGHTS 18 are a group process's and a first worker's; this client sends none)
MAX_FRAME = 512 << 20  # section 6: the default limits
MAX_META = 1 << 20
MAX_BUFFERS = 16


class Broken(Exception):
    """The server sent something section 1 or 3 does not allow."""


class Refused(Exception):
    """REFUSE or ERROR from the server."""


def send(sock: socket.socket, kind: int, meta: dict[str, Any],
         buffers: tuple[bytes, ...] = ()) -> None:
    """One frame: prefix, a raw table entry per buffer, the map, the buffers (section 1)."""
    packed = msgpack.packb(meta)
    table = b"".join(TABLE_ENTRY.pack(0, len(b), len(b)) for b in buffers)
    body = b"".join(buffers)
    sock.sendall(PREFIX.pack(MAGIC, VERSION, kind, len(buffers), 0, len(packed), len(body))
                 + table + packed + body)


def recv_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise Broken(f"connection closed with {n - got} bytes of a frame missing")
        got += k
    return buf


def recv_frame(sock: socket.socket) -> tuple[int, dict[str, Any], list[bytes]]:
    """Read one frame (section 8, step 2): kind, map, buffers."""
    magic, version, kind, nbuf, flags, meta_len, body_len = PREFIX.unpack(
        recv_exactly(sock, PREFIX.size))
    if magic != MAGIC or flags or nbuf > MAX_BUFFERS or meta_len > MAX_META:
        raise Broken(f"bad prefix: magic {magic!r} flags {flags} nbuf {nbuf} meta {meta_len}")
    if version != VERSION and kind not in (REFUSE, ERROR):
        raise Broken(f"protocol version {version}, this client speaks {VERSION}")
    if PREFIX.size + TABLE_ENTRY.size * nbuf + meta_len + body_len > MAX_FRAME:
        raise Broken("frame over 512 MiB")
    table = list(TABLE_ENTRY.iter_unpack(recv_exactly(sock, TABLE_ENTRY.size * nbuf)))
    if sum(wire for _, wire, _ in table) != body_len:
        raise Broken("buffer table does not add up to body_len")
    try:
        meta = msgpack.unpackb(recv_exactly(sock, meta_len))
    except ValueError as e:  # msgpack's errors: invalid data, bytes after the map, ...
        raise Broken(f"bad msgpack map: {e}") from None
    if not isinstance(meta, dict):
        raise Broken("meta is not a map")
    buffers = [raw_buffer(codec, recv_exactly(sock, wire), raw) for codec, wire, raw in table]
    if kind in (REFUSE, ERROR):
        raise Refused(f"{meta.get('code')}: {meta.get('reason')}")
    return kind, meta, buffers


def raw_buffer(codec: int, data: bytearray, raw_len: int) -> bytes:
    if codec == 0:
        return bytes(data)
    if codec != 1:
        raise Broken(f"unknown codec {codec}")
    import lz4.block  # only a server that compresses needs it

    out = lz4.block.decompress(bytes(data), uncompressed_size=raw_len)
    if len(out) != raw_len:
        raise Broken("lz4 buffer decompressed to the wrong size")
    return bytes(out)


def expect(got: tuple[int, dict[str, Any], list[bytes]], kind: int) -> dict[str, Any]:
    if got[0] != kind:
        raise Broken(f"expected message kind {kind}, got {got[0]}")
    return got[1]


def next_message(sock: socket.socket, kind: int) -> tuple[dict[str, Any], list[bytes]]:
    """The next message of ``kind``, HEARTBEATs skipped; LEAVE or another kind is an error."""
    while True:
        got, meta, buffers = recv_frame(sock)
        if got == kind:
            return meta, buffers
        if got == LEAVE:
            raise Refused(f"the server left: {meta.get('reason')}")
        if got != HEARTBEAT:
            raise Broken(f"expected message kind {kind}, got {got}")


def transcript(label: bytes, role: str, worker_id: int, nonce_c: bytes, nonce_s: bytes) -> bytes:
    """Section 5: what both MACs are computed over."""
    return (label + bytes([VERSION, len(role)]) + role.encode("ascii")
            + struct.pack("<q", worker_id) + nonce_c + nonce_s)


def handshake(sock: socket.socket, key: bytes, role: str = "evaluator", worker_id: int = -1,
              group: int = -1) -> dict[str, Any]:
    """HELLO -> CHALLENGE -> AUTH -> WELCOME; returns WELCOME's map (worker_id, mac, info)."""
    nonce_c = secrets.token_bytes(32)
    send(sock, HELLO, {"role": role, "worker_id": worker_id, "nonce": nonce_c,
                       "capabilities": [], "address": "", "group": group})
    nonce_s = expect(recv_frame(sock), CHALLENGE)["nonce"]
    mac_c = hmac.new(key, transcript(b"minips-client-v1\0", role, worker_id, nonce_c, nonce_s),
                     hashlib.sha256).digest() if key else b""
    send(sock, AUTH, {"mac": mac_c})
    welcome = expect(recv_frame(sock), WELCOME)
    if key:
        want = hmac.new(key, transcript(b"minips-server-v1\0", role, worker_id, nonce_c,
                                        nonce_s), hashlib.sha256).digest()
        if not hmac.compare_digest(want, welcome["mac"]):
            raise Refused("auth: the server does not know the secret")
    return welcome


def dial(host: str, port: int) -> socket.socket:
    """A TCP connection; a failure says which address it was."""
    try:
        return socket.create_connection((host, port), timeout=60)
    except OSError as e:
        raise ConnectionError(f"{host}:{port}: {e.strerror or e}") from None


def pull_weights(host: str, port: int, key: bytes) -> tuple[dict[str, Any], bytes]:
    """One evaluator session: the GLOBAL_WEIGHTS map and the weights' float32 bytes."""
    with dial(host, port) as sock:
        handshake(sock, key)
        send(sock, PULL, {"clock": 0, "since": -1})
        kind, meta, buffers = recv_frame(sock)
        if (kind != GLOBAL_WEIGHTS or meta.get("encoding") != "dense-f32" or len(buffers) != 1
                or len(buffers[0]) != 4 * meta.get("size", -1)):
            raise Broken(f"expected dense-f32 GLOBAL_WEIGHTS of its size, got kind {kind} "
                         f"{meta.get('encoding')}")
        send(sock, LEAVE, {"reason": "done"})
    return meta, buffers[0]


def pull(sock: socket.socket, clock: int) -> array:
    """PULL at ``clock`` (keeping no copy: ``since`` -1); the whole weights that answer it."""
    send(sock, PULL, {"clock": clock, "since": -1})
    meta, buffers = next_message(sock, WEIGHTS)
    if meta["since"] != -1 or meta["encoding"] != "dense-f32" or len(buffers) != 1:
        raise Broken(f"expected dense-f32 WEIGHTS, got {meta['encoding']}")
    return array("f", buffers[0])  # little-endian hosts: x86-64 and aarch64


def worker_step(host: str, port: int, key: bytes, k: int) -> dict[str, Any]:
    """A worker's sessions (section 9), one step with a made-up sparse gradient."""
    with dial(host, port) as ctl:
        worker_id = handshake(ctl, key, "worker")["worker_id"]
        send(ctl, STATS, {"clock": 0, "step_time": 0.05, "loss": 2.3, "samples": 32})
        assign, _ = next_message(ctl, ASSIGN)
        group_host, group_port = assign["address"].rsplit(":", 1)
        group_host = group_host.strip("[]") or host  # no host: the one we reached
        with dial(group_host, int(group_port)) as grp:  # where ASSIGN said
            handshake(grp, key, "worker", worker_id, assign["group"])
            clock = next_message(grp, ACK)[0]["clock"]  # where this worker starts
            before = pull(grp, clock)
            rng = secrets.SystemRandom()
            index = sorted(rng.sample(range(len(before)), k))
            value = [rng.choice((-1.0, 1.0)) for _ in index]
            send(grp, PUSH, {"clock": clock + 1, "step_time": 0.05, "loss": 2.3, "samples": 32,
                             "encoding": "sparse-v1",
                             "codec": {"k": k, "index": "u32", "value": "f32"}},
                 (array("I", index).tobytes(), array("f", value).tobytes()))
            ack, _ = next_message(grp, ACK)
            after = pull(grp, clock + 1)
            send(grp, LEAVE, {"reason": "done"})
        send(ctl, LEAVE, {"reason": "done"})
    if len(after) != len(before):
        raise Broken(f"the weights changed size: {len(before)} -> {len(after)}")
    moved = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    pushed = dict(zip(index, value, strict=True))
    return {"worker_id": worker_id, "group": assign["group"], "clock": ack["clock"],
            "version": ack["version"], "k": k, "moved": len(moved),
            "moved_only_where_pushed": set(moved) <= set(pushed),
            "moved_against_the_gradient": all((after[i] - before[i]) * pushed[i] < 0
                                              for i in moved if i in pushed)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("--out", help="write the weights' float32 bytes here")
    ap.add_argument("--worker", action="store_true", help="one worker step instead of a PULL")
    ap.add_argument("--k", type=int, default=50, help="coordinates of the made-up gradient")
    args = ap.parse_args()
    key = os.environ.get("MINIPS_TOKEN", "").encode()
    try:
        if args.worker:
            print(json.dumps(worker_step(args.host, args.port, key, args.k)))
            return 0
        meta, weights = pull_weights(args.host, args.port, key)
    except Refused as e:
        print(f"refused: {e}", file=sys.stderr)
        return 1
    except (Broken, KeyError) as e:  # KeyError: a map without a key section 3 lists
        print(f"protocol error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"cannot talk to {e}", file=sys.stderr)
        return 3
    if args.out:
        with open(args.out, "wb") as f:
            f.write(weights)
    print(json.dumps({"version": meta["version"], "encoding": meta["encoding"],
                      "params": len(weights) // 4, "done": meta["done"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
