"""A child process ends when the process that started it dies, whatever killed it.

A launcher (`minips local`, `minips server --eval`, the test helpers) puts its pid in each
child's environment with ``child_env``; the child calls ``watch_parent`` first thing (``minips``
does, in ``cli.main``). From then on the child gets SIGTERM within ``POLL_S`` seconds of its
parent's death, by SIGKILL included:

- Linux: ``prctl(PR_SET_PDEATHSIG, SIGTERM)``. The kernel sends it when the *thread* that forked
  the child exits, not the process, so launchers start children from their main thread.
- Everywhere (and as a second line on Linux): a daemon thread compares ``os.getppid()`` with the
  recorded parent every ``POLL_S`` (an orphan is re-parented, so the pid changes).

A child whose parent is already gone when it starts exits at once. The variable is removed from
the child's environment once read, so a grandchild is watched by its own parent, never by a
process that is not its parent. Without the variable nothing is watched (a `minips` command
started from a shell lives on its own).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

__all__ = ["ENV", "POLL_S", "child_env", "watch_parent"]

ENV = "MINIPS_PARENT_PID"  # pid of the launcher a child must not outlive
POLL_S = 0.5  # parent-pid check period of the portable watch, seconds
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) plus this process's pid for the child to watch."""
    return {**(os.environ if env is None else env), ENV: str(os.getpid())}


def watch_parent() -> None:
    """When started by ``child_env``: end this process (SIGTERM) when its parent dies."""
    text = os.environ.pop(ENV, "")
    if not text.isdigit():
        return
    parent = int(text)
    _death_signal()
    if os.getppid() != parent:  # it died before we could ask to be told
        sys.exit(f"minips: the process that started this one ({parent}) is gone")
    threading.Thread(target=_poll, args=(parent,), name="minips-lifeline", daemon=True).start()


def _death_signal() -> None:
    """Ask Linux for SIGTERM when the parent dies (nothing on other systems)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # no libc symbol: the polling thread still watches
        pass


def _poll(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
