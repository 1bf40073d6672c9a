"""Checks the servers apply to message fields beyond the wire schema, and how a violation ends.

The protocol modules already check framing, types, lengths, limits and which message kinds a
connection state allows; ``sparse.decode_vector`` checks encodings, sizes, index bounds and
NaN/inf; a group's EXCHANGE counters are typed fields, checked by the message
(messages.py). What is left is meaning that only a server knows: ranges of counters and
times, clocks that go backwards, messages a role may not send in a session, what a group
process's HELLO says its workers dial. A violation raises ``RemoteProtocolError`` (``OrderError``
for a message before the one it must follow); ``reject`` then answers ERROR with the reason
(code ``invalid``, ``clock`` or ``order``), logs (as counts) and counts it, and the caller
closes that one connection (``replace`` ends a session that a new connection with the same
worker id takes over, with ERROR ``replaced``). The model is never touched by a rejected
message: every check runs before anything is applied.
"""

from __future__ import annotations

import collections
import logging
import math
from typing import Any

from minips.core import ssp
from minips.errors import AuthError, RemoteProtocolError
from minips.net.channel import Channel
from minips.net.endpoints import WILDCARD_HOSTS
from minips.net.transport import CountingLog
from minips.wire import messages

__all__ = ["MAX_SAMPLES", "MAX_STEP_S", "MAX_EXCHANGE_COUNT", "REPLACED", "OrderError",
           "check_push", "check_push_order", "check_stats", "check_exchange",
           "check_group_address", "replace", "unexpected", "reject"]

log = logging.getLogger("minips.server")
_counted = CountingLog(log)  # one line per kind and period, with counts: a flood is a few lines

MAX_SAMPLES = 1 << 20  # samples one push may claim (a batch); more is a broken or hostile peer
MAX_STEP_S = 1e5  # seconds one step may claim to take (a day); beyond that it is garbage
# samples (or pushes) one EXCHANGE may claim: a group's pushes since its last exchange, 2^20
# samples each at most; 2^40 is a million full pushes, and 2^22 exchanges of it still fit in the
# run's counters (messages.MAX_COUNT, 2^62), which GlobalCore bounds cumulatively
MAX_EXCHANGE_COUNT = 1 << 40
REPLACED = "replaced"  # ERROR code: another connection with the same worker id took over


def _number(name: str, value: Any, lo: float, hi: float) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not lo <= value <= hi:
        raise RemoteProtocolError(f"{name} out of range", expected=f"[{lo}, {hi}]", got=value)


class OrderError(RemoteProtocolError):
    """A message before the one it must follow (an EXCHANGE before its connection's first
    PULL): ERROR ``order``."""


def check_push(msg: messages.Push) -> None:
    """A worker's PUSH counters: samples, step time, loss (the gradient is checked on decode)."""
    _number("samples", msg.samples, 0, MAX_SAMPLES)
    _number("step_time", msg.step_time, 0.0, MAX_STEP_S)
    _number("loss", msg.loss, -1e30, 1e30)


def check_push_order(pulled: int | None, clock: int) -> None:
    """A worker's PUSH follows its PULL (clock ``pulled``) and carries the next clock."""
    if pulled is None or clock != pulled + 1:
        raise RemoteProtocolError("PUSH must follow a PULL at the clock before it",
                                  expected=None if pulled is None else pulled + 1, got=clock)


def check_stats(msg: messages.Stats) -> None:
    """A worker's STATS: a positive finite step time, a sample count and, in ``data``, at most
    the keys of ``messages.DATA_KEYS`` with their types (on the wire ``data`` is any map: its
    keys are the server's to check, answered ``invalid``). Its clock is not compared with the
    last one: it counts steps in the worker's current group, and starts again when the worker
    moves to another group or its group server restarts."""
    _number("step_time", msg.step_time, 1e-9, MAX_STEP_S)
    _number("samples", msg.samples, 0, 1 << 62)
    try:
        messages.data_origin(msg.data)
    except messages.Invalid as e:
        raise RemoteProtocolError(f"STATS data: {e}", expected=str(e),
                                  got=repr(msg.data)[:200]) from None


def check_exchange(msg: messages.Exchange) -> None:
    """A group process's EXCHANGE counters per message: ``samples`` and ``pushes`` at most
    ``MAX_EXCHANGE_COUNT`` (the run's sums are bounded by ``GlobalCore.merge``); its answered
    PULLs, one entry per PULL in each of the three lists (equal lengths)."""
    _number("samples", msg.samples, 0, MAX_EXCHANGE_COUNT)
    _number("pushes", msg.pushes, 0, MAX_EXCHANGE_COUNT)
    n = len(msg.pull_workers)
    if not len(msg.pull_leads) == len(msg.pull_waits_us) == n:
        raise RemoteProtocolError("EXCHANGE's pull_* lists differ in length",
                                  expected=f"{n} entries each",
                                  got=[n, len(msg.pull_leads), len(msg.pull_waits_us)])


def check_group_address(address: str) -> None:
    """A group process's HELLO ``address``, where its workers are to connect: HOST:PORT, port
    1..65535 (a wildcard host is replaced later by the host it connects from:
    ``sessions.group_address``). ``AuthError`` (REFUSE ``refused``) naming the field."""
    host, sep, port = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    bare = host.removeprefix("[").removesuffix("]") if bracketed else host
    ok = (sep and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535 and bare
          and not any(c.isspace() for c in bare)
          and (bracketed or ":" not in host or host in WILDCARD_HOSTS))  # IPv6 in brackets
    if not ok:
        raise AuthError(f"HELLO address {address!r} of a group server must be HOST:PORT (port "
                        "1..65535), the address its workers connect to (minips group --listen "
                        "/ --advertise)")


async def replace(old: Channel, w: int, counts: collections.Counter[str], where: str) -> None:
    """A new connection with worker id ``w`` takes the session over: the old one is told why
    (ERROR ``replaced``) and closed. A worker that gets it stops rather than reconnecting, so two
    processes started with one id do not evict each other without end."""
    counts[REPLACED] += 1
    log.warning("%s: worker %d connected again; its connection from %s is replaced", where, w,
                old.peername)
    await old.send_error(REPLACED, f"another connection with worker id {w} took this session "
                         "over (is a second worker running with this id?)")
    await old.close()


def unexpected(msg: messages.Message, role: str) -> RemoteProtocolError:
    """The error for a message kind this role may not send here."""
    return RemoteProtocolError(f"{type(msg).__name__.upper()} not allowed from a {role} here",
                               got=type(msg).__name__)


async def reject(ch: Channel, exc: Exception, counts: collections.Counter[str], where: str) -> None:
    """Tell the peer why (ERROR), log and count it; the caller then closes the connection."""
    code = getattr(exc, "code", "") or ("clock" if isinstance(exc, ssp.ClockError)
                                        else "order" if isinstance(exc, OrderError) else "invalid")
    counts[code] += 1
    _counted.note(f"{where}: rejected", f"{ch.peername}: {exc} (expected "
                  f"{getattr(exc, 'expected', None)}, got {getattr(exc, 'got', None)!r})")
    await ch.send_error(code, str(exc))

