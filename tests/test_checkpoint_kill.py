"""A server killed while it writes a checkpoint leaves no temporary file, and resumes.

The real thing, small: a `minips server` process (LeNet-5's weights, one worker played by hand,
a checkpoint every 10 ms) is killed with SIGKILL the moment a `.checkpoint.npz.tmpPID` file is
in its run directory, ten times, each followed by a `--resume` start. The writing child of a
killed server must delete its own temporary file (it ends on its parent's death, through
``save``'s cleanup) before any new server starts, every resumed server must come up from the
checkpoint, and none of the files may be left at the end (issue 58: 2 of 10 were).

Beside it, the writing child's own exits in one process: a SIGTERM in the middle of a write
deletes the temporary file, a SIGKILL leaves it to the parent, which deletes it once it has
reaped the child; and ``remove_stale_temps`` takes a zombie's or a reused PID's file for a dead
writer's.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import raw_worker
from conftest import records, wait_ready_file

from minips.net import lifeline
from minips.record import checkpoint
from minips.record.checkpoint import load, remove_stale_temps, save, save_in_child

TOKEN = "kill-secret"
ROUNDS = 10  # kill -9 during a write, then --resume (the count)
CATCH_S = 10.0  # a temporary file must show up within this long (a checkpoint every 10 ms)
GONE_S = 10.0  # the killed writer's file must be gone within this long (3 s missed once, loaded)
TEMP = ".checkpoint.npz.tmp"


def _temps(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith(TEMP))


class Server:
    """The test's `minips server` processes, one at a time; the last one is killed at the end."""

    def __init__(self, d: Path) -> None:
        self.d = d
        self.env = lifeline.child_env({**os.environ, "MINIPS_TOKEN": TOKEN})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, resume: bool) -> tuple[str, int]:
        ready = self.d / "server.addr"
        ready.unlink(missing_ok=True)
        extra = ["--resume"] if resume else ["--init", str(self.d / "init.npy")]
        with open(self.d / "server.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "minips", "server", "--port", "0", "--quiet",
                 "--workers", "1", "--checkpoint-every", "0.01", "--wall-s", "600",
                 "--run-dir", str(self.d), "--ready-file", str(ready), *extra],
                env=self.env, stdout=log, stderr=subprocess.STDOUT)
        host, port = wait_ready_file(ready, self.proc, 60)
        return host, int(port)

    def kill_while_writing(self) -> list[str]:
        """SIGKILL the server as soon as a temporary file exists; the files seen then."""
        assert self.proc is not None
        deadline = time.monotonic() + CATCH_S
        while not (seen := _temps(self.d)):
            assert time.monotonic() < deadline, "no checkpoint being written"
            assert self.proc.poll() is None, (self.d / "server.log").read_text()[-2000:]
            time.sleep(0.0005)  # polling a directory with a deadline
        self.proc.kill()
        self.proc.wait()
        return seen

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _writer_of(d: Path, name: str) -> str:
    """What is known of the process a left temporary file names (a full suite once left one
    for over 10 s: whether its writer lived on, and where it waited, tells why)."""
    pid, tmp = name.removeprefix(TEMP), d / name
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:200]
        alive = f"alive, state {stat[0]}, waits in {wchan or '-'}, ppid {stat[1]}: {cmd}"
    except OSError:
        alive = "its writer is gone"
    age = time.time() - tmp.stat().st_mtime if tmp.exists() else float("nan")
    return f"{name} (written {age:.1f} s ago; {alive})"


def _wait_gone(d: Path, names: list[str]) -> list[str]:
    """The files of ``names`` still there after ``GONE_S`` ([] as soon as all are gone)."""
    deadline = time.monotonic() + GONE_S
    while (left := [n for n in names if (d / n).exists()]) and time.monotonic() < deadline:
        time.sleep(0.01)  # polling a directory with a deadline
    return left


@pytest.mark.timeout(120)
def test_kill_9_during_checkpoint_writes_then_resume_leaves_no_temp_file(tmp_path: Path) -> None:
    np.save(tmp_path / "init.npy", np.zeros(raw_worker.N, np.float32))
    server = Server(tmp_path)
    try:
        host, port = server.start(resume=False)

        async def join() -> None:  # one worker joins: the group forms, checkpoints begin
            await raw_worker.open_control(host, port, 0, token=TOKEN)

        asyncio.run(join())
        deadline = time.monotonic() + CATCH_S
        while not (tmp_path / "checkpoint.npz").exists():
            assert time.monotonic() < deadline, "no first checkpoint"
            time.sleep(0.01)  # polling a file with a deadline
        first = load(tmp_path / "checkpoint.npz")["saved_at"]
        left_behind = []
        for r in range(ROUNDS):  # the check: each kill followed by --resume
            seen = server.kill_while_writing()
            server.start(resume=True)  # its start-up removes what a dead writer left
            assert len(records(tmp_path / "global.jsonl", event="resumed")) == r + 1
            left_behind += _wait_gone(tmp_path, seen)
        last = server.kill_while_writing()
    finally:
        server.stop()
    remove_stale_temps(tmp_path / "checkpoint.npz")  # what the next --resume's start-up does
    left_behind += _wait_gone(tmp_path, last)
    assert left_behind == [], (f"{len(left_behind)} of {ROUNDS + 1} killed writes left a file: "
                               f"{[_writer_of(tmp_path, n) for n in left_behind]}")
    assert _temps(tmp_path) == []
    assert load(tmp_path / "checkpoint.npz")["saved_at"] > first  # the resumed servers saved


# -- the writing child's exits, in this process ----------------------------------------------

def _state() -> dict[str, Any]:
    return {"version": 2, "weights": np.arange(1000, dtype=np.float32)}


def _interrupted_savez(sig: int) -> Any:
    """np.savez that writes part of the archive, then gets ``sig`` (in the writing child)."""
    real = np.savez

    def savez(f: Any, *args: Any, **kw: Any) -> None:
        f.write(b"\0" * 4096)  # half a checkpoint on disk
        f.flush()
        os.kill(os.getpid(), sig)
        real(f, *args, **kw)

    return savez


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
async def test_a_writer_ended_mid_write_leaves_no_temp_and_the_old_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: int) -> None:
    """SIGTERM/SIGINT: the child deletes its file on the way out; SIGKILL: the parent does,
    once it has reaped the child. Either way the previous checkpoint stays."""
    path = tmp_path / "checkpoint.npz"
    save(path, {"version": 1})
    monkeypatch.setattr(checkpoint.np, "savez", _interrupted_savez(sig))
    with pytest.raises(OSError, match="writing process failed"):
        await asyncio.wait_for(save_in_child(path, _state), 30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.npz"]
    assert load(path) == {"version": 1}


def test_stale_temps_of_zombies_and_reused_pids_are_removed(tmp_path: Path) -> None:
    """A zombie (ended, not reaped: an orphan's new parent may take a second) writes nothing
    more; a live process that started after a file was last written is not its writer; a
    live process that may be the writer keeps its file."""
    path = tmp_path / "checkpoint.npz"
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    newer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while _state_of(zombie.pid) != "Z":
            assert time.monotonic() < deadline, "the child did not end"
            time.sleep(0.01)  # polling a process's state with a deadline
        dead, reused, live = (tmp_path / f"{TEMP}{p}" for p in (zombie.pid, newer.pid,
                                                                os.getpid()))
        for f in (dead, reused, live):
            f.write_bytes(b"\0" * 100)
        hour_ago = time.time() - 3600
        os.utime(reused, (hour_ago, hour_ago))  # written an hour before its PID's process began
        removed = remove_stale_temps(path)
    finally:
        newer.kill()
        newer.wait()
        zombie.wait()
    assert sorted(removed) == sorted([dead, reused]) and live.exists()


def _state_of(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
