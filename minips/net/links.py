"""Emulated network links: link profiles (`--link`), the token bucket that paces a connection to
a link's rate, and the read pacer that is the downlink half of a paced channel.

A profile says how fast each worker's network link is, in both directions:

    10mbit                            every worker, both directions
    100,100,50,50,20,20,10,10mbit     one rate per worker (the last one repeats)
    10mbit/40mbit                     uplink (worker -> servers) / downlink (servers -> worker)
    20mbit+5ms                        with 5 ms of latency added to every message a worker sends
    +5ms                              latency only, no rate limit
    path/to/profile.txt               a file holding a profile (lines joined by commas, # comments)

Rates are bits per second with a unit: ``bps`` (or ``bit``), ``kbit``, ``mbit``, ``gbit``
(factors of 1000). A number without a unit takes the unit of the next rate that has one, so
``100,50,10mbit`` is three rates in mbit. Latency units: ``us``, ``ms``, ``s``.

The file holds, in order: the profiles (``Rate``, ``LinkProfile``, ``parse_profile``,
``format_rate``); ``TokenBucket``, sans-IO: ``take(n, now)`` answers how long to wait before
``n`` bytes may pass at the bucket's rate; ``Pacing``, a worker's two buckets (uplink, downlink),
which ``channel.Channel.set_pacing`` applies to a connection (docs/links.md); and ``ReadPacer``,
reading a socket no faster than a link.

``ReadPacer`` charges every read of a ``FrameProtocol`` to a ``TokenBucket``. While the bucket
is in debt it *holds*: the protocol pauses reading (bytes wait in the socket's receive buffer,
then the peer's TCP waits, as behind a slow link) and keeps complete messages from ``recv``
until their bytes' time has passed. Reads are cut to one chunk of the bucket (about 10 ms of the
rate), so a large frame arrives at an even pace instead of in one socket read and one long pause.
The uplink half (paced writes) is ``Channel._send_paced`` in ``channel.py``.

Links that change (``--link-change``, kernel shaping only: the tbf's rate is changed live):

    3:5mbit@60s,3:50mbit@120s         worker 3's link drops to 5 mbit at 60 s, back at 120 s
    *:10mbit/20mbit@30                every worker's from 30 s on (UP/DOWN as in a profile)

T counts from the start of training (the global server's ``groups`` event), as a
``--slowdown`` schedule does (core/slowdown.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minips.errors import ConfigError

__all__ = [
    "Rate",
    "LinkProfile",
    "LINK_FILE",
    "read_link_record",
    "parse_profile",
    "LinkChange",
    "parse_link_changes",
    "TokenBucket",
    "Pacing",
    "SHAPINGS",
    "format_rate",
    "ReadPacer",
]


# -- link profiles and the token bucket ------------------------------------------------------------

SHAPINGS = ("auto", "kernel", "pacer")  # --link-shaping choices
_RATE_UNITS = {"bps": 1.0, "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_LATENCY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_RATE_RE = re.compile(_NUMBER + r"\s*([a-z]*)")
MAX_RATE_BPS = 1e12  # 1 tbit: beyond any link this runs on; a typo, most likely
MAX_LATENCY_S = 10.0
MAX_FILE_BYTES = 64 << 10  # a profile file is a few lines


@dataclass(frozen=True)
class Rate:
    """One worker's link: bits per second each way."""

    up_bps: float  # worker -> servers
    down_bps: float  # servers -> worker


@dataclass(frozen=True)
class LinkProfile:
    """A parsed ``--link``: the text as given, one ``Rate`` per listed worker, the latency."""

    text: str
    rates: tuple[Rate, ...]
    latency_s: float = 0.0

    def rate(self, worker: int) -> Rate:
        """Worker ``worker``'s rate: its entry, else the last one (0/0: not limited)."""
        return self.rates[min(worker, len(self.rates) - 1)] if self.rates else Rate(0.0, 0.0)

    def slowed(self, factor: float) -> str:
        """This profile in profile syntax with every rate divided by ``factor`` and the
        latency multiplied by it: the same links on a clock ``factor`` times slower (a byte
        takes ``factor`` times longer, as a step does when the base step is ``factor`` times
        longer)."""
        if factor <= 0:
            raise ConfigError(f"slowing a link profile by {factor!r}: expected a factor > 0")
        def one(bps: float) -> str:  # 2.5mbit rather than 2500000bit where it is exact
            for unit, size in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
                if bps >= size and float(f"{bps / size:g}") * size == bps:
                    return f"{bps / size:g}{unit}"
            return format_rate(bps)

        text = ",".join(one(r.up_bps / factor) if r.up_bps == r.down_bps
                        else f"{one(r.up_bps / factor)}/{one(r.down_bps / factor)}"
                        for r in self.rates)
        if self.latency_s:
            text += f"+{self.latency_s * factor * 1e6:.0f}us"
        return text

    def record(self, workers: int, shaping: str) -> dict[str, Any]:
        """What the run directory's link.json (and summary.json's ``link``) say: rates in
        bits/s per worker (empty when not limited) and the shaping used."""
        return {"profile": self.text, "shaping": shaping, "latency_s": self.latency_s,
                "rates": [{"worker": w, "up_bps": self.rate(w).up_bps,
                           "down_bps": self.rate(w).down_bps}
                          for w in range(workers if self.rates else 0)]}


LINK_FILE = "link.json"  # a --link run's ``LinkProfile.record``, in its run directory


def read_link_record(run_dir: str | Path) -> dict[str, Any] | None:
    """A run directory's link.json (``LinkProfile.record``); None for a run without a link
    or a file that cannot be read."""
    try:
        record = json.loads((Path(run_dir) / LINK_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def parse_profile(text: str) -> LinkProfile:
    """A ``--link`` value (or the name of a file holding one); ``ConfigError`` in one line
    saying what is wrong otherwise."""
    spec = text.strip()
    if not spec:
        raise ConfigError("--link: empty profile; expected e.g. 10mbit, 10mbit/40mbit, "
                          "100,50,10mbit or 20mbit+5ms")
    if spec.startswith(("/", "./", "../", "~")) or Path(spec).is_file():
        spec = _read_file(os.path.expanduser(spec))
    rates_text, plus, latency_text = spec.partition("+")
    latency = _latency(latency_text) if plus else 0.0
    if plus and not rates_text.strip():
        return LinkProfile(text.strip(), (), latency)
    entries = [e.strip() for e in rates_text.split(",")]
    if any(not e for e in entries):
        raise ConfigError(f"--link {text!r}: an empty rate between commas")
    pairs = [e.split("/") for e in entries]
    for e, pair in zip(entries, pairs, strict=True):
        if len(pair) > 2:
            raise ConfigError(f"--link {text!r}: {e!r} has more than one '/': expected UP/DOWN")
    flat = _rates([r.strip() for pair in pairs for r in pair], text)
    rates, i = [], 0
    for pair in pairs:
        up = flat[i]
        down = flat[i + 1] if len(pair) == 2 else up
        i += len(pair)
        rates.append(Rate(up, down))
    return LinkProfile(text.strip(), tuple(rates), latency)


@dataclass(frozen=True)
class LinkChange:
    """Worker ``worker``'s link (-1: every worker's) takes ``rate`` at ``at_s`` s of training."""

    worker: int
    rate: Rate
    at_s: float

    def applies_to(self, worker: int) -> bool:
        return self.worker in (-1, worker)


def parse_link_changes(text: str) -> list[LinkChange]:
    """``--link-change W:RATE@T,...`` (W a worker id or ``*``, RATE or UP/DOWN, T in s), in
    the order of their times; ``ConfigError`` in one line otherwise."""
    out = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        who, colon, rest = item.partition(":")
        rate_text, at, when = rest.partition("@")
        try:
            worker = -1 if who.strip() == "*" else int(who)
            at_s = float(when.strip().removesuffix("s"))
        except ValueError:
            raise ConfigError(f"--link-change {item!r}: expected W:RATE@SECONDS, W a worker "
                              "id or *") from None
        if not (colon and at) or worker < -1 or at_s < 0:
            raise ConfigError(f"--link-change {item!r}: expected W:RATE@SECONDS, W a worker "
                              "id or *, SECONDS >= 0")
        pair = [r.strip() for r in rate_text.split("/")]
        if len(pair) > 2:
            raise ConfigError(f"--link-change {item!r}: expected RATE or UP/DOWN")
        bps = _rates(pair, item)
        out.append(LinkChange(worker, Rate(bps[0], bps[-1]), at_s))
    return sorted(out, key=lambda c: c.at_s)


def _read_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--link {path}: cannot read the profile file ({exc})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"--link {path}: a profile file holds a few lines, not "
                          f"{len(raw)}+ bytes")
    lines = [line.split("#", 1)[0].strip() for line in raw.splitlines()]
    spec = ",".join(line for line in lines if line)
    if not spec:
        raise ConfigError(f"--link {path}: the file holds no profile")
    return spec.replace(",+", "+")  # a latency on a line of its own


def _rates(tokens: list[str], text: str) -> list[float]:
    """Bits per second of each rate token; one without a unit takes the next unit given."""
    parsed: list[tuple[float, str]] = []
    for tok in tokens:
        m = _RATE_RE.fullmatch(tok.lower())
        if m is None:
            raise ConfigError(f"--link {text!r}: {tok!r} is not a rate; expected a number and "
                              f"a unit ({', '.join(_RATE_UNITS)}), e.g. 10mbit")
        unit = m.group(2)
        if unit and unit not in _RATE_UNITS:
            hint = " (bytes per second are not accepted: use bits, e.g. 80mbit for 10 MB/s)" \
                if unit.endswith(("bps", "b/s")) else ""
            raise ConfigError(f"--link {text!r}: unknown unit {unit!r} in {tok!r}; expected "
                              f"one of {', '.join(_RATE_UNITS)}{hint}")
        parsed.append((float(m.group(1)), unit))
    out, unit = [0.0] * len(parsed), ""
    for i in range(len(parsed) - 1, -1, -1):  # right to left: the next unit given applies
        value, unit = parsed[i][0], parsed[i][1] or unit
        if not unit:
            raise ConfigError(f"--link {text!r}: {tokens[i]!r} has no unit; give one "
                              f"({', '.join(_RATE_UNITS)}) on it or on a later rate")
        bps = value * _RATE_UNITS[unit]
        if not 0 < bps <= MAX_RATE_BPS or not math.isfinite(bps):
            raise ConfigError(f"--link {text!r}: {tokens[i]!r} is out of range; a rate is "
                              f"above 0 and at most 1000gbit")
        out[i] = bps
    return out


def _latency(text: str) -> float:
    m = re.fullmatch(_NUMBER + r"\s*([a-z]+)", text.strip().lower())
    if m is None or m.group(2) not in _LATENCY_UNITS:
        raise ConfigError(f"--link: latency {text.strip()!r} is not a duration; expected e.g. "
                          f"+5ms ({', '.join(_LATENCY_UNITS)})")
    seconds = float(m.group(1)) * _LATENCY_UNITS[m.group(2)]
    if seconds > MAX_LATENCY_S:
        raise ConfigError(f"--link: latency {text.strip()!r} is above {MAX_LATENCY_S:g} s")
    return seconds


def format_rate(bps: float) -> str:
    """A rate in profile syntax (whole bits per second: ``tc`` and ``parse_profile`` read it)."""
    return f"{round(bps)}bit"


class TokenBucket:
    """``rate`` bytes per second with bursts of up to ``burst`` bytes (sans-IO: the caller
    passes the time and waits). Tokens may go negative: a take larger than what the bucket holds
    passes after the debt is repaid, so the long-run rate is exact whatever the chunk sizes."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("a token bucket needs a positive rate and burst")
        self.rate, self.burst = float(rate), float(burst)
        self.tokens, self.t = self.burst, now

    def take(self, n: int, now: float) -> float:
        """Take ``n`` bytes' tokens at time ``now``; seconds to wait before sending them."""
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now
        self.tokens -= n
        return -self.tokens / self.rate if self.tokens < 0 else 0.0

    def chunk(self) -> int:
        """Bytes to send or receive between two takes: about 10 ms of the rate (4 KiB to
        256 KiB), so a large frame leaves smoothly rather than in one burst and one wait."""
        return int(min(256 << 10, max(4 << 10, self.rate / 100)))


@dataclass
class Pacing:
    """A worker's link in a pacer: uplink bucket (what it sends), downlink (what it reads)."""

    up: TokenBucket | None
    down: TokenBucket | None

    @classmethod
    def of(cls, up_bytes_s: float, down_bytes_s: float, now: float) -> Pacing | None:
        """Buckets for the given rates in bytes/s (0: that direction unpaced); None when both
        are 0. The burst is 10 ms of the rate, at least 4 KiB."""
        def bucket(rate: float) -> TokenBucket | None:
            return TokenBucket(rate, max(4096.0, rate / 100), now) if rate > 0 else None

        if up_bytes_s <= 0 and down_bytes_s <= 0:
            return None
        return cls(bucket(up_bytes_s), bucket(down_bytes_s))


# -- the read pacer: reading a socket no faster than a link ----------------------------------------

class ReadPacer:
    """Holds reading while ``bucket`` is in debt; calls ``changed()`` when ``hold`` flips."""

    def __init__(self, bucket: TokenBucket, loop: asyncio.AbstractEventLoop,
                 changed: Callable[[], None]) -> None:
        self.bucket, self.loop, self.changed = bucket, loop, changed
        self.hold = False  # reading paused and messages kept until the debt is repaid

    def chunked(self, get_buffer: Callable[[int], memoryview]) -> Callable[[int], memoryview]:
        """``get_buffer`` handing the socket at most one chunk of the bucket per read."""
        chunk = self.bucket.chunk()
        return lambda hint: get_buffer(hint)[:chunk]

    def charge(self, nbytes: int) -> None:
        """A read of ``nbytes``: hold until the bucket has paid for it."""
        wait = self.bucket.take(nbytes, self.loop.time())
        if wait > 0 and not self.hold:
            self.hold = True
            self.changed()
            self.loop.call_later(wait, self._release)

    def _release(self) -> None:
        wait = self.bucket.take(0, self.loop.time())
        if wait > 0:  # a read under way when reading paused added to the debt
            self.loop.call_later(wait, self._release)
            return
        self.hold = False
        self.changed()

    def stop(self) -> None:
        """The connection closed: hold nothing back (a pending release changes nothing)."""
        self.hold = False
