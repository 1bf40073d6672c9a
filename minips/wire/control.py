"""The handshake and control messages, sans-IO: how a peer opens a session and what it says
beside the training step.

The handshake (``handshake.py`` runs it): HELLO (the peer's role and nonce), CHALLENGE (the
server's nonce), AUTH (the HMAC of both), WELCOME (the peer's id, the server's HMAC and the run's
configuration) or REFUSE (a code and a readable reason). After it: ASSIGN (which group a worker
trains in, at what ratio and staleness), STATS (a worker's clock, step time and loss on its
control channel), an evaluator's SCORE, HEARTBEAT, LEAVE and ERROR. Each is a frozen dataclass
of ``messages.py``'s ``Message`` whose fields carry their checks (``fields.py``);
docs/protocol.md, sections 3 and 4, lists every field, and ``kinds.py`` is the table of every kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minips.wire.fields import (
    MAX_NAME,
    MAX_TEXT,
    Invalid,
    blob,
    boolean,
    checked,
    integer,
    mapping,
    names,
    number,
    text,
)
from minips.wire.messages import PROTOCOL_VERSION, Kind, Message

__all__ = [
    "NONCE_BYTES",
    "MAC_BYTES",
    "ROLES",
    "Hello",
    "Challenge",
    "Auth",
    "Score",
    "Welcome",
    "Refuse",
    "Assign",
    "Stats",
    "DATA_KEYS",
    "data_origin",
    "Heartbeat",
    "Leave",
    "Error",
]


NONCE_BYTES = 32  # fresh random bytes per handshake side, so a recorded handshake cannot replay
MAC_BYTES = 32  # HMAC-SHA256 digest
ROLES = ("worker", "group", "evaluator")


@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    """Client opens a session. ``version`` travels in the frame prefix, not in the map."""

    KIND = Kind.HELLO
    NOT_IN_META = ("version",)
    version: int = checked(integer(0, 255), PROTOCOL_VERSION)
    role: str = checked(text(MAX_NAME, ROLES), "worker")
    worker_id: int = checked(integer(-1), -1)  # -1: let the server choose
    nonce: bytes = checked(blob(NONCE_BYTES))
    capabilities: tuple[str, ...] = checked(names, ())
    address: str = checked(text(MAX_TEXT), "")  # "host:port" a group server accepts workers on
    group: int = checked(integer(-1), -1)  # -1: none


@dataclass(frozen=True, kw_only=True)
class Challenge(Message):
    KIND = Kind.CHALLENGE
    nonce: bytes = checked(blob(NONCE_BYTES))


@dataclass(frozen=True, kw_only=True)
class Auth(Message):
    KIND = Kind.AUTH
    mac: bytes = checked(blob(0, MAC_BYTES))  # empty: the client has no secret


@dataclass(frozen=True, kw_only=True)
class Welcome(Message):
    KIND = Kind.WELCOME
    worker_id: int = checked(integer(-1))
    mac: bytes = checked(blob(0, MAC_BYTES))  # empty only from a server without a secret
    info: dict[str, Any] = checked(mapping, factory=dict)


@dataclass(frozen=True, kw_only=True)
class Refuse(Message):
    KIND = Kind.REFUSE
    code: str = checked(text(MAX_NAME))
    reason: str = checked(text(MAX_TEXT))


@dataclass(frozen=True, kw_only=True)
class Assign(Message):
    KIND = Kind.ASSIGN
    group: int = checked(integer())
    address: str = checked(text(MAX_TEXT))
    ratio: float = checked(number(0.0, 1.0))
    staleness: int = checked(integer(-1))  # -1: no bound (ASP)
    local_steps: int = checked(integer(0), 0)  # the group's H (local steps); 0: the run's


@dataclass(frozen=True, kw_only=True)
class Stats(Message):
    KIND = Kind.STATS
    MAY_OMIT = ("data",)  # only a worker's first STATS says where its data came from
    clock: int = checked(integer())
    step_time: float = checked(number(0.0))  # seconds per step
    loss: float = checked(number())
    samples: int = checked(integer(), 0)
    # its training data (data_origin's keys; a server checks them: conversation.check_stats)
    data: dict[str, Any] = checked(mapping, factory=dict)


DATA_KEYS = {"dataset": str, "split": str, "synthetic": bool, "source": str, "reason": str}


def data_origin(v: Any) -> dict[str, Any]:
    """Where a worker's training data came from (STATS ``data``): a map of at most the keys
    of ``DATA_KEYS``, each of its type (strings of <= MAX_TEXT chars); empty: not said. Not a
    field check: on the wire ``data`` is a ``mapping``, and a server applies this one to it
    (``conversation.check_stats``: ERROR ``invalid``, protocol.md section 9)."""
    if not isinstance(v, dict) or any(
            k not in DATA_KEYS or type(x) is not DATA_KEYS[k]
            or (type(x) is str and len(x) > MAX_TEXT) for k, x in v.items()):
        raise Invalid(f"expected a map of {', '.join(DATA_KEYS)} (str, synthetic: bool)")
    return v


@dataclass(frozen=True, kw_only=True)
class Score(Message):
    """An evaluator's score of the global weights at ``version``, to the global server (sent
    only when its WELCOME's info says ``scores``: an older server does not know the kind)."""
    KIND = Kind.SCORE
    version: int = checked(integer())  # the GLOBAL_WEIGHTS version scored
    accuracy: float = checked(number(0.0, 1.0))  # share of the test samples right
    loss: float = checked(number())  # mean test loss
    tested: int = checked(integer(), 0)  # test samples scored
    final: bool = checked(boolean, False)  # the run's final weights


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    KIND = Kind.HEARTBEAT
    seq: int = checked(integer(), 0)


@dataclass(frozen=True, kw_only=True)
class Leave(Message):
    KIND = Kind.LEAVE
    reason: str = checked(text(MAX_TEXT), "")  # "done" from a server: training is over


@dataclass(frozen=True, kw_only=True)
class Error(Message):
    KIND = Kind.ERROR
    code: str = checked(text(MAX_NAME))
    reason: str = checked(text(MAX_TEXT))
