"""docs/protocol.md's smaller statements, each checked against the code that keeps it.

The INIT_WEIGHTS message gets no reply; a PULL's clock must be the worker's own; over-long
varints are accepted up to 5 bytes; NaN and inf are refused in dense gradients too; a small
frame's buffer table is checked once the frame is whole, a large one's before its body; a
handshake that runs out of time is closed without ERROR; ``read_timeout`` counts silence, not
slowness; HEARTBEAT's ``seq`` and an evaluator's ``address`` are not checked; section 3 lists
every key of every kind. And the page holds every number a validator checks: the named limits,
the bounds of every message field's check and the range checks of the servers, found in the
code (``code_bounds``) and looked for on the page in any common spelling (``mentioned``); its
model table is the code's, and the handshake back-off starts where both documents say.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import inspect
import math
import re
import types
from pathlib import Path

import numpy as np
import pytest
from conftest import recv_as, until
from test_server import TOKEN, join, make_server, push

from minips.core import config, global_core
from minips.errors import RemoteProtocolError
from minips.net import channel, guard, transport
from minips.net.endpoints import parse_address
from minips.serve import sessions
from minips.server import InProcGroup
from minips.sparse import SparseVector, decode_vector, encode_vector
from minips.wire import checks, control, conversation, fields, frames, handshake, kinds, messages
from minips.wire.fields import Payload


async def group_session(ctl: channel.Channel) -> tuple[channel.Channel, int]:
    """Worker 0 on its group server, after ASSIGN: the channel and its starting clock."""
    assign = await recv_as(ctl, control.Assign, 5)
    host, port = parse_address(assign.address)
    ch = await transport.connect(host, port, role="worker", worker_id=0, group=assign.group,
                                 token=TOKEN)
    return ch, (await recv_as(ch, messages.Ack, 5)).clock


async def test_init_weights_gets_no_reply(tmp_path: Path) -> None:
    srv = make_server(tmp_path, None, workers=1, mode="asp")
    port = await srv.start()
    ctl = await transport.connect("127.0.0.1", port, role="worker", worker_id=-1, token=TOKEN)
    try:
        encoding, codec, buffers = encode_vector(np.ones(4, np.float32))
        await ctl.send(messages.InitWeights(size=4, payload=Payload(encoding, codec,
                                     tuple(buffers))))
        await ctl.send(control.Stats(clock=0, step_time=0.01, loss=1.0))
        await recv_as(ctl, control.Assign, 5)  # the next message is ASSIGN, no ACK before it
    finally:
        await ctl.close()
        await srv.close()


async def test_a_pull_at_another_clock_makes_the_push_after_it_fail(tmp_path: Path) -> None:
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=1, mode="asp")
    port = await srv.start()
    ctl = await join(port, 0, 0.01)
    ch, clock = await group_session(ctl)
    try:
        await ch.send(messages.Pull(clock=clock + 5))  # not the worker's own clock
        await recv_as(ch, messages.Weights, 5)  # answered for the worker's real clock ...
        await ch.send(push(clock + 6, np.ones(3, np.float32)))
        error = await recv_as(ch, control.Error, 5)  # ... so its PUSH carries the wrong one
        assert error.code == "clock" and f"expected {clock + 1}" in error.reason
    finally:
        await ch.close()
        await ctl.close()
        await srv.close()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
async def test_nan_or_inf_in_a_dense_gradient_is_refused(tmp_path: Path, bad: float) -> None:
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=1, mode="asp")
    port = await srv.start()
    ctl = await join(port, 0, 0.01)
    ch, clock = await group_session(ctl)
    try:
        await ch.send(messages.Pull(clock=clock))
        await recv_as(ch, messages.Weights, 5)
        await ch.send(push(clock + 1, np.array([1.0, bad, 0.0], np.float32)))
        error = await recv_as(ch, control.Error, 5)
        assert error.code == "invalid" and "NaN or inf" in error.reason
        assert isinstance(peer := srv.peers[0], InProcGroup)
        assert peer.server.core.weights.tolist() == [0.0] * 3  # nothing applied
    finally:
        await ch.close()
        await ctl.close()
        await srv.close()


def sparse_v1(k: int, index: bytes, values: bytes) -> Payload:
    return Payload("sparse-v1", {"k": k, "index": "varint", "value": "f32"}, (index, values))


def test_over_long_varints_are_accepted_up_to_five_bytes() -> None:
    values = np.ones(2, np.float32).tobytes()
    # gaps 3 (as 83 80 00: three bytes for a one-byte number) and 0 (as 80 80 80 80 00)
    index = bytes([0x83, 0x80, 0x00, 0x80, 0x80, 0x80, 0x80, 0x00])
    g = decode_vector(sparse_v1(2, index, values), 10)
    assert isinstance(g, SparseVector) and g.indices.tolist() == [3, 4]
    with pytest.raises(RemoteProtocolError, match="larger than 32 bits"):  # six bytes
        decode_vector(sparse_v1(1, bytes([0x80] * 5 + [0x00]), values[:4]), 10)


def test_small_frame_table_is_checked_once_whole_large_one_before_its_body() -> None:
    def head(body_len: int, wire: int) -> bytes:  # one raw buffer whose table says ``wire``
        meta = b"\x80"  # an empty msgpack map: the table is what is wrong here
        return (checks.PREFIX.pack(checks.MAGIC, messages.PROTOCOL_VERSION, messages.Kind.PUSH,
                                     1, 0, len(meta), body_len)
                + checks.TABLE_ENTRY.pack(0, wire, wire) + meta)

    small = frames.FrameDecoder()
    assert small.feed(head(100, 99)) == []  # the table does not add up: not looked at yet
    with pytest.raises(RemoteProtocolError, match="does not add up"):
        small.feed(bytes(100))  # the frame is whole: now it is
    large = frames.FrameDecoder()
    with pytest.raises(RemoteProtocolError, match="does not add up"):
        large.feed(head(1 << 20, (1 << 20) - 1))  # refused before any of the body


async def test_handshake_timeout_closes_without_error() -> None:
    async def never(ch: channel.Channel) -> None:
        raise AssertionError("no handshake, no handler")

    options = channel.Options(handshake_timeout=0.3)
    async with await transport.serve("127.0.0.1", 0, accept=lambda h: {}, handler=never,
                                     token=TOKEN, options=options) as srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, not a byte sent
        assert srv.stats["handshake_timeouts"] == 1
        writer.close()


async def test_read_timeout_counts_silence_not_slowness() -> None:
    """A frame that trickles in a byte every 0.05 s (over 1.5 s in all, 15 times read_timeout)
    is not cut off: only silence is."""
    got: list[messages.Message] = []

    async def keep(ch: channel.Channel) -> None:
        got.append(await ch.recv())

    options = channel.Options(read_timeout=0.1)
    async with await transport.serve("127.0.0.1", 0, accept=lambda h: {}, handler=keep,
                                     token=TOKEN, options=options) as srv:
        ch = await transport.connect("127.0.0.1", srv.port, token=TOKEN)
        frame = b"".join(bytes(b) for b in frames.encode(messages.Pull(clock=7)))
        for byte in range(len(frame)):  # a byte at a time, on the channel's own socket
            ch._transport.write(frame[byte:byte + 1])
            await asyncio.sleep(0.05)
        await until(lambda: bool(got), 5)
        assert got == [messages.Pull(clock=7)] and srv.stats["read_timeouts"] == 0
        await ch.close()


async def test_heartbeat_seq_and_evaluator_address_are_not_checked(tmp_path: Path) -> None:
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=1, mode="asp")
    port = await srv.start()
    ev = await transport.connect("127.0.0.1", port, role="evaluator", address="anything:1",
                                 token=TOKEN)
    try:
        for seq in (5, 5, 0):  # repeated and going back
            await ev.send(control.Heartbeat(seq=seq))
        await ev.send(messages.Pull(clock=0))
        assert (await recv_as(ev, messages.GlobalWeights, 5)).info["size"] == 3
        assert not srv.rejected and srv.server is not None
        assert srv.server.stats["protocol_errors"] == 0
    finally:
        await ev.close()
        await srv.close()


def test_section_3_lists_every_kind_with_every_key_of_its_map() -> None:
    """Each row of section 3's table names its kind's number and name and every key of its map
    (``kinds.meta_keys``), so a client written from the page sends and checks whole maps."""
    doc = (Path(__file__).parent.parent / "docs" / "protocol.md").read_text()
    rows = {int(m[1]): (m[2], m[3]) for m in
            re.finditer(r"^\| *(\d+) *\| *([A-Z_]+) *\|[^|]*\|([^\n]*)$", doc, re.M)}
    assert set(rows) == {int(k) for k in messages.Kind}
    for kind in messages.Kind:
        name, text = rows[int(kind)]
        assert name == kind.name
        keys = set(re.findall(r"`([a-z_]+)`", text))
        missing = set(kinds.meta_keys(kind)) - keys
        assert not missing, f"{kind.name}: {sorted(missing)} not in docs/protocol.md section 3"


# -- every numeric bound of the code's validators is on the page ----------------------------------

DOCS = Path(__file__).parent.parent / "docs"
# modules whose named limits a peer runs into: the wire, the connection, the servers' checks
LIMIT_MODULES = (messages, control, fields, frames, checks, handshake, conversation, channel,
                 sessions, global_core)
# ... and those whose range checks (calls and comparisons) are read from their source
CHECK_SOURCES = (messages, control, fields, conversation, sessions, global_core)
LIMIT_NAME = re.compile(r"(^|_)(MAX|MIN)(_|$)|_TIMEOUT_S$")  # MAX_SEQ, LZ4_MIN_BYTES, ...
RANGE_CHECKS = {"_number", "integer", "number", "ints", "text", "blob"}  # their args are bounds


def _add(bounds: dict[float, set[str]], value: object, where: str) -> None:
    """Record ``value`` (a number, a tuple of them or a ``checks.Limits``) as a bound."""
    if isinstance(value, checks.Limits):
        for f in dataclasses.fields(value):
            _add(bounds, getattr(value, f.name), f"{where}.{f.name}")
    elif isinstance(value, tuple):
        for v in value:
            _add(bounds, v, where)
    elif (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value)):
        bounds.setdefault(abs(value), set()).add(where)


def _constant(node: ast.expr, namespace: dict[str, object]) -> object:
    """The value of ``node`` when it is a constant expression of numbers and the module's named
    numbers (``1 << 62``, ``-1e30``, ``MAX_STEP_S``, ``fields.MAX_TEXT``), else None."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) or (isinstance(sub, ast.Constant)
                                         and not isinstance(sub.value, (int, float))):
            return None
        if isinstance(sub, ast.Name) and not isinstance(namespace.get(sub.id),
                                                        (int, float, types.ModuleType)):
            return None
    try:
        value = eval(compile(ast.Expression(node), "<bound>", "eval"), dict(namespace))
    except Exception:
        return None
    return value if isinstance(value, (int, float)) else None


def code_bounds() -> dict[float, set[str]]:
    """Every number a validator checks against, by its magnitude, with where it comes from: the
    named limits (``MAX_*``, ``*_MIN_*``, ``*_TIMEOUT_S``, ``checks.Limits`` values) of
    ``LIMIT_MODULES``, the bounds every message field's check was built with (read from the
    check's closure), and the constant arguments of the range checks and comparisons in
    ``CHECK_SOURCES``."""
    bounds: dict[float, set[str]] = {}
    for mod in LIMIT_MODULES:
        for name, value in vars(mod).items():
            if LIMIT_NAME.search(name) or isinstance(value, checks.Limits):
                _add(bounds, value, f"{mod.__name__}.{name}")
    for cls in kinds.MESSAGE_TYPES.values():
        for f in dataclasses.fields(cls):
            check = f.metadata["check"]
            for var, cell in zip(check.__code__.co_freevars, check.__closure__ or (), strict=True):
                _add(bounds, cell.cell_contents, f"{cls.__name__}.{f.name} ({var})")
    for mod in CHECK_SOURCES:
        namespace = vars(mod)
        for node in ast.walk(ast.parse(inspect.getsource(mod))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in RANGE_CHECKS:
                args: list[ast.expr] = node.args
            elif isinstance(node, ast.Compare):
                args = [node.left, *node.comparators]
            else:
                continue
            for arg in args:
                value = _constant(arg, namespace)
                if value is not None:
                    _add(bounds, value, f"{mod.__name__}, line {arg.lineno}")
    return bounds


def spellings(value: float) -> list[str]:
    """Regular expressions for the ways the page may write ``value``: 1048576, 1,048,576,
    2^20 (or 2**20, 1 << 20), 1 MiB; 2^53-1; 100000, 1e5, 10^5; 1e-9."""
    out: list[str] = []
    exact = isinstance(value, int) or (value.is_integer() and abs(value) < 2**53)
    if exact:
        n = int(value)
        out += [re.escape(str(n)), re.escape(f"{n:,}")]
        if n >= 2 and n & (n - 1) == 0:  # a power of two
            k = n.bit_length() - 1
            out += [rf"2\s*\^\s*{k}", rf"2\*\*{k}", rf"1\s*<<\s*{k}"]
        if n >= 3 and n & (n + 1) == 0:  # one less than a power of two
            k = n.bit_length()
            out += [rf"2\s*\^\s*{k}\s*[-−]\s*1", rf"2\*\*{k}\s*-\s*1", rf"\(1\s*<<\s*{k}\)\s*-\s*1"]
        for shift, unit in ((10, "KiB"), (20, "MiB"), (30, "GiB"), (40, "TiB")):
            if n >= 1 << shift and n % (1 << shift) == 0:
                out.append(rf"{n >> shift}\s*{unit}")
    elif value < 1:
        out += [re.escape(repr(float(value))), re.escape(f"{value:g}")]
    if value > 0:
        k = round(math.log10(value))
        if abs(k) >= 3 and float(10.0**k) == float(value):  # 1e5, 1e30, 1e-9
            out += [rf"1e\+?0*{k}" if k > 0 else rf"1e-0*{-k}", rf"10\s*\^\s*{k}"]
    return out


_BEFORE = r"(?<![\w^*<])(?<!<<\s)(?<!\d\.)(?<!\d,)"  # not inside another number or 2^k, 1 << k
_AFTER = r"(?!\w|[.,]\d|\s*[-−+]\s*\d|\s*(?:<<|\^|\*\*))"  # nor followed by more of one
_UNIT = r"(?!\s*[KMGT]i?B\b)"  # a bare 16 is not "16 KiB"


def mentioned(text: str, value: float) -> bool:
    """Whether ``text`` writes the number ``value`` (or its negative) as a number of its own."""
    for spelling in spellings(value):
        unit = "" if re.search(r"[KMGT]iB$", spelling) else _UNIT
        if re.search(_BEFORE + spelling + _AFTER + unit, text):
            return True
    return False


def test_the_number_matcher_finds_a_bound_in_any_spelling_and_only_that_bound() -> None:
    for text in ("at most 2^20 samples", "1,048,576", "1048576 bytes", "1 MiB", "(1 << 20)",
                 "0..2^20", "2**20"):
        assert mentioned(text, 1 << 20), text
    for text in ("2^200", "2^20-1", "2^20 - 1", "10485760", "2^2", "11 MiB",
                 "1.048576", "21,048,576", "2^20.5"):
        assert not mentioned(text, 1 << 20), text
    assert mentioned("0..2^53-1", (1 << 53) - 1) and not mentioned("0..2^53", (1 << 53) - 1)
    assert mentioned("[-1e30, 1e30]", 1e30) and not mentioned("1e300", 1e30)
    assert mentioned("[0, 1e5] seconds", 1e5) and mentioned("100,000 s", 1e5)
    assert mentioned("[1e-9, 1]", 1e-9) and not mentioned("1e-90", 1e-9)
    assert mentioned("16 KiB", 16 << 10) and not mentioned("16 KiB", 16)
    assert mentioned("at most 64 names", 64) and not mentioned("64 KiB", 64)
    assert not mentioned("4096", 4095) and not mentioned("section 64.5", 64)


def test_the_bound_scan_finds_the_named_limits_the_field_checks_and_the_range_checks() -> None:
    bounds = code_bounds()
    assert {conversation.MAX_SAMPLES, conversation.MAX_STEP_S, messages.MAX_SEQ, messages.MAX_COUNT,
            checks.MAX_FRAME_BYTES, checks.Limits().max_array_len,
            handshake.HANDSHAKE_FRAME_BYTES, channel.READ_TIMEOUT_S} <= set(bounds)
    assert any("Exchange.loss" in w for w in bounds[1e30])  # a field check's closure
    assert any("conversation, line" in w for w in bounds[1e30])  # check_push's range of loss
    assert any("conversation, line" in w for w in bounds[1e-9])  # check_stats's step time


def documented(value: float, where: set[str], protocol: str, operations: str) -> bool:
    """On docs/protocol.md; or a server's own budget that the page names (by its constant) and
    leaves the figure of to docs/operations.md."""
    if mentioned(protocol, value):
        return True
    names = {w.rsplit(".", 1)[-1] for w in where if "." in w and " " not in w}
    return any(f"`{n}`" in protocol for n in names) and mentioned(operations, value)


def test_every_numeric_bound_in_the_validators_is_in_the_protocol_document() -> None:
    """A client written from docs/protocol.md alone must know every number a server checks:
    each bound the code's validators use (``code_bounds``) is written on the page, in any
    common spelling (``mentioned``)."""
    protocol = (DOCS / "protocol.md").read_text()
    operations = (DOCS / "operations.md").read_text()
    missing = {value: sorted(where) for value, where in sorted(code_bounds().items())
               if not documented(value, where, protocol, operations)}
    assert not missing, f"bounds not in docs/protocol.md: {missing}"


def test_the_model_table_on_the_page_is_the_code_s() -> None:
    """Section 9's model table (where a client learns ``n``) is ``config.PARAM_COUNTS``."""
    protocol = (DOCS / "protocol.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([\d,]+) \|$", protocol, re.M))
    assert {k: int(v.replace(",", "")) for k, v in rows.items()} == config.PARAM_COUNTS


def test_the_handshake_back_off_starts_after_the_failure_the_documents_name() -> None:
    """A source may fail ``free_failures`` (3) handshakes at no cost; the next failure (the 4th)
    starts its back-off of ``backoff_first_s``, as both documents say."""
    limits, g = guard.GuardLimits(), guard.Guard()
    waits = [g.failed("10.0.0.1", now=0.0) for _ in range(limits.free_failures + 2)]
    assert waits == [0.0] * limits.free_failures + [limits.backoff_first_s,
                                                    2 * limits.backoff_first_s]
    nth = {3: "3rd", 4: "4th", 5: "5th"}[limits.free_failures + 1]
    for doc in ("protocol.md", "operations.md"):
        text = (DOCS / doc).read_text()
        assert re.search(rf"after the {nth} fail", text, re.I), doc


def test_the_page_gives_one_version_byte_the_code_s() -> None:
    """The title, section 1.1's prefix table, section 5's diagram and text and section 7's bytes
    all name ``messages.PROTOCOL_VERSION`` (they said 2 and 3 once)."""
    protocol = (DOCS / "protocol.md").read_text()
    said = [int(v) for v in re.findall(
        r"wire protocol \(version (\d+)\)|protocol version, `(\d+)`|version byte != (\d+)"
        r"|must carry version (\d+)|\| `04` \| `0(\d)` \| version (\d+)", protocol) for v in v if v]
    assert len(said) >= 6 and set(said) == {messages.PROTOCOL_VERSION}, said
