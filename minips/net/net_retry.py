"""The one retry loop of minips: exponential backoff with jitter, bounded by a deadline.

Every place that tries to reach a peer again uses ``backoff``: ``transport.connect`` (a client's
connection and handshake, hence also a `minips group` process registering and reconnecting with
the global server) and a worker reaching its group server (``worker._connect_group``).

Rules: the first attempt is made at once; after a failure of a kind in ``retry_on`` the loop
waits ``first``, then twice as long each time up to ``most``, each delay times a random factor
in [0.5, 1) (jitter: peers that lost a server together do not come back in step), and never past
the deadline; a set ``wake`` event cuts a wait short (a worker told of a new group address tries
it at once). It gives up with ``ConnectionError`` once the deadline has passed or ``attempts``
were made; any other exception (or one in ``fatal``: a refused secret) passes through at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["FIRST_S", "MOST_S", "delay", "backoff"]

T = TypeVar("T")

FIRST_S, MOST_S = 0.05, 2.0  # the first and the longest wait between attempts, s


def delay(failures: int, first: float = FIRST_S, most: float = MOST_S,
          rng: Callable[[float, float], float] = random.uniform) -> float:
    """The wait after the ``failures``-th failure in a row (1, 2, ...): ``first`` doubled each
    time up to ``most``, times a random factor in [0.5, 1)."""
    return min(most, first * 2 ** (failures - 1)) * rng(0.5, 1.0)


def _ignore(exc: BaseException) -> None:
    """``on_fail``'s default: a failure is only retried."""


async def backoff(attempt: Callable[[float], Awaitable[T]], *, timeout: float, what: str,
                  retry_on: tuple[type[BaseException], ...] = (OSError, asyncio.TimeoutError),
                  fatal: tuple[type[BaseException], ...] = (),
                  attempts: int | None = None, first: float = FIRST_S, most: float = MOST_S,
                  on_fail: Callable[[BaseException], None] = _ignore,
                  wake: asyncio.Event | None = None) -> T:
    """``await attempt(seconds left)`` until it returns, retrying failures in ``retry_on`` (but
    not in ``fatal``) for up to ``timeout`` seconds and ``attempts`` attempts (None: as many as
    fit).

    ``on_fail(exc)`` sees each retried failure. Raises ``ConnectionError`` naming ``what``, the
    number of attempts and the last failure once the deadline or ``attempts`` is reached."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    failures = 0
    while True:
        try:
            return await attempt(max(0.0, deadline - loop.time()))
        except fatal:
            raise
        except retry_on as exc:
            failures += 1
            on_fail(exc)
            left = deadline - loop.time()
            if left <= 0 or (attempts is not None and failures >= attempts):
                raise ConnectionError(f"{what} within {timeout} s ({failures} attempts): "
                                      f"{exc!r}") from None
            await _wait(min(delay(failures, first, most), left), wake)


async def _wait(seconds: float, wake: asyncio.Event | None) -> None:
    """Sleep ``seconds``, or less when ``wake`` is set meanwhile (it is cleared first)."""
    if wake is None:
        await asyncio.sleep(seconds)
        return
    wake.clear()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(wake.wait(), seconds)
