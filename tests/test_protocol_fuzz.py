"""Fuzz test of the decoder's one promise: any bytes give messages or RemoteProtocolError."""

from __future__ import annotations

import random

import numpy as np

from minips.errors import RemoteProtocolError
from minips.wire import control, messages
from minips.wire.checks import MAGIC, Limits
from minips.wire.fields import Payload
from minips.wire.frames import FrameDecoder, encode

LIMITS = Limits(max_frame_bytes=1 << 20, max_raw_bytes=1 << 20)  # keep mutated sizes cheap


def seed_frames() -> list[bytes]:
    msgs: list[messages.Message] = [
        control.Hello(nonce=bytes(32), capabilities=("lz4",), address="h:1"),
        control.Challenge(nonce=bytes(range(32))),
        control.Auth(mac=bytes(32)),
        control.Welcome(worker_id=1, mac=b"", info={"a": [1, 2.5, None], "b": {"c": "d"}}),
        control.Refuse(code="auth", reason="wrong"),
        control.Assign(group=0, address="x:1", ratio=0.01, staleness=3),
        control.Stats(clock=1, step_time=0.1, loss=2.3, samples=64),
        messages.Push(clock=2, payload=Payload("topk", {"k": 3}, (np.arange(3,
                                                                                   dtype=np.uint32),
                                                                   np.ones(3, np.float32)))),
        messages.Ack(clock=2, version=7),
        messages.Pull(clock=2, since=5),
        messages.Weights(version=1, payload=Payload("dense", {}, (bytes(600),)), done=True),
        control.Heartbeat(seq=9),
        control.Leave(reason="done"),
        control.Error(code="x", reason="y"),
    ]
    frames = [b"".join(bytes(b) for b in encode(m)) for m in msgs]
    frames.append(b"".join(bytes(b) for b in encode(msgs[10], compress=True)))
    return frames


def mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        i = rng.randrange(len(buf) + 1)
        if op == 0 and buf:  # flip a byte
            buf[min(i, len(buf) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:  # overwrite with a random byte
            buf[min(i, len(buf) - 1)] = rng.randrange(256)
        elif op == 2:  # insert random bytes
            buf[i:i] = rng.randbytes(rng.randint(1, 8))
        elif op == 3:  # delete a slice
            del buf[i:i + rng.randint(1, 8)]
        else:  # truncate
            del buf[i:]
    return bytes(buf)


def decode_all(data: bytes, rng: random.Random) -> None:
    dec = FrameDecoder(limits=LIMITS)
    try:
        while data:
            n = rng.choice((1, 7, 64, len(data)))
            for msg in dec.feed(data[:n]):
                assert isinstance(msg, messages.Message)
            data = data[n:]
    except RemoteProtocolError:
        pass


def test_random_and_mutated_frames_give_only_messages_or_remote_errors() -> None:
    rng = random.Random(1234)
    seeds = seed_frames()
    for _ in range(10_000):
        base = rng.choice(seeds) + (rng.choice(seeds) if rng.random() < 0.2 else b"")
        decode_all(mutate(rng, base), rng)
    for _ in range(2_000):  # pure noise, sometimes behind a valid magic and version
        noise = rng.randbytes(rng.randint(0, 64))
        decode_all((MAGIC + b"\x01" if rng.random() < 0.5 else b"") + noise, rng)
