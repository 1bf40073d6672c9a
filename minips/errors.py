"""Exception classes shared by every minips module.

One base class, ``MiniPSError``. Protocol errors are split as in h11: a *local* error means we
(or the code calling us) misused the protocol; a *remote* error means the peer sent something
invalid. A remote error closes that one connection and is counted; it never stops a server.
Exceptions carry data (``expected``/``got``) and subclass the builtin they resemble.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "MiniPSError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "LimitExceeded",
    "AuthError",
    "ConfigError",
    "DataError",
]


class MiniPSError(Exception):
    """Base class of every error minips raises on purpose."""


class ProtocolError(MiniPSError, ValueError):
    """A frame or message broke the wire protocol.

    ``expected`` and ``got`` describe the violation when that helps a reader of the log.
    """

    def __init__(self, msg: str, *, expected: Any = None, got: Any = None) -> None:
        super().__init__(msg)
        self.expected = expected
        self.got = got


class LocalProtocolError(ProtocolError):
    """We tried to send or do something the protocol forbids (a bug on our side)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes or a message that is invalid; close that connection."""


class LimitExceeded(RemoteProtocolError):
    """A length or size from the peer is over one of the protocol's named limits."""


class AuthError(MiniPSError, PermissionError):
    """The handshake was refused: wrong protocol version, wrong or missing secret, ...

    ``reason`` is the human-readable text the refusing side sent or logged.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ConfigError(MiniPSError, ValueError):
    """A configuration value is invalid (bad flag, checkpoint from another config, ...)."""


class DataError(MiniPSError, ValueError):
    """A data file is missing, truncated or corrupt; the message names the file."""
