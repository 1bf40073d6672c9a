"""minips connection state and handshake, sans-IO: which message may pass when, and the HMAC
challenge-response that opens a session. No networking code, no clocks.

Invariants:
- Both sides of a connection track the same ``State``; ``STATE_TRANSITIONS`` lists every
  allowed (sender, state, kind). Sending a message out of turn raises ``LocalProtocolError``,
  receiving one raises ``RemoteProtocolError``; after REFUSE or ERROR nothing more passes. OPEN
  lets every data message pass in its direction; the order they come in after it, per role (a
  PUSH follows its PULL, ...), is the conversation's table (conversation.py).
- The shared secret never crosses the wire: each side proves it with HMAC-SHA256 over a
  transcript that includes both sides' fresh nonces, so a recorded handshake cannot be replayed
  (docs/protocol.md, section 5). MACs are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from enum import IntEnum
from typing import Any

from minips.errors import AuthError, LocalProtocolError, RemoteProtocolError
from minips.wire.checks import DEFAULT_LIMITS, Limits
from minips.wire.control import NONCE_BYTES, Auth, Challenge, Error, Hello, Refuse, Welcome
from minips.wire.frames import SCRATCH_BYTES, Alloc, FrameDecoder, encode
from minips.wire.messages import PROTOCOL_VERSION, Kind, Message

__all__ = [
    "HANDSHAKE_FRAME_BYTES", "HANDSHAKE_SCRATCH_BYTES", "HANDSHAKE_LIMITS",
    "Side", "State", "STATE_TRANSITIONS", "Connection", "CLIENT_LABEL", "SERVER_LABEL",
    "new_nonce", "make_mac", "ClientHandshake", "ServerHandshake",
]


# ---------------------------------------------------------------------------------------------
# Connection state

# What a server accepts from a peer that has not authenticated yet: HELLO and AUTH are a few
# hundred bytes (a HELLO with a 4096-character ASCII address still fits), so nobody can make a
# server hold more than this per connection before proving the secret.
HANDSHAKE_FRAME_BYTES = 16 << 10  # bytes per frame before WELCOME
HANDSHAKE_SCRATCH_BYTES = 4 << 10  # receive buffer before WELCOME; grows to a frame's size
HANDSHAKE_LIMITS = Limits(max_frame_bytes=HANDSHAKE_FRAME_BYTES,
                          max_meta_bytes=HANDSHAKE_FRAME_BYTES, max_buffers=0, max_raw_bytes=0)


# IntEnum rather than Enum: Enum hashes in Python, and STATE_TRANSITIONS is looked up per
# message.
class Side(IntEnum):
    CLIENT = 0  # opened the TCP connection
    SERVER = 1  # accepted it


class State(IntEnum):
    START = 0  # nothing has passed yet; the client owes HELLO
    HELLO = 1  # HELLO passed; the server owes CHALLENGE (or REFUSE)
    CHALLENGE = 2  # CHALLENGE passed; the client owes AUTH
    AUTH = 3  # AUTH passed; the server owes WELCOME (or REFUSE)
    OPEN = 4  # handshake done; data messages flow, each in its direction
    CLOSED = 5  # REFUSE or ERROR passed; nothing more may be sent or received


_C, _S = Side.CLIENT, Side.SERVER
# (sender, state, kind) -> next state. ERROR is allowed from either side in any state but CLOSED.
STATE_TRANSITIONS: dict[tuple[Side, State, Kind], State] = {
    (_C, State.START, Kind.HELLO): State.HELLO,
    (_S, State.HELLO, Kind.CHALLENGE): State.CHALLENGE,
    (_S, State.HELLO, Kind.REFUSE): State.CLOSED,
    (_C, State.CHALLENGE, Kind.AUTH): State.AUTH,
    (_S, State.AUTH, Kind.WELCOME): State.OPEN,
    (_S, State.AUTH, Kind.REFUSE): State.CLOSED,
    **{(_C, State.OPEN, k): State.OPEN for k in (Kind.STATS, Kind.PUSH, Kind.PULL,
                                                  Kind.EXCHANGE, Kind.INIT_WEIGHTS, Kind.SCORE)},
    **{(_S, State.OPEN, k): State.OPEN for k in (Kind.ASSIGN, Kind.ACK, Kind.WEIGHTS,
                                                  Kind.EXCHANGE_REPLY, Kind.GLOBAL_WEIGHTS)},
    **{(s, State.OPEN, k): State.OPEN for s in Side for k in (Kind.HEARTBEAT, Kind.LEAVE)},
    **{(s, st, Kind.ERROR): State.CLOSED for s in Side for st in State if st != State.CLOSED},
}


class Connection:
    """One side of a connection: checks every message sent or received against
    ``STATE_TRANSITIONS``.

    Our own out-of-order message raises ``LocalProtocolError``; the peer's raises
    ``RemoteProtocolError``. ``decoder`` is exposed for the zero-copy receive path. On the
    server side the decoder accepts only ``HANDSHAKE_LIMITS`` until WELCOME is sent, then
    ``limits``.
    """

    def __init__(self, side: Side, *, alloc: Alloc | None = None,
                 limits: Limits = DEFAULT_LIMITS) -> None:
        self.side = side
        self.peer = _S if side == _C else _C
        self.state = State.START
        self.limits = limits
        if side == _S:
            self.decoder = FrameDecoder(alloc=alloc, limits=HANDSHAKE_LIMITS,
                                        scratch=HANDSHAKE_SCRATCH_BYTES)
        else:
            self.decoder = FrameDecoder(alloc=alloc, limits=limits)

    @property
    def closed(self) -> bool:
        """True once an ERROR or LEAVE ended the connection: nothing more may be sent."""
        return self.state == State.CLOSED

    def set_limits(self, limits: Limits) -> None:
        """Accept frames up to ``limits`` from now on (a server that learned the model's size
        narrows them, ``Limits.sized_for``); a server connection still in its handshake keeps
        the handshake's limits and takes these at WELCOME."""
        self.limits = limits
        if self.decoder.limits is not HANDSHAKE_LIMITS:
            self.decoder.limits = limits

    def send(self, msg: Message, *, compress: bool = False) -> list[Any]:
        """Check that we may send ``msg`` now, advance the state, return its frame buffers."""
        self._advance(self.side, msg.KIND)
        return encode(msg, compress=compress, limits=self.limits)

    def receive(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Feed bytes from the peer; return the messages they complete, state-checked."""
        return self.received(self.decoder.feed(data))

    def received(self, msgs: list[Message]) -> list[Message]:
        """State-check messages the decoder produced (zero-copy path); return them."""
        for msg in msgs:
            self._advance(self.peer, msg.KIND)
        return msgs

    def received_one(self, msg: Message) -> None:
        """State-check one message from the peer (``RemoteProtocolError`` when out of turn)."""
        self._advance(self.peer, msg.KIND)

    def _advance(self, sender: Side, kind: Kind) -> None:
        """Move to the state ``STATE_TRANSITIONS`` gives, or raise saying what was allowed."""
        nxt = STATE_TRANSITIONS.get((sender, self.state, kind))
        if nxt is None:
            allowed = sorted(k.name for (s, st, k) in STATE_TRANSITIONS
                             if s == sender and st == self.state)
            err = LocalProtocolError if sender == self.side else RemoteProtocolError
            raise err(f"{sender.name.lower()} may not send {kind.name} in state "
                      f"{self.state.name}",
                      expected=allowed, got=kind.name)
        if nxt != self.state and nxt == State.OPEN:  # authenticated: full-size frames from now
            self.decoder.widen(self.limits, SCRATCH_BYTES)
        self.state = nxt


# ---------------------------------------------------------------------------------------------
# Handshake: HELLO -> CHALLENGE -> AUTH -> WELCOME | REFUSE, HMAC-SHA256 over the transcript.

CLIENT_LABEL = b"minips-client-v1\x00"
SERVER_LABEL = b"minips-server-v1\x00"


def new_nonce() -> bytes:
    """32 fresh random bytes (a replayed handshake fails because the other side's nonce changed)."""
    return secrets.token_bytes(NONCE_BYTES)


def _key(token: str | bytes | None) -> bytes | None:
    if token is None or token in ("", b""):
        return None
    return token.encode() if isinstance(token, str) else bytes(token)


def make_mac(token: str | bytes, label: bytes, hello: Hello, server_nonce: bytes) -> bytes:
    """HMAC-SHA256(token, label | version u8 | len(role) u8 | role | worker_id i64 LE
    | client nonce | server nonce). The secret itself never crosses the wire."""
    role = hello.role.encode()
    transcript = b"".join([label, bytes([hello.version, len(role)]), role,
                           struct.pack("<q", hello.worker_id), hello.nonce, server_nonce])
    key = _key(token)
    if key is None:
        raise LocalProtocolError("make_mac needs a non-empty token")
    return hmac.new(key, transcript, hashlib.sha256).digest()


class ClientHandshake:
    """The client's half: build HELLO, answer CHALLENGE with AUTH, verify WELCOME's MAC."""

    def __init__(self, token: str | bytes | None, *, nonce: bytes | None = None, **hello: Any):
        self.token = _key(token)
        self.hello = Hello(nonce=nonce or new_nonce(), **hello)
        self._server_nonce = b""

    def on_challenge(self, ch: Challenge) -> Auth:
        self._server_nonce = ch.nonce
        if self.token is None:
            return Auth(mac=b"")
        return Auth(mac=make_mac(self.token, CLIENT_LABEL, self.hello, ch.nonce))

    def on_reply(self, msg: Message) -> Welcome:
        """WELCOME -> itself (after checking the server's MAC); REFUSE or ERROR -> AuthError."""
        if isinstance(msg, (Refuse, Error)):
            # the generic code "refused" would only repeat the word: the reason says why
            code = "" if msg.code == "refused" else f" ({msg.code})"
            raise AuthError(f"refused by server{code}: {msg.reason}")
        if not isinstance(msg, Welcome):
            raise RemoteProtocolError("expected WELCOME or REFUSE", expected="WELCOME",
                                      got=msg.KIND.name)
        if self.token is not None:
            want = make_mac(self.token, SERVER_LABEL, self.hello, self._server_nonce)
            if not hmac.compare_digest(msg.mac, want):
                raise AuthError("the server failed to prove the shared secret (wrong token?)")
        return msg


class ServerHandshake:
    """The server's half: check HELLO's version, send CHALLENGE, check AUTH, build WELCOME."""

    def __init__(self, token: str | bytes | None, *, nonce: bytes | None = None) -> None:
        self.token = _key(token)
        self.nonce = nonce or new_nonce()
        self.hello: Hello | None = None

    def on_hello(self, hello: Hello) -> Challenge | Refuse:
        self.hello = hello
        if hello.version != PROTOCOL_VERSION:
            return Refuse(code="version", reason=f"protocol version mismatch: server speaks "
                          f"{PROTOCOL_VERSION}, client sent {hello.version}")
        return Challenge(nonce=self.nonce)

    def on_auth(self, auth: Auth) -> Refuse | None:
        """None when the client proved the secret (or the server has none)."""
        if self.token is None:
            return None
        if not auth.mac:
            return Refuse(code="auth", reason="missing token: this server requires a shared "
                          "secret (set MINIPS_TOKEN)")
        assert self.hello is not None
        want = make_mac(self.token, CLIENT_LABEL, self.hello, self.nonce)
        if not hmac.compare_digest(auth.mac, want):
            return Refuse(code="auth", reason="wrong token: HMAC check failed")
        return None

    def welcome(self, worker_id: int, info: dict[str, Any]) -> Welcome:
        assert self.hello is not None
        if self.token is None:
            return Welcome(worker_id=worker_id, mac=b"", info=info)
        mac = make_mac(self.token, SERVER_LABEL, self.hello, self.nonce)
        return Welcome(worker_id=worker_id, mac=mac, info=info)
