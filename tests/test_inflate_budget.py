"""What decompressing a frame may cost: per buffer and per frame (``Limits``, narrowed to the
model by ``Limits.sized_for``), and over every connection of a process (``InflateBudget``),
charged before an lz4 block is inflated, in place, into its destination (docs/protocol.md,
section 1.2; docs/operations.md, "Hostile or broken peers")."""

from __future__ import annotations

import gc
import itertools
import tracemalloc

import lz4.block
import numpy as np
import pytest

from minips.errors import LimitExceeded, RemoteProtocolError
from minips.wire import checks, frames, messages, receive
from minips.wire.fields import Payload

MiB = 1 << 20
N = 61_706  # LeNet-5


def frame(msg: messages.Message, compress: bool = True) -> bytes:
    return b"".join(bytes(memoryview(b).cast("B")) for b in frames.encode(msg, compress=compress))


def bomb(raw: int) -> messages.Push:
    """A PUSH whose one buffer is ``raw`` zero bytes: lz4 makes it about raw / 250."""
    return messages.Push(clock=1, samples=1, payload=Payload("dense-f32", {}, (bytes(raw),)))


DECODERS = [frames.FrameDecoder, receive.FrameReceiver]  # plain and zero-copy: the same limits


def never_alloc(kind: messages.Kind, index: int, nbytes: int) -> memoryview:
    raise AssertionError("allocated before the limit check")


def test_limits_sized_for_a_model_fit_its_largest_payloads_and_nothing_wider() -> None:
    lim = checks.DEFAULT_LIMITS.sized_for(N)
    assert lim.max_buffer_bytes == 5 * N + checks.MODEL_SLACK_BYTES
    assert lim.max_raw_bytes == 2 * lim.max_buffer_bytes
    assert lim.max_frame_bytes < 4 * MiB  # was 512 MiB
    # the widest payloads of that model still decode: dense f32, and sparse with every index
    from minips import sparse
    dense = sparse.encode_vector(np.ones(N, np.float32))
    full = sparse.encode_vector(sparse.SparseVector(np.arange(N, dtype=np.uint32),
                                                    np.ones(N, np.float32), N), index="u32")
    for payload in (dense, full):
        msg = messages.Push(clock=1, samples=1, payload=payload)
        for compress, decoder in itertools.product((False, True), DECODERS):
            (got,) = decoder(limits=lim).feed(frame(msg, compress))
            assert isinstance(got, messages.Push)
            assert [bytes(b) for b in got.payload.buffers] == [
                bytes(memoryview(b).cast("B")) for b in payload.buffers]


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("split", [False, True])  # whole in scratch / a big frame in pieces
def test_a_buffer_that_inflates_past_the_models_size_is_refused_before_allocating(
        split: bool, decoder: type[frames.FrameDecoder]) -> None:
    data = frame(bomb(64 * MiB))
    assert len(data) < 512 << 10  # the attack: ~260 KB on the wire for 64 MiB
    dec = decoder(limits=checks.DEFAULT_LIMITS.sized_for(N), alloc=never_alloc)
    with pytest.raises(LimitExceeded) as info:
        if split:
            for i in range(0, len(data), 4096):
                dec.feed(data[i:i + 4096])
        else:
            dec.feed(data)
    assert "decompressed" in str(info.value) and info.value.got >= 64 * MiB


def test_the_process_budget_refuses_what_does_not_fit_and_gets_it_back_when_freed() -> None:
    budget = checks.InflateBudget(8 * MiB)
    data = frame(bomb(5 * MiB))
    first = receive.FrameReceiver(budget=budget).feed(data)  # 5 of 8 MiB
    assert budget.used == 5 * MiB
    with pytest.raises(LimitExceeded) as info:  # another 5 does not fit while the first lives
        receive.FrameReceiver(budget=budget).feed(data)
    assert "budget" in str(info.value) and budget.used == 5 * MiB
    del first, info
    gc.collect()
    assert budget.used == 0  # freed: charged back
    (again,) = receive.FrameReceiver(budget=budget).feed(data)
    assert isinstance(again, messages.Push)
    assert bytes(again.payload.buffers[0]) == bytes(5 * MiB) and budget.used == 5 * MiB


def test_the_plain_decoder_charges_a_frame_while_it_inflates_it() -> None:
    budget = checks.InflateBudget(8 * MiB)
    two = messages.Push(clock=1, samples=1, payload=Payload("dense-f32", {},
                        (bytes(5 * MiB), bytes(5 * MiB))))
    with pytest.raises(LimitExceeded, match="budget"):  # 10 MiB of one frame: over 8
        frames.FrameDecoder(budget=budget).feed(frame(two))
    assert budget.used == 0
    first = frames.FrameDecoder(budget=budget).feed(frame(bomb(5 * MiB)))
    assert budget.used == 0 and len(first) == 1  # returned once the frame is decoded


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_corrupt_block_is_refused_and_its_charge_returned(
        decoder: type[frames.FrameDecoder]) -> None:
    budget = checks.InflateBudget(8 * MiB)
    data = bytearray(frame(bomb(1 * MiB)))
    data[-10:] = b"\xff" * 10  # the block's last bytes: its output no longer fits raw_len
    with pytest.raises(RemoteProtocolError) as info:
        decoder(budget=budget).feed(bytes(data))
    assert "lz4" in str(info.value)
    del info
    gc.collect()
    assert budget.used == 0


def test_a_block_that_inflates_short_of_raw_len_is_refused() -> None:
    packed = lz4.block.compress(bytes(10_000), store_size=False)
    dest = np.empty(10_001, np.uint8)
    with pytest.raises(RemoteProtocolError, match="wrong size"):
        receive.decompress_into(memoryview(packed), dest.data)


def test_decompression_is_in_place_one_copy_of_the_output_not_two() -> None:
    raw = 32 * MiB
    data = frame(bomb(raw))
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        (msg,) = receive.FrameReceiver().feed(data)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert isinstance(msg, messages.Push) and bytes(msg.payload.buffers[0][:16]) == bytes(16)
    assert peak < 1.25 * raw, f"decoding held {peak / MiB:.1f} MiB for {raw / MiB:.0f} MiB"
