"""Wire benchmark: minips vs torch.distributed (gloo) vs a bare socket, two processes on loopback,
plus the round trips of bench_rtt.py.

Figures (one run, printed as one JSON object with --json). The machine may be busy, so the three
dense transports take turns round by round and each figure comes from its median round.
- dense_gbps: PUSH of a dense float32 vector of 11,689,512 elements (ResNet-18) to a server
  process, ACK, PULL, and the same vector back as WEIGHTS; bytes both ways / time (GB/s, 1e9).
- gloo_gbps: the same tensor sent and received back with gloo send/recv, timed the same way.
- raw_gbps: the same bytes both ways over a blocking socket pair (sendall / recv_into), in
  writes and reads of minips' sizes (transport.WRITE_BYTES, receive.DIRECT_READ_BYTES), with
  the socket options minips sets (4 MiB SO_SNDBUF / SO_RCVBUF, TCP_NODELAY), between numpy
  arrays as minips' are.
- ratio_vs_gloo, ratio_vs_raw: dense_gbps over the two above.
- gloo_vs_raw: how close gloo comes to the bare socket (the ceiling of every transport here).
- rtt_*, echo_rtt_*, hop_rtt_*, floor_rtt_*: see bench_rtt.py (a sparse PUSH and its ACK vs a
  bare echo), with both ends on one core, on two cores (*_split) and unpinned (*_unpinned).

Usage: python scripts/bench_wire.py [--json] [--iters 20] [--rtt-iters 2000] [--cpu 0]
       [--server-cpu 1]
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
from bench_rtt import (
    DENSE_N,
    TOKEN,
    into,
    minips_server,
    rtt_figures,
    sparse_push,
    split_figures,
    start_server,
)

from minips.net import channel
from minips.net import transport as t
from minips.net.channel import tune_socket
from minips.wire import frames, messages, receive
from minips.wire.fields import Payload


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# minips: server process and client


class MinipsDense:
    """Client side of the dense test: PUSH the vector, ACK, PULL, WEIGHTS back into ``back``."""

    def __init__(self, port: int) -> None:
        self.loop = asyncio.new_event_loop()  # a uvloop loop once install_uvloop() ran
        self.vec = np.random.default_rng(0).standard_normal(DENSE_N).astype(np.float32)
        self.back = np.empty_like(self.vec)  # (n,) f32, WEIGHTS land here without a copy
        options = channel.Options(alloc=into(self.back))
        self.ch = self.loop.run_until_complete(
            t.connect("127.0.0.1", port, token=TOKEN, options=options))
        self.push = messages.Push(clock=0, payload=Payload("dense-f32", {}, (self.vec,)))

    async def _round(self) -> None:
        await self.ch.send(self.push)
        await self.ch.recv()
        await self.ch.send(messages.Pull(clock=0))
        await self.ch.recv()

    def round(self) -> float:
        began = time.perf_counter()
        self.loop.run_until_complete(self._round())
        return time.perf_counter() - began

    def close(self) -> None:
        assert np.array_equal(self.back, self.vec), "weights came back different"
        self.loop.run_until_complete(self.ch.close(leave="done"))
        self.loop.close()


# ---------------------------------------------------------------------------------------------
# Bare blocking sockets


def raw_server(port_q: Any, nbytes: int, rounds: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        port_q.put(lsock.getsockname()[1])
        conn, _ = lsock.accept()
    tune_socket(conn, channel.SOCKET_BUFFER_BYTES)  # like for like with a minips connection
    buf = np.empty(nbytes, dtype=np.uint8).data  # numpy memory, as minips receives into
    with conn:
        for _ in range(rounds):
            recv_exactly(conn, buf)
            send_all(conn, buf)


def send_all(sock: socket.socket, buf: memoryview) -> None:
    for start in range(0, len(buf), channel.WRITE_BYTES):
        sock.sendall(buf[start:start + channel.WRITE_BYTES])


def recv_exactly(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:got + receive.DIRECT_READ_BYTES])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


class RawDense:
    """Client side of the bare-socket test: sendall the bytes, recv_into them back."""

    def __init__(self, port: int) -> None:
        nbytes = DENSE_N * 4
        # numpy memory on both ends, as minips sends from and receives into: large numpy
        # arrays may get transparent huge pages, a bytearray does not (the copies run slower)
        self.send = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).data
        self.back = np.empty(nbytes, dtype=np.uint8).data
        self.sock = socket.create_connection(("127.0.0.1", port))
        tune_socket(self.sock, channel.SOCKET_BUFFER_BYTES)

    def round(self) -> float:
        began = time.perf_counter()
        send_all(self.sock, self.send)
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
    ap.add_argument("--cpu", type=int, default=0, help="core for the pinned round trips")
    ap.add_argument("--server-cpu", type=int, help="servers' core for the *_split round trips "
                    "(default: the core after --cpu)")
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
    result.update(rtt_figures(args.rtt_iters, args.cpu, args.cpu, ""))
    result.update(split_figures(args.rtt_iters, args.cpu, args.server_cpu))
    result.update(rtt_figures(args.rtt_iters, None, None, "_unpinned"))
    result.update({
        "dense_bytes_each_way": DENSE_N * 4,
        "push_frame_bytes": sum(len(b) for b in frames.encode(sparse_push())),
        "iters": args.iters, "rtt_iters": args.rtt_iters, "rtt_cpu": args.cpu,
        "cpus": os.cpu_count(), "load_avg_1min_before": load_before,
    })
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
