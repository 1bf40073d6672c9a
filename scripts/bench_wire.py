"""Wire benchmark: minips vs torch.distributed (gloo) vs a bare socket, two processes on loopback.

Figures (one run, printed as one JSON object with --json). The machine may be busy, so the three
dense transports take turns round by round and each figure comes from its median round; the
round trips are measured in alternating batches in the same way.
- dense_gbps: PUSH of a dense float32 vector of 11,689,512 elements (ResNet-18) to a server
  process, ACK, PULL, and the same vector back as WEIGHTS; bytes both ways / time (GB/s, 1e9).
- gloo_gbps: the same tensor sent and received back with gloo send/recv.
- raw_gbps: the same bytes both ways over a blocking socket pair (sendall / recv_into).
- ratio_vs_gloo, ratio_vs_raw: dense_gbps over the two above.
- rtt_us_p50: PUSH carrying a 1% sparse gradient of LeNet-5 (61,706 parameters, 617 kept,
  encoded by sparse_codec as a worker does) and its ACK; echo_rtt_us_p50: a bare uvloop echo of
  as many bytes as that PUSH frame; rtt_ratio = the first / the second (medians).

Usage: python scripts/bench_wire.py [--json] [--iters 20] [--rtt-iters 2000]
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
from typing import Any

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
# Round trips: minips PUSH/ACK and a bare uvloop echo, interleaved in batches so that both see
# the same machine load.


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


class EchoClient(asyncio.Protocol):
    """Sends ``nbytes`` and waits until as many came back."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.got = nbytes, 0
        self.waiter: asyncio.Future[None] | None = None

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        if self.got >= self.nbytes and self.waiter is not None:
            self.got -= self.nbytes
            self.waiter.set_result(None)


async def rtt_rounds(minips_port: int, echo_port: int, iters: int) -> tuple[list[float], ...]:
    loop = asyncio.get_running_loop()
    ch = await t.connect("127.0.0.1", minips_port, token=TOKEN)
    push = sparse_push()
    nbytes = sum(len(b) for b in p.encode(push))
    transport, echo = await loop.create_connection(lambda: EchoClient(nbytes), "127.0.0.1",
                                                   echo_port)
    payload, ours, bare = bytes(nbytes), [], []
    for i in range(iters):
        if i % 100 < 50:  # batches of 50 of each
            began = time.perf_counter_ns()
            await ch.send(push)
            await ch.recv()
            ours.append((time.perf_counter_ns() - began) / 1e3)
        else:
            echo.waiter = loop.create_future()
            began = time.perf_counter_ns()
            transport.write(payload)
            await echo.waiter
            bare.append((time.perf_counter_ns() - began) / 1e3)
    await ch.close(leave="done")
    transport.close()
    return ours, bare


def run_rtt(iters: int) -> tuple[list[float], list[float]]:
    minips_proc, minips_port = start_server(minips_server)
    echo_proc, echo_port = start_server(echo_server)
    ours, bare = asyncio.run(rtt_rounds(minips_port, echo_port, 2 * iters))
    for proc in (minips_proc, echo_proc):
        proc.join(30)
    return ours, bare


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--iters", type=int, default=20, help="dense round trips per transport")
    ap.add_argument("--rtt-iters", type=int, default=2000, help="sparse PUSH/ACK round trips")
    args = ap.parse_args()
    t.install_uvloop()
    gbps = dense_rounds(args.iters)
    dense, raw, gloo = gbps["minips"], gbps["raw"], gbps["gloo"]
    assert dense is not None and raw is not None
    rtts, echo = run_rtt(args.rtt_iters)
    frame_bytes = sum(len(b) for b in p.encode(sparse_push()))
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
