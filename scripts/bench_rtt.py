"""Round-trip benchmark: a worker's sparse PUSH and its ACK over minips, against a bare uvloop
echo and an await-based "hop" server, client and servers in separate processes on loopback.

Figures (one run, printed as one JSON object with --json), medians of batches of 50 that take
turns so that all see the same machine load:
- rtt_us_p50: PUSH carrying a 1% sparse gradient of LeNet-5 (61,706 parameters, 617 kept,
  encoded by sparse.encode_vector as a worker does) and its ACK; echo_rtt_us_p50: a bare uvloop
  echo of as many bytes as that PUSH frame; rtt_ratio = the first / the second.
- hop_rtt_us_p50: the same PUSH bytes answered with ACK-sized bytes by a task that a future
  wakes (what any await-based asyncio server pays, with no protocol work at all).
- floor_rtt_us_p50: the same PUSH and ACK frames, encoded and decoded in the least Python the
  format allows (struct and one msgpack call each way, the body copied out), with no checks, no
  connection state, no queue: what Python pays for the wire format itself. rtt_us_p50 minus
  this is minips' own machinery.
The minips server has default options, as the group server does. Every process is pinned to
one core (--cpu, default 0): both ends share it, as the scheduler places a quick echo anyway,
so the figures measure software cost. The *_unpinned figures let the scheduler choose; on a
virtual machine a wake-up on another core can cost tens of µs. The *_split figures pin the
client to --cpu and the servers to --server-cpu (default: the next core), as a worker and its
server on two machines each have a core of their own: every process keeps its caches warm, and
the wake-up across cores is part of both the minips and the echo round trip.

bench_wire.py includes these figures; its minips server and helpers live here.

Usage: python scripts/bench_rtt.py [--json] [--rtt-iters 2000] [--cpu 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import msgpack
import numpy as np

from minips.net import channel
from minips.net import transport as t
from minips.net.transport import serve
from minips.sparse import SparseVector, encode_vector
from minips.wire import checks, frames, messages
from minips.wire.fields import Payload
from minips.wire.frames import TABLES

DENSE_N = 11_689_512  # ResNet-18 parameters (the dense test of bench_wire.py)
LENET_N = 61_706  # LeNet-5 parameters
SPARSE_K = LENET_N // 100  # 1% of the coordinates
TOKEN = "bench"


def start_server(target: Any, *args: Any) -> tuple[Any, int]:
    """Start ``target(port_q, *args)`` in a spawned process; return it and the port it put."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(q, *args))
    proc.start()
    return proc, int(q.get(timeout=60))


# ---------------------------------------------------------------------------------------------
# The minips server (dense and round trips)


def pin(cpu: int | None) -> None:
    """Run this process on one core (None: wherever the scheduler likes)."""
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def into(arr: np.ndarray) -> frames.Alloc:
    """An allocator that receives a payload of arr's size straight into arr (zero-copy)."""

    def alloc(kind: messages.Kind, index: int, nbytes: int) -> memoryview:
        return arr.data.cast("B") if nbytes == arr.nbytes else frames.default_alloc(kind, index,
                                                                                    nbytes)

    return alloc


def minips_server(port_q: Any, cpu: int | None = None, dense: bool = True) -> None:
    """PUSH -> ACK, PULL -> WEIGHTS of ``buf``. With ``dense`` a PUSH of buf's size is received
    into buf (zero-copy); without it the options are the defaults, as in the group server."""
    pin(cpu)
    t.install_uvloop()
    buf = np.zeros(DENSE_N, dtype=np.float32)  # (n,) f32, receives every dense PUSH in place

    async def handler(ch: channel.Channel) -> None:
        while True:
            msg = await ch.recv()
            if isinstance(msg, messages.Push):
                await ch.send(messages.Ack(clock=msg.clock, version=msg.clock))
            elif isinstance(msg, messages.Pull):
                await ch.send(messages.Weights(version=msg.clock,
                                               payload=Payload("dense", {}, (buf,))))
            else:
                done.set()
                return

    async def main() -> None:
        global done
        done = asyncio.Event()
        srv = await serve("127.0.0.1", 0, token=TOKEN, accept=lambda h: {}, handler=handler,
                            options=channel.Options(alloc=into(buf) if dense else None))
        port_q.put(srv.port)
        await done.wait()
        srv.close()
        await srv.wait_closed()

    asyncio.run(main())


done: asyncio.Event


def sparse_push() -> messages.Push:
    """A worker's PUSH of a 1% LeNet-5 gradient, encoded by the real sparse codec."""
    rng = np.random.default_rng(1)
    idx = np.sort(rng.choice(LENET_N, SPARSE_K, replace=False)).astype(np.uint32)  # (k,) u32
    val = rng.standard_normal(SPARSE_K).astype(np.float32)  # (k,) f32
    return messages.Push(clock=1, step_time=0.01, loss=2.3, samples=64,
                         payload=encode_vector(SparseVector(idx, val, LENET_N)))


# ---------------------------------------------------------------------------------------------
# Round trips, interleaved in batches of 50 so that all see the same machine load:
# - minips: PUSH (sparse) -> ACK through Channel.send / Channel.recv on both sides;
# - echo: a bare uvloop echo of as many bytes as that PUSH frame (the target's baseline);
# - hop: the same bytes answered with an ACK-sized reply by a task woken through a future, as
#   any asyncio request/response server is: the floor of an await-based design, no protocol.


def echo_server(port_q: Any, cpu: int | None = None) -> None:
    pin(cpu)
    t.install_uvloop()

    class Echo(asyncio.Protocol):
        def __init__(self, stop: asyncio.Future[None]) -> None:
            self.stop = stop

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = cast(asyncio.Transport, transport)

        def data_received(self, data: bytes) -> None:
            self.transport.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if not self.stop.done():
                self.stop.set_result(None)

    serve_until_closed(Echo, port_q)


class HopServer(asyncio.Protocol):
    """Counts bytes to whole requests of ``size``; a task awaits each and writes ``reply``."""

    def __init__(self, stop: asyncio.Future[None], size: int, reply: bytes) -> None:
        self.stop, self.size, self.reply, self.got = stop, size, reply, 0
        self.pending = 0  # whole requests not answered yet
        self.waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.task = asyncio.get_running_loop().create_task(self.answer())

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        while self.got >= self.size:
            self.got -= self.size
            self.pending += 1
        if self.pending and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def answer(self) -> None:
        while True:
            while not self.pending:
                self.waiter = asyncio.get_running_loop().create_future()
                await self.waiter
            self.pending -= 1
            self.transport.write(self.reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.task.cancel()
        if not self.stop.done():
            self.stop.set_result(None)


def hop_server(port_q: Any, cpu: int | None, size: int, reply: bytes) -> None:
    pin(cpu)
    t.install_uvloop()
    serve_until_closed(lambda stop: HopServer(stop, size, reply), port_q)


def serve_until_closed(make: Callable[[asyncio.Future[None]], asyncio.BaseProtocol],
                       port_q: Any) -> None:
    """Serve protocols ``make(stop)`` on a free port until one of them sets ``stop``."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        srv = await loop.create_server(lambda: make(stop), "127.0.0.1", 0)
        port_q.put(srv.sockets[0].getsockname()[1])
        await stop
        srv.close()

    asyncio.run(main())


class FloorServer(asyncio.BufferedProtocol):
    """Decodes each whole PUSH frame (prefix, table, map, body copy) and answers an ACK frame,
    both with struct and msgpack alone: the wire format's cost in Python, nothing else."""

    def __init__(self, stop: asyncio.Future[None]) -> None:
        self.stop, self.buf, self.hi = stop, bytearray(frames.SCRATCH_BYTES), 0
        self.view = memoryview(self.buf)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.hi:]

    def buffer_updated(self, nbytes: int) -> None:
        self.hi += nbytes
        at = 0
        while self.hi - at >= checks.PREFIX.size:
            _, _, _, nbuf, _, meta_len, body_len = checks.PREFIX.unpack_from(self.buf, at)
            head = at + checks.PREFIX.size + checks.TABLE_ENTRY.size * nbuf
            end = head + meta_len + body_len
            if end > self.hi:
                break
            meta = msgpack.unpackb(self.view[head:head + meta_len])
            self.body = self.buf[head + meta_len:end]  # the copy a decoder makes
            self.transport.write(floor_frame(messages.Kind.ACK, {"clock": meta["clock"],
                                                          "version": meta["clock"]}))
            at = end
        self.view[:self.hi - at] = self.view[at:self.hi]
        self.hi -= at

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.stop.done():
            self.stop.set_result(None)


def floor_frame(kind: int, meta: dict[str, Any], buffers: tuple[Any, ...] = ()) -> bytes:
    """A frame of the minips format built with one struct and one msgpack call."""
    packed = msgpack.packb(meta)
    sizes = [b.nbytes for b in buffers]
    head = checks.PREFIX.pack(checks.MAGIC, messages.PROTOCOL_VERSION, kind, len(buffers), 0,
                              len(packed),
                         sum(sizes))
    table = TABLES[len(buffers)].pack(*[x for n in sizes for x in (checks.CODEC_RAW, n, n)])
    return b"".join([head, table, packed, *buffers])


def floor_server(port_q: Any, cpu: int | None = None) -> None:
    pin(cpu)
    t.install_uvloop()
    serve_until_closed(FloorServer, port_q)


class FloorClient(asyncio.Protocol):
    """Decodes the ACK (prefix and map) and hands its map to ``waiter``."""

    def __init__(self) -> None:
        self.waiter: asyncio.Future[Any] | None = None

    def data_received(self, data: bytes) -> None:
        meta_len = checks.PREFIX.unpack_from(data)[5]  # one ACK per read: a reply to one request
        if self.waiter is not None:
            start = checks.PREFIX.size
            self.waiter.set_result(msgpack.unpackb(data[start:start + meta_len]))


class EchoClient(asyncio.Protocol):
    """Counts bytes back; ``waiter`` is set once ``nbytes`` have arrived."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.got = nbytes, 0
        self.waiter: asyncio.Future[None] | None = None

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        if self.got >= self.nbytes and self.waiter is not None:
            self.got -= self.nbytes
            self.waiter.set_result(None)


async def request_client(port: int, make: Callable[[], Any],
                         request: Callable[[], bytes]) -> Callable[[], Awaitable[None]]:
    """One round trip: write ``request()``, wait until the protocol ``make()`` built (EchoClient,
    FloorClient) sets its ``waiter`` for the reply."""
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_connection(make, "127.0.0.1", port)

    async def round_trip() -> None:
        proto.waiter = loop.create_future()
        transport.write(request())
        await proto.waiter

    round_trip.close = transport.close  # type: ignore[attr-defined]
    return round_trip


async def rtt_rounds(ports: dict[str, int], iters: int) -> dict[str, list[float]]:
    """Round trips in µs per kind, in alternating batches of 50 of each."""
    ch = await t.connect("127.0.0.1", ports["minips"], token=TOKEN)
    push = sparse_push()
    frame = b"".join(frames.encode(push))
    ack = b"".join(frames.encode(messages.Ack(clock=push.clock, version=push.clock)))
    meta = push.meta()  # the floor packs the same map

    async def minips_round() -> None:
        await ch.send(push)
        await ch.recv()

    rounds = {"minips": minips_round,
              "echo": await request_client(ports["echo"], lambda: EchoClient(len(frame)),
                                           lambda: frame),
              "hop": await request_client(ports["hop"], lambda: EchoClient(len(ack)),
                                          lambda: frame),
              "floor": await request_client(  # encodes the PUSH the floor's way every time
                  ports["floor"], FloorClient,
                  lambda: floor_frame(messages.Kind.PUSH, meta, push.payload.buffers))}
    times: dict[str, list[float]] = {name: [] for name in rounds}
    for _ in range(max(1, iters // 50)):
        for name, round_trip in rounds.items():
            for _ in range(50):
                began = time.perf_counter_ns()
                await round_trip()
                times[name].append((time.perf_counter_ns() - began) / 1e3)
    await ch.close(leave="done")
    for name in ("echo", "hop", "floor"):
        rounds[name].close()  # type: ignore[attr-defined]
    return times


def run_rtt(iters: int, cpu: int | None, server_cpu: int | None,
            minips_target: Callable[..., None] = minips_server) -> dict[str, list[float]]:
    """Round trips with the client on core ``cpu`` and the servers on ``server_cpu``
    (None: unpinned); ``minips_target`` runs the minips server process (rtt_breakdown.py swaps
    it for variants)."""
    push = sparse_push()
    frame_len = sum(len(b) for b in frames.encode(push))
    ack = b"".join(frames.encode(messages.Ack(clock=push.clock, version=push.clock)))
    servers = {"minips": start_server(minips_target, server_cpu, False),
               "echo": start_server(echo_server, server_cpu),
               "hop": start_server(hop_server, server_cpu, frame_len, ack),
               "floor": start_server(floor_server, server_cpu)}
    mask = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    pin(cpu)
    try:
        times = asyncio.run(rtt_rounds({k: port for k, (_, port) in servers.items()}, iters))
    finally:
        if mask is not None:
            os.sched_setaffinity(0, mask)
    for proc, _ in servers.values():
        proc.join(30)
    return times


def rtt_figures(iters: int, cpu: int | None, server_cpu: int | None,
                suffix: str) -> dict[str, float]:
    """p50 round trips (µs) of minips, echo, hop and floor, and minips over echo; the client runs on
    core ``cpu``, the servers on ``server_cpu`` (None: unpinned)."""
    p50 = {k: statistics.median(v) for k, v in run_rtt(iters, cpu, server_cpu).items()}
    return {f"rtt_us_p50{suffix}": round(p50["minips"], 1),
            f"echo_rtt_us_p50{suffix}": round(p50["echo"], 1),
            f"hop_rtt_us_p50{suffix}": round(p50["hop"], 1),
            f"floor_rtt_us_p50{suffix}": round(p50["floor"], 1),
            f"rtt_ratio{suffix}": round(p50["minips"] / p50["echo"], 3)}


def split_figures(iters: int, cpu: int, server_cpu: int | None) -> dict[str, Any]:
    """rtt_figures with the servers on a core of their own (empty on a 1-core machine)."""
    if server_cpu is None:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        others = [c for c in cores if c != cpu]
        if not others:
            return {}
        server_cpu = others[0]
    return {**rtt_figures(iters, cpu, server_cpu, "_split"), "rtt_server_cpu": server_cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--rtt-iters", type=int, default=2000, help="round trips of each kind")
    ap.add_argument("--cpu", type=int, default=0, help="core for the pinned round trips")
    ap.add_argument("--server-cpu", type=int, help="servers' core for the *_split figures "
                    "(default: the core after --cpu; none on a 1-core machine)")
    args = ap.parse_args()
    t.install_uvloop()
    result: dict[str, Any] = rtt_figures(args.rtt_iters, args.cpu, args.cpu, "")
    result.update(split_figures(args.rtt_iters, args.cpu, args.server_cpu))
    result.update(rtt_figures(args.rtt_iters, None, None, "_unpinned"))
    result.update({"rtt_iters": args.rtt_iters, "rtt_cpu": args.cpu, "cpus": os.cpu_count()})
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
