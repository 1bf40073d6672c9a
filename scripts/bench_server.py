"""Server capacity: how many workers one global server (and its group servers) carries.

For each model size (LeNet-5: 61,706 parameters; ResNet-18: 11,173,962; VGG-19: 20,040,522),
each place of the optimizer (on the group servers: workers push gradients; on the workers: they
push updates the servers only add), each push density (1% sparse-v1, dense) and each count of
connected workers, this script starts a real `minips server` in a fresh run directory of its
own (GSSP, up to --groups group servers, in the server's process or with --group-processes as
`minips group` processes, no staleness bound in practice so idle workers hold no one back) and
several client processes (scripts/bench_server_clients.py: asyncio, no torch). Up to
--max-active of the workers are active: PULL -> WEIGHTS, PUSH -> ACK every --step-s seconds;
the rest are connected and idle (heartbeats only). Once every worker is in its loop the script
measures --window-s seconds:

  pushes_s, push_bytes_s, pull_bytes_s     operations that ended inside the window
  push_ack_p50/p99_ms, pull_p50/p99_ms     push -> ACK, PULL -> WEIGHTS as the clients saw them
  server_cpu, clients_cpu                  CPU seconds per second (1.0 = one core busy;
                                           server: with its group processes, if any)
  server_rss_mb                            at the end of the window
  setup_s, setup_stages_s                  from the server's start to every worker stepping;
                                           when the slowest worker had its control session,
                                           ASSIGN, its group session, its start clock (s after
                                           its client process began)
  cpu_per_message                          per kind (push, pull, exchange, checkpoint): the
                                           messages served in the window and the CPU time
                                           the servers' cores spent on them, us per message

The CPU per message is measured inside the server processes: each runs under this script
(``--serve-probed``), which wraps the core entry points that serve a message kind (``PROBED``)
with a per-thread CPU clock and writes its totals to a file when sent SIGUSR1, once before the
window and once after. It counts the cores' work (numpy included), not framing, decoding or
the event loop's own costs, which the difference to server_cpu shows.

The clients run on the same cores as the server: clients_cpu says how much of the machine they
took, so a point where server_cpu is well under 1 while clients_cpu fills the rest is limited by
the clients, not the server (the server is one asyncio loop: it can use one core).

Every point runs in its own run directory, removed after it (a server refuses a directory that
holds an earlier run). ``--runs N`` measures each point N times.

Side by side with a git ref (``--baseline-ref REF``): the guard against regressions. REF's tree
is checked out with ``git worktree add`` in a temporary directory (removed after) and each point
is measured alternately with this tree and with REF's (this, ref, this, ref, ...: a machine
getting busier weighs on both), REF's side by REF's own scripts/bench_server.py and clients
with PYTHONPATH set to REF's tree, so its server runs its own code. Flags REF's script does not
know are left out for it and named in the output (``baseline.dropped_flags``; a script without
``--optimizer-at`` measures its one place, ``ref_optimizer_at`` says so). The output's
``side_by_side`` gives, per point, each run's figures of both trees and the ratio of their
medians (``this_over_ref``) for ``COMPARED``: pushes/s, p99 push -> ACK, server CPU, RSS,
set-up time.

Usage:
  flock /tmp/minips-bench.lock python scripts/bench_server.py --json [--chart docs/img/x.png]
  python scripts/bench_server.py --json --models lenet5 --ratios 0.01 --workers 256 \
      --baseline-ref 0162ffa --runs 3
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

MODELS = {"lenet5": 61_706, "resnet18": 11_173_962, "vgg19": 20_040_522}  # flat parameters
CLIENTS = Path(__file__).with_name("bench_server_clients.py")
READY_TIMEOUT_S = 240.0  # every worker connected, assigned and stepping
PROBE_TIMEOUT_S = 20.0  # a server process writes its counters once sent SIGUSR1
REPO = Path(__file__).resolve().parents[1]  # this tree
# what --baseline-ref compares per point: the figures of both trees and the ratio of medians
COMPARED = ("pushes_s", "push_ack_p99_ms", "server_cpu", "server_rss_mb", "setup_s")
TICKS = os.sysconf("SC_CLK_TCK")

# What serves each message kind in the servers' cores: (module, class or None, function). The
# first entry that was called counts the messages; every entry's CPU adds up (an entry called
# inside another one of the same process counts once, with the outer one).
PROBED: dict[str, list[tuple[str, str | None, str]]] = {
    "push": [("minips.core.group_core", "GroupCore", "push")],
    "pull": [("minips.core.group_core", "GroupCore", "weights_message"),
             ("minips.core.group_core", "GroupCore", "publish")],
    "exchange": [("minips.core.merge", "Merger", "merge"),
                 ("minips.core.merge", "Merger", "exchange_reply"),
                 ("minips.core.group_core", "GroupCore", "begin_exchange"),
                 ("minips.core.group_core", "GroupCore", "exchanged")],
    # a checkpoint's count is its fork (checkpoint.save_in_child); where the snapshot and the
    # write run in the forked child, their CPU is the child's and not counted here: what the
    # server's loop spends is the fork (and, with group processes, the snapshot)
    "checkpoint": [("os", None, "fork"),
                   ("minips.core.global_core", "GlobalCore", "checkpoint_state"),
                   ("minips.record.checkpoint", None, "save")],
}


# -- inside a server process: the CPU its cores spend per message kind -------------------------

class Meter:
    """Calls and CPU seconds (``time.thread_time``: the calling thread's) per probed entry."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = {}  # "Class.function" -> [calls, cpu seconds]
        self.inside = threading.local()  # an outer probed call is running in this thread

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        self.totals[name] = [0, 0.0]

        @functools.wraps(fn)
        def probed(*args: Any, **kwargs: Any) -> Any:
            if getattr(self.inside, "on", False):
                return fn(*args, **kwargs)
            self.inside.on, t = True, time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside.on = False
                total = self.totals[name]
                total[0] += 1
                total[1] += time.thread_time() - t
        return probed

    def install(self) -> None:
        for entries in PROBED.values():
            for module, cls, fn in entries:
                owner: Any = importlib.import_module(module)
                owner = getattr(owner, cls) if cls else owner
                setattr(owner, fn, self.wrap(f"{cls or module}.{fn}", getattr(owner, fn)))

    def dump(self, path: str) -> None:
        tmp = f"{path}.tmp"
        Path(tmp).write_text(json.dumps(self.totals))
        os.replace(tmp, path)


def serve_probed(out: str, argv: list[str]) -> int:
    """Run `minips ARGV` (a server or a group process) with its cores probed; SIGUSR1 writes
    the counters so far to ``out``."""
    meter = Meter()
    meter.install()
    signal.signal(signal.SIGUSR1, lambda *_: meter.dump(out))
    from minips.run.cli import main as minips_main

    return minips_main(argv)


def read_probes(procs: list[subprocess.Popen[bytes]], files: list[Path]) -> dict[str, list[float]]:
    """Every probed process's counters now, summed by entry."""
    for f, p in zip(files, procs, strict=True):
        f.unlink(missing_ok=True)
        p.send_signal(signal.SIGUSR1)
    summed: dict[str, list[float]] = {}
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    for f in files:
        while not f.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no counters from a server process ({f.name})")
            time.sleep(0.02)
        for name, (calls, cpu) in json.loads(f.read_text()).items():
            total = summed.setdefault(name, [0, 0.0])
            total[0] += calls
            total[1] += cpu
    return summed


def per_message(before: dict[str, list[float]], after: dict[str, list[float]]
                ) -> dict[str, dict[str, float | None]]:
    """The window's messages and CPU per kind: count, cpu_ms in all, cpu_us per message."""
    out: dict[str, dict[str, float | None]] = {}
    for kind, entries in PROBED.items():
        names = [f"{cls or module}.{fn}" for module, cls, fn in entries]
        d = {n: [a - b for a, b in zip(after.get(n, [0, 0.0]), before.get(n, [0, 0.0]),
                                          strict=True)]
             for n in names}
        # the first entry that ran counts: with group processes the global side's merges; a
        # checkpoint by its snapshot where no fork took it (code before save_in_child)
        count = next((int(d[n][0]) for n in names if d[n][0]), 0)
        cpu = sum(d[n][1] for n in names)
        out[kind] = {"count": count, "cpu_ms": round(cpu * 1e3, 2),
                     "cpu_us": round(cpu * 1e6 / count, 1) if count else None}
    return out


# -- the driver ------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, seconds (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def py_spy() -> str:
    """The py-spy to run for --profile: on PATH, else beside this Python (a venv's bin, run
    without activating it); a clear error when neither has it."""
    beside = Path(sys.executable).parent / "py-spy"
    found = shutil.which("py-spy") or (str(beside) if beside.exists() else None)
    if found is None:
        raise SystemExit("bench_server.py: --profile needs py-spy (pip install py-spy)")
    return found


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def minips_cmd(tmp: Path, name: str, argv: list[str]) -> list[str]:
    """`minips ARGV` under this script's probe; its counters go to tmp/probe-NAME.json."""
    return [sys.executable, str(Path(__file__).resolve()), "--serve-probed",
            str(tmp / f"probe-{name}.json"), *argv]


def start_server(tmp: Path, init: Path, spec: dict[str, Any], args: argparse.Namespace,
                 env: dict[str, str]) -> tuple[list[subprocess.Popen[bytes]], str]:
    """The global server (and, with --group-processes, one `minips group` process per group)
    in the point's directory ``tmp``; returns the processes, the global server first, and its
    address. Its downlink and exchange keep ``ratio`` (1: dense weights answer every PULL),
    unless --dense-down."""
    workers, ratio = spec["workers"], spec["ratio"]
    ready = tmp / "ready"
    groups = min(args.groups, workers)
    cmd = minips_cmd(tmp, "server", [
        "server", "--port", "0", "--quiet", "--ready-file", str(ready), "--init", str(init),
        "--run-dir", str(tmp / "run"), "--model", spec["model"], "--workers", str(workers),
        "--mode", "gssp", "--groups", str(groups), "--staleness", "1000000",
        "--optimizer-at", spec["optimizer_at"], "--epochs", "0",
        "--compressor", "topk", "--checkpoint-every", str(args.checkpoint_every),
        "--calib-timeout", "600", "--lease", "60", "--heartbeat", "2",
        "--down-ratio", str(1.0 if args.dense_down else ratio), "--xchg-ratio", str(ratio),
        "--down-mode", "exact" if args.exact_down else "auto",
        "--xchg-mode", "exact" if args.exact_xchg else "topk",
        "--external-groups", str(groups if args.group_processes else 0)])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop([proc])
            raise RuntimeError(f"server did not start: {cmd}")
        time.sleep(0.05)
    host, port = ready.read_text().split()
    address = f"{host}:{port}"
    return [proc] + [subprocess.Popen(minips_cmd(tmp, f"group-{g}", [
        "group", "--connect", address, "--listen", "127.0.0.1:0",
        "--run-dir", str(tmp / f"group-{g}")]), env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL) for g in range(groups if args.group_processes else 0)], address


def start_clients(address: str, size: int, ratio: float, workers: int, active: int,
                  args: argparse.Namespace, env: dict[str, str]) -> list[subprocess.Popen[str]]:
    procs = []
    n = min(args.clients, workers)
    for c in range(n):
        ids = list(range(c, workers, n))
        cmd = [sys.executable, str(CLIENTS), "--connect", address, "--size", str(size),
               "--ratio", str(ratio), "--step-s", str(args.step_s),
               "--ids", ",".join(map(str, ids)),
               "--active", ",".join(str(w) for w in ids if w < active)]
        procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True))
    return procs


def wait_ready(procs: list[subprocess.Popen[str]], timeout_s: float) -> None:
    """Until every client process said ``ready``; RuntimeError if one failed or took too long."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        assert p.stdout is not None
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([p.stdout], [], [], left)[0]:
            raise RuntimeError(f"clients not ready within {timeout_s:.0f} s")
        line = p.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"client did not get ready: {line.strip()!r} (exit {p.poll()})")


def measure(tmp: Path, servers: list[subprocess.Popen[bytes]],
            procs: list[subprocess.Popen[str]], window: float,
            profile: str | None) -> dict[str, Any]:
    """The window: the clients' operations, the processes' CPU and memory, and the servers'
    CPU per message kind (their probes read before and after)."""
    pids, spids = [p.pid for p in procs], [p.pid for p in servers]
    files = [tmp / "probe-server.json"] + [tmp / f"probe-group-{g}.json"
                                           for g in range(len(servers) - 1)]
    spy = None
    if profile:  # py-spy samples the server through the window (collapsed stacks)
        spy = subprocess.Popen([py_spy(), "record", "--pid", str(servers[0].pid),
                                "--nonblocking", "--duration", str(int(window)), "--format",
                                "raw", "-o", profile],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    before = read_probes(servers, files)
    t0, s0, c0 = time.monotonic(), sum(map(cpu_seconds, spids)), sum(map(cpu_seconds, pids))
    time.sleep(window)
    t1, s1, c1 = time.monotonic(), sum(map(cpu_seconds, spids)), sum(map(cpu_seconds, pids))
    cpu = per_message(before, read_probes(servers, files))
    rss = sum(map(rss_mb, spids))
    if spy is not None:
        spy.wait(timeout=60)
    results = []
    for p in procs:
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write(f"{t0} {t1}\n")
        p.stdin.flush()
    for p in procs:
        assert p.stdout is not None
        results.append(json.loads(p.stdout.readline()))
    return {**summarize(results, t1 - t0, (s1 - s0) / (t1 - t0), (c1 - c0) / (t1 - t0), rss),
            "cpu_per_message": cpu}


def summarize(results: list[dict[str, Any]], span: float, server_cpu: float,
              clients_cpu: float, rss: float) -> dict[str, Any]:
    push = np.array([x for r in results for x in r["push_ms"]])
    pull = np.array([x for r in results for x in r["pull_ms"]])

    def pct(a: np.ndarray, q: float) -> float | None:
        return round(float(np.percentile(a, q)), 2) if a.size else None

    return {"pushes_s": round(push.size / span, 1),
            "push_bytes_s": round(sum(r["push_bytes"] for r in results) / span),
            "pull_bytes_s": round(sum(r["pull_bytes"] for r in results) / span),
            "push_ack_p50_ms": pct(push, 50), "push_ack_p99_ms": pct(push, 99),
            "pull_p50_ms": pct(pull, 50), "pull_p99_ms": pct(pull, 99),
            "server_cpu": round(server_cpu, 2), "clients_cpu": round(clients_cpu, 2),
            "server_rss_mb": round(rss, 1),
            "setup_stages_s": {k: max(r["setup"][k] for r in results)
                               for k in results[0].get("setup", {})} if results else {}}


def stop(procs: list[Any]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def point(root: Path, spec: dict[str, Any], args: argparse.Namespace,
          env: dict[str, str]) -> dict[str, Any]:
    """One figure: a fresh server (in a directory of its own, removed after) and clients, the
    window, everything stopped. ``spec``: model, optimizer_at, ratio, workers."""
    model, workers = spec["model"], spec["workers"]
    active = min(workers, args.max_active.get(model, workers))
    init = root / f"{model}.npy"
    if not init.exists():
        np.save(init, np.random.default_rng(0).normal(0, 0.05, MODELS[model]).astype(np.float32))
    tmp = Path(tempfile.mkdtemp(prefix="point-", dir=root))
    procs: list[Any] = []
    servers: list[Any] = []
    t = time.monotonic()
    try:
        servers, address = start_server(tmp, init, spec, args, env)
        procs = start_clients(address, MODELS[model], spec["ratio"], workers, active, args, env)
        wait_ready(procs, READY_TIMEOUT_S)
        setup_s = time.monotonic() - t
        profile = args.profile and (f"{args.profile}-{model}-{spec['optimizer_at']}-"
                                    f"{spec['ratio']}-{workers}.txt")
        fig = measure(tmp, servers, procs, args.window_s, profile)
    except RuntimeError as exc:  # the point failed (e.g. setup too slow): say so, go on
        setup_s, fig = time.monotonic() - t, {"error": str(exc), "push_ack_p99_ms": None}
    finally:
        stop(procs + servers)
        shutil.rmtree(tmp, ignore_errors=True)
    return {**spec, "params": MODELS[model], "active": active,
            "group_processes": args.group_processes, "setup_s": round(setup_s, 1), **fig}


def grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The points to measure, in order: model, optimizer place, ratio, workers."""
    return [{"model": m, "optimizer_at": place, "ratio": float(r), "workers": int(n)}
            for m in args.models.split(",") for place in args.optimizer_at.split(",")
            for r in args.ratios.split(",") for n in args.workers.split(",")]


def knee(points: list[dict[str, Any]], model: str, ratio: float, limit_ms: float,
         place: str = "server") -> int | None:
    """The largest worker count with p99 push -> ACK under ``limit_ms`` (None: not even 1),
    the optimizer at ``place`` (points of outputs older than that axis: on the servers)."""
    ok = [p["workers"] for p in points if p["model"] == model and p["ratio"] == ratio
          and p.get("optimizer_at", "server") == place
          and p["push_ack_p99_ms"] is not None and p["push_ack_p99_ms"] < limit_ms]
    return max(ok) if ok else None


def chart(points: list[dict[str, Any]], path: str,
          baseline: list[dict[str, Any]] | None = None) -> None:
    """pushes/s and p99 push->ACK against connected workers; ``baseline`` points dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3.2), dpi=80)
    def line(p: dict[str, Any]) -> tuple[str, str, float]:
        return p["model"], p.get("optimizer_at", "server"), p["ratio"]

    for i, (model, place, ratio) in enumerate(sorted({line(p) for p in points})):
        label = f"{model} {place} {'dense' if ratio >= 1 else f'{ratio:.0%}'}"
        for pts, style, suffix in ((points, "-", ""), (baseline or [], "--", " before")):
            sel = [p for p in pts if line(p) == (model, place, ratio)]
            if sel:
                xs = [p["workers"] for p in sel]
                kw = {"color": f"C{i}", "linestyle": style, "marker": "o", "markersize": 3}
                ax1.plot(xs, [p.get("pushes_s", float("nan")) for p in sel],
                         label=label + suffix, **kw)
                ax2.plot(xs, [p["push_ack_p99_ms"] or float("nan") for p in sel], **kw)
    for ax, title in ((ax1, "pushes/s"), (ax2, "p99 push->ACK, ms")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("connected workers")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax2.axhline(50, color="grey", linestyle=":", linewidth=1)
    ax1.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)


def _load(files: str | None) -> list[dict[str, Any]]:
    """The points of earlier --json outputs (comma-separated paths)."""
    return [p for f in (files or "").split(",") if f
            for p in json.loads(Path(f).read_text())["points"]]


# -- side by side with a git ref ----------------------------------------------------------------

@contextlib.contextmanager
def ref_tree(ref: str, parent: Path) -> Iterator[tuple[Path, str]]:
    """REF's tree checked out (``git worktree add --detach``) under ``parent``, and its commit;
    the worktree is removed after. SystemExit with one line when REF is not a commit here."""
    got = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "-q",
                          f"{ref}^{{commit}}"], capture_output=True, text=True)
    if got.returncode:
        raise SystemExit(f"--baseline-ref {ref}: not a commit in {REPO}")
    commit, tree = got.stdout.strip(), parent / "ref"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree),
                    commit], check=True, stdout=subprocess.DEVNULL)
    try:
        yield tree, commit
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run(["git", "-C", str(REPO), "worktree", "prune"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def ref_env(tree: Path) -> dict[str, str]:
    """The environment of REF's bench: its own tree first on the path (before this venv's
    editable install of this tree), so its server and clients run its code."""
    return {**os.environ, "PYTHONPATH": str(tree)}


def ref_flags(tree: Path) -> set[str]:
    """The flags REF's bench script knows (from its --help); SystemExit if it has none."""
    script = tree / "scripts" / "bench_server.py"
    if not script.exists():
        raise SystemExit(f"--baseline-ref: {script.relative_to(tree)} does not exist there")
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                         text=True, env=ref_env(tree), timeout=60)
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", out.stdout))


def ref_argv(spec: dict[str, Any], args: argparse.Namespace,
             known: set[str]) -> tuple[list[str], list[str]]:
    """The argv of REF's bench for one point of ``spec`` and the flags it left out (REF's
    script does not know them; their defaults are not passed either)."""
    wanted: list[tuple[str, str | None]] = [
        ("--json", None), ("--models", spec["model"]), ("--ratios", str(spec["ratio"])),
        ("--workers", str(spec["workers"])), ("--optimizer-at", spec["optimizer_at"]),
        ("--max-active", args.max_active_text), ("--step-s", str(args.step_s)),
        ("--window-s", str(args.window_s)), ("--clients", str(args.clients)),
        ("--groups", str(args.groups))]
    wanted += [(f, None) for f, on in (("--group-processes", args.group_processes),
                                       ("--dense-down", args.dense_down),
                                       ("--exact-down", args.exact_down),
                                       ("--exact-xchg", args.exact_xchg)) if on]
    if args.checkpoint_every:
        wanted.append(("--checkpoint-every", str(args.checkpoint_every)))
    argv, dropped = [], []
    for flag, value in wanted:
        if flag not in known:
            dropped.append(flag)
        else:
            argv += [flag] if value is None else [flag, value]
    return argv, dropped


def ref_point(tree: Path, spec: dict[str, Any], args: argparse.Namespace,
              known: set[str]) -> dict[str, Any]:
    """One point measured by REF's own bench script (its server, its clients, its code)."""
    argv, _ = ref_argv(spec, args, known)
    limit = READY_TIMEOUT_S + args.window_s + 120
    failed = {**spec, "push_ack_p99_ms": None}
    try:
        out = subprocess.run([sys.executable, str(tree / "scripts" / "bench_server.py"), *argv],
                             stdout=subprocess.PIPE, text=True, env=ref_env(tree),
                             timeout=limit)
    except subprocess.TimeoutExpired:
        return {**failed, "error": f"REF's bench took over {limit:.0f} s"}
    try:
        points = json.loads(out.stdout)["points"]
    except (json.JSONDecodeError, KeyError, TypeError):
        points = []
    if out.returncode or len(points) != 1:
        return {**failed, "error": f"REF's bench exited with {out.returncode}, "
                f"{len(points)} points"}
    return points[0]


def _median(values: list[Any]) -> float | None:
    got = [v for v in values if v is not None]
    return float(np.median(got)) if got else None


def side_by_side(spec: dict[str, Any], this: list[dict[str, Any]], ref: list[dict[str, Any]],
                 ref_place: str) -> dict[str, Any]:
    """One point's runs of both trees: each figure of ``COMPARED`` per run, and the ratio of
    the medians, this tree / REF (None where either has no figure)."""
    row: dict[str, Any] = {**spec, "ref_optimizer_at": ref_place,
                           "this": {k: [p.get(k) for p in this] for k in COMPARED},
                           "ref": {k: [p.get(k) for p in ref] for k in COMPARED},
                           "this_over_ref": {}}
    for k in COMPARED:
        a, b = _median(row["this"][k]), _median(row["ref"][k])
        row["this_over_ref"][k] = round(a / b, 3) if a is not None and b else None
    errors = [p["error"] for p in this + ref if "error" in p]
    if errors:
        row["errors"] = errors
    return row


def measure_side_by_side(root: Path, args: argparse.Namespace,
                         env: dict[str, str]) -> dict[str, Any]:
    """Every point, ``args.runs`` times with each tree, alternating: the output's
    ``points``, ``baseline`` and ``side_by_side``."""
    with ref_tree(args.baseline_ref, root) as (tree, commit):
        known = ref_flags(tree)
        rows, ours, theirs, dropped = [], [], [], set()
        for spec in grid(args):
            this, ref = [], []
            for _ in range(args.runs):
                this.append(point(root, spec, args, env))
                ref.append(ref_point(tree, spec, args, known))
                if not args.json:
                    print(json.dumps({"this": this[-1], "ref": ref[-1]}), flush=True)
            dropped |= set(ref_argv(spec, args, known)[1])
            place = spec["optimizer_at"] if "--optimizer-at" in known else \
                "its bench's one place (it has no --optimizer-at)"
            rows.append(side_by_side(spec, this, ref, place))
            ours += this
            theirs += ref
    return {"points": ours, "side_by_side": rows, "baseline": {
        "ref": args.baseline_ref, "commit": commit, "points": theirs,
        "driver": "REF's own scripts/bench_server.py and clients, PYTHONPATH = REF's tree",
        "dropped_flags": sorted(dropped)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document (else lines)")
    ap.add_argument("--models", default="lenet5,resnet18,vgg19", help="models to measure")
    ap.add_argument("--optimizer-at", default="server,worker",
                    help="places of the optimizer to measure: server (workers push gradients), "
                    "worker (they push updates the servers add)")
    ap.add_argument("--ratios", default="0.01,1", help="pushed fractions (1 = dense)")
    ap.add_argument("--workers", default="1,4,16,64,256,1024", help="connected worker counts")
    ap.add_argument("--max-active", default="lenet5=1024,resnet18=16,vgg19=16",
                    help="MODEL=N: at most N active workers, the rest idle")
    ap.add_argument("--step-s", type=float, default=0.1, help="s between an active worker's steps")
    ap.add_argument("--window-s", type=float, default=3.0, help="measured seconds per point")
    ap.add_argument("--clients", type=int, default=3, help="client processes")
    ap.add_argument("--groups", type=int, default=4, help="group servers (GSSP groups)")
    ap.add_argument("--group-processes", action="store_true",
                    help="group servers as `minips group` processes (default: in the server's)")
    ap.add_argument("--checkpoint-every", type=float, default=0.0,
                    help="s between the server's checkpoints (0: none; the checkpoint row)")
    ap.add_argument("--dense-down", action="store_true",
                    help="answer every PULL with the dense weights (the downlink before it was "
                    "compressed)")
    ap.add_argument("--exact-down", action="store_true",
                    help="answer PULLs with the exact downlink (--down-mode exact: the changes "
                    "since the worker's version, at their values now)")
    ap.add_argument("--exact-xchg", action="store_true",
                    help="groups exchange with the global server exactly (--xchg-mode exact: "
                    "every entry changed since the last exchange, both ways)")
    ap.add_argument("--profile", help="py-spy the server: collapsed stacks to PREFIX-...txt")
    ap.add_argument("--chart", help="write a PNG of pushes/s and p99 push->ACK here")
    ap.add_argument("--baseline", help="earlier --json outputs, FILE,...: drawn dashed, knee shown")
    ap.add_argument("--replot", help="draw and summarise these --json outputs, FILE,... "
                    "instead of measuring")
    ap.add_argument("--runs", type=int, default=1, help="measure each point this many times")
    ap.add_argument("--baseline-ref", metavar="REF",
                    help="measure each point with this git ref's tree too, alternating runs, "
                    "and give the ratio per point (side_by_side)")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.profile:
        py_spy()  # before any server starts: a missing py-spy is one line, not a traceback
    args.max_active_text = args.max_active
    args.max_active = {k: int(v) for k, v in (x.split("=") for x in args.max_active.split(","))}
    env = {**os.environ, "MINIPS_TOKEN": secrets.token_hex(16), "PYTHONPATH": str(REPO)}
    points, load0 = _load(args.replot), os.getloadavg()
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-server-") as d:
        if args.baseline_ref and not args.replot:
            extra = measure_side_by_side(Path(d), args, env)
            points = extra.pop("points")
        for spec in grid(args) if not (args.replot or args.baseline_ref) else ():
            for _ in range(args.runs):
                points.append(point(Path(d), spec, args, env))
                if not args.json:
                    print(json.dumps(points[-1]), flush=True)
    out = {"load_avg_start": load0, "load_avg_end": os.getloadavg(), "step_s": args.step_s,
           "group_processes": args.group_processes, "dense_down": args.dense_down,
           "exact_down": args.exact_down, "exact_xchg": args.exact_xchg,
           "window_s": args.window_s, "clients": args.clients, "runs": args.runs,
           "points": points, **extra,
           "knee_lenet5_1pct_p99_under_50ms": knee(points, "lenet5", 0.01, 50.0)}
    baseline = _load(args.baseline) if args.baseline else None
    if baseline is None and "baseline" in extra:  # the chart draws REF's points dashed
        baseline = extra["baseline"]["points"]
    if baseline is not None:
        out["baseline_knee_lenet5_1pct_p99_under_50ms"] = knee(baseline, "lenet5", 0.01, 50.0)
    if args.chart:
        chart(points, args.chart, baseline)
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-probed"]:  # a server process of a point (serve_probed)
        sys.exit(serve_probed(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
