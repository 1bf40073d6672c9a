"""Coverage-guided fuzzing of what a server does with a peer's bytes (needs `pip install atheris`,
which is not a minips dependency; tests/test_protocol.py holds the same invariant with random and
mutated frames on every run).

Each input is cut in two at a point its first byte chooses and fed to a FrameDecoder; every
message it yields goes through the server's checks (``conversation``), and each vector payload
through the gradient decoder (``sparse.decode_vector``); the whole input also goes
through a server-side ``Connection`` (state machine). The invariant: any bytes give messages
or ``RemoteProtocolError``, never another exception; atheris stops at the first other one and
writes the input to a file.

Seeds: frames of every kind of gradient (sparse u32 and varint, f32 and f16, with and without lz4,
dense) and of the other messages, written to CORPUS_DIR when it is empty.

Usage: python scripts/fuzz_wire.py CORPUS_DIR -max_total_time=600 -max_len=200000
"""

from __future__ import annotations

import os
import sys
from typing import Any

import atheris

from minips.wire.fields import Payload

with atheris.instrument_imports():
    import numpy as np

    from minips import sparse
    from minips.errors import RemoteProtocolError
    from minips.wire import checks, control, conversation, frames, handshake, kinds, messages
    from minips.wire.frames import FrameDecoder

N = 61_706  # LeNet-5's parameters: the size gradients are decoded against
LIMITS = checks.Limits(max_frame_bytes=1 << 20, max_raw_bytes=1 << 20)  # small, to keep runs fast


def frame(msg: messages.Message, compress: bool = False) -> bytes:
    return b"".join(frames.encode(msg, compress=compress))


def seeds() -> list[bytes]:
    rng = np.random.default_rng(0)
    grad = sparse.SparseVector(np.sort(rng.choice(N, 300, replace=False)).astype(np.uint32),
                                   rng.standard_normal(300).astype(np.float32), N)
    out = []
    for index in ("u32", "varint"):
        for value in ("f32", "f16"):
            enc, codec, bufs = sparse.encode_vector(grad, value_dtype=value, index=index)
            push = messages.Push(clock=3, payload=Payload(enc, codec, tuple(bufs)))
            out += [frame(push, compress=lz4) for lz4 in (False, True)]
    enc, codec, bufs = sparse.encode_vector(rng.standard_normal(N).astype(np.float32))
    out.append(frame(messages.Weights(version=1, payload=Payload(enc, codec, tuple(bufs)),
                               group=2, waited_for=[1, 3], lead=1, min_clock=4)))
    zeros = (np.zeros(64, np.float32),)
    out.append(frame(messages.Exchange(session=1, seq=2, samples=5, payload=Payload("dense-f32", {},
                                zeros))))
    out.append(frame(messages.ExchangeReply(version=3, saved_exchanges=[[1, 2], [-1, -1]],
                                     payload=Payload("dense-f32", {}, zeros))))
    out.append(frame(messages.GlobalWeights(version=3, size=64, members=[0, 1], last_exchange=[1,
                                                                                               2],
                                     payload=Payload("dense-f32", {}, zeros))))
    out.append(frame(messages.InitWeights(size=N, payload=Payload(enc, codec, tuple(bufs)))))
    out.append(frame(control.Hello(nonce=bytes(32), capabilities=("a",), address="h:1")))
    out.append(frame(control.Stats(clock=1, step_time=0.1, loss=2.0, samples=3)))
    out.append(frame(messages.Ack(clock=1, version=2)) + frame(messages.Pull(clock=1)))
    return [b"\x05" + s for s in out]  # first byte: where the input is cut in two


def check(msg: messages.Message) -> None:
    """What a server does with a message before it uses it."""
    if isinstance(msg, control.Stats):
        conversation.check_stats(msg)
    if isinstance(msg, messages.Push):
        conversation.check_push(msg)
    if msg.KIND in kinds.WITH_BUFFERS:  # every vector payload
        payload: Any = msg
        sparse.decode_vector(payload.payload, N)


def one_input(data: bytes) -> None:
    cut, data = (data[0] % 64, data[1:]) if data else (0, data)
    decoder = FrameDecoder(limits=LIMITS)
    msgs: list[messages.Message] = []
    try:
        msgs += decoder.feed(data[:cut])
        msgs += decoder.feed(data[cut:])
    except RemoteProtocolError:
        pass
    for msg in msgs:
        try:
            check(msg)
        except RemoteProtocolError:
            pass
    try:
        handshake.Connection(handshake.Side.SERVER, limits=LIMITS).receive(data)
    except RemoteProtocolError:
        pass


def main() -> None:
    corpus = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if corpus and os.path.isdir(corpus) and not os.listdir(corpus):
        for i, seed in enumerate(seeds()):
            with open(os.path.join(corpus, f"seed{i}"), "wb") as f:
                f.write(seed)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
