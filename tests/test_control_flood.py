"""The global server's control channel: INIT_WEIGHTS once per session, dense float32 only
(docs/protocol.md), and a flood on it, against a real `minips server` process: an
authenticated worker writes INIT_WEIGHTS frames (the model's 247 KB of dense float32 each) as
fast as TCP takes them and never reads, coming back each time it is cut off. The control channel
takes one message per turn of the server's loop and INIT_WEIGHTS once per session (a second one
is ERROR ``invalid`` and the connection is closed), so the other workers keep their step rate
(measured calm and flooded, side by side, in one test).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import raw_worker
from conftest import recv_as
from raw_worker import MB, N

from minips import sparse
from minips.core.config import RunConfig
from minips.net import channel, transport
from minips.server import GlobalServer, ServerConfig
from minips.wire import frames, messages

TOKEN = "control-flood-secret-0123"
WINDOW_S = 2.0  # seconds of each measurement window; calm and flooded windows alternate
ROUNDS = 3  # calm, flooded, calm, flooded, ...: a machine getting slower or faster meanwhile
# (another tenant, CPU steal) weighs on both the same
COMPUTE_S = 0.03  # a good worker's "gradient" time per step


server = functools.partial(raw_worker.server, token=TOKEN)  # with known initial weights


GRAD = sparse.encode_vector(sparse.SparseVector(  # (encoding, codec, buffers): 8 coordinates
    np.arange(8, dtype=np.uint32), np.full(8, 1e-3, np.float32), N))


def push_msg(clock: int) -> messages.Push:
    encoding, codec, buffers = GRAD
    return messages.Push(clock=clock, step_time=COMPUTE_S, loss=2.3, samples=32,
                         encoding=encoding, codec=codec, buffers=tuple(buffers))


def init_weights() -> messages.InitWeights:
    """The model's weights, dense float32 (247 KB on the wire)."""
    encoding, codec, buffers = sparse.encode_vector(np.zeros(N, np.float32))
    return messages.InitWeights(size=N, encoding=encoding, codec=codec, buffers=tuple(buffers))


control = functools.partial(raw_worker.control, token=TOKEN, step_time=COMPUTE_S)


async def good_worker(host: str, port: int, w: int, steps: list[float],
                      stop: asyncio.Event) -> None:
    """Worker ``w`` steps until ``stop`` (PULL, 30 ms, PUSH); the time of each step into
    ``steps``."""
    ctl, assign = await control(host, port, w)
    gport = int(assign.address.rsplit(":", 1)[1])
    grp = await transport.connect(host, gport, role="worker", worker_id=w, token=TOKEN,
                                  group=assign.group, options=channel.Options(heartbeat=1.0))
    clock = (await recv_as(grp, messages.Ack, 10)).clock
    try:
        while not stop.is_set():
            await grp.send(messages.Pull(clock=clock))
            await recv_as(grp, messages.Weights, 30)
            await asyncio.sleep(COMPUTE_S)
            await grp.send(push_msg(clock + 1))
            clock = (await recv_as(grp, messages.Ack, 30)).clock
            steps.append(time.monotonic())
    finally:
        await grp.close(leave="done")
        await ctl.close(leave="done")


async def flood(host: str, port: int, w: int) -> None:
    """Join as worker ``w`` (its STATS, so the grouping does not wait for it), then, while the
    last line on stdin is "go" (until "stop"), write INIT_WEIGHTS frames as fast as TCP takes
    them and never read; when the server cuts the connection off, connect again and go on."""
    frame = b"".join(bytes(part) for part in frames.encode(init_weights()))
    ctl, _ = await control(host, port, w)
    print("joined", flush=True)
    loop = asyncio.get_running_loop()
    going = asyncio.Event()

    def commands() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(going.set if line.strip() == "go" else going.clear)

    threading.Thread(target=commands, daemon=True).start()
    sent = 0
    while True:
        await going.wait()
        tr = ctl._transport
        tr.pause_reading()  # never read what the server says
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            while not ctl.closed and going.is_set():
                tr.write(frame)
                sent += 1
                await asyncio.sleep(0)
                while tr.get_write_buffer_size() > MB and not ctl.closed:  # TCP holds us
                    await asyncio.sleep(0.01)
        if not going.is_set() and not ctl.closed:
            continue  # paused: the connection stays open, unread
        tr.abort()
        print(f"cut off after {sent} frames", flush=True)
        ctl = await transport.connect(host, port, role="worker", worker_id=w, token=TOKEN)


# ---------------------------------------------------------------------------------------------
# INIT_WEIGHTS: once per session, dense float32

async def refused_init(run_dir: Path, msg: messages.InitWeights, *, weights: bool) -> str:
    """An in-process server (``weights``: started with its initial weights, else waiting for a
    worker's); a worker sends ``msg`` (after a dense-f32 INIT_WEIGHTS when ``msg`` is one too).
    The reason of the ERROR ``invalid`` it gets back, once the server closed the connection."""
    cfg = ServerConfig(run=RunConfig(workers=2, mode="asp"), port=0, token=TOKEN,
                       run_dir=str(run_dir))
    srv = GlobalServer(cfg, np.zeros(N, np.float32) if weights else None)
    port = await srv.start()
    try:
        ch = await transport.connect("127.0.0.1", port, role="worker", worker_id=0, token=TOKEN)
        if msg.encoding == "dense-f32":
            await ch.send(init_weights())
        await ch.send(msg)
        try:
            error = await recv_as(ch, messages.Error, 10)
            await asyncio.wait_for(ch.wait_closed(), 10)
        finally:
            await ch.close()
        assert error.code == "invalid" and srv.rejected["invalid"] == 1
        return error.reason
    finally:
        await srv.close()


async def test_a_second_init_weights_in_one_session_is_refused_and_closes_it(
        tmp_path: Path) -> None:
    for weights in (False, True):
        reason = await refused_init(tmp_path, init_weights(), weights=weights)
        assert "INIT_WEIGHTS sent twice" in reason


async def test_init_weights_in_another_encoding_is_refused_and_closes_it(tmp_path: Path) -> None:
    half = np.zeros(N, np.float16)
    encoding, codec, buffers = sparse.encode_vector(half)
    assert encoding == "dense-f16"
    msg = messages.InitWeights(size=N, encoding=encoding, codec=codec, buffers=tuple(buffers))
    for weights in (False, True):  # taken as the weights, or silently dropped, before
        assert "dense float32" in await refused_init(tmp_path, msg, weights=weights)


# ---------------------------------------------------------------------------------------------
# A flood of INIT_WEIGHTS

def steps_between(steps: list[float], t0: float, t1: float) -> int:
    return sum(1 for t in steps if t0 <= t < t1)


async def until_steps(steps: list[float], n: int, tasks: list[asyncio.Task[None]]) -> None:
    """Until ``n`` steps are done (fails early if a worker task ended)."""
    deadline = time.monotonic() + 60
    while len(steps) < n:
        for t in tasks:
            if t.done():
                t.result()
        assert time.monotonic() < deadline, "the good workers did not start"
        await asyncio.sleep(0.05)


async def rate_over(steps: list[float], window: float) -> float:
    """The good workers' steps per second over the next ``window`` seconds."""
    t0 = time.monotonic()
    await asyncio.sleep(window)  # a measurement window, not a wait for an event
    return steps_between(steps, t0, t0 + window) / window


@pytest.mark.timeout(180)
async def test_an_init_weights_flood_on_the_control_channel_does_not_slow_the_others(
        tmp_path: Path) -> None:
    with server(tmp_path, "--mode", "asp", "--workers", "3") as (proc, host, port):
        flooder = subprocess.Popen([sys.executable, __file__, host, str(port), "2"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            steps: list[float] = []
            stop = asyncio.Event()
            good = [asyncio.create_task(good_worker(host, port, w, steps, stop)) for w in (0, 1)]
            assert flooder.stdout is not None and flooder.stdin is not None
            line = await asyncio.wait_for(asyncio.to_thread(flooder.stdout.readline), 60)
            assert line == "joined\n"
            await until_steps(steps, 20, good)  # warmed up
            calm: list[float] = []
            flooded: list[float] = []
            for _ in range(ROUNDS):
                calm.append(await rate_over(steps, WINDOW_S))
                flooder.stdin.write("go\n")
                flooder.stdin.flush()
                flooded.append(await rate_over(steps, WINDOW_S))
                flooder.stdin.write("stop\n")
                flooder.stdin.flush()
                assert proc.poll() is None, "the server should be serving"
            stop.set()
            await asyncio.wait_for(asyncio.gather(*good), 30)
        finally:
            flooder.kill()
            out = flooder.communicate(timeout=30)[0]
    cuts = out.count("cut off")
    sent = out.rsplit("after ", 1)[-1].split()[0] if cuts else "?"
    print(f"good workers, steps/s: calm {' '.join(f'{r:.1f}' for r in calm)}, flooded "
          f"{' '.join(f'{r:.1f}' for r in flooded)}; the flooder was cut off {cuts} times "
          f"({sent} INIT_WEIGHTS frames written)")
    # Measured on a 2-core machine: 0.97-0.99 with this test alone, 0.87 late in the full
    # suite (alternating windows, so not the machine drifting); the flood's own kernel work
    # shares the two cores with the server. A server that served the flood before the others
    # would fall far below 0.8.
    assert sum(flooded) >= 0.8 * sum(calm)
    assert cuts >= ROUNDS, "a second INIT_WEIGHTS on one session closes it"


if __name__ == "__main__":  # the flooder process: python test_control_flood.py HOST PORT ID
    # Lowest CPU priority: on a shared test machine, what the flood costs the server is measured,
    # not the cores the flooder's own loop takes from everyone (on a network it runs elsewhere).
    os.nice(19)
    threading.excepthook = lambda args: None
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(flood(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
