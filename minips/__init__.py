"""minips: a minimal, real parameter server for heterogeneous clusters.

Modes BSP / SSP / ASP / GSSP, gradient compression (Top-K, DGC, GDTopK, LossComp), asyncio and
plain TCP. The servers need numpy only; workers use PyTorch. See README.md and docs/.
"""

from minips.errors import (
    AuthError,
    ConfigError,
    DataError,
    LocalProtocolError,
    MiniPSError,
    ProtocolError,
    RemoteProtocolError,
)

__all__ = [
    "MiniPSError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "AuthError",
    "ConfigError",
    "DataError",
    "__version__",
]

__version__ = "0.1.0"
