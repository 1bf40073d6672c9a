"""A real `minips server` process and workers played by hand over loopback, for the tests that
attack a server and measure what it costs (tests/test_hostile.py, tests/test_control_flood.py,
tests/test_memory_budget.py): the server with known initial weights, its memory read from
/proc, and a worker's joining steps (control channel, STATS, ASSIGN, its group)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from conftest import minips_server, recv_as

from minips.net import channel, transport
from minips.wire import control, messages

N = 61_706  # LeNet-5's parameters, the server's default model
MB = 1 << 20


@contextlib.contextmanager
def server(tmp: Path, *flags: str, token: str,
           init: bool = True) -> Iterator[tuple[subprocess.Popen[str], str, int]]:
    """A `minips server` (with ``init``: known initial weights, so no worker sends them)."""
    if init:
        np.save(tmp / "init.npy", np.zeros(N, np.float32))
        flags = ("--init", str(tmp / "init.npy"), *flags)
    with minips_server(tmp, token, *flags) as (proc, host, port):
        yield proc, host, int(port)


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} for {pid}")


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` now, in MB (VmRSS)."""
    return _status_kb(pid, "VmRSS") / 1024


def open_fds(pid: int) -> int:
    """File descriptors process ``pid`` has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def peak_rss_mb(pid: int) -> float:
    """The most resident memory process ``pid`` ever had, in MB (VmHWM): a peak between two
    samples is not missed."""
    return _status_kb(pid, "VmHWM") / 1024


async def open_control(host: str, port: int, w: int, *, token: str,
                  step_time: float = 0.03) -> tuple[Any, control.Assign]:
    """Worker ``w``'s control channel, its calibration STATS sent; (channel, its ASSIGN)."""
    ctl = await transport.connect(host, port, role="worker", worker_id=w, token=token,
                                  options=channel.Options(heartbeat=1.0))
    await ctl.send(control.Stats(clock=0, step_time=step_time, loss=2.3, samples=32))
    return ctl, await recv_as(ctl, control.Assign, 60)


async def join_group(host: str, gport: int, w: int, group: int, *, token: str) -> tuple[Any, int]:
    """Worker ``w``'s connection to its group server; (channel, the clock its ACK says)."""
    grp = await transport.connect(host, gport, role="worker", worker_id=w, token=token,
                                  group=group, options=channel.Options(heartbeat=1.0))
    ack = await recv_as(grp, messages.Ack, 10)
    return grp, ack.clock


async def join(host: str, port: int, w: int, *, token: str) -> tuple[Any, Any, int]:
    """Worker ``w`` joins: control channel, STATS, ASSIGN, its group; (ctl, group ch, clock)."""
    ctl, assign = await open_control(host, port, w, token=token)
    gport = int(assign.address.rsplit(":", 1)[1])
    grp, clock = await join_group(host, gport, w, assign.group, token=token)
    return ctl, grp, clock
