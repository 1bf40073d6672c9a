"""`minips` command line: server, group, worker, evaluator, local, plot.

The file holds, in order: `minips server`'s process (``serve_run``, ``run_server``): a
``GlobalServer`` (fresh, or resumed from its checkpoint) served until its run is over, with the
dashboard / TensorBoard monitor and an evaluator child when asked; then one command per role and
``main``.

The parser and the run settings' flags are in flags.py. The CLI only parses flags into the
config dataclasses of each role (``RunConfig`` and ``WorkerConfig`` in core/config.py,
``ServerConfig`` in server.py, ``GroupConfig`` in serve/group_process.py, ``LaunchConfig`` in
launch.py) and calls one entry point per role; it holds no logic of its own. torch is imported
lazily (workers, the evaluator and `local`), so `minips server` and `minips group` run on
machines without it. The shared secret comes from the environment (MINIPS_TOKEN), never from a
flag, so it does not show in `ps`; the dashboard's own read-only token too
(MINIPS_DASHBOARD_TOKEN, or one made at start), never the cluster's.

Run settings resolve in this order: RunConfig defaults (a command's own first: `minips
server` has no emulated base step), then ``--run-config``, then ``--preset``, then explicit
flags (``flags.run_config_from_args``); a run that names no budget gets one epoch.
``--config FILE.toml`` supplies flags in front of the command line's (``flags.with_config``), so
the command line overrides the file. Errors the user can fix (bad flag, unreachable address,
wrong secret, a run directory that holds another run) print one line and exit 2.

`minips server` says what it does on its console: the commands other machines run (``join:``
/ ``group:`` lines with its reachable address, ``join_commands``), joins and the groups
(``server.console_line``), a progress line, and at the end the headline of the summary.json it
writes in its run directory.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from minips.core.config import WorkerConfig
from minips.core.slowdown import Schedule
from minips.core.snapshot import check_compatible
from minips.errors import ConfigError, MiniPSError
from minips.net import lifeline, transport
from minips.net.endpoints import (
    WILDCARD_HOSTS,
    check_bind,
    check_port,
    dashboard_secret,
    format_address,
    is_loopback,
    issuing_ca,
    local_addresses,
    parse_address,
    reachable_url,
)
from minips.record.checkpoint import load
from minips.record.metrics import summarize
from minips.record.rundir import claim, dump_json, holds_run
from minips.run import flags, trace_cmd
from minips.run.checks import (
    check_address,
    check_checkpoint,
    check_dir,
    check_host,
    check_init,
    check_link,
    check_tls_client,
    check_tls_server,
    speaks_tls,
)
from minips.run.flags import PRESETS, build_parser, run_config_from_args
from minips.run.launch import LaunchConfig, prometheus_note
from minips.serve.group_process import GroupConfig
from minips.server import GlobalServer, ServerConfig

__all__ = ["serve_run", "run_server", "reachable_hosts", "join_commands", "keep_flags", "main"]

TOKEN_ENV = "MINIPS_TOKEN"
PROGRESS_EVERY_S = 10.0  # `minips server`'s progress line, one every this many seconds


def _token() -> str:
    return os.environ.get(TOKEN_ENV, "")


# -- `minips server`'s process: a GlobalServer served until its run is over ------------------------

async def serve_run(cfg: ServerConfig, *, announce: bool = True,
                    spawn_evaluator: bool = False) -> GlobalServer:
    """Run a global server until its run is over; return it (closed) for inspection.
    With ``cfg.resume`` it starts from the checkpoint (refused if from another config)."""
    srv = _make_server(cfg)
    port = await srv.start()
    try:  # after the ready file: importing the dashboard's packages does not delay workers
        monitor = await _start_monitor(cfg, srv)
    except BaseException:  # e.g. its port is taken: the error ends the server, cleanly
        await srv.close()
        raise
    if announce:
        _announce(cfg, port)
    child = _spawn_evaluator(cfg, port) if spawn_evaluator else None
    progress = asyncio.ensure_future(_progress(srv)) if cfg.console and announce else None
    try:
        await srv.wait_finished()
    finally:
        if progress is not None:
            progress.cancel()
        await srv.close()
        if monitor is not None:
            await monitor.stop()
        if child is not None:
            await asyncio.get_running_loop().run_in_executor(None, _reap, child)
    return srv


async def _progress(srv: GlobalServer) -> None:
    """The progress line every PROGRESS_EVERY_S once training started, from the server's
    memory (``GlobalServer.progress_text``: its ledger, no file read, no thread)."""
    await srv.groups_opened.wait()
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        print(srv.progress_text(), file=sys.stderr, flush=True)


async def _start_monitor(cfg: ServerConfig, srv: GlobalServer) -> Any:
    """The dashboard / TensorBoard monitor of ``--dashboard`` / ``--tensorboard``, or None."""
    if not (cfg.dashboard or cfg.tensorboard):
        return None
    from minips.dashboard.monitor import Monitor, MonitorConfig

    monitor = Monitor(MonitorConfig(run_dir=cfg.run_dir, dashboard=cfg.dashboard,
                                    tensorboard=cfg.tensorboard, token=dashboard_secret(),
                                    insecure=cfg.insecure), srv)
    url = await monitor.start()
    if url:  # a token not in the URL is $MINIPS_DASHBOARD_TOKEN's (Monitor._token)
        guarded = "?token=" in url or bool(dashboard_secret()) and not is_loopback(
            parse_address(url.split("//", 1)[-1].split("/")[0], 0)[0])
        url = reachable_url(url, reachable_hosts(cfg)[0])
        print(f"minips server: dashboard at {url}  {prometheus_note(url, guarded)}", flush=True)
    return monitor


def _make_server(cfg: ServerConfig) -> GlobalServer:
    if not cfg.resume:
        return GlobalServer(cfg, np.load(cfg.init_path) if cfg.init_path else None)
    state = load(cfg.checkpoint_path or Path(cfg.run_dir) / "checkpoint.npz")
    check_compatible(state, cfg.run.to_info(), np.asarray(state["weights"]).size)
    cfg.run.t0 = float(state["t0"])  # metrics keep one time axis across the restart
    srv = GlobalServer(cfg, None)
    srv.restore(state)
    return srv


def reachable_hosts(cfg: ServerConfig) -> list[str]:
    """Where other machines reach this server: ``--advertise``, else the listen host, else
    (a wildcard) this machine's addresses (``endpoints.local_addresses``)."""
    if cfg.advertise_host:
        return [cfg.advertise_host]
    return [cfg.host] if cfg.host not in WILDCARD_HOSTS else local_addresses()


def join_commands(cfg: ServerConfig, port: int) -> list[str]:
    """The commands other machines run, as printed: 'join: minips worker ...' for each address
    this server is reached at, and 'group: minips group ...' with --external-groups. Every
    flag they need is there (TLS: the CA to verify this server with; a group's own certificate
    and key are its own, named GROUP_CERT / GROUP_KEY); the secret comes from MINIPS_TOKEN."""
    # the CA the user made (beside the certificate), or the certificate itself if self-signed
    ca = f" --tls-ca {issuing_ca(cfg.tls_cert, cfg.tls_key) or 'CA_FILE'}" if cfg.tls_cert else ""
    lines = []
    for host in reachable_hosts(cfg):
        address = format_address(host, port)
        lines.append(f"join: minips worker --connect {address}{ca}")
        if cfg.external_groups:
            own = " --tls-cert GROUP_CERT --tls-key GROUP_KEY" if cfg.tls_cert else ""
            lines.append(f"group: minips group --connect {address}{ca} --listen 0.0.0.0:7071"
                         f"{own}")
    return lines


def _announce(cfg: ServerConfig, port: int) -> None:
    run = cfg.run
    budget = ", ".join(f"{k} {v:g}" for k, v in (("epochs", run.epochs), ("wall-s", run.wall_s),
                                                   ("max-steps", run.max_steps)) if v)
    secret = (f"export {TOKEN_ENV}=<this server's secret> on each machine first" if cfg.token
              else "no secret (loopback only)")
    print(f"minips server listening on {format_address(cfg.host, port)} ({run.mode}, "
          f"{run.compressor}, {run.model} on {run.dataset}, budget {budget or 'none'}, "
          f"waiting for {run.workers} worker{'' if run.workers == 1 else 's'}; {secret}; "
          f"{f'emulated base step {run.base_step_s:g} s' if run.base_step_s else 'real speeds'})",
          flush=True)
    for line in join_commands(cfg, port):
        print(line, flush=True)


def run_server(cfg: ServerConfig, *, spawn_evaluator: bool = False,
               announce: bool = True) -> GlobalServer:
    """`minips server`: serve one run (optionally with an evaluator child process); return
    the closed server (``failure`` says whether the run ended short)."""
    if spawn_evaluator and cfg.tls_cert and not issuing_ca(cfg.tls_cert, cfg.tls_key):
        raise ConfigError(f"--eval with --tls-cert {cfg.tls_cert}: no CA that verifies it beside "
                          "it (the evaluator child verifies this server as a worker does); put "
                          "ca.pem next to the certificate, or start 'minips evaluator --connect "
                          "NAME:PORT --tls-ca CA' instead")
    transport.install_uvloop()
    return asyncio.run(serve_run(cfg, announce=announce, spawn_evaluator=spawn_evaluator))


def _spawn_evaluator(cfg: ServerConfig, port: int) -> subprocess.Popen[bytes]:
    """`minips evaluator` as a child; under TLS it verifies this server with the run's CA by
    the name workers use (``reachable_hosts``: the certificate names it), as a worker would."""
    host = "127.0.0.1" if cfg.host in WILDCARD_HOSTS else cfg.host
    tls: list[str] = []
    if cfg.tls_cert:
        host = reachable_hosts(cfg)[0] if cfg.host in WILDCARD_HOSTS else cfg.host
        tls = ["--tls-ca", str(issuing_ca(cfg.tls_cert, cfg.tls_key))]
    cmd = [sys.executable, "-m", "minips", "evaluator", "--connect",
           format_address(host, port), "--run-dir", cfg.run_dir, "--timeout", "30", *tls]
    return subprocess.Popen(cmd, env=lifeline.child_env())


def _reap(child: subprocess.Popen[bytes]) -> None:
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


# -- one command per role, and main ----------------------------------------------------------------

def _check_devices(specs: str) -> None:
    """A --device that is not here fails before any process starts. ``auto`` and ``cpu`` are
    always here: only other names cost the launcher an import of torch (about 2 s of CPU)."""
    named = [s for s in specs.split(",") if s.strip().lower() not in ("", "auto", "cpu")]
    if named:
        from minips.ml.device import pick_device

        for spec in named:
            pick_device(spec)


def _cmd_local(args: argparse.Namespace) -> int:
    from minips.run.launch import run_local

    preset = PRESETS.get(args.preset or "", {})
    run = run_config_from_args(args)
    schedules = args.slowdown if args.slowdown is not None else [
        Schedule.flat(f) for f in preset.get("slowdowns", [])]
    slowdowns = [s.first for s in schedules]  # the factors at the start (the profile)
    if args.slowdown and args.workers is not None and len(args.slowdown) != args.workers:
        raise ConfigError(f"--slowdown {len(args.slowdown)} factors for --workers "
                          f"{args.workers}: give one per worker (FxN repeats F N times)")
    check_dir("--data-dir", run.data_dir)
    _check_name(args)
    if args.workers is None and args.slowdown:
        run = dataclasses.replace(run, workers=len(slowdowns))
    link = check_link(args.link, args.bandwidth, args.latency, run.workers)
    _check_devices(args.device)
    cfg = LaunchConfig(run=run, slowdowns=slowdowns, link=link, link_shaping=args.link_shaping,
                       schedules=schedules, throttle=args.throttle,
                       link_changes=args.link_change,
                       out_dir=args.out, name=args.name,
                       progress=not args.no_progress, evaluator=not args.no_eval,
                       plot=not args.no_plot, timeout_s=args.timeout,
                       dashboard=args.dashboard, tensorboard=args.tensorboard,
                       devices=[d.strip() for d in args.device.split(",") if d.strip()],
                       amp=args.amp, force=args.force, data=args.data,
                       groups_in_process=args.groups_in_process,
                       trace=args.trace, trace_cap_mb=args.trace_cap)
    _check_watch(args)
    flags.say_default_budget(args)
    summary = run_local(cfg)
    return {"done": 0, "interrupted": 130, "terminated": 143}.get(summary.get("status", "done"), 1)


def _check_name(args: argparse.Namespace) -> None:
    """`minips local --name NAME` naming a directory that holds a run: refused saying what
    `local` takes (it has no --resume: a local run starts over, so nothing there continues)."""
    path = Path(args.out) / args.name if args.name else None
    if path is not None and not args.force and holds_run(path):
        raise ConfigError(f"--name {args.name}: {path} holds an earlier run; pass --force to "
                          f"move it aside ({path}.old-N), or name a new directory with --name "
                          "(minips local starts every run afresh)")


def _cmd_server(args: argparse.Namespace) -> int:
    check_host("--host", args.host)
    check_bind(args.host, _token(), args.insecure)  # before the run directory is made
    check_port("--port", args.host, args.port)  # taken: one line naming the flag, nothing made
    if args.dashboard:
        check_port("--dashboard", *parse_address(args.dashboard))
    check_tls_server(args.tls_cert, args.tls_key)
    cfg = ServerConfig(run=run_config_from_args(args), host=args.host, port=args.port,
                       token=_token(), tls_cert=args.tls_cert, tls_key=args.tls_key,
                       run_dir=args.run_dir, init_path=args.init,
                       external_groups=args.external_groups, advertise_host=args.advertise,
                       calib_timeout_s=args.calib_timeout, ready_file=args.ready_file,
                       checkpoint_path=args.checkpoint, checkpoint_every_s=args.checkpoint_every,
                       resume=args.resume, insecure=args.insecure,
                       rejoin_wait_s=args.rejoin_wait,
                       dashboard=args.dashboard, tensorboard=args.tensorboard,
                       group_ports=args.group_ports, console=True)
    if not args.resume:
        check_init(args.init, cfg.run.model)
        check_checkpoint(args.checkpoint, force=args.force)
    aside = claim(args.run_dir, resume=args.resume, force=args.force)
    if aside is not None:
        print(f"minips server: moved the earlier run in {args.run_dir} to {aside}", flush=True)
    keep_flags(args, Path(args.run_dir))
    if 0 < cfg.run.fixed_groups != args.external_groups > 0:
        raise ConfigError(f"--external-groups {args.external_groups}: this run forms "
                          f"{cfg.run.fixed_groups} group(s) (--mode {cfg.run.mode}, --groups "
                          f"{cfg.run.groups}); start as many group servers")
    _check_watch(args)
    flags.say_default_budget(args)
    srv = run_server(cfg, spawn_evaluator=args.eval, announce=not args.quiet)
    _report(cfg, srv)
    if srv.failure:  # the run ended short of its budget, or diverged (GlobalCore.fail)
        print(f"minips server: error: {srv.failure}", file=sys.stderr)
        return 3
    return 0


def _report(cfg: ServerConfig, srv: GlobalServer) -> None:
    """summary.json in the run directory, and its headline on the console (as `minips local`)."""
    summary = summarize(cfg.run_dir)
    acc = summary.get("final_accuracy")
    if srv.core.grouped:  # the run's figures as they end: the ledger's, as summary.json's
        print(srv.progress_text(), file=sys.stderr, flush=True)
    print(f"minips server: {'failed' if srv.failure else 'done'} "
          f"({srv.core.done_reason or 'ended'}) after {summary.get('train_s') or 0:.1f} s of "
          f"training, {srv.core.samples:,} samples, final accuracy "
          f"{'- (no evaluator: --eval)' if acc is None else f'{acc:.4f}'} "
          f"({summary.get('data') or 'unknown'} data)\n"
          f"  summary: {Path(cfg.run_dir) / 'summary.json'}", flush=True)


def keep_flags(args: argparse.Namespace, run_dir: Path) -> None:
    """``flags.json`` in the run directory: every flag of the command, merged (its --config
    file, then the command line), as the run used them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_json(run_dir / "flags.json", {k: v for k, v in vars(args).items()
                                        if k not in ("run_defaults", "default_budget",
                                                     "optimizer_note")})


def _cmd_group(args: argparse.Namespace) -> int:
    from minips.serve.group_process import run_group_process

    shost, sport = check_address("--connect", args.connect, 7070)
    host, port = check_address("--listen", args.listen, 7071, listen=True)
    check_tls_server(args.tls_cert, args.tls_key)
    check_tls_client(args.tls_ca)
    cfg = GroupConfig(server_host=shost, server_port=sport, host=host, port=port,
                      advertise_host=args.advertise, token=_token(), tls_cert=args.tls_cert,
                      tls_key=args.tls_key, tls_ca=args.tls_ca, run_dir=args.run_dir,
                      reconnect_s=args.reconnect, insecure=args.insecure)
    run_group_process(cfg)
    return 0


def _client_config(args: argparse.Namespace) -> WorkerConfig:
    """The flags `minips worker` and `minips evaluator` share (the evaluator's whole config)."""
    host, port = check_address("--connect", args.connect, 7070)
    check_tls_client(args.tls_ca)
    check_dir("--data-dir", args.data_dir)
    return WorkerConfig(server_host=host, server_port=port, token=_token(), tls_ca=args.tls_ca,
                        run_dir=args.run_dir, data_dir=args.data_dir, data=args.data,
                        torch_threads=args.threads,
                        connect_timeout_s=args.timeout or math.inf,  # 0: until it answers
                        reconnect_s=args.reconnect)


def _worker_config(args: argparse.Namespace) -> WorkerConfig:
    return dataclasses.replace(
        _client_config(args), worker_id=args.id, slowdown=args.slowdown.first,
        slowdown_schedule=args.slowdown.text() if args.slowdown.changes else "",
        throttle=args.throttle, bandwidth_bps=args.bandwidth,
        bandwidth_down_bps=args.bandwidth_down, latency_s=args.latency, device=args.device,
        amp=args.amp)


def _cmd_worker(args: argparse.Namespace) -> int:
    cfg = _worker_config(args)  # a bad flag is refused before torch is imported (about 2 s)
    from minips.worker import run_worker

    run_worker(cfg)
    return 0


def _cmd_evaluator(args: argparse.Namespace) -> int:
    cfg = _client_config(args)  # a bad flag is refused before torch is imported (about 2 s)
    from minips.evaluator import run_evaluator

    run_evaluator(cfg)
    return 0


def _check_watch(args: argparse.Namespace) -> None:
    """Before anything starts: --dashboard needs its extra and a well-formed address."""
    if args.dashboard:
        from minips.dashboard.monitor import check_extra

        parse_address(args.dashboard)
        check_extra()
        dashboard_secret()  # never the cluster's secret


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from minips.dashboard.monitor import serve_replay

    serve_replay(args.run_dir, args.listen, speed=None if args.follow else args.speed,
                 token=dashboard_secret(), insecure=args.insecure)
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from minips.record.plot import plot_runs

    for path in plot_runs(args.run_dirs, out_dir=args.out):
        print(path)
    return 0


def _cmd_ray(args: argparse.Namespace) -> int:
    return flags.ray_command(args, run_config_from_args(args))


def _cmd_simulate(args: argparse.Namespace) -> int:
    return flags.simulate_command(args, run_config_from_args(args))


COMMANDS = {"local": _cmd_local, "server": _cmd_server, "group": _cmd_group,
            "worker": _cmd_worker, "evaluator": _cmd_evaluator, "plot": _cmd_plot,
            "ray": _cmd_ray, "simulate": _cmd_simulate, "dashboard": _cmd_dashboard,
            "trace": trace_cmd.trace_command}


SERVING = ("server", "group")  # one asyncio loop each, numpy on vectors: one BLAS thread


def one_blas_thread() -> None:
    """Hold numpy's BLAS to one thread in a serving process. Its calls there are dot products
    of one push's or one model's vectors on the event loop's thread; OpenBLAS hands each to
    its thread pool, whose threads spin for work and take the cores the loop and its clients
    need: np.dot of LeNet-5's 61,706 floats took 86 us with the pool against 8 us without,
    and 2.1 ms against 0.09 ms when other processes kept both cores busy (2-core AMD, numpy
    2.2's OpenBLAS). threadpoolctl sets it for the libraries already loaded (numpy's OpenBLAS
    or MKL), which environment variables set now could not."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `minips` command; returns the exit status."""
    lifeline.watch_parent()  # started by a launcher: do not outlive it
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(flags.with_config(argv))
    except ConfigError as exc:  # the --config file: unreadable, or a key that is no flag
        print(f"minips: error: {exc}", file=sys.stderr)
        return 2
    try:
        trace_cmd.open_role_tracer(args)  # --trace FILE: this process's frames
        if args.command in SERVING:
            one_blas_thread()
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("minips: interrupted", file=sys.stderr)
        return 130
    except (MiniPSError, ConnectionError, OSError) as exc:
        print(f"minips {args.command}: error: {_explain(args, exc)}", file=sys.stderr)
        return 2


def _explain(args: argparse.Namespace, exc: BaseException) -> str:
    """The error, or why a plain client could not connect: the server speaks TLS."""
    if (isinstance(exc, ConnectionError) and getattr(args, "connect", None)
            and not getattr(args, "tls_ca", None)
            and not getattr(exc, "silent", False)):  # nothing answered: no TLS probe to wait on
        host, port = parse_address(args.connect)
        if speaks_tls(host, port):
            return (f"{args.connect}: the server speaks TLS; pass --tls-ca CA_FILE (the CA or "
                    f"the server's own certificate)")
    return str(exc)


if __name__ == "__main__":
    sys.exit(main())
