"""`minips trace`: a run's frames as one conversation, and its sequence chart.

Input is either the trace files the roles wrote with ``--trace`` (record/trace.py: a run
directory or a directory of ``<role>.trace.jsonl`` files, or the files themselves) or, with
``--pcap FILE``, a packet capture of a plain-TCP run (tcpdump, tshark), whose TCP streams are
reassembled and cut into frames here (dpkt reads the capture: minips[trace]).

Both become a list of ``Frame``s (time, from, to, kind, bytes, clock, version, payload): a
frame traced on both ends is paired by its connection and per-direction ``seq`` and shown
once, at its send time, with its receive time beside it. Roles are named from the files
(each file's ``local`` addresses belong to its role) or, in a capture, from the HELLO frames
(a worker's HELLO names it and, with ``group`` set, the group server it dials). The text is
one line a frame; the chart (matplotlib, minips[plot]) draws a window of it: one lifeline per
role, an arrow per frame labelled with its kind and bytes, PNG and SVG.

This module also holds the ``--trace`` flags of the roles (``add_trace_flags``), how a role's
process opens its tracer (``open_role_tracer``) and the flags `minips local` passes its
children (``child_trace_args``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from minips.errors import ConfigError
from minips.record import trace
from minips.wire.checks import MAGIC, PREFIX, TABLE_ENTRY
from minips.wire.messages import Kind

__all__ = ["add_trace_flags", "add_trace_parser", "open_role_tracer", "child_trace_args",
           "Frame", "trace_files", "load_frames", "read_pcap", "render_text", "chart_window",
           "draw_chart", "trace_command", "MAX_ARROWS"]

MAX_ARROWS = 120  # frames a chart draws at most (a readable chart; --max-arrows)
CHART_NAME = "trace-chart"  # RUN_DIR/trace-chart.png and .svg when a run directory is given


# -- the --trace flags of the roles ----------------------------------------------------------------

def add_trace_flags(p: argparse.ArgumentParser, *, local: bool = False) -> None:
    """``--trace`` (a file; `minips local`: a directory, the run directory by default) and
    ``--trace-cap``."""
    if local:
        p.add_argument("--trace", nargs="?", const="", default=None, metavar="DIR",
                       help="every process writes its frames to DIR/<role>.trace.jsonl "
                       "(server, group-G, worker-N, evaluator); without DIR the run directory; "
                       "read them with `minips trace` (default off)")
    else:
        p.add_argument("--trace", default="", metavar="FILE",
                       help="write one JSON line per frame sent or received to FILE; a name "
                       "ROLE.trace.jsonl tags the lines ROLE (default off)")
    p.add_argument("--trace-cap", type=float, default=trace.DEFAULT_CAP_BYTES / 1e6,
                   metavar="MB", help="trace file size before only every "
                   f"{trace.SAMPLE_EVERY}th frame is written (the file says so)")


def _role(args: argparse.Namespace) -> str:
    """A role's name in its trace when the file's name does not say it."""
    if args.command == "worker" and getattr(args, "id", -1) >= 0:
        return f"worker-{args.id}"
    return str(args.command)


def open_role_tracer(args: argparse.Namespace) -> None:
    """Open this process's tracer when ``--trace`` asked for one (not `minips local`, whose
    children trace)."""
    if getattr(args, "trace", "") and args.command != "local":
        if not args.trace_cap > 0:
            raise ConfigError(f"--trace-cap {args.trace_cap}: give a size in MB > 0")
        trace.open_tracer(args.trace, _role(args), cap_bytes=int(args.trace_cap * 1e6))


def child_trace_args(trace_dir: str | None, run_dir: Path, name: str,
                     cap_mb: float) -> list[str]:
    """The flags that make `minips local`'s child ``name`` (server, worker-3, ...) trace into
    ``trace_dir`` ("": the run directory); none when it is None (no --trace)."""
    if trace_dir is None:
        return []
    path = Path(trace_dir or run_dir) / f"{name}{trace.SUFFIX}"
    return ["--trace", str(path), "--trace-cap", repr(cap_mb)]


# -- the conversation: one Frame a frame, from the trace files -------------------------------------

@dataclass
class Frame:
    """One frame of the conversation."""

    t: float  # unix s it was sent (or received, when only the receiver traced it)
    src: str  # role (or address) that sent it
    dst: str  # role (or address) it went to
    kind: str
    nbytes: int  # bytes of the whole frame
    meta: dict[str, Any] = field(default_factory=dict)
    payload: dict[str, Any] | None = None
    t_recv: float | None = None  # unix s it was received, when known
    inproc: bool = False  # a direct call in one process (an in-process group's exchange)

    def payload_text(self) -> str:
        p = self.payload
        if not p:
            return ""
        parts = [str(p.get("encoding"))]
        if p.get("n") is not None:
            parts.append(f"n={p['n']}")
        if p.get("k") is not None and not str(p.get("encoding")).startswith("dense"):
            parts.append(f"k={p['k']}")
        parts += [str(p[key]) for key in ("value", "index") if p.get(key)]
        return " ".join(parts)


def trace_files(target: Path) -> list[Path]:
    """The trace files of ``target``: the file itself, or a directory's ``*.trace.jsonl``
    (and those one level below, e.g. a group process's run directory)."""
    if target.is_file():
        return [target]
    if target.is_dir():
        return sorted([*target.glob("*" + trace.SUFFIX), *target.glob("*/*" + trace.SUFFIX)])
    raise ConfigError(f"{target}: no such file or directory")


def _read_lines(paths: list[Path], notes: list[str]) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for path in paths:
        bad = 0
        with open(path, encoding="utf-8") as f:
            for text in f:
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError:
                    bad += 1  # a process killed mid-line leaves half a line
                    continue
                if "event" in obj:
                    if obj["event"] != "open":
                        notes.append(f"{path.name}: {obj.get('note', obj['event'])}")
                    continue
                lines.append(obj)
        if bad:
            notes.append(f"{path.name}: {bad} unreadable line(s) skipped")
    return lines


def load_frames(paths: list[Path]) -> tuple[list[Frame], list[str]]:
    """The frames the trace files hold, each once, in time order, and notes (sampling, ...)."""
    notes: list[str] = []
    lines = _read_lines(paths, notes)
    roles = {ln["local"]: ln["role"] for ln in lines if not ln["local"].startswith("inproc:")}

    def name(line: dict[str, Any]) -> str:
        return str(line.get("peer_role") or roles.get(line["peer"], line["peer"]))

    sends: dict[tuple[str, str, int], Frame] = {}
    out: list[Frame] = []
    for ln in sorted(lines, key=lambda x: x["dir"] != "send"):  # sends first: recvs pair up
        if ln["dir"] == "send":
            frame = Frame(ln["t"], ln["role"], name(ln), ln["kind"], ln["bytes"],
                          ln.get("meta") or {}, ln.get("payload"),
                          inproc=ln["local"].startswith("inproc:"))
            sends[(ln["local"], ln["peer"], ln["seq"])] = frame
            out.append(frame)
            continue
        sent = sends.get((ln["peer"], ln["local"], ln["seq"]))
        if sent is not None and sent.kind == ln["kind"]:
            sent.t_recv = ln["t"]
            continue
        out.append(Frame(ln["t"], name(ln), ln["role"], ln["kind"], ln["bytes"],
                         ln.get("meta") or {}, ln.get("payload"), t_recv=ln["t"],
                         inproc=ln["local"].startswith("inproc:")))
    out.sort(key=lambda f: f.t)
    return out, notes


# -- a packet capture: TCP streams reassembled, cut into frames ------------------------------------

def _ahead(seq: int, at: int) -> int:
    """How far TCP sequence number ``seq`` lies past ``at`` (modulo 2**32); 0 is ``at`` itself,
    and 2**31 or more means ``seq`` lies before it."""
    return (seq - at) & 0xFFFFFFFF


class _Stream:
    """One direction of a TCP connection: its bytes in order (retransmissions dropped,
    segments that arrive early held back, bytes the capture never saw passed over at its
    end), cut into minips frames as they complete."""

    def __init__(self, src: str, dst: str) -> None:
        self.src, self.dst = src, dst
        self.next: int | None = None  # the sequence number of the next byte in order
        self.early: dict[int, tuple[float, bytes]] = {}  # seq -> segment that came too soon
        self.buf = bytearray()  # bytes of the frame head being collected
        self.skip = 0  # body bytes still to pass over
        self.pending: Frame | None = None  # the frame whose body is being passed over
        self.start = 0.0  # time the current frame's first byte was seen
        self.frames: list[Frame] = []

    def segment(self, ts: float, seq: int, syn: bool, data: bytes) -> None:
        if syn:
            self.next = (seq + 1) & 0xFFFFFFFF
            return
        if not data:
            return
        if self.next is None:
            self.next = seq  # the capture began mid-connection: resynchronised on MAGIC
        if 0 < _ahead(seq, self.next) < 1 << 31:  # a gap: held until the bytes before it come
            self.early[seq] = (ts, data)
            return
        self._take(ts, seq, data)
        self._drain()

    def _take(self, ts: float, seq: int, data: bytes) -> None:
        assert self.next is not None
        behind = _ahead(self.next, seq)
        if behind < len(data):  # else all seen already (a retransmission)
            self._bytes(ts, data[behind:])

    def _drain(self) -> None:
        """Take the held segments that are now due, or overlap what came (a retransmission
        may cover a held segment's start)."""
        while True:
            at = self.next
            assert at is not None
            seq = next((s for s in self.early if not 0 < _ahead(s, at) < 1 << 31), None)
            if seq is None:
                return
            self._take(*self._held(seq))

    def finish(self) -> None:
        """The capture ended: bytes it never saw (dropped by the capture) are passed over, so
        what came after a gap still shows. A gap inside a frame's body keeps the frames in
        step; one in a head loses that frame, and the stream finds the next MAGIC. One pass
        over the held segments in sequence order."""
        at = self.next
        if at is None or not self.early:
            return
        for seq in sorted(self.early, key=lambda s: _ahead(s, at)):
            gap = _ahead(seq, self.next or 0)
            if 0 < gap < 1 << 31:  # else it overlaps what came: _take trims it
                self._unseen(gap)
            self._take(*self._held(seq))

    def _held(self, seq: int) -> tuple[float, int, bytes]:
        ts, data = self.early.pop(seq)
        return ts, seq, data

    def _unseen(self, n: int) -> None:
        """Pass over ``n`` bytes the capture never saw: body bytes keep the frames in step; a
        head cut short is dropped, and ``_cut`` finds the next MAGIC."""
        assert self.next is not None
        self.next = (self.next + n) & 0xFFFFFFFF
        if self.skip > n:
            self.skip -= n
        else:
            self.skip, self.pending, self.buf = 0, None, bytearray()

    def _bytes(self, ts: float, data: bytes) -> None:
        assert self.next is not None
        self.next = (self.next + len(data)) & 0xFFFFFFFF
        view = memoryview(data)
        while view.nbytes:
            if self.skip:
                n = min(self.skip, view.nbytes)
                self.skip -= n
                view = view[n:]
                if not self.skip and self.pending is not None:
                    self.pending.t_recv = ts
                    self.pending = None
                continue
            if not self.buf:
                self.start = ts
            self.buf += view
            view = view[view.nbytes:]
            self._cut(ts)

    def _cut(self, ts: float) -> None:
        """Take the whole frame heads out of ``buf``; a frame's body is skipped, not kept."""
        while True:
            at = self.buf.find(MAGIC)
            if at != 0:  # not on a frame boundary (a capture begun mid-stream): resync
                del self.buf[: at if at > 0 else max(0, len(self.buf) - len(MAGIC) + 1)]
            if len(self.buf) < PREFIX.size:
                return
            _, _, kind, nbuf, _, meta_len, body_len = PREFIX.unpack_from(self.buf)
            head = PREFIX.size + TABLE_ENTRY.size * nbuf + meta_len
            if len(self.buf) < head:
                return
            frame = self._frame(kind, nbuf, meta_len, head + body_len, ts)
            rest = self.buf[head:]
            self.buf = bytearray()
            self.frames.append(frame)
            if len(rest) >= body_len:
                frame.t_recv = ts
                self.buf = bytearray(rest[body_len:])
                self.start = ts
                continue
            self.skip, self.pending = body_len - len(rest), frame
            return

    def _frame(self, kind: int, nbuf: int, meta_len: int, size: int, ts: float) -> Frame:
        table = [TABLE_ENTRY.unpack_from(self.buf, PREFIX.size + TABLE_ENTRY.size * i)
                 for i in range(nbuf)]
        at = PREFIX.size + TABLE_ENTRY.size * nbuf
        try:
            meta = msgpack.unpackb(bytes(self.buf[at:at + meta_len]), raw=False,
                                   strict_map_key=False)
        except Exception:  # a capture may hold anything; the frame still shows
            meta = {}
        meta = meta if isinstance(meta, dict) else {}
        payload = None
        if "encoding" in meta:
            payload = trace.summarise_payload(str(meta.pop("encoding")),
                                              meta.pop("codec", None) or {},
                                              [entry[-1] for entry in table])
        name = Kind(kind).name if kind in Kind._value2member_map_ else f"KIND_{kind}"
        return Frame(self.start, self.src, self.dst, name, size,
                     trace._jsonable(meta), payload, t_recv=ts)


def _open_capture(path: Path) -> Any:
    try:
        import dpkt
    except ImportError:
        raise ConfigError("--pcap needs dpkt: pip install 'minips[trace]'") from None
    f = open(path, "rb")  # noqa: SIM115 (the reader reads it lazily; closed by read_pcap)
    try:
        magic = f.read(4)
        f.seek(0)
        return f, (dpkt.pcapng.Reader(f) if magic == b"\x0a\x0d\x0d\x0a" else dpkt.pcap.Reader(f))
    except (ValueError, dpkt.dpkt.Error) as exc:
        f.close()
        raise ConfigError(f"{path}: not a pcap or pcapng capture ({exc})") from None


def _ip_of(datalink: int, buf: bytes) -> Any:
    """The IP packet of a captured link-layer frame (Ethernet, Linux cooked v1/v2, loopback,
    raw IP), or None."""
    import dpkt

    try:
        if datalink == dpkt.pcap.DLT_EN10MB:
            return dpkt.ethernet.Ethernet(buf).data
        if datalink == dpkt.pcap.DLT_LINUX_SLL:
            return dpkt.sll.SLL(buf).data
        if datalink == 276:  # DLT_LINUX_SLL2 (tcpdump -i any)
            return dpkt.sll2.SLL2(buf).data
        if datalink in (dpkt.pcap.DLT_NULL, dpkt.pcap.DLT_LOOP):
            return dpkt.loopback.Loopback(buf).data
        if datalink in (dpkt.pcap.DLT_RAW, 12, 14, 101):
            return dpkt.ip.IP(buf) if buf[:1] and buf[0] >> 4 == 4 else dpkt.ip6.IP6(buf)
    except (dpkt.dpkt.Error, IndexError):
        return None
    return None


def _segments(path: Path) -> Iterator[tuple[float, str, str, Any]]:
    """(time, source address, destination address, TCP segment) of each TCP packet."""
    import socket

    import dpkt

    f, reader = _open_capture(path)
    with f:
        link = reader.datalink()
        for ts, buf in reader:
            ip = _ip_of(link, buf)
            if not isinstance(ip, (dpkt.ip.IP, dpkt.ip6.IP6)) or not isinstance(ip.data,
                                                                                dpkt.tcp.TCP):
                continue
            family = socket.AF_INET if isinstance(ip, dpkt.ip.IP) else socket.AF_INET6
            tcp = ip.data
            src = trace._address((socket.inet_ntop(family, ip.src), tcp.sport))
            dst = trace._address((socket.inet_ntop(family, ip.dst), tcp.dport))
            yield float(ts), src, dst, tcp


def _name_endpoints(streams: dict[tuple[str, str], _Stream]) -> dict[str, str]:
    """Roles of the connections' ends, from the HELLO each client sent (and the id its
    WELCOME gave it)."""
    names: dict[str, str] = {}
    for (src, dst), stream in streams.items():
        hello = next((f.meta for f in stream.frames if f.kind == "HELLO"), None)
        if hello is None:
            continue
        back = streams.get((dst, src))
        welcome = next((f.meta for f in back.frames if f.kind == "WELCOME"), {}) if back else {}
        role, wid = str(hello.get("role", "peer")), hello.get("worker_id", -1)
        wid = wid if isinstance(wid, int) and wid >= 0 else welcome.get("worker_id", -1)
        group = hello.get("group", -1)
        if role == "group":
            names.setdefault(src, f"group-{group}")
        else:
            names.setdefault(src, f"{role}-{wid}" if role == "worker" and wid >= 0 else role)
        server = f"group-{group}" if role == "worker" and isinstance(group, int) and \
            group >= 0 else "server"
        names.setdefault(dst, server)
    return names


def read_pcap(path: Path, ports: frozenset[int] = frozenset()) -> list[Frame]:
    """The minips frames of a capture, in time order, with roles named from the HELLOs; with
    ``ports``, only the connections with an end on one of them."""
    import dpkt

    streams: dict[tuple[str, str], _Stream] = {}
    for ts, src, dst, tcp in _segments(path):
        if ports and tcp.sport not in ports and tcp.dport not in ports:
            continue
        stream = streams.get((src, dst))
        if stream is None:
            stream = streams[(src, dst)] = _Stream(src, dst)
        stream.segment(ts, tcp.seq, bool(tcp.flags & dpkt.tcp.TH_SYN), bytes(tcp.data))
    for stream in streams.values():
        stream.finish()
    names = _name_endpoints(streams)
    frames = [f for s in streams.values() for f in s.frames]
    for f in frames:
        f.src, f.dst = names.get(f.src, f.src), names.get(f.dst, f.dst)
    frames.sort(key=lambda f: f.t)
    return frames


# -- the text: one line a frame --------------------------------------------------------------------

def _fields(f: Frame) -> str:
    out = [f"{key}={f.meta[key]}" for key in ("clock", "version", "since") if key in f.meta]
    return " ".join(out)


def render_text(frames: list[Frame], t0: float) -> Iterator[str]:
    """One line a frame: seconds since ``t0``, from -> to, kind, bytes, clock and version,
    the payload in brief, and how long it took to arrive when both ends were seen."""
    width = max([len(f.src) for f in frames] + [len(f.dst) for f in frames] + [6])
    for f in frames:
        took = "  (in-process call)" if f.inproc else "" if f.t_recv is None or \
            f.t_recv == f.t else f"  (+{1e3 * (f.t_recv - f.t):.2f} ms)"
        yield (f"{f.t - t0:11.6f}  {f.src:>{width}} -> {f.dst:<{width}}  {f.kind:<14} "
               f"{f.nbytes:>11,} B  {_fields(f):<28} {f.payload_text()}{took}").rstrip()


# -- the sequence chart ----------------------------------------------------------------------------

def _role_key(role: str) -> tuple[int, int, str]:
    """Lifelines left to right: server, groups, workers, evaluator, anything else."""
    order = {"server": 0, "group": 1, "worker": 2, "evaluator": 3}
    head, _, num = role.partition("-")
    return (order.get(head, 4), int(num) if num.isdigit() else -1, role)


def chart_window(frames: list[Frame], t0: float, start: float | None, end: float | None,
                 most: int = MAX_ARROWS) -> tuple[list[Frame], float, float]:
    """The frames a chart draws and its window (s since ``t0``). Without ``start``/``end``:
    from the first PULL up to the first EXCHANGE_REPLY (one round trip of every kind), the
    last ``most`` frames of it."""
    if start is None and end is None:
        first = next((f.t for f in frames if f.kind == "PULL"), frames[0].t if frames else t0)
        reply = next((f.t for f in frames if f.kind == "EXCHANGE_REPLY" and f.t >= first), None)
        start, end = first - t0, (reply if reply is not None else first + 1.0) - t0
        chosen = [f for f in frames if start <= f.t - t0 <= end][-most:]
        return chosen, (chosen[0].t - t0 if chosen else start), end
    lo = -math.inf if start is None else start
    hi = math.inf if end is None else end
    chosen = [f for f in frames if lo <= f.t - t0 <= hi][:most]
    if not chosen:
        return [], lo if start is not None else 0.0, hi if end is not None else 0.0
    return chosen, (chosen[0].t - t0) if start is None else lo, \
        (chosen[-1].t - t0) if end is None else hi


def _human(n: int) -> str:
    for unit, size in (("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# strong colours for the kinds of a training step, one per kind; the rest share muted ones
COLORS = {"PULL": "tab:orange", "WEIGHTS": "tab:green", "PUSH": "tab:blue", "ACK": "tab:purple",
          "EXCHANGE": "tab:red", "EXCHANGE_REPLY": "tab:brown", "GLOBAL_WEIGHTS": "darkgreen",
          "INIT_WEIGHTS": "navy", "STATS": "tab:olive", "ASSIGN": "tab:pink",
          "HEARTBEAT": "0.55", "HELLO": "tab:cyan", "CHALLENGE": "tab:cyan", "AUTH": "tab:cyan",
          "WELCOME": "tab:cyan", "LEAVE": "black", "ERROR": "black", "REFUSE": "black"}


def _label(f: Frame) -> str:
    """An arrow's label: kind, SSP clock and version where the frame has them, bytes."""
    extra = [f"{key}={f.meta[key]}" for key in ("clock", "version") if key in f.meta]
    return " ".join([f.kind, *extra, "·", _human(f.nbytes), *(["(in-process)"] if f.inproc
                                                              else [])])


def draw_chart(frames: list[Frame], t0: float, window: tuple[float, float], path: Path,
               title: str = "", cut: bool = False) -> list[Path]:
    """The sequence chart of ``frames`` as PATH.png and PATH.svg: one lifeline per role, one
    row per frame in time order (its send time on the left, s since the first frame), an arrow
    from sender to receiver labelled with kind, clock, version and frame bytes; colours by
    kind (legend)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        raise ConfigError("the chart needs matplotlib: pip install 'minips[plot]'") from None
    roles = sorted({f.src for f in frames} | {f.dst for f in frames}, key=_role_key)
    x = {r: i for i, r in enumerate(roles)}
    kinds = sorted({f.kind for f in frames},
                   key=lambda k: Kind[k].value if k in Kind.__members__ else 99)
    fig, ax = plt.subplots(figsize=(max(6.0, 2.0 * len(roles) + 2.0),
                                    min(60.0, 1.6 + 0.3 * len(frames))))
    for r in roles:
        ax.axvline(x[r], color="0.8", lw=1, zorder=0)
    for i, f in enumerate(frames):
        c = COLORS.get(f.kind, "0.4")
        ax.annotate("", xy=(x[f.dst], i), xytext=(x[f.src], i),
                    arrowprops={"arrowstyle": "-|>", "color": c, "lw": 1.3,
                                "shrinkA": 0, "shrinkB": 0})
        ax.text((x[f.src] + x[f.dst]) / 2, i - 0.12, _label(f), fontsize=7, ha="center",
                va="bottom", color=c)
    ax.set_yticks(range(len(frames)), [f"{f.t - t0:.4f}" for f in frames], fontsize=7)
    ax.set_ylim(len(frames) - 0.5, -0.8)
    ax.set_ylabel("send time, s since the first frame (one row per frame)")
    ax.set_xticks(range(len(roles)), roles)
    ax.xaxis.tick_top()
    ax.set_xlim(-0.5, len(roles) - 0.5)
    note = f", the first {len(frames)} frames of it" if cut else ""
    ax.set_title(f"{title}minips frames from {window[0]:.3f} to {window[1]:.3f} s{note}\n"
                 "arrow: sender -> receiver; label: kind, clock, version, frame bytes "
                 "(kB = 1000 B)", fontsize=9, pad=22)
    ax.legend([Line2D([0], [0], color=COLORS.get(k, "0.4"), lw=2) for k in kinds], kinds,
              fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), title="kind")
    fig.tight_layout()
    out = [path.with_suffix(".png"), path.with_suffix(".svg")]
    for p in out:
        fig.savefig(p, dpi=110)
    plt.close(fig)
    return out


# -- the command -----------------------------------------------------------------------------------

def add_trace_parser(sub: Any) -> None:
    """`minips trace`."""
    p = sub.add_parser("trace", help="a run's frames as one conversation and a sequence chart")
    p.add_argument("paths", nargs="*", metavar="RUN_DIR_or_FILE",
                   help="a run directory (its *.trace.jsonl) or trace files of --trace")
    p.add_argument("--pcap", metavar="FILE",
                   help="decode a packet capture (tcpdump/tshark) of a plain-TCP run instead "
                   "(needs minips[trace])")
    p.add_argument("--port", type=int, action="append", default=[], metavar="N",
                   help="with --pcap: only connections with an end on port N (repeatable)")
    p.add_argument("--from", dest="start", type=float, metavar="S",
                   help="chart (and text) from S seconds after the first frame")
    p.add_argument("--to", dest="end", type=float, metavar="S",
                   help="chart (and text) up to S seconds after the first frame")
    p.add_argument("--chart", metavar="PATH",
                   help="write the sequence chart as PATH.png and PATH.svg (default: "
                   f"RUN_DIR/{CHART_NAME} for a run directory, else none)")
    p.add_argument("--max-arrows", type=int, default=MAX_ARROWS,
                   help="frames the chart draws at most")
    p.add_argument("--no-chart", action="store_true", help="print the text only")


def _source(args: argparse.Namespace) -> tuple[list[Frame], list[str], Path | None]:
    """The frames to show, notes, and the default chart path."""
    if args.pcap:
        if args.paths:
            raise ConfigError("give trace files or --pcap FILE, not both")
        path = Path(args.pcap)
        if not path.is_file():
            raise ConfigError(f"--pcap {path}: no such file")
        return read_pcap(path, frozenset(args.port)), [], None
    if not args.paths:
        raise ConfigError("name a run directory or trace files (or --pcap FILE)")
    files = [p for target in args.paths for p in trace_files(Path(target))]
    if not files:
        raise ConfigError(f"no *{trace.SUFFIX} files in {', '.join(args.paths)} (run with "
                          "--trace)")
    frames, notes = load_frames(files)
    first = Path(args.paths[0])
    return frames, notes, (first / CHART_NAME) if first.is_dir() else None


def trace_command(args: argparse.Namespace) -> int:
    """Print the conversation; draw the chart of the window."""
    frames, notes, default_chart = _source(args)
    if not frames:
        raise ConfigError("no frames found")
    t0 = frames[0].t
    lo = -math.inf if args.start is None else args.start
    hi = math.inf if args.end is None else args.end
    shown = [f for f in frames if lo <= f.t - t0 <= hi]
    print(f"# minips trace: {len(shown)} of {len(frames)} frames; times in s since the first "
          f"frame (unix {t0:.6f}); bytes: the whole frame")
    for note in notes:
        print(f"# note: {note}")
    for line in render_text(shown, t0):
        print(line)
    chart = None if args.no_chart else (Path(args.chart) if args.chart else default_chart)
    if chart is not None:
        chosen, a, b = chart_window(frames, t0, args.start, args.end, args.max_arrows)
        if not chosen:
            raise ConfigError(f"no frames between {args.start} and {args.end} s to chart")
        total = sum(1 for f in frames if a <= f.t - t0 <= b)
        for out in draw_chart(chosen, t0, (a, b), chart, cut=total > len(chosen)):
            print(f"# chart: {out}")
    return 0
