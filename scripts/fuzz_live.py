"""Live fuzzing of a real `minips server` process over loopback, while a well-behaved worker
keeps training against it.

Inputs (each one a frame or a blob of bytes written to the server):
- random: 0-96 random bytes on a fresh connection;
- mutated: a valid HELLO, AUTH, PULL, STATS, PUSH, HEARTBEAT or LEAVE frame with 1-4 bytes
  changed, cut short or extended, on a fresh connection (before the handshake);
- session: a handshake with the right secret (as an evaluator), then mutated frames on that
  authenticated connection until the server closes it (or 32 of them).
Connections come from 256 loopback addresses (127.0.1.x), as a crowd of peers would.

Printed as one JSON object: inputs by class, seconds, inputs/s, crashes (the server exited, or
wrote a traceback), the server's RSS at start, peak and end (MB, sampled every 0.2 s), the good
worker's steps/s before and during the fuzzing, and whether it was still served at the end.

Usage: python scripts/fuzz_live.py [--inputs 1000000] [--seed 0] [--concurrency 64]
       [--max-seconds 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from minips import sparse
from minips.errors import MiniPSError
from minips.net import channel, transport
from minips.wire import control, frames, handshake, messages
from minips.wire.fields import Payload

TOKEN = "fuzz-live-secret-0123456789"
N = 61_706  # LeNet-5, the server's default model (--init must match it)
SOURCES = [f"127.0.1.{i}" for i in range(1, 256)]
PER_SESSION = 32  # mutated frames at most per authenticated session


def frame(msg: messages.Message) -> bytes:
    return b"".join(bytes(memoryview(b).cast("B")) for b in frames.encode(msg))


def push(clock: int) -> messages.Push:
    grad = sparse.SparseVector(np.array([1, 5, 9], np.uint32), np.ones(3, np.float32), N)
    encoding, codec, buffers = sparse.encode_vector(grad)
    return messages.Push(clock=clock, samples=1, payload=Payload(encoding, codec,
                         tuple(buffers)))


VALID = [frame(m) for m in (
    control.Hello(role="evaluator",
                   nonce=b"n" * 32), control.Auth(mac=b"m" * 32), messages.Pull(clock=0),
    push(1), control.Heartbeat(seq=1), control.Leave(reason="bye"),
    control.Stats(clock=1, step_time=0.1, loss=1.0, samples=1),
    messages.Exchange(session=1, seq=1, samples=1,
                      payload=Payload("dense-f32", {}, (bytes(4 * N),))),
    messages.InitWeights(size=N, payload=Payload("dense-f32", {}, (bytes(4 * N),))),
)]


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.6 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif choice < 0.8:
            b = b[: rng.randrange(len(b) + 1)]
        else:
            b += rng.randbytes(rng.randint(1, 16))
    return bytes(b)


# ---------------------------------------------------------------------------------------------
# The three kinds of input


async def fresh(port: int, src: str, data: bytes) -> None:
    """One blob on a new connection; read until the server closes (or 5 s pass)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(src, 0))
    try:
        writer.write(data)
        writer.write_eof()
        await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def session(port: int, src: str, rng: random.Random) -> int:
    """Handshake, then mutated frames until closed; the number of frames sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(src, 0))
    conn = handshake.Connection(handshake.Side.CLIENT)
    hs = handshake.ClientHandshake(TOKEN, role="evaluator")
    sent = 0
    try:
        writer.write(b"".join(conn.send(hs.hello)))
        writer.write(b"".join(conn.send(hs.on_challenge(await next_msg(reader, conn)))))
        hs.on_reply(await next_msg(reader, conn))
        while sent < PER_SESSION and not reader.at_eof():
            writer.write(mutate(rng, rng.choice(VALID[2:])))
            sent += 1
            await writer.drain()
            with contextlib.suppress(asyncio.TimeoutError):  # answers are read, not checked
                await asyncio.wait_for(reader.read(1 << 16), 0.005)
    finally:
        writer.close()
    return sent


async def next_msg(reader: asyncio.StreamReader, conn: handshake.Connection) -> Any:
    while True:
        data = await asyncio.wait_for(reader.read(1 << 16), 5)
        if not data:
            raise ConnectionResetError("closed during the handshake")
        msgs = conn.receive(data)
        if msgs:
            return msgs[0]


async def one_input(port: int, rng: random.Random, counts: dict[str, int]) -> None:
    src = rng.choice(SOURCES)
    kind = rng.random()
    # RuntimeError: uvloop's "transport is closed" when the server cut us off mid-write
    with contextlib.suppress(OSError, RuntimeError, asyncio.TimeoutError, MiniPSError):
        if kind < 0.3:
            counts["random"] += 1
            await fresh(port, src, rng.randbytes(rng.randint(0, 96)))
        elif kind < 0.6:
            counts["mutated"] += 1
            await fresh(port, src, mutate(rng, rng.choice(VALID)))
        else:
            counts["session"] += await session(port, src, rng)


async def fuzz(port: int, n: int, seed: int, concurrency: int,
               max_s: float = 0.0) -> dict[str, int]:
    rng = random.Random(seed)
    counts = {"random": 0, "mutated": 0, "session": 0}
    end = time.monotonic() + max_s if max_s else float("inf")

    async def runner() -> None:
        while sum(counts.values()) < n and time.monotonic() < end:
            await one_input(port, rng, counts)

    await asyncio.gather(*(runner() for _ in range(concurrency)))
    return counts


# ---------------------------------------------------------------------------------------------
# The server, the good worker, the measurements


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mb(pid: int) -> float:
    """The most resident memory ``pid`` ever had, in MB (VmHWM: no peak between samples is
    missed)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start_server(tmp: Path, workers: int = 1) -> tuple[subprocess.Popen[str], int]:
    """A `minips server` of ``workers`` workers (ASP, LeNet-5's zeros as initial weights) in
    ``tmp``; (process, port) once it listens."""
    np.save(tmp / "init.npy", np.zeros(N, np.float32))
    ready = tmp / "server.addr"
    proc = subprocess.Popen(
        [sys.executable, "-m", "minips", "server", "--port", "0", "--quiet", "--mode", "asp",
         "--workers", str(workers), "--init", str(tmp / "init.npy"), "--run-dir", str(tmp / "run"),
         "--ready-file", str(ready), "--lease", "60"],
        env={**os.environ, "MINIPS_TOKEN": TOKEN}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (ready.exists() and ready.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start: {proc.communicate()[1]}")
        time.sleep(0.05)  # polling a file with a deadline
    return proc, int(ready.read_text().split()[1])


class GoodWorker(threading.Thread):
    """Worker 0 in its own thread and event loop: PULL, PUSH, ACK as fast as it is served."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.steps, self.error = port, 0, ""
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            asyncio.run(self._work())
        except Exception as e:  # reported in the JSON: the good worker was not served
            self.error = f"{type(e).__name__}: {e}"

    async def _work(self) -> None:
        opts = channel.Options(heartbeat=1.0)
        ctl = await transport.connect("127.0.0.1", self.port, role="worker", worker_id=0,
                                      token=TOKEN, options=opts)
        await ctl.send(control.Stats(clock=0, step_time=0.01, loss=2.3, samples=1))
        assign = await asyncio.wait_for(ctl.recv(), 30)
        grp = await transport.connect("127.0.0.1", int(assign.address.rsplit(":", 1)[1]),
                                      role="worker", worker_id=0, token=TOKEN, options=opts)
        clock = (await asyncio.wait_for(grp.recv(), 10)).clock
        while not self.stop.is_set():
            await grp.send(messages.Pull(clock=clock))
            await asyncio.wait_for(grp.recv(), 10)
            await grp.send(push(clock + 1))
            clock = (await asyncio.wait_for(grp.recv(), 10)).clock
            self.steps += 1
        await grp.close(leave="done")
        await ctl.close(leave="done")


def rate(good: GoodWorker, seconds: float) -> float:
    s0, t0 = good.steps, time.monotonic()
    time.sleep(seconds)  # a measurement window
    return (good.steps - s0) / (time.monotonic() - t0)


def kinds(log: list[str]) -> set[str]:
    """What the server's log lines are about (their text up to the first colon)."""
    return {ln.split(":", 1)[0].strip() for ln in log if ln.strip()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=1_000_000, help="inputs to send (1000000)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (0)")
    ap.add_argument("--concurrency", type=int, default=64, help="connections at once (64)")
    ap.add_argument("--max-seconds", type=float, default=0.0,
                    help="stop after this long even if fewer inputs were sent (0: no limit)")
    serve_and_print(ap.parse_args(), run)


def serve_and_print(args: argparse.Namespace,
                    measure: Any, workers: int = 1) -> None:
    """Start the server, print ``measure(proc, port, args)`` as JSON, stop the server."""
    transport.install_uvloop()
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_server(Path(tmp), workers)
        try:
            print(json.dumps(measure(proc, port, args)))
        finally:
            proc.kill()
            proc.communicate()


def run(proc: subprocess.Popen[str], port: int, args: argparse.Namespace) -> dict[str, Any]:
    log: list[str] = []
    assert proc.stderr is not None
    stream = proc.stderr
    threading.Thread(target=lambda: log.extend(stream), daemon=True).start()
    good = GoodWorker(port)
    good.start()
    deadline = time.monotonic() + 60
    while good.steps < 20 and not good.error and time.monotonic() < deadline:
        time.sleep(0.05)  # until the good worker trains
    calm = rate(good, 2.0)
    rss = [rss_mb(proc.pid)]
    result: dict[str, Any] = {}
    fuzzer = threading.Thread(target=lambda: result.update(counts=asyncio.run(
        fuzz(port, args.inputs, args.seed, args.concurrency, args.max_seconds))), daemon=True)
    t0, s0 = time.monotonic(), good.steps
    fuzzer.start()
    while fuzzer.is_alive() and proc.poll() is None:
        rss.append(rss_mb(proc.pid))
        fuzzer.join(0.2)
    seconds = time.monotonic() - t0
    fuzzing = (good.steps - s0) / seconds
    served_after = proc.poll() is None and rate(good, 1.0) > 0
    good.stop.set()
    good.join(15)
    counts = result.get("counts", {})
    tracebacks = sum("Traceback" in ln for ln in log)
    return {
        "inputs": sum(counts.values()), "by_class": counts, "seconds": round(seconds, 1),
        "inputs_per_s": round(sum(counts.values()) / seconds), "crashes":
        int(proc.poll() is not None) + tracebacks, "server_exit": proc.poll(),
        "tracebacks": tracebacks, "rss_start_mb": round(rss[0], 1),
        "rss_peak_mb": round(max(rss), 1), "rss_end_mb": round(rss[-1], 1),
        "good_steps_per_s_calm": round(calm, 1), "good_steps_per_s_fuzzing": round(fuzzing, 1),
        "good_served_after": served_after, "good_error": good.error,
        "server_log_lines": len(log), "server_log_kinds": sorted(kinds(log)),
        "load_avg_1min": os.getloadavg()[0],
    }


if __name__ == "__main__":
    main()
