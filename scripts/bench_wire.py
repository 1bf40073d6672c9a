"""Wire benchmark: minips vs torch.distributed (gloo) vs a bare socket, two processes on loopback.

Figures (one run, printed as one JSON object with --json). The machine may be busy, so the three
dense transports take turns round by round and each figure comes from its median round; the
round trips are measured in alternating batches in the same way.
- dense_gbps: PUSH of a dense float32 vector of 11,689,512 elements (ResNet-18) to a server
  process, ACK, PULL, and the same vector back as WEIGHTS; bytes both ways / time (GB/s, 1e9).
- gloo_gbps: the same tensor sent and received back with gloo send/recv.
- raw_gbps: the same bytes both ways over a blocking socket pair (sendall / recv_into).
- ratio_vs_gloo, ratio_vs_raw: dense_gbps over the two above.
- gloo_vs_raw: how close gloo comes to the bare socket (the ceiling of every transport here).
- rtt_us_p50: PUSH carrying a 1% sparse gradient of LeNet-5 (61,706 parameters, 617 kept,
  encoded by sparse_codec as a worker does) and its ACK; echo_rtt_us_p50: a bare uvloop echo of
  as many bytes as that PUSH frame; rtt_ratio = the first / the second (medians).
  hop_rtt_us_p50: the same PUSH bytes answered with ACK-sized bytes by a task that a future
  wakes (what any await-based asyncio server pays, with no protocol work at all).
  The minips server of the round trips has default options, as the group server does (the
  dense test receives into a preallocated array instead). Every process of the round trips is
  pinned to one core (--cpu, default 0): both ends share it, as the scheduler places a quick
  echo anyway, so the figures measure software cost. The *_unpinned figures let the scheduler
  choose; on a virtual machine a wake-up on another core can cost tens of µs.

Usage: python scripts/bench_wire.py [--json] [--iters 20] [--rtt-iters 2000] [--cpu 0]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import numpy as np

from minips import protocol as p
from minips import transport as t
from minips.sparse_codec import SparseGrad, encode_gradient

DENSE_N = 11_689_512  # ResNet-18 parameters
LENET_N = 61_706  # LeNet-5 parameters
SPARSE_K = LENET_N // 100  # 1% of the coordinates
TOKEN = "bench"


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# minips: server process and client


def into(arr: np.ndarray) -> p.Alloc:
    """An allocator that receives a payload of arr's size straight into arr (zero-copy)."""

    def alloc(kind: p.Kind, index: int, nbytes: int) -> memoryview:
        return arr.data.cast("B") if nbytes == arr.nbytes else p.default_alloc(kind, index, nbytes)

    return alloc


def minips_server(port_q: Any, cpu: int | None = None, dense: bool = True) -> None:
    """PUSH -> ACK, PULL -> WEIGHTS of ``buf``. With ``dense`` a PUSH of buf's size is received
    into buf (zero-copy); without it the options are the defaults, as in the group server."""
    pin(cpu)
    t.install_uvloop()
    buf = np.zeros(DENSE_N, dtype=np.float32)  # (n,) f32, receives every dense PUSH in place

    async def handler(ch: t.Channel) -> None:
        while True:
            msg = await ch.recv()
            if isinstance(msg, p.Push):
                await ch.send(p.Ack(clock=msg.clock, version=msg.clock))
            elif isinstance(msg, p.Pull):
                await ch.send(p.Weights(version=msg.clock, encoding="dense", buffers=(buf,)))
            else:
                done.set()
                return

    async def main() -> None:
        global done
        done = asyncio.Event()
        srv = await t.serve("127.0.0.1", 0, token=TOKEN, accept=lambda h: {}, handler=handler,
                            options=t.Options(alloc=into(buf) if dense else None))
        port_q.put(srv.port)
        await done.wait()
        srv.close()
        await srv.wait_closed()

    asyncio.run(main())


done: asyncio.Event


class MinipsDense:
    """Client side of the dense test: PUSH the vector, ACK, PULL, WEIGHTS back into ``back``."""

    def __init__(self, port: int) -> None:
        self.loop = asyncio.new_event_loop()  # a uvloop loop once install_uvloop() ran
        self.vec = np.random.default_rng(0).standard_normal(DENSE_N).astype(np.float32)
        self.back = np.empty_like(self.vec)  # (n,) f32, WEIGHTS land here without a copy
        options = t.Options(alloc=into(self.back))
        self.ch = self.loop.run_until_complete(
            t.connect("127.0.0.1", port, token=TOKEN, options=options))
        self.push = p.Push(clock=0, encoding="dense-f32", buffers=(self.vec,))

    async def _round(self) -> None:
        await self.ch.send(self.push)
        await self.ch.recv()
        await self.ch.send(p.Pull(clock=0))
        await self.ch.recv()

    def round(self) -> float:
        began = time.perf_counter()
        self.loop.run_until_complete(self._round())
        return time.perf_counter() - began

    def close(self) -> None:
        assert np.array_equal(self.back, self.vec), "weights came back different"
        self.loop.run_until_complete(self.ch.close(leave="done"))
        self.loop.close()


def sparse_push() -> p.Push:
    """A worker's PUSH of a 1% LeNet-5 gradient, encoded by the real sparse codec."""
    rng = np.random.default_rng(1)
    idx = np.sort(rng.choice(LENET_N, SPARSE_K, replace=False)).astype(np.uint32)  # (k,) u32
    val = rng.standard_normal(SPARSE_K).astype(np.float32)  # (k,) f32
    encoding, codec, buffers = encode_gradient(SparseGrad(idx, val, LENET_N))
    return p.Push(clock=1, step_time=0.01, loss=2.3, samples=64, encoding=encoding,
                  codec=codec, buffers=tuple(buffers))


# ---------------------------------------------------------------------------------------------
# Round trips, interleaved in batches of 50 so that all see the same machine load:
# - minips: PUSH (sparse) -> ACK through Channel.send / Channel.recv on both sides;
# - echo: a bare uvloop echo of as many bytes as that PUSH frame (the target's baseline);
# - hop: the same bytes answered with an ACK-sized reply by a task woken through a future, as
#   any asyncio request/response server is: the floor of an await-based design, no protocol.


def pin(cpu: int | None) -> None:
    """Run this process on one core (None: wherever the scheduler likes)."""
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


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


async def bytes_client(port: int, send: bytes, back: int) -> Callable[[], Awaitable[None]]:
    """One round trip: write ``send``, wait until ``back`` bytes came back."""
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_connection(lambda: EchoClient(back), "127.0.0.1", port)

    async def round_trip() -> None:
        proto.waiter = loop.create_future()
        transport.write(send)
        await proto.waiter

    round_trip.close = transport.close  # type: ignore[attr-defined]
    return round_trip


async def rtt_rounds(ports: dict[str, int], iters: int) -> dict[str, list[float]]:
    """Round trips in µs per kind, in alternating batches of 50 of each."""
    ch = await t.connect("127.0.0.1", ports["minips"], token=TOKEN)
    push = sparse_push()
    frame = b"".join(p.encode(push))
    ack = b"".join(p.encode(p.Ack(clock=push.clock, version=push.clock)))

    async def minips_round() -> None:
        await ch.send(push)
        await ch.recv()

    rounds = {"minips": minips_round,
              "echo": await bytes_client(ports["echo"], frame, len(frame)),
              "hop": await bytes_client(ports["hop"], frame, len(ack))}
    times: dict[str, list[float]] = {name: [] for name in rounds}
    for _ in range(max(1, iters // 50)):
        for name, round_trip in rounds.items():
            for _ in range(50):
                began = time.perf_counter_ns()
                await round_trip()
                times[name].append((time.perf_counter_ns() - began) / 1e3)
    await ch.close(leave="done")
    rounds["echo"].close()  # type: ignore[attr-defined]
    rounds["hop"].close()  # type: ignore[attr-defined]
    return times


def run_rtt(iters: int, cpu: int | None) -> dict[str, list[float]]:
    """Round trips with every process on core ``cpu`` (None: unpinned)."""
    push = sparse_push()
    frame_len = sum(len(b) for b in p.encode(push))
    ack = b"".join(p.encode(p.Ack(clock=push.clock, version=push.clock)))
    servers = {"minips": start_server(minips_server, cpu, False),
               "echo": start_server(echo_server, cpu),
               "hop": start_server(hop_server, cpu, frame_len, ack)}
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


# ---------------------------------------------------------------------------------------------
# Bare blocking sockets


def raw_server(port_q: Any, nbytes: int, rounds: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        port_q.put(lsock.getsockname()[1])
        conn, _ = lsock.accept()
    buf = memoryview(bytearray(nbytes))
    with conn:
        for _ in range(rounds):
            recv_exactly(conn, buf)
            conn.sendall(buf)


def recv_exactly(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


class RawDense:
    """Client side of the bare-socket test: sendall the bytes, recv_into them back."""

    def __init__(self, port: int) -> None:
        nbytes = DENSE_N * 4
        self.send = memoryview(bytearray(os.urandom(16)) * (nbytes // 16))
        self.back = memoryview(bytearray(nbytes))
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def round(self) -> float:
        began = time.perf_counter()
        self.sock.sendall(self.send)
        recv_exactly(self.sock, self.back)
        return time.perf_counter() - began

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------------------------
# torch.distributed gloo: rank 0 does one timed round per "go", rank 1 just answers.


def gloo_peer(rank: int, port: int, rounds: int, go_q: Any, out_q: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    tensor = torch.randn(DENSE_N) if rank == 0 else torch.empty(DENSE_N)
    if rank == 0:
        out_q.put("ready")
    for _ in range(rounds):
        if rank == 0:
            go_q.get()
            began = time.perf_counter()
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
            out_q.put(time.perf_counter() - began)
        else:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
    dist.destroy_process_group()


class GlooDense:
    def __init__(self, rounds: int) -> None:
        ctx = mp.get_context("spawn")
        self.go, self.out = ctx.Queue(), ctx.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.procs = [ctx.Process(target=gloo_peer, args=(r, port, rounds, self.go, self.out))
                      for r in (0, 1)]
        for proc in self.procs:
            proc.start()
        assert self.out.get(timeout=300) == "ready"

    def round(self) -> float:
        self.go.put(1)
        return float(self.out.get(timeout=120))

    def close(self) -> None:
        for proc in self.procs:
            proc.join(60)


def start_server(target: Any, *args: Any) -> tuple[Any, int]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(q, *args))
    proc.start()
    return proc, int(q.get(timeout=60))


def dense_rounds(iters: int) -> dict[str, float | None]:
    """Interleave single round trips of the three transports; GB/s from each median round."""
    rounds = iters + 2  # two warm-up rounds each
    minips_proc, minips_port = start_server(minips_server)
    raw_proc, raw_port = start_server(raw_server, DENSE_N * 4, rounds)
    clients: dict[str, Any] = {"minips": MinipsDense(minips_port), "raw": RawDense(raw_port)}
    if importlib.util.find_spec("torch") is not None:
        clients["gloo"] = GlooDense(rounds)
    else:
        log("torch is not installed: gloo_gbps skipped")
    times: dict[str, list[float]] = {name: [] for name in clients}
    for i in range(rounds):
        for name, client in clients.items():
            elapsed = client.round()
            if i >= 2:
                times[name].append(elapsed)
    for client in clients.values():
        client.close()
    for proc in (minips_proc, raw_proc):
        proc.join(30)
    gbps = {k: 2 * DENSE_N * 4 / statistics.median(v) / 1e9 for k, v in times.items()}
    return {name: gbps.get(name) for name in ("minips", "raw", "gloo")}


# ---------------------------------------------------------------------------------------------


def rtt_figures(iters: int, cpu: int | None, suffix: str) -> dict[str, float]:
    """p50 round trips (µs) of minips, echo and hop, and minips over echo."""
    p50 = {k: statistics.median(v) for k, v in run_rtt(iters, cpu).items()}
    return {f"rtt_us_p50{suffix}": round(p50["minips"], 1),
            f"echo_rtt_us_p50{suffix}": round(p50["echo"], 1),
            f"hop_rtt_us_p50{suffix}": round(p50["hop"], 1),
            f"rtt_ratio{suffix}": round(p50["minips"] / p50["echo"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--iters", type=int, default=20, help="dense round trips per transport")
    ap.add_argument("--rtt-iters", type=int, default=2000, help="sparse PUSH/ACK round trips")
    ap.add_argument("--cpu", type=int, default=0, help="core for the pinned round trips")
    args = ap.parse_args()
    load_before = round(os.getloadavg()[0], 2)  # other work on the machine, not ours
    t.install_uvloop()
    gbps = dense_rounds(args.iters)
    dense, raw, gloo = gbps["minips"], gbps["raw"], gbps["gloo"]
    assert dense is not None and raw is not None
    result: dict[str, Any] = {
        "dense_gbps": round(dense, 3), "gloo_gbps": gloo and round(gloo, 3),
        "raw_gbps": round(raw, 3),
        "ratio_vs_gloo": gloo and round(dense / gloo, 3), "ratio_vs_raw": round(dense / raw, 3),
        "gloo_vs_raw": gloo and round(gloo / raw, 3),
    }
    result.update(rtt_figures(args.rtt_iters, args.cpu, ""))
    result.update(rtt_figures(args.rtt_iters, None, "_unpinned"))
    result.update({
        "dense_bytes_each_way": DENSE_N * 4,
        "push_frame_bytes": sum(len(b) for b in p.encode(sparse_push())),
        "iters": args.iters, "rtt_iters": args.rtt_iters, "rtt_cpu": args.cpu,
        "cpus": os.cpu_count(), "load_avg_1min_before": load_before,
    })
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
