"""Where the same-core round trip of bench_rtt.py goes: minips as it is, against the same minips
with its codec made free and with its field checks left out. The last two are what-ifs for
measurement only, made by replacing functions in the benchmark's own processes; minips itself
never runs that way.

Variants (each is one run of bench_rtt.py's round trips, client and servers on core --cpu, so each
also measures the echo and the floor next to it):
- minips: as it runs.
- free_codec: the PUSH and ACK frames are encoded once and reused, and their messages decoded once
  and handed out again (the decoder only reads each prefix to find the frame's end). What is left
  is the socket, the asyncio plumbing (FrameProtocol, Channel, the state machine, the receive
  queue, the task the handler runs in) and the handler: what a codec that took no time would give.
- no_checks: ``from_wire`` builds each received message without any field check (keys, types,
  bounds), on both ends.

Derived figures (µs, from the medians):
- plumbing_us = free_codec - echo: minips' asyncio machinery without its codec;
- codec_us = minips - free_codec: encoding and decoding a PUSH and an ACK, checks included;
- checks_us = minips - no_checks: the field checks of both received messages;
- floor_codec_us = floor - echo: the least Python the wire format allows (struct and one msgpack
  call each way, the body copied, no checks, no state, answered in the protocol callback);
- least_python_us = echo + plumbing_us + floor_codec_us, and least_python_ratio over the echo:
  minips with that codec and no checks at all, if the costs add up.

Usage: python scripts/rtt_breakdown.py [--json] [--rtt-iters 2000] [--cpu 0]   (about 1 min)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import bench_rtt as b

from minips.wire import control, handshake, kinds, messages, receive
from minips.wire import frames as frames_mod
from minips.wire.checks import PREFIX, TABLE_ENTRY
from minips.wire.fields import Payload
from minips.wire.receive import FrameReceiver

VARIANTS = ("minips", "free_codec", "no_checks")


def _cached_codec() -> list[Any]:
    """Patches that encode PUSH and ACK once and decode them once (the what-if free codec)."""
    push = b.sparse_push()
    frames = {messages.Kind.PUSH: frames_mod.encode(push),
              messages.Kind.ACK: frames_mod.encode(messages.Ack(clock=1, version=1))}
    decoded = {int(kind): FrameReceiver().feed(b"".join(f))[0] for kind, f in frames.items()}
    encode, next_frame = frames_mod.encode, FrameReceiver._next

    def cached_encode(msg: messages.Message, **kw: Any) -> list[Any]:
        frame = frames.get(msg.KIND)
        return frame if frame is not None else encode(msg, **kw)

    def cached_next(self: Any, out: list[messages.Message]) -> bool:
        if self._frame is None:
            _, _, kind, nbuf, _, meta_len, body_len = PREFIX.unpack_from(self._buf, self._lo)
            end = self._lo + PREFIX.size + TABLE_ENTRY.size * nbuf + meta_len + body_len
            if kind in decoded and end <= self._hi:
                self._lo = end
                out.append(decoded[kind])
                return True
        return next_frame(self, out)  # the handshake, decoded for real

    return [mock.patch.object(handshake, "encode", cached_encode),
            mock.patch.object(FrameReceiver, "_next", cached_next)]


def _unchecked() -> list[Any]:
    """A patch that builds received messages from their maps without any field check."""

    def from_wire(kind: int, version: int, meta: dict[str, Any], nbuf: int) -> messages.Message:
        cls = kinds.MESSAGE_TYPES[kind]
        if kind in kinds.WITH_BUFFERS and not nbuf:  # with buffers: kinds.with_buffers
            meta["payload"] = Payload(meta.pop("encoding"), meta.pop("codec"), ())
        elif cls is control.Hello:
            meta["version"] = version
        msg = cls.__new__(cls)
        object.__setattr__(msg, "__dict__", meta)
        return msg

    return [mock.patch.object(frames_mod, "from_wire", from_wire),
            mock.patch.object(receive, "from_wire", from_wire)]


PATCHES: dict[str, Callable[[], list[Any]]] = {
    "minips": lambda: [], "free_codec": _cached_codec, "no_checks": _unchecked}  # minips: none


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """Run the block with ``name``'s patches applied in this process."""
    with contextlib.ExitStack() as stack:
        for patch in PATCHES[name]():
            stack.enter_context(patch)
        yield


def variant_server(name: str, port_q: Any, cpu: int | None, dense: bool) -> None:
    """bench_rtt's minips server process, with ``name``'s patches (no need to undo them)."""
    with variant(name):
        b.minips_server(port_q, cpu, dense)


def measure(name: str, iters: int, cpu: int) -> dict[str, float]:
    """One same-core run of the round trips with ``name`` on both ends: p50 µs per kind."""
    with variant(name):
        times = b.run_rtt(iters, cpu, cpu, functools.partial(variant_server, name))
    return {kind: statistics.median(v) for kind, v in times.items()}


def breakdown(iters: int, cpu: int) -> dict[str, Any]:
    runs = {name: measure(name, iters, cpu) for name in VARIANTS}
    out: dict[str, Any] = {f"{name}_us": round(r["minips"], 1) for name, r in runs.items()}
    out.update({f"{name}_echo_us": round(r["echo"], 1) for name, r in runs.items()})
    out.update({f"{name}_ratio": round(r["minips"] / r["echo"], 3) for name, r in runs.items()})
    echo = statistics.median(r["echo"] for r in runs.values())
    floor = statistics.median(r["floor"] for r in runs.values())
    plumbing = runs["free_codec"]["minips"] - runs["free_codec"]["echo"]
    least = floor + plumbing  # echo + plumbing + (floor - echo)
    out.update({
        "echo_us": round(echo, 1), "floor_us": round(floor, 1),
        "plumbing_us": round(plumbing, 1),
        "codec_us": round(runs["minips"]["minips"] - runs["free_codec"]["minips"], 1),
        "checks_us": round(runs["minips"]["minips"] - runs["no_checks"]["minips"], 1),
        "floor_codec_us": round(floor - echo, 1),
        "least_python_us": round(least, 1), "least_python_ratio": round(least / echo, 3),
        "rtt_iters": iters, "rtt_cpu": cpu})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--rtt-iters", type=int, default=2000, help="round trips of each kind per run")
    ap.add_argument("--cpu", type=int, default=0, help="the core every process runs on")
    args = ap.parse_args()
    b.t.install_uvloop()
    result = breakdown(args.rtt_iters, args.cpu)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
