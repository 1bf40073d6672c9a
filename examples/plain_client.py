"""A minips client written from docs/protocol.md alone: Python's standard library and msgpack
(lz4 only if the server compresses), no minips import. It is what a student porting minips to
another language writes first, and the test suite runs it against a real `minips server`.

It opens a session as an evaluator (HELLO, CHALLENGE, AUTH, WELCOME: section 5), PULLs the global
weights once (section 3), checks the frame and the table (section 1), writes the weights' raw
little-endian float32 bytes to --out, prints one JSON line and says LEAVE.

Usage: MINIPS_TOKEN=secret python examples/plain_client.py HOST PORT [--out weights.f32]
Exit status: 0 with the weights; 1 refused or an ERROR from the server (reason printed);
2 the server broke the protocol; 3 the connection failed.
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
from typing import Any

import msgpack

PREFIX = struct.Struct("<4sBBBBII")  # magic, version, kind, nbuf, flags, meta_len, body_len
TABLE_ENTRY = struct.Struct("<B3xII")  # codec, padding, wire_len, raw_len
MAGIC, VERSION = b"MNPS", 1
HELLO, CHALLENGE, AUTH, WELCOME, REFUSE = 1, 2, 3, 4, 5
PULL, WEIGHTS, LEAVE, ERROR = 10, 11, 13, 14
MAX_FRAME = 512 << 20  # section 6: the default limits
MAX_META = 1 << 20
MAX_BUFFERS = 16


class Broken(Exception):
    """The server sent something section 1 or 3 does not allow."""


class Refused(Exception):
    """REFUSE or ERROR from the server."""


def send(sock: socket.socket, kind: int, meta: dict[str, Any]) -> None:
    packed = msgpack.packb(meta)
    sock.sendall(PREFIX.pack(MAGIC, VERSION, kind, 0, 0, len(packed), 0) + packed)


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
    table = [TABLE_ENTRY.unpack_from(recv_exactly(sock, TABLE_ENTRY.size)) for _ in range(nbuf)]
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


def transcript(label: bytes, role: str, worker_id: int, nonce_c: bytes, nonce_s: bytes) -> bytes:
    """Section 5: what both MACs are computed over."""
    return (label + bytes([VERSION, len(role)]) + role.encode("ascii")
            + struct.pack("<q", worker_id) + nonce_c + nonce_s)


def handshake(sock: socket.socket, key: bytes, role: str = "evaluator") -> dict[str, Any]:
    """HELLO -> CHALLENGE -> AUTH -> WELCOME; returns WELCOME's info (the run configuration)."""
    nonce_c, worker_id = secrets.token_bytes(32), -1
    send(sock, HELLO, {"role": role, "worker_id": worker_id, "nonce": nonce_c,
                       "capabilities": [], "address": "", "group": -1})
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
    return dict(welcome["info"])


def pull_weights(host: str, port: int, key: bytes) -> tuple[dict[str, Any], bytes]:
    """One evaluator session: the WEIGHTS map and the weights' float32 bytes."""
    with socket.create_connection((host, port), timeout=30) as sock:
        handshake(sock, key)
        send(sock, PULL, {"clock": 0, "since": -1})
        kind, meta, buffers = recv_frame(sock)
        if kind != WEIGHTS or meta.get("encoding") != "dense-f32" or len(buffers) != 1:
            raise Broken(f"expected dense-f32 WEIGHTS, got kind {kind} {meta.get('encoding')}")
        send(sock, LEAVE, {"reason": "done"})
    return meta, buffers[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("--out", help="write the weights' float32 bytes here")
    args = ap.parse_args()
    key = os.environ.get("MINIPS_TOKEN", "").encode()
    try:
        meta, weights = pull_weights(args.host, args.port, key)
    except Refused as e:
        print(f"refused: {e}", file=sys.stderr)
        return 1
    except (Broken, KeyError) as e:  # KeyError: a map without a key section 3 lists
        print(f"protocol error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"cannot talk to {args.host}:{args.port}: {e}", file=sys.stderr)
        return 3
    if args.out:
        with open(args.out, "wb") as f:
            f.write(weights)
    print(json.dumps({"version": meta["version"], "encoding": meta["encoding"],
                      "params": len(weights) // 4, "done": meta["done"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
