"""minips: a minimal, real parameter server for heterogeneous clusters.

Modes BSP / SSP / ASP / GSSP, gradient compression (Top-K, DGC, GDTopK, LossComp), asyncio and
plain TCP. The servers need numpy only; workers use PyTorch. See README.md and docs/.

The public API is the names in ``__all__``. They are loaded on first use (PEP 562), so
``import minips`` stays light and the server-side names never import torch; only ``Worker``,
``run_worker`` and ``train_reference`` do. docs/architecture.md says which module holds each.
"""

from __future__ import annotations

import importlib
from typing import Any

from minips.errors import (
    AuthError,
    ConfigError,
    DataError,
    LocalProtocolError,
    MiniPSError,
    ProtocolError,
    RemoteProtocolError,
)

__version__ = "0.1.0"

# name -> module that defines it; read by __getattr__ below.
_LAZY = {
    # configuration of a run and of each role
    "RunConfig": "minips.core.config",
    "ServerConfig": "minips.server",
    "GroupConfig": "minips.serve.group_process",
    "WorkerConfig": "minips.core.config",
    # the roles: sans-IO cores and the processes that drive them
    "SyncPolicy": "minips.core.config",
    "GroupCore": "minips.core.group_core",
    "GlobalCore": "minips.core.global_core",
    "GlobalServer": "minips.server",
    "GroupServer": "minips.serve.group",
    "Worker": "minips.worker",
    "run_worker": "minips.worker",
    # compression and grouping, usable from a user's own training loop
    "make_compressor": "minips.compress.registry",
    "SparseVector": "minips.sparse",
    "assign_groups": "minips.grouping",
    # the wire, for clients in other languages or tools
    "messages": "minips.wire.messages",
    # simulation, run directories, the reference trainer
    "simulate": "minips.sim.simulate",
    "summarize": "minips.record.metrics",
    "train_reference": "minips.ml.reference",
}
# public names whose attribute in their module is spelled differently
_ATTR = {"train_reference": "train"}

__all__ = [
    "MiniPSError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "AuthError",
    "ConfigError",
    "DataError",
    "__version__",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    """Load a public name from its module the first time it is asked for."""
    if name not in _LAZY:
        raise AttributeError(f"module 'minips' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    value = module if name == "messages" else getattr(module, _ATTR.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
