"""Tests for minips.net.transport, the one backoff loop (transport.connect and a worker's group
reconnect use it): delays, deadline, attempt cap, fatal errors, wake-up."""

from __future__ import annotations

import asyncio

import pytest

from minips.errors import AuthError
from minips.net import transport


def test_delays_double_up_to_the_cap_with_jitter() -> None:
    top = [transport.delay(n, 0.1, 1.0, rng=lambda lo, hi: hi) for n in range(1, 7)]
    assert top == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    low = transport.delay(3, 0.1, 1.0, rng=lambda lo, hi: lo)
    assert low == pytest.approx(0.2)  # half of 0.4: peers that failed together spread out


async def test_retries_until_an_attempt_succeeds() -> None:
    seen: list[BaseException] = []
    calls = 0

    async def attempt(left: float) -> str:
        nonlocal calls
        calls += 1
        assert 0 < left <= 5.0
        if calls < 3:
            raise ConnectionRefusedError("not yet")
        return "up"

    got = await transport.backoff(attempt, timeout=5.0, what="reach it", first=0.001,
                                  on_fail=seen.append)
    assert got == "up" and calls == 3 and len(seen) == 2


async def test_gives_up_after_the_attempts_naming_the_last_failure() -> None:
    async def attempt(left: float) -> None:
        raise ConnectionResetError("reset")

    with pytest.raises(ConnectionError, match=r"reach it within 5.0 s \(4 attempts\).*reset"):
        await transport.backoff(attempt, timeout=5.0, what="reach it", attempts=4, first=0.001)


async def test_gives_up_at_the_deadline() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def attempt(left: float) -> None:
        raise TimeoutError

    with pytest.raises(ConnectionError, match="within 0.2 s"):
        await transport.backoff(attempt, timeout=0.2, what="reach it", first=0.05, most=0.05)
    assert 0.2 <= loop.time() - start < 2.0


async def test_fatal_and_other_errors_pass_through_at_once() -> None:
    calls = 0

    async def refused(left: float) -> None:
        nonlocal calls
        calls += 1
        raise AuthError("wrong secret")  # a PermissionError, an OSError: fatal wins

    with pytest.raises(AuthError):
        await transport.backoff(refused, timeout=5.0, what="x", fatal=(AuthError,))
    assert calls == 1

    async def broken(left: float) -> None:
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        await transport.backoff(broken, timeout=5.0, what="x")


async def test_wake_cuts_a_wait_short() -> None:
    wake = asyncio.Event()
    loop = asyncio.get_running_loop()
    times: list[float] = []

    async def attempt(left: float) -> str:
        times.append(loop.time())
        if len(times) == 1:
            loop.call_later(0.05, wake.set)  # a new ASSIGN arrives while we wait
            raise ConnectionRefusedError
        return "at once"

    got = await transport.backoff(attempt, timeout=30.0, what="x", first=10.0, most=10.0,
                                  wake=wake)
    assert got == "at once" and times[1] - times[0] < 2.0  # not the 5-10 s delay
