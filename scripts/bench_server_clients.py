"""One client process of scripts/bench_server.py: many lightweight workers on one asyncio loop.

Each worker speaks the protocol as `minips worker` does (docs/protocol.md section 9), without
torch: HELLO / AUTH on the global server, STATS until ASSIGN, then its group server (HELLO, the
ACK that gives its start clock). An *active* worker then loops PULL -> WEIGHTS, PUSH -> ACK,
naming in each PULL the version its last WEIGHTS brought it to (``since``), as a worker does, so
a compressed downlink answers with the update since then (the client tracks the version only:
it does not keep the weights, which changes nothing on the server's side);
one step every ``--step-s`` seconds (closed loop: a late step starts at once); its gradient is
made up once (``--ratio`` of the ``--size`` coordinates, sparse-v1 with varint indices as a
worker sends it, or dense-f32 at ratio 1). An *idle* worker stays connected and sends
HEARTBEATs only, as a worker does while it computes.

Protocol with the driver: one line ``ready`` on stdout once every worker of this process is in
its loop; then it reads one line ``T_START T_END`` (time.monotonic, the same clock in every
process on Linux) from stdin and prints one JSON line: the push -> ACK and PULL -> WEIGHTS
latencies (ms) and the bytes of the operations that ended inside the window, and when the
slowest of its workers passed each stage of its set-up (``setup``: s since the process began,
``SETUP_STAGES``), then exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import numpy as np

from minips import sparse
from minips.errors import AuthError
from minips.net import transport
from minips.net.endpoints import parse_address
from minips.wire import control, messages
from minips.wire.fields import Payload

CONNECT_TIMEOUT_S = 120.0  # 1,024 handshakes on two busy cores take a while
# a worker's set-up, in order: its control session authenticated, ASSIGN received, its group
# session authenticated, the ACK that gives its start clock received
SETUP_STAGES = ("control", "assign", "group", "start")
BEGAN = time.monotonic()


class Recorder:
    """Latencies and bytes of finished operations, stamped with their end time."""

    def __init__(self) -> None:
        self.push: list[tuple[float, float, int]] = []  # (end, seconds, bytes sent)
        self.pull: list[tuple[float, float, int]] = []  # (end, seconds, bytes received)
        self.setup = dict.fromkeys(SETUP_STAGES, 0.0)  # stage -> s its slowest worker took

    def passed(self, stage: str) -> None:
        """A worker passed ``stage`` of its set-up now."""
        self.setup[stage] = max(self.setup[stage], time.monotonic() - BEGAN)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        push = [(s, b) for end, s, b in self.push if t0 <= end <= t1]
        pull = [(s, b) for end, s, b in self.pull if t0 <= end <= t1]
        return {"push_ms": [round(s * 1e3, 3) for s, _ in push],
                "pull_ms": [round(s * 1e3, 3) for s, _ in pull],
                "push_bytes": sum(b for _, b in push), "pull_bytes": sum(b for _, b in pull),
                "setup": {k: round(v, 2) for k, v in self.setup.items()}}


def made_up_gradient(size: int, ratio: float, seed: int) -> tuple[str, dict[str, Any], tuple]:
    """The PUSH payload every step of one worker sends: k = ratio * size coordinates."""
    rng = np.random.default_rng(seed)
    if ratio >= 1:
        return sparse.encode_vector(rng.normal(0, 1e-4, size).astype(np.float32))
    k = max(1, int(size * ratio))
    idx = np.sort(rng.choice(size, k, replace=False)).astype(np.uint32)  # (k,) sorted unique
    g = sparse.SparseVector(idx, rng.normal(0, 1e-4, k).astype(np.float32), size)
    enc, codec, bufs = sparse.encode_vector(g)
    return enc, codec, tuple(bufs)


async def open_control(host: str, port: int, step_time: float, token: str,
                       rec: Recorder) -> tuple[Any, Any]:
    """The control session up to ASSIGN; returns (channel, ASSIGN)."""
    ch = await transport.connect(host, port, role="worker", token=token,
                                 timeout=CONNECT_TIMEOUT_S, retries=20)
    rec.passed("control")
    ch.start_heartbeat(2.0)
    await ch.send(control.Stats(clock=0, step_time=step_time, loss=2.3, samples=32))
    while not isinstance(msg := await ch.recv(), control.Assign):
        pass
    rec.passed("assign")
    return ch, msg


async def group_channel(args: argparse.Namespace, host: str, w: int, assign: Any) -> Any:
    """Connect to the group server ASSIGN names. A `minips group` process may refuse for a
    moment (it has not taken its group yet): try again until CONNECT_TIMEOUT_S."""
    ghost, gport = parse_address(assign.address)
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return await transport.connect(ghost or host, gport, role="worker", worker_id=w,
                                           group=assign.group, token=args.token,
                                           timeout=CONNECT_TIMEOUT_S, retries=20)
        except AuthError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def worker(args: argparse.Namespace, w: int, active: bool, rec: Recorder,
                 ready: asyncio.Queue[int], stop: asyncio.Event) -> None:
    host, port = parse_address(args.connect)
    ctl, assign = await open_control(host, port, 0.05 * (1 + w % 4), args.token, rec)
    grp = await group_channel(args, host, int(ctl.worker_id), assign)
    rec.passed("group")
    grp.start_heartbeat(2.0)
    clock = (await grp.recv()).clock  # the ACK that says where this worker starts
    rec.passed("start")
    if not active:
        await ready.put(w)
        await stop.wait()
    else:
        payload = made_up_gradient(args.size, args.ratio, seed=w)
        await asyncio.sleep(random.uniform(0, args.step_s))  # no lock-step between workers
        await steps(args, grp, clock, payload, rec, ready, stop, w)
    await grp.close(leave="done")
    await ctl.close(leave="done")


async def steps(args: argparse.Namespace, grp: Any, clock: int, payload: tuple, rec: Recorder,
                ready: asyncio.Queue[int], stop: asyncio.Event, w: int) -> None:
    """PULL -> WEIGHTS, PUSH -> ACK, one step per ``step_s`` until ``stop``."""
    enc, codec, bufs = payload
    push_bytes = sum(b.nbytes if hasattr(b, "nbytes") else len(b) for b in bufs)
    first, held = True, -1  # held: the version of the weights this worker would hold
    while not stop.is_set():
        t0 = time.monotonic()
        await grp.send(messages.Pull(clock=clock, since=held))
        weights = await grp.recv()
        t1 = time.monotonic()
        held = int(weights.version)
        rec.pull.append((t1, t1 - t0, sum(b.nbytes for b in weights.payload.buffers)))
        clock += 1
        await grp.send(messages.Push(clock=clock, step_time=0.05, loss=2.3, samples=32,
                                     payload=Payload(enc, codec, bufs)))
        ack = await grp.recv()
        t2 = time.monotonic()
        assert isinstance(ack, messages.Ack), ack
        rec.push.append((t2, t2 - t1, push_bytes))
        if first:
            first = False
            await ready.put(w)
        await asyncio.sleep(max(0.0, t0 + args.step_s - time.monotonic()))


async def _count(ready: asyncio.Queue[int], n: int) -> None:
    for _ in range(n):
        await ready.get()


async def main_async(args: argparse.Namespace) -> None:
    ids = [int(x) for x in args.ids.split(",") if x]
    active = {int(x) for x in args.active.split(",") if x}
    rec, ready, stop = Recorder(), asyncio.Queue[int](), asyncio.Event()
    tasks = [asyncio.create_task(worker(args, w, w in active, rec, ready, stop)) for w in ids]
    all_ready = asyncio.create_task(_count(ready, len(ids)))
    await asyncio.wait([all_ready, *tasks], return_when=asyncio.FIRST_COMPLETED)
    if not all_ready.done():  # a worker ended before the window: say why, stop
        failed = next(t for t in tasks if t.done())
        print(f"error {failed.exception()!r}", flush=True)
        raise SystemExit(1)
    print("ready", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    t0, t1 = (float(x) for x in line.split())
    stop.set()
    await asyncio.wait(tasks, timeout=30)
    print(json.dumps(rec.window(t0, t1)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connect", required=True, help="global server HOST:PORT")
    ap.add_argument("--ids", required=True, help="comma-separated bench worker numbers")
    ap.add_argument("--active", default="", help="those of --ids that push (the rest idle)")
    ap.add_argument("--size", type=int, required=True, help="model parameters")
    ap.add_argument("--ratio", type=float, default=0.01, help="pushed fraction (1 = dense)")
    ap.add_argument("--step-s", type=float, default=0.1, help="s between an active worker's steps")
    args = ap.parse_args()
    args.token = None  # from MINIPS_TOKEN
    transport.install_uvloop()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
