"""Atomic checkpoints: a nested map of plain values and numpy arrays in one ``.npz`` file.

A checkpoint is written to a temporary file next to its final name, flushed and fsync'ed, then
renamed over the old one (``os.replace`` is atomic on POSIX) and the directory entry fsync'ed: a
crash at any moment leaves either the previous checkpoint or the new one, never half of one.

Format (no pickle anywhere): an ``np.savez`` archive whose members are the state's arrays, named
by their path in the nested map (``groups/0/weights``), plus ``__meta__``, a uint8 array holding
the UTF-8 JSON of the map with every array replaced by ``{"__array__": name}``. Loading uses
``allow_pickle=False``; JSON maps have string keys, so readers convert ids back to ints.

A checkpoint carries a *fingerprint* of the run settings that define the model and its training
(``snapshot.FINGERPRINT_FIELDS`` plus the vector size); ``snapshot.check_compatible``
refuses a checkpoint whose fingerprint differs from the run that wants to resume it, naming every
field that differs.

Without stalling the event loop: ``save_in_child`` forks, and the child takes the state and
writes it while the parent's loop keeps serving. The child sees the parent's memory as it was at
the fork (the kernel copies a page only when one of the two writes it), so what it saves is the
state at one instant, as consistent as a snapshot taken in one call on the loop, without the
loop copying every array first (~8 ms per ResNet-18-sized vector, 13 of them with four
in-process groups). The parent pays the fork (~2 ms for 600 MB of arrays: page tables) and,
while the child lives, one page copy the first time it writes a page. The child closes the
server's sockets and files and ends with the server (Linux): its parent's death is a SIGTERM
to it, on which it deletes its temporary file and exits, so a server killed mid-checkpoint
leaves no temporary file behind. Where there is no fork (Windows) the state is taken on the loop
and written in a thread, as before.

Invariants: ``load(save(p, s)) == s`` for maps of str keys, JSON scalars, lists and arrays;
``save`` never leaves a partial file under the final name. A writer that can still run code
(SIGTERM, SIGINT, its parent's death) deletes its temporary file (``.NAME.tmpPID``); one killed
outright (SIGKILL, power loss) leaves it, and ``remove_stale_temps`` deletes those whose writer
is gone: no process of that PID, a zombie (an orphan its new parent has not reaped yet), or a
process started after the file was last written (the PID was reused). The global server calls
it when it starts (fresh or resumed), and every ``save`` calls it before writing, so a temporary
file whose writer was still dying at start-up goes at the next checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from minips.errors import DataError

__all__ = ["save", "save_in_child", "load", "remove_stale_temps", "has_room"]


META = "__meta__"  # archive member that holds the JSON map
REAP_POLL_S = 0.005  # after the child's pipe closed, how often to look whether it has exited
MAX_FD = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 4096  # fds a child closes
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>: a signal for this process when its parent dies
ZOMBIE_STATES = ("Z", "X")  # /proc/PID/stat states of a process that has ended
START_SLACK_S = 2.0  # a process start time from /proc is known to ~1 s (boot time's rounding)


def _split(obj: Any, path: str, arrays: dict[str, np.ndarray]) -> Any:
    """The JSON-able copy of ``obj`` with its arrays moved into ``arrays`` (by path)."""
    if isinstance(obj, np.ndarray):
        arrays[path] = obj
        return {"__array__": path}
    if isinstance(obj, dict):
        return {str(k): _split(v, f"{path}/{k}", arrays) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_split(v, f"{path}/{i}", arrays) for i, v in enumerate(obj)]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _join(obj: Any, arrays: Any) -> Any:
    """Inverse of ``_split``: put the arrays back in place."""
    if isinstance(obj, dict):
        if set(obj) == {"__array__"}:
            return np.array(arrays[obj["__array__"]])
        return {k: _join(v, arrays) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join(v, arrays) for v in obj]
    return obj


def save(path: str | Path, state: dict[str, Any]) -> int:
    """Write ``state`` atomically to ``path`` (temp file, fsync, rename); return its bytes."""
    path = Path(path)
    arrays: dict[str, np.ndarray] = {}
    meta = json.dumps(_split(state, "", arrays)).encode()
    remove_stale_temps(path)  # of writers killed before us (cheap: one glob)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **{META: np.frombuffer(meta, np.uint8)}, **arrays)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return path.stat().st_size


async def save_in_child(path: str | Path, take_state: Callable[[], dict[str, Any]]) -> int:
    """``save(path, take_state())`` as of now, in a forked child, while this event loop keeps
    serving; return the file's bytes. ``OSError`` when the child failed (the previous file
    stays). Without ``os.fork`` the state is taken here and written in a thread."""
    if not hasattr(os, "fork"):
        return await asyncio.to_thread(save, path, take_state())
    r, w = os.pipe()
    parent = os.getpid()
    with warnings.catch_warnings():  # 3.12+ warns of forking with threads: the child below
        warnings.simplefilter("ignore", DeprecationWarning)  # takes no lock another may hold
        pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(path, take_state, w, parent)  # never returns
    os.close(w)
    try:
        said = await _read_all(r)
    finally:
        os.close(r)
        status = await _reap(pid)
    if status != 0:  # killed before it could clean up (SIGKILL): its temporary file goes here
        _temp_of(path, pid).unlink(missing_ok=True)
    if status != 0 or not said.isdigit():
        raise OSError(f"checkpoint {path}: the writing process failed ({said or status})")
    return int(said)


def _child(path: str | Path, take_state: Callable[[], dict[str, Any]], w: int,
           parent: int) -> None:
    """In the forked child: write the checkpoint, say its size (or the error) on ``w``, exit
    without running the parent's cleanup (its loop, files and atexit handlers are not ours)."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)  # our signals must not wake the parent's event loop
        for sig in (signal.SIGINT, signal.SIGTERM):  # end through save's cleanup: no temp left
            signal.signal(sig, _exit_on_signal)
        _leave_parent_alone(w, parent)
        said, code = str(save(path, take_state())), 0
    except BaseException as exc:  # noqa: BLE001 - whatever it was, the parent hears of it
        said = f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(OSError):
            os.write(w, said.encode()[:4096])
        os._exit(code)


def _exit_on_signal(signum: int, frame: Any) -> None:
    """SIGTERM / SIGINT in the writing child (its parent's death included): unwind, so that
    ``save`` deletes its temporary file, then ``_child`` exits."""
    raise SystemExit(128 + signum)


def _leave_parent_alone(keep: int, parent: int) -> None:
    """Hold none of the server's sockets (a server restarted at once could not bind its port
    while we held its listening one) and end with it: a checkpoint of a dead server must not
    land after a new one read the file. Its death is a SIGTERM to us (Linux; the handler is
    already in place), which deletes our temporary file on the way out."""
    os.closerange(3, keep)
    os.closerange(keep + 1, MAX_FD)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # no libc symbol: as elsewhere
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0,
                                                    0, 0)
    if os.getppid() != parent:  # it died before we asked
        os._exit(1)


async def _read_all(fd: int) -> str:
    """What the child writes on ``fd`` until it closes it (at its exit)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    chunks: list[bytes] = []

    def readable() -> None:
        data = os.read(fd, 4096)
        chunks.append(data)
        if not data and not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
    return b"".join(chunks).decode(errors="replace").strip()


async def _reap(pid: int) -> int:
    """The exit status of child ``pid``, once it has exited (it closed its pipe: soon)."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        await asyncio.sleep(REAP_POLL_S)


def remove_stale_temps(path: str | Path) -> list[Path]:
    """Delete the temporary files of ``save`` calls that never finished (``.NAME.tmpPID`` next
    to ``path`` whose writer is gone: killed mid-write); return them. A live writer's file is
    kept: it may still be writing it."""
    path = Path(path)
    removed = []
    for tmp in path.parent.glob(f".{path.name}.tmp*"):
        pid = tmp.name.removeprefix(f".{path.name}.tmp")
        if pid.isdigit() and not _writing(int(pid), tmp):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def has_room(path: str | Path, need: int) -> bool:
    """Whether ``path``'s directory exists and has ``need`` bytes free (``os.statvfs``: what an
    unprivileged writer may use), so that a new checkpoint of ``need`` bytes fits beside the
    old one until the rename; True where the platform cannot tell (no ``statvfs``)."""
    if not hasattr(os, "statvfs"):
        return True
    try:
        st = os.statvfs(Path(path).parent)
    except OSError:  # the directory is gone: no room until it is back
        return False
    return st.f_bavail * st.f_frsize >= need


def _temp_of(path: str | Path, pid: int) -> Path:
    """The temporary file process ``pid`` writes while it saves ``path``."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp{pid}")


def _writing(pid: int, tmp: Path) -> bool:
    """Whether process ``pid`` may still be writing ``tmp``: it runs, is no zombie, and (where
    /proc tells) started before ``tmp`` was last written, so it is not a later process that
    was given the same PID."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: assume it is the writer
        return True
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        started = _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
        written = tmp.stat().st_mtime
    except (OSError, IndexError, ValueError):  # no /proc (not Linux), or it just ended
        return True
    return fields[0] not in ZOMBIE_STATES and started <= written + START_SLACK_S


def _boot_time() -> float:
    """Unix time this machine booted (/proc/stat's btime)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (the directory entry), where the platform allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by ``save``; ``DataError`` when it is missing or damaged."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z[META]).decode())
            return dict(_join(meta, z))
    except FileNotFoundError:
        raise DataError(f"no checkpoint at {path}") from None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        # a truncated or overwritten archive: zipfile raises BadZipFile, np.load ValueError
        raise DataError(f"checkpoint {path} is damaged: {exc}") from None

