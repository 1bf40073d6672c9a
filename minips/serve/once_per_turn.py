"""``OncePerTurn``: one call of a function per turn of the asyncio event loop, shared by all.

A group server publishes its compressed downlink (``downlink.py``, an O(n) exact top-k) once for
all the PULLs it answers in one turn of its loop (they arrived together, or a BSP round or the
staleness bound released them together), not once per PULL; every such PULL still gets weights
at least as new as when it arrived.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["OncePerTurn"]


class OncePerTurn:
    """``await once()`` runs ``fn`` soon, once for every caller awaiting in this turn."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        self._due: asyncio.Future[None] | None = None  # the call due this turn

    async def __call__(self) -> None:
        if self._due is None:
            loop = asyncio.get_running_loop()
            self._due = loop.create_future()
            loop.call_soon(self._run, self._due)
        await asyncio.shield(self._due)  # a caller given up on must not cancel the others'

    def _run(self, due: asyncio.Future[None]) -> None:
        self._due = None
        try:
            self.fn()
        except Exception as exc:  # the callers waiting for it fail (their sessions end), not hang
            due.set_exception(exc)
        else:
            due.set_result(None)
