"""The lz4 amplification attack against a real `minips server` process: an authenticated peer
sends about 1 MB whose lz4 block inflates to 256 MiB, with an honest ``raw_len``. The server
refuses it with ERROR ``limit_exceeded`` before inflating anything, and its peak RSS (VmHWM,
so no peak between two samples is missed) stays within the budget of docs/operations.md:

- to a group server, which knows the model: the buffer is wider than any payload of the model
  (``checks.Limits.sized_for``), refused at the buffer table;
- to the global server before it knows the model (no ``--init``; INIT_WEIGHTS on a worker's
  control channel): the 256 MiB do not fit the process's lz4 budget (``InflateBudget``, 64 MiB).

Either way the server goes on serving: the model is unchanged and another worker trains.
"""

from __future__ import annotations

import asyncio
import functools
import subprocess
from pathlib import Path

import lz4.block
import numpy as np
import pytest
import raw_worker
from conftest import recv_as
from raw_worker import MB, N, peak_rss_mb, rss_mb

from minips.net import channel, transport
from minips.wire import checks, control, frames, messages
from minips.wire.fields import Payload

pytestmark = pytest.mark.timeout(120)

TOKEN = "memory-budget-secret-0123"
BOMB = 256 << 20  # bytes the block inflates to
# docs/operations.md: a server holds at most (connections) x (2 x the model's frame + 16 MiB)
# beyond its RSS at rest; these tests open 2 or 3 connections
FRAME_MB = 4 * N / MB
BUDGET_MB = 3 * (2 * FRAME_MB + 16)

join = functools.partial(raw_worker.join, token=TOKEN)


def bomb_frame(kind: type[messages.Message], encoding: str, **fields: object) -> bytes:
    """A frame of ``kind`` whose one buffer is an lz4 block of BOMB zero bytes (raw_len honest)."""
    packed = lz4.block.compress(bytes(BOMB), store_size=False)
    msg = kind(**fields, payload=Payload(encoding, {}, (bytes(1),)))  # type: ignore[call-arg]
    head = frames.encode(msg)[0]  # prefix + table + meta + the 1-byte buffer
    meta = bytes(head[checks.PREFIX.size + checks.TABLE_ENTRY.size:-1])
    prefix = checks.PREFIX.pack(checks.MAGIC, messages.PROTOCOL_VERSION, msg.KIND, 1, 0,
                                len(meta), len(packed))
    table = checks.TABLE_ENTRY.pack(checks.CODEC_LZ4, len(packed), BOMB)
    assert len(packed) < 2 * MB  # about 1 MB on the wire
    return prefix + table + meta + packed


async def bomb_answer(proc: subprocess.Popen[str], ch: channel.Channel, data: bytes,
                      where: str) -> tuple[messages.Message, float]:
    """Send the bomb ``data`` on ``ch``; (the server's answer, how much its peak RSS grew in
    MB over the larger of its RSS at rest and its peak so far), printed."""
    rest, peak0 = rss_mb(proc.pid), peak_rss_mb(proc.pid)
    answer = await send_raw(ch, data)
    grown = peak_rss_mb(proc.pid) - max(rest, peak0)
    print(f"{where}: RSS at rest {rest:.1f} MB, peak grew {grown:+.1f} MB "
          f"(budget {BUDGET_MB:.1f} MB)")
    return answer, grown


async def send_raw(ch: channel.Channel, data: bytes) -> messages.Message:
    """Write ``data`` as it is on ``ch``'s socket; the server's answer."""
    ch._transport.write(data)
    return await asyncio.wait_for(ch.recv(), 30)


async def test_an_lz4_bomb_to_a_group_server_is_refused_before_inflating(tmp_path: Path) -> None:
    with raw_worker.server(tmp_path, "--workers", "2", "--mode", "asp",
                           token=TOKEN) as (proc, host, port):
        (ctl, grp, clock), (ctl1, good, clock1) = await asyncio.gather(join(host, port, 0),
                                                                       join(host, port, 1))
        await grp.send(messages.Pull(clock=clock))
        before = await recv_as(grp, messages.Weights, 30)
        answer, grown = await bomb_answer(proc, grp, bomb_frame(
            messages.Push, "dense-f32", clock=clock + 1, samples=32),
            "group server")
        assert isinstance(answer, control.Error) and answer.code == "limit_exceeded", answer
        assert "decompressed" in answer.reason
        assert grown <= BUDGET_MB
        # the other worker is served, and the model is the one before the attack
        await good.send(messages.Pull(clock=clock1))
        after = await recv_as(good, messages.Weights, 30)
        assert bytes(after.payload.buffers[0]) == bytes(before.payload.buffers[0])
        for ch in (good, ctl1, ctl):
            await ch.close(leave="done")


async def test_an_lz4_bomb_before_the_model_is_known_does_not_fit_the_budget(
        tmp_path: Path) -> None:
    with raw_worker.server(tmp_path, "--workers", "1", token=TOKEN,
                           init=False) as (proc, host, port):
        ctl = await transport.connect(host, port, role="worker", worker_id=0, token=TOKEN)
        answer, grown = await bomb_answer(proc, ctl, bomb_frame(
            messages.InitWeights, "dense-f32", size=BOMB // 4),
            "global server")
        assert isinstance(answer, control.Error) and answer.code == "limit_exceeded", answer
        assert "budget" in answer.reason
        assert grown <= BUDGET_MB
        # the model is still free to be set by an honest worker, which then trains
        ctl2 = await transport.connect(host, port, role="worker", worker_id=0, token=TOKEN)
        await ctl2.send(messages.InitWeights(size=N, payload=Payload("dense-f32", {},
                                             (np.zeros(N, np.float32),))))
        await ctl2.send(control.Stats(clock=0, step_time=0.03, loss=2.3, samples=32))
        assign = await recv_as(ctl2, control.Assign, 60)
        grp, clock = await raw_worker.join_group(host, int(assign.address.rsplit(":", 1)[1]), 0,
                                                 assign.group, token=TOKEN)
        await grp.send(messages.Pull(clock=clock))
        got = await recv_as(grp, messages.Weights, 30)
        assert memoryview(got.payload.buffers[0]).nbytes == 4 * N
        await grp.close(leave="done")
        await ctl2.close(leave="done")
