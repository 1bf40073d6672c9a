"""Grammar fuzzing of a real `minips server` process: inputs generated from docs/protocol.md's
message grammar, not from the code's classes, sent while a well-behaved worker trains.

The grammar is read from the document itself: section 3's table gives each kind's number,
sender, keys and their types; section 2's types and section 1.4's encodings give the values.
Frames are built by hand from section 1's layout (prefix, buffer table, msgpack map, body),
with raw and lz4 buffers. Each field is, with some probability, a valid value (edges of its
range included), a value just outside it, or one of another type; a map may miss a key or have
an extra one; a frame may have the wrong version, flags, buffer count or codec; and the kind is
sometimes one the session may not send there. Sessions authenticate (the one part done with
minips' own client code: the handshake is not what is fuzzed) as one of three peers: an
evaluator and a worker on the global server's control port, and a worker on its group server,
with PULL -> PUSH flows that follow the document's rules (clock + 1) half the time. Every kind
reaches both servers, EXCHANGE and INIT_WEIGHTS included; what is not covered is a group
process's own session (its EXCHANGEs merged): a run with in-process groups refuses a group
process at the handshake.

Printed as one JSON object: inputs (frames sent) by target, seconds, inputs/s, crashes (the
server exited, wrote a traceback, or answered ERROR ``internal``), the ERROR codes it answered,
its RSS at rest, peak (VmHWM) and end and the RSS every tenth of the run, the good worker's
steps/s calm and while fuzzed, and whether it was served at the end.

Usage: python scripts/fuzz_grammar.py [--inputs 1000000] [--seed 0] [--concurrency 32]
       [--max-seconds 0] [--doc docs/protocol.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lz4.block
import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fuzz_live: the good worker, RSS
import fuzz_live  # noqa: E402

from minips.errors import MiniPSError  # noqa: E402
from minips.net import channel, transport  # noqa: E402
from minips.wire import control, handshake, messages  # noqa: E402
from minips.wire.fields import Payload

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
TOKEN = fuzz_live.TOKEN
N = fuzz_live.N  # the server's model size: LeNet-5 (GLOBAL_WEIGHTS `size` says it too)
PER_SESSION = 48  # frames at most per authenticated session
FUZZ_WORKER = 1  # the worker id the fuzzing sessions speak for (the good worker is 0)


# ---------------------------------------------------------------------------------------------
# The grammar, read from the document


@dataclass
class KindSpec:
    number: int
    name: str
    sender: str  # "client", "server" or "either"
    keys: dict[str, str]  # key -> its type as the document writes it
    max_buffers: int


def _split_top(text: str, seps: str) -> str:
    """``text`` up to the first of ``seps`` outside brackets and quotes."""
    depth, quoted = 0, False
    for i, c in enumerate(text):
        if c == "`":
            quoted = not quoted
        elif not quoted and c in "([":
            depth += 1
        elif not quoted and c in ")]":
            depth -= 1
        elif not quoted and depth == 0 and c in seps:
            return text[:i]
    return text


def _keys(column: str) -> dict[str, str]:
    """Section 3's keys column -> {key: type}: every run of backticked names followed by a
    parenthesised type (names in a run share it)."""
    out: dict[str, str] = {}
    i = 0
    name_run = re.compile(r"`([a-z_]+)`((?:, `[a-z_]+`)*)\s*\(")
    while (m := name_run.search(column, i)) is not None:
        names = [m.group(1), *re.findall(r"`([a-z_]+)`", m.group(2))]
        depth, j = 1, m.end()
        while depth and j < len(column):
            depth += {"(": 1, ")": -1}.get(column[j], 0)
            j += 1
        inner = column[m.end():j - 1]
        if inner.startswith('`"'):  # an enumeration: `"a"`, `"b"` or `"c"`
            typ = _split_top(inner, ";").strip()
        else:  # "int>=0: ...", "`pairs`, section 9", "`pair` for a group process"
            typ = _split_top(inner, ";:,").strip()
            if typ.startswith("`"):
                typ = typ.split("`")[1]
        for name in names:
            out[name] = typ
        i = j
    return out


def grammar(doc: Path = DOC) -> dict[str, KindSpec]:
    """Section 3 of the document: the message kinds by name."""
    text = doc.read_text()
    section = text[text.index("## 3. Messages"):text.index("## 4.")]
    kinds: dict[str, KindSpec] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].isdigit():
            continue
        top = re.findall(r"\d+", cells[4])
        kinds[cells[1]] = KindSpec(int(cells[0]), cells[1], cells[2], _keys(cells[3]),
                                   int(top[-1]) if top else 0)
    for spec in kinds.values():  # "as STATS": the same key's type in the kind it names
        for key, typ in spec.keys.items():
            if typ.startswith("as "):
                spec.keys[key] = kinds[typ[3:].strip()].keys[key]
    return kinds


def encodings(doc: Path = DOC) -> list[str]:
    """Section 1.4's table of encodings."""
    text = doc.read_text()
    section = text[text.index("### 1.4 Body"):text.index("## 2.")]
    return re.findall(r"^\| `([a-z0-9]+-[a-z0-9]+)` \|", section, flags=re.M)


def frame_layout(doc: Path = DOC) -> tuple[bytes, int]:
    """Section 1.1: the magic and the version byte."""
    text = doc.read_text()
    section = text[text.index("### 1.1 Prefix"):text.index("### 1.2")]
    magic = re.search(r"`magic` +\| ASCII `([A-Z]{4})`", section)
    version = re.search(r"`version` +\| protocol version, `(\d+)`", section)
    assert magic and version, "section 1.1 no longer names the magic and the version"
    return magic.group(1).encode(), int(version.group(1))


# ---------------------------------------------------------------------------------------------
# Values of a type, mostly valid


def _power(expr: str) -> int:
    """"2^53-1", "2^62", "0", "1e9" -> the number."""
    expr = expr.strip()
    m = re.fullmatch(r"(-?)2\^(\d+)(-1)?", expr)
    if m:
        v = (1 << int(m.group(2))) - (1 if m.group(3) else 0)
        return -v if m.group(1) else v
    return int(float(expr))


INT_MAX = (1 << 63) - 1


class Values:
    """Values for the document's types: valid (with their edges), just outside, or wrong."""

    def __init__(self, rng: random.Random, encodings: list[str]) -> None:
        self.rng = rng
        self.encodings = encodings

    def valid(self, typ: str) -> Any:
        r = self.rng
        if typ.startswith("`\""):  # an enumeration of strings
            return r.choice(re.findall(r'`"([^"]*)"`', typ))
        m = re.fullmatch(r"int in (\S+)\.\.(\S+)", typ)
        if m:
            lo, hi = _power(m.group(1)), _power(m.group(2))
            return r.choice([lo, hi, r.randint(lo, min(hi, lo + 1000)), r.randint(lo, hi)])
        m = re.fullmatch(r"float in \[(\S+), (\S+)\]", typ)
        if m:
            lo, hi = float(m.group(1)), float(m.group(2))
            return r.choice([lo, hi, r.uniform(lo, hi), r.uniform(lo, min(hi, lo + 10))])
        m = re.fullmatch(r"float ?>= ?(-?\d+)", typ)
        if m:
            return r.choice([float(m.group(1)), r.uniform(0, 10), 1e30, r.randint(0, 9)])
        simple = {
            "int>=0": lambda: r.choice([0, 1, r.randint(0, 1000), INT_MAX]),
            "id": lambda: r.choice([-1, 0, 1, r.randint(0, 100), INT_MAX]),
            "int": lambda: r.choice([0, -INT_MAX, INT_MAX, r.randint(-100, 100)]),
            "float": lambda: r.choice([0.0, -1e300, 1e300, r.uniform(-10, 10), 3]),
            "bool": lambda: r.random() < 0.5,
            "name": lambda: r.choice(["", "done", "x" * 64, *self.encodings,
                                      r.randbytes(8).hex()]),
            "text": lambda: r.choice(["", "127.0.0.1:7301", "x" * 4096, "done",
                                      r.randbytes(16).hex()]),
            "names": lambda: r.choice([[], ["tls"], ["x" * 64] * 64, ["a", "b"]]),
            "map": lambda: r.choice([{}, {"a": 1}, {"a": {"b": [1, 2.0, "c", None, b"d"]}}]),
            "nonce": lambda: r.randbytes(32),
            "mac": lambda: r.choice([b"", r.randbytes(32)]),
            "ints": lambda: [r.randint(-1, 5) for _ in range(r.choice([0, 1, 3, 4096]))],
            "pair": lambda: r.choice([[-1, -1], [1, r.randint(0, 10)], []]),
            "pairs": lambda: [[r.randint(0, 9), r.randint(0, 9)] for _ in range(r.randint(0, 64))],
            "codec": lambda: self.codec(),
        }
        return simple.get(typ, lambda: r.choice([0, "", None]))()

    def outside(self, typ: str) -> Any:
        """Just past the type's range or length."""
        r = self.rng
        m = re.fullmatch(r"int in (\S+)\.\.(\S+)", typ)
        if m:
            return r.choice([_power(m.group(1)) - 1, _power(m.group(2)) + 1])
        return {
            "int>=0": -1, "id": -2, "int": (1 << 63), "float": float("nan"),
            "bool": 1, "name": "x" * 65, "text": "x" * 4097, "names": ["x"] * 65,
            "nonce": r.randbytes(31), "mac": r.randbytes(16), "ints": list(range(4097)),
            "pair": [1, 2, 3], "pairs": [[0, 0]] * 65, "codec": {"lz4": True},
            "map": {"a": [[[[[[[[[[1]]]]]]]]]]},
        }.get(typ.split()[0] if typ.startswith("float") else typ,
              r.choice([float("inf"), -1e309, 2 ** 64]))

    def wrong(self) -> Any:
        """A value of some other type."""
        r = self.rng
        return r.choice([None, True, 3.5, "s", b"b", [1], {"k": 1}, -7, 2 ** 64 - 1,
                         msgpack.ExtType(1, b"x")])

    def codec(self) -> dict[str, Any]:
        r = self.rng
        if r.random() < 0.4:
            return {}
        return {"k": r.choice([0, 1, 3, N, N + 1]), "index": r.choice(["u32", "varint"]),
                "value": r.choice(["f32", "f16"])}

    def field(self, typ: str) -> Any:
        x = self.rng.random()
        if x < 0.8:
            return self.valid(typ)
        if x < 0.93:
            return self.outside(typ)
        return self.wrong()


# ---------------------------------------------------------------------------------------------
# Frames, by hand from section 1


PREFIX = struct.Struct("<4sBBBBII")
ENTRY = struct.Struct("<B3xII")


class Frames:
    """Messages of the grammar as bytes, mostly well formed."""

    def __init__(self, rng: random.Random, doc: Path = DOC) -> None:
        self.rng = rng
        self.kinds = grammar(doc)
        self.magic, self.version = frame_layout(doc)
        self.values = Values(rng, encodings(doc))

    def meta(self, spec: KindSpec, **given: Any) -> dict[str, Any]:
        r = self.rng
        out = {k: given[k] if k in given else self.values.field(t) for k, t in spec.keys.items()}
        x = r.random()
        if x < 0.04 and out:
            del out[r.choice(list(out))]
        elif x < 0.08:
            out[r.choice(["extra", "lz4", "version", "worker"])] = 1
        return out

    def buffers(self, meta: dict[str, Any], spec: KindSpec) -> list[bytes]:
        r = self.rng
        if not spec.max_buffers:
            return [r.randbytes(4)] if r.random() < 0.03 else []
        enc = meta.get("encoding")
        codec = meta.get("codec") if isinstance(meta.get("codec"), dict) else {}
        k = codec.get("k") if isinstance(codec.get("k"), int) else 3
        k = max(0, min(k, 2 * N))
        if enc == "sparse-v1" and r.random() < 0.9:
            idx = sorted(r.sample(range(N), min(k, 64))) if r.random() < 0.8 else [
                r.randint(0, 2 * N) for _ in range(min(k, 64))]
            iw = 2 if codec.get("value") == "f16" else 4
            index = (np.asarray(idx, "<u4").tobytes() if codec.get("index") == "u32"
                     else _varint(idx))
            vals = np.full(len(idx), r.choice([1e-3, 0.0, np.nan, np.inf]),
                           "<f2" if iw == 2 else "<f4").tobytes()
            return [index, vals]
        if enc in ("dense-f32", "dense-f16") and r.random() < 0.9:
            n = N if r.random() < 0.8 else r.choice([0, N - 1, N + 1])
            width = "<f2" if enc == "dense-f16" else "<f4"
            return [np.full(n, r.choice([0.0, 1e-3, np.inf]), width).tobytes()]
        return [r.randbytes(r.choice([0, 1, 7, 64])) for _ in range(r.randint(0, 3))]

    def frame(self, name: str, **given: Any) -> bytes:
        r = self.rng
        spec = self.kinds[name]
        meta = self.meta(spec, **given)
        bufs = self.buffers(meta, spec)
        try:
            packed = msgpack.packb(meta, use_bin_type=True)
        except (OverflowError, TypeError, ValueError):  # a value msgpack cannot write
            packed = msgpack.packb({}, use_bin_type=True)
        table, body = [], []
        for b in bufs:
            codec, wire, raw = 0, b, len(b)
            if len(b) >= 64 and r.random() < 0.3:
                codec, wire = 1, lz4.block.compress(b, store_size=False)
                if r.random() < 0.1:
                    raw = r.choice([raw - 1, raw + 1, raw * 1000, 0])
            table.append(ENTRY.pack(codec, len(wire), raw))
            body.append(wire)
        version, flags, nbuf = self.version, 0, len(bufs)
        body_len = sum(len(w) for w in body)
        x = r.random()
        if x < 0.02:
            version = r.choice([2, 4, 255])
        elif x < 0.03:
            flags = 1
        elif x < 0.04:
            nbuf = min(255, nbuf + 1)
        elif x < 0.05:
            body_len += r.choice([-1, 1])
        head = PREFIX.pack(self.magic, version, spec.number, nbuf, flags, len(packed),
                           max(0, body_len))
        return head + b"".join(table) + packed + b"".join(body)

    def client_kind(self) -> str:
        """A kind a client sends, now and then one a client may not send."""
        names = [k for k, s in self.kinds.items() if s.sender in ("client", "either")]
        if self.rng.random() < 0.05:
            names = list(self.kinds)
        return self.rng.choice(names)


def _varint(indices: list[int]) -> bytes:
    out, prev = bytearray(), -1
    for i in indices:
        gap = max(0, i - prev - 1)
        prev = i
        while True:
            byte = gap & 0x7F
            gap >>= 7
            out.append(byte | (0x80 if gap else 0))
            if not gap:
                break
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# Sessions


@dataclass
class Target:
    name: str
    port: int
    role: str
    worker_id: int = -1
    group: int = -1


class Tally:
    def __init__(self) -> None:
        self.inputs: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.internal: list[str] = []


async def _answers(reader: asyncio.StreamReader, conn: handshake.Connection, tally: Tally,
                   wait: float) -> list[Any]:
    """What the server sent within ``wait`` s (ERRORs tallied by code)."""
    out: list[Any] = []
    with contextlib.suppress(asyncio.TimeoutError):
        data = await asyncio.wait_for(reader.read(1 << 20), wait)
        if data:
            with contextlib.suppress(MiniPSError):
                out = conn.decoder.feed(data)
    for m in out:
        if isinstance(m, control.Error):
            tally.errors[m.code] += 1
            if m.code == "internal" and len(tally.internal) < 20:
                tally.internal.append(m.reason)
    return out


async def session(t: Target, src: str, gen: Frames, tally: Tally) -> None:
    """Handshake as ``t`` says, then up to PER_SESSION grammar frames until the server closes."""
    r = gen.rng
    reader, writer = await asyncio.open_connection("127.0.0.1", t.port, local_addr=(src, 0))
    conn = handshake.Connection(handshake.Side.CLIENT)
    hs = handshake.ClientHandshake(TOKEN, role=t.role, worker_id=t.worker_id, group=t.group)
    try:
        writer.write(b"".join(conn.send(hs.hello)))
        writer.write(b"".join(conn.send(hs.on_challenge(await fuzz_live.next_msg(reader, conn)))))
        hs.on_reply(await fuzz_live.next_msg(reader, conn))
        clock = 0
        for _ in range(PER_SESSION):
            if reader.at_eof():
                break
            if t.name == "group_worker" and r.random() < 0.5:  # the document's flow: PULL, PUSH
                writer.write(gen.frame("PULL", clock=clock, since=-1))
                got = await _answers(reader, conn, tally, 0.05)
                clock = next((m.version for m in got if isinstance(m, messages.Ack)), clock)
                writer.write(gen.frame("PUSH", clock=clock + 1, payload=Payload(r.choice(
                    ["dense-f32", "sparse-v1"]), {}, ()), samples=32, step_time=0.01, loss=2.0))
                tally.inputs[t.name] += 2
            else:
                writer.write(gen.frame(gen.client_kind()))
                tally.inputs[t.name] += 1
            await writer.drain()
            await _answers(reader, conn, tally, 0.003)
    finally:
        writer.close()


async def fuzz(targets: list[Target], n: int, seed: int, concurrency: int, max_s: float,
               tally: Tally) -> None:
    gen = Frames(random.Random(seed))
    end = time.monotonic() + max_s if max_s else float("inf")

    async def runner() -> None:
        while sum(tally.inputs.values()) < n and time.monotonic() < end:
            t = gen.rng.choice(targets)
            # uvloop's "transport is closed" (RuntimeError) when the server cut us off mid-write
            with contextlib.suppress(OSError, RuntimeError, asyncio.TimeoutError, MiniPSError):
                await session(t, gen.rng.choice(fuzz_live.SOURCES), gen, tally)

    await asyncio.gather(*(runner() for _ in range(concurrency)))


# ---------------------------------------------------------------------------------------------
# The server, the targets, the measurements


async def group_of(port: int, w: int) -> tuple[int, int]:
    """Worker ``w``'s group and its group server's port (STATS, then its ASSIGN)."""
    ctl = await transport.connect("127.0.0.1", port, role="worker", worker_id=w, token=TOKEN,
                                  options=channel.Options(heartbeat=1.0))
    await ctl.send(control.Stats(clock=0, step_time=0.01, loss=2.3, samples=1))
    assign = await asyncio.wait_for(ctl.recv(), 60)
    assert isinstance(assign, control.Assign), assign
    await ctl.close()
    return assign.group, int(assign.address.rsplit(":", 1)[1])


def run(proc: subprocess.Popen[str], port: int, args: argparse.Namespace) -> dict[str, Any]:
    log: list[str] = []
    assert proc.stderr is not None
    stream = proc.stderr
    threading.Thread(target=lambda: log.extend(stream), daemon=True).start()
    good = fuzz_live.GoodWorker(port)
    good.start()
    group, gport = asyncio.run(group_of(port, FUZZ_WORKER))  # the grouping waits for both
    deadline = time.monotonic() + 60
    while good.steps < 20 and not good.error and time.monotonic() < deadline:
        time.sleep(0.05)  # until the good worker trains
    calm = fuzz_live.rate(good, 2.0)
    targets = [Target("evaluator", port, "evaluator"),
               Target("control", port, "worker", FUZZ_WORKER),
               Target("group_worker", gport, "worker", FUZZ_WORKER, group)]
    tally = Tally()
    rest = fuzz_live.rss_mb(proc.pid)
    series = [rest]
    fuzzer = threading.Thread(target=lambda: asyncio.run(fuzz(
        targets, args.inputs, args.seed, args.concurrency, args.max_seconds, tally)),
        daemon=True)
    t0, s0 = time.monotonic(), good.steps
    fuzzer.start()
    while fuzzer.is_alive() and proc.poll() is None:
        series.append(fuzz_live.rss_mb(proc.pid))
        fuzzer.join(0.2)
    seconds = time.monotonic() - t0
    fuzzing = (good.steps - s0) / seconds
    peak = fuzz_live.peak_rss_mb(proc.pid)
    served_after = proc.poll() is None and fuzz_live.rate(good, 1.0) > 0
    good.stop.set()
    good.join(15)
    tracebacks = sum("Traceback" in ln for ln in log)
    first = next((i for i, ln in enumerate(log) if "Traceback" in ln), None)
    inputs = sum(tally.inputs.values())
    tenth = max(1, len(series) // 10)
    return {
        "inputs": inputs, "by_target": dict(tally.inputs), "seconds": round(seconds, 1),
        "inputs_per_s": round(inputs / seconds), "crashes": int(proc.poll() is not None)
        + tracebacks + tally.errors["internal"], "server_exit": proc.poll(),
        "tracebacks": tracebacks, "internal_errors": tally.internal,
        "first_traceback": "" if first is None else "".join(log[max(0, first - 2):first + 30]),
        "error_codes": dict(tally.errors), "rss_rest_mb": round(rest, 1),
        "rss_peak_mb": round(peak, 1), "rss_end_mb": round(series[-1], 1),
        "rss_by_tenth_mb": [round(x, 1) for x in series[::tenth]],
        "good_steps_per_s_calm": round(calm, 1), "good_steps_per_s_fuzzing": round(fuzzing, 1),
        "good_served_after": served_after, "good_error": good.error,
        "kinds_in_grammar": len(Frames(random.Random(0)).kinds), "concurrency": args.concurrency,
        "load_avg_1min": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=1_000_000, help="frames to send (1000000)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (0)")
    ap.add_argument("--concurrency", type=int, default=32, help="sessions at once (32)")
    ap.add_argument("--max-seconds", type=float, default=0.0,
                    help="stop after this long even if fewer inputs were sent (0: no limit)")
    fuzz_live.serve_and_print(ap.parse_args(), run, workers=2)  # the good worker and ours


if __name__ == "__main__":
    main()
