"""Wire benchmark: minips vs torch.distributed (gloo) vs a bare socket, two processes on loopback.

Figures (one run, printed as one JSON object with --json):
- dense_gbps: PUSH of a dense float32 vector of 11,689,512 elements (ResNet-18) to a server
  process, ACK, PULL, and the same vector back as WEIGHTS; bytes both ways / time (GB/s, 1e9).
- gloo_gbps: the same tensor sent and received back with gloo send/recv.
- raw_gbps: the same bytes both ways over a blocking socket pair (sendall / recv_into).
- ratio_vs_gloo, ratio_vs_raw: dense_gbps over the two above.
- rtt_us_p50: PUSH carrying a 1% sparse gradient of LeNet-5 (61,706 parameters: 617 uint32
  indices + 617 float32 values) and its ACK; echo_rtt_us_p50: a bare uvloop echo of as many bytes
  as that PUSH frame; rtt_ratio = the first / the second.

Usage: python scripts/bench_wire.py [--json] [--iters 20] [--rtt-iters 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np

from minips import protocol as p
from minips import transport as t

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


def minips_server(port_q: Any) -> None:
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
                            options=t.Options(alloc=into(buf)))
        port_q.put(srv.port)
        await done.wait()
        srv.close()
        await srv.wait_closed()

    asyncio.run(main())


done: asyncio.Event


async def minips_dense(port: int, iters: int) -> float:
    vec = np.random.default_rng(0).standard_normal(DENSE_N).astype(np.float32)
    back = np.empty_like(vec)

    ch = await t.connect("127.0.0.1", port, token=TOKEN, options=t.Options(alloc=into(back)))
    push = p.Push(clock=0, encoding="dense", buffers=(vec,))
    for i in range(iters + 2):  # two warm-up rounds
        if i == 2:
            began = time.perf_counter()
        await ch.send(push)
        await ch.recv()
        await ch.send(p.Pull(clock=i))
        await ch.recv()
    elapsed = time.perf_counter() - began
    assert np.array_equal(back, vec), "weights came back different"
    await ch.close()
    return 2 * vec.nbytes * iters / elapsed / 1e9


def sparse_push() -> p.Push:
    rng = np.random.default_rng(1)
    idx = np.sort(rng.choice(LENET_N, SPARSE_K, replace=False)).astype(np.uint32)  # (k,) u32
    val = rng.standard_normal(SPARSE_K).astype(np.float32)  # (k,) f32
    return p.Push(clock=1, step_time=0.01, loss=2.3, samples=64, encoding="sparse",
                  codec={"size": LENET_N, "k": SPARSE_K}, buffers=(idx, val))


async def minips_rtt(port: int, iters: int) -> list[float]:
    ch = await t.connect("127.0.0.1", port, token=TOKEN)
    push, out = sparse_push(), []
    for _ in range(iters):
        began = time.perf_counter_ns()
        await ch.send(push)
        await ch.recv()
        out.append((time.perf_counter_ns() - began) / 1e3)
    await ch.close(leave="done")
    return out


def run_minips(iters: int, rtt_iters: int) -> tuple[float, list[float]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    server = ctx.Process(target=minips_server, args=(q,))
    server.start()
    port = q.get(timeout=60)
    t.install_uvloop()
    gbps = asyncio.run(minips_dense(port, iters))
    rtts = asyncio.run(minips_rtt(port, rtt_iters))
    server.join(30)
    return gbps, rtts


# ---------------------------------------------------------------------------------------------
# Bare uvloop echo


def echo_server(port_q: Any) -> None:
    t.install_uvloop()

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.transport.write(data)  # type: ignore[attr-defined]

        def connection_lost(self, exc: Exception | None) -> None:
            stop.set_result(None)

    async def main() -> None:
        global stop
        stop = asyncio.get_running_loop().create_future()
        srv = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
        port_q.put(srv.sockets[0].getsockname()[1])
        await stop

    asyncio.run(main())


stop: asyncio.Future[None]


async def echo_rtt(port: int, nbytes: int, iters: int) -> list[float]:
    loop = asyncio.get_running_loop()

    class Client(asyncio.Protocol):
        got, waiter = 0, loop.create_future()

        def data_received(self, data: bytes) -> None:
            self.got += len(data)
            if self.got >= nbytes:
                self.got -= nbytes
                self.waiter.set_result(None)

    transport, proto = await loop.create_connection(Client, "127.0.0.1", port)
    payload, out = bytes(nbytes), []
    for _ in range(iters):
        proto.waiter = loop.create_future()
        began = time.perf_counter_ns()
        transport.write(payload)
        await proto.waiter
        out.append((time.perf_counter_ns() - began) / 1e3)
    transport.close()
    return out


def run_echo(nbytes: int, iters: int) -> list[float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    server = ctx.Process(target=echo_server, args=(q,))
    server.start()
    port = q.get(timeout=60)
    t.install_uvloop()
    out = asyncio.run(echo_rtt(port, nbytes, iters))
    server.join(30)
    return out


# ---------------------------------------------------------------------------------------------
# Bare blocking sockets


def raw_server(port_q: Any, nbytes: int, iters: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        port_q.put(lsock.getsockname()[1])
        conn, _ = lsock.accept()
    buf = memoryview(bytearray(nbytes))
    with conn:
        for _ in range(iters):
            recv_exactly(conn, buf)
            conn.sendall(buf)


def recv_exactly(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def run_raw(iters: int) -> float:
    nbytes = DENSE_N * 4
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    server = ctx.Process(target=raw_server, args=(q, nbytes, iters + 2))
    server.start()
    send = memoryview(bytearray(os.urandom(16)) * (nbytes // 16))
    back = memoryview(bytearray(nbytes))
    with socket.create_connection(("127.0.0.1", q.get(timeout=60))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(iters + 2):
            if i == 2:
                began = time.perf_counter()
            sock.sendall(send)
            recv_exactly(sock, back)
        elapsed = time.perf_counter() - began
    server.join(30)
    return 2 * nbytes * iters / elapsed / 1e9


# ---------------------------------------------------------------------------------------------
# torch.distributed gloo


def gloo_peer(rank: int, port: int, iters: int, out_q: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    tensor = torch.randn(DENSE_N) if rank == 0 else torch.empty(DENSE_N)
    for i in range(iters + 2):
        if i == 2:
            began = time.perf_counter()
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        else:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
    elapsed = time.perf_counter() - began
    if rank == 0:
        out_q.put(2 * tensor.numel() * 4 * iters / elapsed / 1e9)
    dist.destroy_process_group()


def run_gloo(iters: int) -> float | None:
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        log("torch is not installed: gloo_gbps skipped")
        return None
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=gloo_peer, args=(r, port, iters, q)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    gbps = float(q.get(timeout=300))
    for proc in procs:
        proc.join(60)
    return gbps


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--iters", type=int, default=20, help="dense round trips per transport")
    ap.add_argument("--rtt-iters", type=int, default=2000, help="sparse PUSH/ACK round trips")
    args = ap.parse_args()
    dense, rtts = run_minips(args.iters, args.rtt_iters)
    frame_bytes = sum(memoryview(b).nbytes for b in p.encode(sparse_push()))
    echo = run_echo(frame_bytes, args.rtt_iters)
    raw = run_raw(args.iters)
    gloo = run_gloo(args.iters)
    rtt, echo_p50 = statistics.median(rtts), statistics.median(echo)
    result = {
        "dense_gbps": round(dense, 3), "gloo_gbps": gloo and round(gloo, 3),
        "raw_gbps": round(raw, 3),
        "ratio_vs_gloo": gloo and round(dense / gloo, 3), "ratio_vs_raw": round(dense / raw, 3),
        "rtt_us_p50": round(rtt, 1), "echo_rtt_us_p50": round(echo_p50, 1),
        "rtt_ratio": round(rtt / echo_p50, 3),
        "dense_bytes_each_way": DENSE_N * 4, "push_frame_bytes": frame_bytes,
        "iters": args.iters, "rtt_iters": args.rtt_iters, "cpus": os.cpu_count(),
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
