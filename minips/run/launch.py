"""`minips local`: a whole cluster on this machine, from the run directory to the summary.

One global server (`minips server`, its group servers in its process), N workers and an
evaluator, each a real process talking TCP on loopback exactly as on several machines. The
launcher owns only process management: it writes the initial weights (so every run of one seed
starts from the same point), starts the server on a free port and waits for its ready file,
starts the workers in parallel (importing torch takes seconds each), draws a progress line from
the metrics files, and when the server exits (budget spent) collects the children, writes
summary.json and the PNG charts and prints where they are.

The file holds, in order:

- ``ProgressLine``, `minips local`'s progress line: time, epochs, merges, test accuracy and the
  MB of every hop, read from the tails of the run directory's files (redrawn in place on a
  terminal, a line every 10 s in a log).
- ``Cluster``, the child processes of one run: the global server, the workers and the
  evaluator, each `python -m minips ROLE` in a session of its own, with their logs in
  ``<run dir>/logs``; the links' shaping (``netshape.plan``) around them.
- ``run_local`` and its ``LaunchConfig``. `minips server`'s process is in cli.py
  (``run_server``, ``serve_run``).

With ``--link`` the workers' links are shaped (``netshape.plan``): by the kernel, each worker
in a network namespace of its own behind a rate-limited veth pair and the servers listening on
the host end of worker 0's pair, or by token buckets in the workers (the pacer). link.json in
the run directory (and ``link`` in summary.json) says which; the namespaces are removed when the
run ends, and those of a launcher that was killed before the next kernel-shaped run starts.

Invariants: every child runs in its own session, so Ctrl-C reaches the launcher only; the
launcher then stops the children (``Cluster.stop``: SIGTERM to each child's session, SIGKILL
after ``grace_s``) and still writes the summary; SIGTERM does the same (status "terminated").
No child outlives ``run_local``, nor the launcher's death by any signal, SIGKILL included
(``lifeline.py``: each child watches it).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minips.core.config import LARGE_MODEL_PARAMS, PARAM_COUNTS, RunConfig
from minips.core.slowdown import Schedule
from minips.errors import ConfigError, MiniPSError
from minips.net import lifeline, links, netshape
from minips.net.endpoints import (
    DASHBOARD_TOKEN_BYTES,
    DASHBOARD_TOKEN_ENV,
    check_port,
    is_loopback,
    local_addresses,
    parse_address,
    reachable_url,
)
from minips.record.ledger import progress_text
from minips.record.metrics import DataWatch, TrainingClock, summarize
from minips.record.plot import plot_run
from minips.record.rundir import claim, read_config, read_jsonl, tail_jsonl
from minips.run.trace_cmd import child_trace_args

__all__ = [
    "ProgressLine",
    "Cluster",
    "prometheus_note",
    "WorkersFailed",
    "READY_TIMEOUT_S",
    "EXIT_TIMEOUT_S",
    "Terminated",
    "run_local",
    "make_run_dir",
    "write_init",
    "LaunchConfig",
    "parse_slowdowns",
]


# -- the progress line -----------------------------------------------------------------------------

class ProgressLine:
    """One self-overwriting status line: time, samples / epochs, accuracy, and the MB of every
    hop: up (worker -> group), down (group -> worker), to-global, from-global, total."""

    def __init__(self, run_dir: Path, run: RunConfig, *, tty: bool | None = None) -> None:
        self.run_dir = run_dir
        self.run = run
        self.last = 0.0  # when the line was last drawn
        self.text = ""  # what it said then
        self.train_size = max(1, _train_size(run))  # samples per epoch, for the epochs figure
        # a terminal: redraw in place; a log (or a console with other lines): one every 10 s
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.data = DataWatch(run_dir)  # data-*.json here, and what remote workers reported
        self.clock = TrainingClock(run_dir)  # summary.json's train_s, as it goes

    def draw(self, final: bool = False) -> None:
        """The line as of the global server's last record (its figures are the ledger's:
        record/ledger.py) and the evaluator's last score; one read of each file's tail."""
        if not (final or self.tty or time.monotonic() - self.last >= 10.0):
            return  # in a log file: one line every 10 s
        self.last = time.monotonic()
        ev = _last_record(self.run_dir / "eval.jsonl")
        gl = _last_record(self.run_dir / "global.jsonl")
        acc = ev.get("accuracy") if isinstance(ev.get("accuracy"), (int, float)) else None
        text = progress_text(self.clock.text(time.time()), self.run.mode,
                             self.run.compressor, gl, acc, self.data.verdict(), self.train_size)
        if final and not self.tty and text == self.text:
            return  # the last line drawn already says it: not twice
        self.text = text
        print("\r" + text if self.tty else text, end="\n" if final or not self.tty else "",
              flush=True, file=sys.stderr)


def _train_size(run: RunConfig) -> int:
    try:
        return run.epoch_samples()
    except MiniPSError:
        return 1


def _last_record(path: Path) -> dict[str, Any]:
    """The last complete JSON line of a file ({} when none), reading only its tail."""
    return (tail_jsonl(path, 8192) or [{}])[-1]


# -- the child processes of one run ----------------------------------------------------------------

READY_TIMEOUT_S = 60.0  # the server must be listening within this long
EXIT_TIMEOUT_S = 30.0  # after the server exits, workers and evaluator get this long to leave
PROGRESS_PERIOD_S = 0.5  # progress line refresh


class WorkersFailed(MiniPSError):
    """Every worker of a local run exited, some with an error, while the server waits."""


def prometheus_note(page: str, guarded: bool) -> str:
    """The words printed after a dashboard's ``page`` URL: where Prometheus scrapes and how it
    passes the token that /metrics asks for as the page does (web.py: a ``?token=`` query or an
    ``Authorization: Bearer`` header). ``guarded``: the dashboard has a token even if ``page``
    does not show it (it is $MINIPS_DASHBOARD_TOKEN then)."""
    base, _, query = page.partition("?")
    metrics = base.rstrip("/") + "/metrics"
    token = urllib.parse.parse_qs(query).get("token", [""])[0]
    if not token and not guarded:
        return f"(Prometheus: {metrics}, no token asked)"
    shown = token or f"${DASHBOARD_TOKEN_ENV}"
    return f"(Prometheus: {metrics}?token={shown}, or header 'Authorization: Bearer <token>')"


class Cluster:
    """The child processes of one local run."""

    def __init__(self, cfg: LaunchConfig, run_dir: Path, token: str,
                 link: links.LinkProfile | None = None) -> None:
        self.cfg = cfg
        self.link = link  # the workers' links (--link), None: not limited
        self.shaping = "none"  # how they are shaped: none | kernel | pacer
        self.spaces: netshape.Namespaces | None = None  # the namespaces of kernel shaping
        self.changes = links.parse_link_changes(cfg.link_changes)  # due, in time order
        self.trained_at: float | None = None  # unix time training started (links change)
        self.run_dir = run_dir
        # children die with the launcher, by any signal (lifeline.py)
        # the dashboard's own token (never the cluster's): made here unless given, so the
        # server's log in the run directory does not carry it; only this console prints it
        self.dashboard_token = "" if os.environ.get(DASHBOARD_TOKEN_ENV) else \
            secrets.token_urlsafe(DASHBOARD_TOKEN_BYTES)
        self.env = lifeline.child_env({**os.environ, "MINIPS_TOKEN": token,
                                       "PYTHONUNBUFFERED": "1",
                                       **({DASHBOARD_TOKEN_ENV: self.dashboard_token}
                                          if self.dashboard_token else {})})
        self.logs = run_dir / "logs"
        self.logs.mkdir(exist_ok=True)
        self.server: subprocess.Popen[bytes] | None = None
        self.children: dict[str, subprocess.Popen[bytes]] = {}  # "server", "worker-0", ...
        self.address = ""

    def _spawn(self, name: str, args: list[str], netns: int = -1) -> subprocess.Popen[bytes]:
        """``minips ARGS`` as a child (in worker ``netns``'s namespace when >= 0)."""
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        argv = [sys.executable, "-m", "minips", *args,
                *child_trace_args(self.cfg.trace, self.run_dir, name, self.cfg.trace_cap_mb)]
        if netns >= 0 and self.spaces is not None:
            argv = self.spaces.command(netns, argv)  # ip netns exec: execs, stays our child
        proc = subprocess.Popen(argv, env=self.env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()  # the child holds its own descriptor
        self.children[name] = proc
        return proc

    def shape(self) -> None:
        """Set up the links' shaping (before any child starts) and write link.json."""
        self.shaping, self.spaces = netshape.plan(self.link, self.cfg.run.workers,
                                                  self.cfg.link_shaping)
        if self.link is not None:
            record = self.link.record(self.cfg.run.workers, self.shaping)
            (self.run_dir / links.LINK_FILE).write_text(json.dumps(record) + "\n")
        if self.changes and self.spaces is None:
            raise ConfigError("--link-change needs kernel shaping (root, a --link profile "
                              f"and --link-shaping kernel or auto); this run's: {self.shaping}")

    def change_links(self) -> None:
        """--link-change: apply the changes that are due, T counted from the global server's
        ``groups`` event; each one is a ``link`` record in links.jsonl."""
        if not self.changes or self.spaces is None:
            return
        if self.trained_at is None:
            grouped = [r for r in read_jsonl(self.run_dir / "global.jsonl")
                       if r.get("event") == "groups"]
            if not grouped:
                return
            self.trained_at = float(read_config(self.run_dir).get("t0", 0)) + grouped[0]["t"]
        while self.changes and self.changes[0].at_s <= time.time() - self.trained_at:
            change = self.changes.pop(0)
            for w in range(self.cfg.run.workers):
                if change.applies_to(w):
                    self.spaces.set_rate(w, change.rate)
                    self._record_link(w, change)

    def _record_link(self, w: int, change: links.LinkChange) -> None:
        t0 = float(read_config(self.run_dir).get("t0", 0))
        line = {"t": time.time() - t0, "event": "link", "worker": w, "at_s": change.at_s,
                "up_bps": change.rate.up_bps, "down_bps": change.rate.down_bps}
        with open(self.run_dir / "links.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def unshape(self) -> None:
        """Remove the namespaces and veth pairs (after the children stopped)."""
        if self.spaces is not None:
            self.spaces.remove()
            self.spaces = None

    def start_server(self, init: Path) -> str:
        """Start the global server on a free port; return its "host:port"."""
        (self.run_dir / "run.json").write_text(json.dumps(self.cfg.run.to_info()))
        ready = self.run_dir / "server.addr"
        ready.unlink(missing_ok=True)
        (self.run_dir / "dashboard.url").unlink(missing_ok=True)  # not a URL of an earlier run
        watch = [f"--{k}={v}" for k in ("dashboard", "tensorboard") if (v := getattr(self.cfg, k))]
        self.server = self._spawn("server", [
            "server", "--host", self.spaces.server_host if self.spaces else "127.0.0.1",
            "--port", "0", "--run-dir", str(self.run_dir),
            "--run-config", str(self.run_dir / "run.json"), "--init", str(init),
            "--ready-file", str(ready), "--quiet", *watch, *self._external_args()])
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise MiniPSError(f"the server did not start; see {self.logs / 'server.log'}")
            time.sleep(0.05)
        host, port = ready.read_text().split()
        self.address = f"{host}:{port}"
        return self.address

    def _external_args(self) -> list[str]:
        groups = self.cfg.group_processes()
        return ["--external-groups", str(groups)] if groups else []

    def start_groups(self) -> None:
        """A large model's group servers, each a `minips group` child beside the global
        server (its own core, its own run directory RUN/group-G), said in one console line."""
        groups = self.cfg.group_processes()
        if not groups:
            return
        host = self.spaces.server_host if self.spaces else "127.0.0.1"
        for g in range(groups):
            self._spawn(f"group-{g}", ["group", "--connect", self.address, "--listen",
                                       f"{host}:0", "--run-dir", str(self.run_dir / f"group-{g}")])
        print(f"minips local: --model {self.cfg.run.model}: {groups} group servers run as "
              "processes of their own, so the groups' work spreads over the cores; the group "
              "count is fixed and every exchange crosses TCP (--groups-in-process keeps them "
              "in the server's process)", file=sys.stderr, flush=True)

    def announce_dashboard(self) -> None:
        """Print the dashboard's URL once the server wrote it (it starts after the ready file)."""
        url_file = self.run_dir / "dashboard.url"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not url_file.exists():
            if self.server is None or self.server.poll() is not None \
                    or time.monotonic() > deadline:
                return  # the server's log says why; the run's end reports it
            time.sleep(0.05)
        url = url_file.read_text().strip()  # the address only: no token in the run directory
        url = reachable_url(url, local_addresses()[0])  # not 0.0.0.0: one a browser opens
        host = parse_address(url.split("//", 1)[-1].rstrip("/"), 0)[0]
        guarded = not is_loopback(host)  # the server's dashboard asks for a token there
        if self.dashboard_token and guarded:
            url += f"?token={self.dashboard_token}"
        print(f"minips local: dashboard at {url}  {prometheus_note(url, guarded)}",
              file=sys.stderr, flush=True)

    def start_workers(self) -> None:
        """All workers at once (they calibrate while the others import torch)."""
        for i, factor in enumerate(self.cfg.factors()):
            given = self.cfg.schedules[i] if i < len(self.cfg.schedules) else None
            slowdown = given.text() if given is not None and given.changes else repr(factor)
            throttle = ["--throttle", self.cfg.throttle] if self.cfg.throttle else []
            self._spawn(f"worker-{i}", [
                "worker", "--connect", self.address, "--id", str(i), "--slowdown", slowdown,
                *throttle,
                *self._link_args(i), "--run-dir", str(self.run_dir), "--timeout", "60",
                "--data", self.cfg.data,
                "--device", self.cfg.device(i), *(["--amp"] if self.cfg.amp else [])],
                netns=i if self.spaces else -1)

    def _link_args(self, worker: int) -> list[str]:
        """Worker flags of its link: the latency, and the pacer's rates (bytes/s) when the
        workers pace their links themselves."""
        if self.link is None:
            return []
        args = ["--latency", repr(self.link.latency_s)] if self.link.latency_s else []
        if self.shaping == "pacer":
            rate = self.link.rate(worker)
            args += ["--bandwidth", repr(rate.up_bps / 8), "--bandwidth-down",
                     repr(rate.down_bps / 8)]
        return args

    def start_evaluator(self) -> None:
        self._spawn("evaluator", ["evaluator", "--connect", self.address, "--data",
                                  self.cfg.data, "--run-dir", str(self.run_dir), "--timeout",
                                  "60"])

    def wait(self, timeout_s: float, progress: bool) -> int:
        """Until the server exits (its return code) or ``timeout_s`` passes (TimeoutError)."""
        assert self.server is not None
        line = ProgressLine(self.run_dir, self.cfg.run) if progress else None
        deadline = time.monotonic() + timeout_s
        while self.server.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"run still going after {timeout_s:.0f} s")
            self._check_workers()
            self.change_links()
            if line is not None:
                line.draw()
            time.sleep(PROGRESS_PERIOD_S)
        if line is not None:
            line.draw(final=True)
        return int(self.server.returncode)

    def _check_workers(self) -> None:
        """Every worker exited, one at least with an error: nobody will rejoin (the server
        would wait --rejoin-wait for them); ``WorkersFailed`` ends the run now."""
        workers = {n: p for n, p in self.children.items() if n.startswith("worker-")}
        if workers and all(p.poll() is not None for p in workers.values()):
            failed = sorted(n for n, p in workers.items() if p.returncode)
            if failed:
                raise WorkersFailed(f"{', '.join(failed)} exited with an error; see their logs "
                                    f"in {self.logs}")

    def collect(self, timeout_s: float = EXIT_TIMEOUT_S) -> list[str]:
        """Give the other children ``timeout_s`` to exit on their own; return the names of
        those that exited with an error (their logs say why)."""
        deadline = time.monotonic() + timeout_s
        for proc in self.children.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [name for name, proc in self.children.items() if proc.poll()]

    def stop(self) -> None:
        """SIGTERM every live child, SIGKILL what is left after ``grace_s``."""
        live = [p for p in self.children.values() if p.poll() is None]
        for p in live:
            _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.grace_s
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(p, signal.SIGKILL)
                p.wait()


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the child's session: the child and anything it started
    except ProcessLookupError:
        pass


# -- `minips local`: run directory, cluster, summary -----------------------------------------------

class Terminated(MiniPSError):
    """SIGTERM reached the launcher: stop the cluster, write the summary, exit 143."""


def make_run_dir(cfg: LaunchConfig) -> Path:
    """runs/<time>-<mode>-<compressor>/ (or ``cfg.name``), created, with a unique name."""
    name = cfg.name or f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.run.mode}-{cfg.run.compressor}"
    path = Path(cfg.out_dir) / name
    n = 1
    while path.exists() and cfg.name is None:
        n += 1
        path = Path(cfg.out_dir) / f"{name}-{n}"
    aside = claim(path, option="--name", force=cfg.force)  # a named one may hold a run
    if aside is not None:
        print(f"minips local: moved the earlier run in {path} to {aside}", file=sys.stderr)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_init(run_dir: Path, model: str, seed: int) -> Path:
    """The model's initial flat weights as init.npy (torch is imported here only)."""
    from minips.ml import models

    path = run_dir / "init.npy"
    np.save(path, models.get_flat(models.build_model(model, seed)))
    return path


def _timeout(cfg: LaunchConfig) -> float:
    if cfg.timeout_s > 0:
        return cfg.timeout_s
    return (cfg.run.wall_s or 1800.0) + 120.0


def run_local(cfg: LaunchConfig) -> dict[str, Any]:
    """Run the cluster to the end of its budget; return the summary (``status`` added)."""
    cfg.run.validate()
    if cfg.dashboard:  # taken: one line naming the flag, before the run directory is made
        check_port("--dashboard", *parse_address(cfg.dashboard))
    run_dir = make_run_dir(cfg)
    token = os.environ.get("MINIPS_TOKEN") or secrets.token_hex(16)
    (run_dir / "launch.json").write_text(json.dumps(asdict(cfg), indent=2))
    print(f"minips local: run directory {run_dir}", file=sys.stderr, flush=True)
    cluster = Cluster(cfg, run_dir, token, links.parse_profile(cfg.link) if cfg.link else None)
    status = "done"
    previous = _on_sigterm(_terminate)
    try:
        cluster.shape()
        cluster.start_server(write_init(run_dir, cfg.run.model, cfg.run.seed))
        cluster.start_groups()
        cluster.start_workers()
        if cfg.evaluator:
            cluster.start_evaluator()
        if cfg.dashboard:
            cluster.announce_dashboard()
        if cluster.wait(_timeout(cfg), cfg.progress) != 0:
            status = "failed"
        failed = cluster.collect()
        if failed:
            print(f"minips local: {', '.join(failed)} exited with an error; see their logs in "
                  f"{cluster.logs}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        status = "interrupted"
    except TimeoutError:
        status = "timeout"
    except Terminated:
        status = "terminated"
    except WorkersFailed as exc:
        print(f"minips local: {exc}", file=sys.stderr, flush=True)
        status = "failed"
    finally:
        cluster.stop()
        cluster.unshape()
        _on_sigterm(previous)
    return _finish(cfg, run_dir, status)


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated("terminated by SIGTERM")


def _on_sigterm(handler: Any) -> Any:
    """Install ``handler`` for SIGTERM; return the previous one (None off the main thread,
    where Python cannot set handlers: the caller's own handling applies)."""
    try:
        return signal.signal(signal.SIGTERM, handler)
    except (ValueError, TypeError):
        return None


def _finish(cfg: LaunchConfig, run_dir: Path, status: str) -> dict[str, Any]:
    summary = summarize(run_dir, write=False)
    summary.update(status=status, run_dir=str(run_dir), slowdowns=cfg.factors())
    link = links.read_link_record(run_dir)  # the link of a --link run
    if link is not None:
        summary["link"] = link
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    pngs = plot_run(run_dir, "minips local") if cfg.plot and status != "terminated" else []
    acc = summary.get("final_accuracy")
    print(f"minips local: {status} after {summary.get('train_s') or 0:.1f} s of training "
          f"(start-up {summary.get('train_start_s') or 0:.1f} s before it), final accuracy "
          f"{acc if acc is None else round(acc, 4)} ({summary.get('data') or 'unknown'} data)"
          f"\n  run directory: {run_dir}\n"
          f"  summary:       {run_dir / 'summary.json'}", file=sys.stderr, flush=True)
    for p in pngs:
        print(f"  plot:          {p}", file=sys.stderr, flush=True)
    return summary


@dataclass
class LaunchConfig:
    """`minips local`: a whole cluster of processes on this machine."""

    run: RunConfig = field(default_factory=RunConfig)  # the run's settings
    slowdowns: list[float] = field(default_factory=list)  # factor F per worker; [] = all 1.0
    schedules: list[Schedule] = field(default_factory=list)  # F over time per worker; [] = flat
    throttle: str = ""  # --throttle P,MIN-MAX,SECONDS of every worker (core/slowdown.py)
    link: str = ""  # --link profile of the workers' links (links.py); "" = not limited
    link_shaping: str = "auto"  # auto | kernel (namespaces + tc) | pacer (token buckets)
    link_changes: str = ""  # --link-change W:RATE@T,... (links.py; kernel shaping only)
    out_dir: str = "runs"  # parent of the run directory
    name: str | None = None  # run directory name; None = mode-compressor-time
    progress: bool = True  # draw the one-line progress display
    evaluator: bool = True  # start the evaluator process
    plot: bool = True  # draw the PNGs at the end
    timeout_s: float = 0.0  # hard stop of the whole cluster; 0 = budget + a margin
    grace_s: float = 5.0  # SIGTERM to SIGKILL delay when stopping children
    dashboard: str = ""  # HOST:PORT of the server's live dashboard; "" = none
    tensorboard: str = ""  # directory for the server's TensorBoard event files; "" = none
    devices: list[str] = field(default_factory=lambda: ["auto"])  # per worker; last repeats
    amp: bool = False  # workers use mixed precision where their device supports it
    force: bool = False  # a --name directory holding an earlier run: move it aside (else refused)
    data: str = "real"  # the workers' and evaluator's --data: real files, or synthetic (asked)
    groups_in_process: bool = False  # a large model's group servers stay in the server's process
    trace: str | None = None  # --trace: each child's frames in DIR/<name>.trace.jsonl; "": run dir
    trace_cap_mb: float = 20.0  # --trace-cap: MB of each trace file before it is sampled

    def group_processes(self) -> int:
        """How many `minips group` processes this run starts: for a model of
        ``LARGE_MODEL_PARAMS`` or more one per group (the run's fixed count, or GSSP's
        ``max_groups``, at most one per worker), so each group's merges and answers get a core
        of their own (docs/performance.md); 0 (in the server's process) for a smaller model or
        with ``groups_in_process``."""
        if self.groups_in_process or PARAM_COUNTS.get(self.run.model, 0) < LARGE_MODEL_PARAMS:
            return 0
        return self.run.fixed_groups or min(self.run.max_groups, self.run.workers)

    def factors(self) -> list[float]:
        """Slowdown factor of each of the run's workers (missing ones are 1.0)."""
        given = list(self.slowdowns)[: self.run.workers]
        return given + [1.0] * (self.run.workers - len(given))

    def device(self, worker: int) -> str:
        """``--device`` of worker ``worker``: its entry in ``devices``, else the last one."""
        return self.devices[min(worker, len(self.devices) - 1)] if self.devices else "auto"


def parse_slowdowns(text: str) -> list[float]:
    """'1,1,2x2,4' → [1, 1, 2, 2, 4]; 'FxN' repeats F N times. Spaces around an entry are
    ignored ('1, 2' is [1, 2]); an empty entry ('1,,2', '1,') is refused: it is a typo, not
    a worker."""
    out: list[float] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise ConfigError(f"bad slowdown {text!r}: an empty entry, expected F or FxN "
                              "between the commas")
        factor, _, count = part.partition("x")
        try:
            out += [float(factor)] * int(count or 1)
        except ValueError:
            raise ConfigError(f"bad slowdown {part!r}, expected F or FxN") from None
    if any(f <= 0 for f in out):
        raise ConfigError(f"slowdown factors must be > 0, got {out}")
    return out
