"""A checkpoint does not stall the server's event loop, and saves one instant's state
(issue 41 item 1).

``checkpoint.save_in_child`` forks; the child takes the snapshot (copies of every array, as
``GlobalCore.checkpoint_state`` makes) and writes it while the parent's loop keeps turning. The
bound on the loop's longest gap, beyond what a fork of the same process costs anyway, is half
the gap the same checkpoint makes the way the server took it before (the snapshot on the loop,
the write in a thread), measured in the same test: the fork copies page tables, not the arrays
(128 MB here: ~5-10 ms against ~20-60 ms, by CPU). Each figure is the best of three
checkpoints, so a moment when this shared machine did not run the test is not taken for a
checkpoint's stall.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from minips.record import checkpoint

N = 4_000_000  # float32 per array: 16 MB
ARRAYS = 8  # 128 MB: the global weights and, per in-process group, its weights, w_sync, velocity


def live_state() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {"version": 7, "groups": {str(g): {"weights": rng.standard_normal(N, np.float32)}
                                      for g in range(ARRAYS)}}


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint of ``state`` holds: copies, as the cores' state_dicts make."""
    return {"version": state["version"],
            "groups": {g: {"weights": v["weights"].copy()} for g, v in state["groups"].items()}}


async def longest_gap(work: Awaitable[Any]) -> float:
    """The longest time between two turns of the event loop while ``work`` runs, seconds."""
    done = False
    longest = 0.0
    ticking = asyncio.Event()

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.0005)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
            ticking.set()

    tick = asyncio.ensure_future(ticker())
    await ticking.wait()
    try:
        await work
    finally:
        done = True
        await tick
    return longest


async def on_the_loop_then_a_thread(path: Path, state: dict[str, Any]) -> int:
    """The server's checkpoint before save_in_child: snapshot on the loop, write in a thread."""
    taken = snapshot(state)
    return await asyncio.to_thread(checkpoint.save, path, taken)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["version"] == b["version"] and all(
        a["groups"][g]["weights"].tobytes() == b["groups"][g]["weights"].tobytes()
        for g in b["groups"])


async def test_the_checkpoint_holds_the_state_of_its_call_bit_for_bit(tmp_path: Path) -> None:
    state = live_state()
    expected = snapshot(state)
    path = tmp_path / "checkpoint.npz"
    saving = asyncio.ensure_future(checkpoint.save_in_child(path, lambda: snapshot(state)))
    await asyncio.sleep(0)  # the task forked; the child writes while the loop goes on:
    for v in state["groups"].values():  # pushes land on every array meanwhile
        v["weights"][::1000] += 1.0
    state["version"] += 1
    assert await saving == path.stat().st_size
    saved = checkpoint.load(path)
    assert same(saved, expected) and not same(saved, state)


async def test_the_loop_keeps_turning_while_a_large_checkpoint_is_taken(tmp_path: Path) -> None:
    """The checkpoint's stall, beyond what the fork alone costs (a checkpoint of a tiny state
    from the same process: the page tables of everything the process holds), is under half the
    stall of the snapshot on the loop. The fork's own cost grows with the whole process (late
    in a full test run, gigabytes), not with the state saved, so it is measured, not bounded."""
    state = live_state()
    before, after, fork = [], [], []
    for i in range(3):
        before.append(await longest_gap(on_the_loop_then_a_thread(tmp_path / f"a{i}.npz", state)))
        after.append(await longest_gap(checkpoint.save_in_child(tmp_path / f"b{i}.npz",
                                                                lambda: snapshot(state))))
        fork.append(await longest_gap(checkpoint.save_in_child(tmp_path / f"c{i}.npz",
                                                               lambda: {"version": 0})))
        assert same(checkpoint.load(tmp_path / f"b{i}.npz"), state)
    assert min(after) < min(fork) + 0.5 * min(before), (
        f"longest gaps {after}; the fork alone: {fork}; snapshot on the loop: {before}")


async def test_a_failed_checkpoint_raises_and_keeps_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.npz"
    checkpoint.save(path, {"version": 1})

    def broken() -> dict[str, Any]:
        raise MemoryError("no room for the copy")

    with pytest.raises(OSError, match="MemoryError: no room for the copy"):
        await checkpoint.save_in_child(path, broken)
    assert checkpoint.load(path) == {"version": 1}
    assert not list(tmp_path.glob(".checkpoint.npz.tmp*"))


async def test_the_server_checkpoints_its_weights_as_of_the_call(tmp_path: Path) -> None:
    from minips.core.config import RunConfig
    from minips.server import GlobalServer, ServerConfig

    weights = np.random.default_rng(1).standard_normal(N, np.float32)
    srv = GlobalServer(ServerConfig(run=RunConfig(workers=1), port=0, run_dir=str(tmp_path)),
                       weights.copy())
    await srv._save()
    assert checkpoint.load(srv.checkpoint_path)["weights"].tobytes() == weights.tobytes()
    srv.writer.close()


def wait_until(what: str, check: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s} s")
        time.sleep(0.02)


def gated_state(gate: Path, pid_file: Path) -> dict[str, Any]:
    """A snapshot that, in the child, says the child's pid and waits for ``gate`` to exist."""
    pid_file.write_text(str(os.getpid()))
    wait_until("the gate", gate.exists, timeout_s=120.0)  # longer than any wait of the tests
    return {"version": 1}


async def test_a_server_restarted_during_a_checkpoint_can_bind_its_port(tmp_path: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    gate, pid_file = tmp_path / "gate", tmp_path / "child.pid"
    saving = asyncio.ensure_future(checkpoint.save_in_child(
        tmp_path / "checkpoint.npz", lambda: gated_state(gate, pid_file)))
    try:
        await asyncio.to_thread(wait_until, "the child", pid_file.exists)
        listener.close()  # the server is gone; a new one takes its port while the child writes
        socket.create_server(("127.0.0.1", port)).close()
    finally:
        gate.touch()
    assert await saving > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG, /proc")
def test_the_writer_dies_with_a_killed_server(tmp_path: Path) -> None:
    gate, pid_file, path = tmp_path / "gate", tmp_path / "child.pid", tmp_path / "checkpoint.npz"
    script = (f"import asyncio, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
              "from test_checkpoint_stall import gated_state; from pathlib import Path; "
              "from minips.record import checkpoint; "
              f"asyncio.run(checkpoint.save_in_child({str(path)!r}, lambda: gated_state("
              f"Path({str(gate)!r}), Path({str(pid_file)!r}))))")
    server = subprocess.Popen([sys.executable, "-c", script])
    try:
        wait_until("the child", pid_file.exists)
    finally:
        server.kill()
        server.wait(timeout=30)
    child = int(pid_file.read_text())
    try:
        wait_until("the writer's end", lambda: not Path(f"/proc/{child}").exists()
                   or Path(f"/proc/{child}/stat").read_text().split()[2] == "Z", timeout_s=10.0)
    finally:
        gate.touch()  # a writer that outlived its server would write now
    assert not path.exists()
