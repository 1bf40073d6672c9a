"""Which minips modules one gradient's in-process round trip runs (issue 27's module figure).

Usage::

    PYTHONPATH=. python scripts/round_trip_modules.py [--compressors gdtopk,none] [--windows 3]

The cluster: ONE Python process, one asyncio event loop. A real ``minips.GlobalServer`` (its
``ServerConfig``, in-process group servers: no ``external_groups``) listens on loopback and one
``minips.Worker`` runs in the same loop as a coroutine (``await Worker(cfg).run()``, what
``minips worker`` runs under ``asyncio.run``), talking to both servers over real TCP sockets
and the real wire. Only public entry points are used (``minips.RunConfig``, ``WorkerConfig``,
``ServerConfig``, ``GlobalServer``, ``Worker``), so this keeps working when internal modules
move. The model is lenet5 on the real Fashion-MNIST training set (the run directory's
``data-*.json`` says whether the data set was real; ``data`` in the output). Mode gssp (one
group: one worker), ``sync_every=1`` so that every PUSH makes its group exchange with the
global server, no evaluator, dashboard or checkpoints, a few warm-up steps first.

One worker only, on purpose: a second worker would compute its gradient (torch and
``minips.ml``) or push its own during the window, and its code would be counted with ours.

The window: it opens when the worker calls its compressor's ``compress`` on the gradient in
hand (the script wraps ``worker.compressor.compress`` on the instance, after the worker built
its parts), so the forward/backward pass is outside it, and it closes when the worker's
``trainer.load`` (the step that applies the next PULL's answer, the group's published weights,
to the worker's replica and model) returns. In between: compress, encode and frame the PUSH,
send it, the group server decodes it and applies SGD, exchanges with the global server (which
merges the delta and answers), publishes its weights to the downlink (compressed for a sparse
compressor), answers the next PULL, and the worker decodes the answer into its replica. The
script checks that the global server merged at least once inside each window (its ``version``
moved) and fails otherwise. Windows are consecutive gradients after the warm-up; ``modules`` is
their union, ``in_every_window`` the modules each one ran, ``per_window`` their counts.

What counts: ``sys.setprofile`` (and ``threading.setprofile`` for threads the run starts) sees
every Python event while the window is open (a call, a coroutine resumed, a return, a call into
C from a Python frame); the module of each event's code object is read from its file path
under the imported ``minips`` package (code without a file, such as a dataclass's generated
``__init__``, counts for its module's ``__name__``). Every minips module whose code runs counts,
whatever it does, including anything periodic that happens to run in the window; package
``__init__.py`` files do not count. ``lines`` is the total number of source lines (all lines)
of the counted modules. Torch's own code is not minips and is never counted; the gradient
computation is outside the window anyway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import minips

PKG = Path(minips.__file__).resolve().parent  # the minips package whose code is measured
TOKEN = "round-trip-secret"


class Recorder:
    """The profile hook: while ``open``, remember the code of every event."""

    def __init__(self) -> None:
        self.open = False
        self.files: set[str] = set()
        self.names: set[str] = set()  # __name__ of code without a file (exec'd, generated)

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.open:
            return
        name = frame.f_code.co_filename
        if name.startswith("<"):
            self.names.add(str(frame.f_globals.get("__name__", "")))
        else:
            self.files.add(name)

    def take(self) -> set[str]:
        """The minips modules seen since the last take (package ``__init__`` files left out)."""
        found = {m for m in map(module_of_file, self.files) if m}
        found |= {n for n in self.names
                  if (n == "minips" or n.startswith("minips.")) and not is_package(n)}
        self.files, self.names = set(), set()
        return found


def module_of_file(filename: str) -> str | None:
    """``minips.serve.group`` for ``.../minips/serve/group.py``; None outside minips and for
    package ``__init__`` files."""
    try:
        rel = Path(filename).resolve().relative_to(PKG)
    except (ValueError, OSError):
        return None
    if rel.suffix != ".py" or rel.name == "__init__.py":
        return None
    return ".".join(("minips", *rel.with_suffix("").parts))


def is_package(name: str) -> bool:
    return (PKG.parent.joinpath(*name.split(".")) / "__init__.py").is_file()


def file_of_module(name: str) -> Path:
    return PKG.parent.joinpath(*name.split(".")).with_suffix(".py")


def global_version(srv: Any) -> int | None:
    """Merges the global server applied (``version``), on the server or on a core it holds."""
    for obj in (srv, getattr(srv, "core", None)):
        v = getattr(obj, "version", None)
        if isinstance(v, int):
            return v
    return None


class Windows:
    """Opens a window at a compress call, closes it when the next PULL's answer is loaded."""

    def __init__(self, rec: Recorder, srv: Any, warmup: int, count: int) -> None:
        self.rec, self.srv, self.warmup, self.count = rec, srv, warmup, count
        self.compresses = 0
        self.results: list[dict[str, Any]] = []
        self.done = asyncio.Event()
        self._t = 0.0
        self._version: int | None = None

    def wrap_compress(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def compress(*args: Any, **kwargs: Any) -> Any:
            self.compresses += 1
            if self.compresses > self.warmup and len(self.results) < self.count:
                self._version = global_version(self.srv)
                self._t = time.perf_counter()
                self.rec.open = True
                sys.setprofile(self.rec.hook)
            return fn(*args, **kwargs)
        return compress

    def wrap_load(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def load(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if self.rec.open:
                sys.setprofile(None)
                self.rec.open = False
                after = global_version(self.srv)
                merges = None if after is None or self._version is None else after - self._version
                self.results.append({"modules": self.rec.take(), "merges": merges,
                                     "window_s": round(time.perf_counter() - self._t, 4)})
                if len(self.results) >= self.count:
                    self.done.set()
            return out
        return load


async def wrap_when_built(worker: Any, win: Windows) -> None:
    """Wrap the worker's compressor and trainer on the instance once it has built them."""
    while getattr(worker, "compressor", None) is None or getattr(worker, "trainer", None) is None:
        await asyncio.sleep(0.005)
    worker.compressor.compress = win.wrap_compress(worker.compressor.compress)
    worker.trainer.load = win.wrap_load(worker.trainer.load)


def data_used(run_dir: str) -> str:
    """``real``/``synthetic`` from the run directory's data-*.json records (``unknown``: none)."""
    kinds = set()
    for p in Path(run_dir).glob("data-*.json"):
        try:
            kinds.add("synthetic" if json.loads(p.read_text())["synthetic"] else "real")
        except (OSError, ValueError, KeyError):
            kinds.add("unknown")
    return ",".join(sorted(kinds)) or "unknown"


async def measure(compressor: str, mode: str, warmup: int, windows: int) -> dict[str, Any]:
    run = minips.RunConfig(mode=mode, compressor=compressor, workers=1, groups=1, sync_every=1,
                           max_steps=warmup + windows + 2, base_step_s=0.0, calib_steps=1,
                           lr=0.05, lr_warmup=0.0, heartbeat_s=30.0, lease_s=60.0,
                           eval_every_s=60.0)
    rec = Recorder()
    threading.setprofile(rec.hook)  # threads started from now on (to_thread) are seen too
    with tempfile.TemporaryDirectory(prefix="minips-trace-") as tmp:
        cfg = minips.ServerConfig(run=run, host="127.0.0.1", port=0, token=TOKEN, run_dir=tmp,
                                  checkpoint_every_s=0.0, linger_s=0.0)
        srv = minips.GlobalServer(cfg)  # no initial weights: the worker sends its own
        port = await srv.start()
        worker = minips.Worker(minips.WorkerConfig(server_port=port, token=TOKEN, worker_id=0,
                                                   run_dir=tmp, device="cpu"))
        win = Windows(rec, srv, warmup, windows)
        wrapper = asyncio.ensure_future(wrap_when_built(worker, win))
        try:
            await asyncio.wait_for(asyncio.gather(worker.run(), wrapper), 300)
            await asyncio.wait_for(srv.wait_finished(), 30)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
            await srv.close()
        data = data_used(tmp)
    if len(win.results) < windows:
        raise SystemExit(f"{compressor}: only {len(win.results)} of {windows} windows closed")
    if any(r["merges"] is not None and r["merges"] < 1 for r in win.results):
        raise SystemExit(f"{compressor}: a window without a global merge: {win.results}")
    union = set().union(*(r["modules"] for r in win.results))
    every = set.intersection(*(r["modules"] for r in win.results))
    down = run.downlink_ratio() if hasattr(run, "downlink_ratio") else run.down_ratio
    return {
        "modules": sorted(union),
        "count": len(union),
        "lines": sum(len(file_of_module(m).read_text().splitlines()) for m in union),
        "in_every_window": sorted(every),
        "per_window": [{"count": len(r["modules"]), "global_merges": r["merges"],
                        "window_s": r["window_s"]} for r in win.results],
        "settings": {"mode": mode, "compressor": compressor, "model": run.model,
                     "dataset": run.dataset, "data": data, "workers": 1, "groups": 1,
                     "sync_every": run.sync_every, "ratio": run.ratio, "down_ratio": down,
                     "warmup_steps": warmup, "windows": windows, "worker": "Worker.run() "
                     "coroutine in the servers' event loop", "groups_in_process": True,
                     "python": sys.version.split()[0], "package": str(PKG)},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compressors", default="gdtopk,none", help="one row each, comma-separated")
    ap.add_argument("--mode", default="gssp", choices=("gssp", "ssp"))
    ap.add_argument("--warmup", type=int, default=3, help="steps before the first window")
    ap.add_argument("--windows", type=int, default=3, help="consecutive gradients measured")
    args = ap.parse_args(argv)
    rows = [asyncio.run(measure(c, args.mode, args.warmup, args.windows))
            for c in args.compressors.split(",")]
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
