"""`minips` command line: server, group, worker, evaluator, local, plot.

One command per role and ``main``; the parser is in cli_parser.py, the run settings' flags in
cli_flags.py. The CLI only parses flags into the config dataclasses of ``minips.run.config`` and
calls one entry point per role; it holds no logic of its own. torch is imported lazily (workers,
the evaluator and `local`), so `minips server` and `minips group` run on machines without it.
The shared secret comes from the environment (MINIPS_TOKEN), never from a flag, so it does not
show in `ps`.

Run settings resolve in this order: RunConfig defaults, then ``--preset``, then explicit flags.
Errors the user can fix (bad flag, unreachable address, wrong secret) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

from minips.errors import ConfigError, MiniPSError
from minips.net import lifeline
from minips.run import cli_checks as checks
from minips.run import cli_ray, cli_simulate
from minips.run.cli_flags import run_config_from_args
from minips.run.cli_parser import build_parser
from minips.run.config import (
    PRESETS,
    GroupConfig,
    LaunchConfig,
    ServerConfig,
    WorkerConfig,
    parse_address,
)

__all__ = ["main", "build_parser", "run_config_from_args"]

TOKEN_ENV = "MINIPS_TOKEN"


def _token() -> str:
    return os.environ.get(TOKEN_ENV, "")


def _cmd_local(args: argparse.Namespace) -> int:
    from minips.ml.device import pick_device
    from minips.run.launch import run_local

    for spec in args.device.split(","):  # a device that is not here fails before any process
        pick_device(spec)

    preset = PRESETS.get(args.preset or "", {})
    run = run_config_from_args(args)
    slowdowns = args.slowdown if args.slowdown is not None else list(preset.get("slowdowns", []))
    if args.slowdown and args.workers is not None and len(args.slowdown) != args.workers:
        raise ConfigError(f"--slowdown {len(args.slowdown)} factors for --workers "
                          f"{args.workers}: give one per worker (FxN repeats F N times)")
    checks.check_dir("--data-dir", run.data_dir)
    if args.workers is None and args.slowdown:
        run = dataclasses.replace(run, workers=len(slowdowns))
    link = checks.check_link(args.link, args.bandwidth, args.latency, run.workers)
    cfg = LaunchConfig(run=run, slowdowns=slowdowns, link=link, link_shaping=args.link_shaping,
                       out_dir=args.out, name=args.name,
                       progress=not args.no_progress, evaluator=not args.no_eval,
                       plot=not args.no_plot, timeout_s=args.timeout,
                       dashboard=args.dashboard, tensorboard=args.tensorboard,
                       devices=[d.strip() for d in args.device.split(",") if d.strip()],
                       amp=args.amp)
    _check_watch(args)
    summary = run_local(cfg)
    return {"done": 0, "interrupted": 130, "terminated": 143}.get(summary.get("status", "done"), 1)


def _cmd_server(args: argparse.Namespace) -> int:
    from minips.run.server_process import run_server

    checks.check_host("--host", args.host)
    if not args.eval:  # --eval with --tls-cert is refused anyway (run_server says why)
        checks.check_tls_server(args.tls_cert, args.tls_key)
    cfg = ServerConfig(run=run_config_from_args(args), host=args.host, port=args.port,
                       token=_token(), tls_cert=args.tls_cert, tls_key=args.tls_key,
                       run_dir=args.run_dir, init_path=args.init,
                       external_groups=args.external_groups, advertise_host=args.advertise,
                       calib_timeout_s=args.calib_timeout, ready_file=args.ready_file,
                       checkpoint_path=args.checkpoint, checkpoint_every_s=args.checkpoint_every,
                       resume=args.resume, insecure=args.insecure,
                       rejoin_wait_s=args.rejoin_wait,
                       dashboard=args.dashboard, tensorboard=args.tensorboard)
    if not args.resume:
        checks.check_init(args.init, cfg.run.model)
    if 0 < cfg.run.fixed_groups != args.external_groups > 0:
        raise ConfigError(f"--external-groups {args.external_groups}: this run forms "
                          f"{cfg.run.fixed_groups} group(s) (--mode {cfg.run.mode}, --groups "
                          f"{cfg.run.groups}); start as many group servers")
    _check_watch(args)
    srv = run_server(cfg, spawn_evaluator=args.eval, announce=not args.quiet)
    if srv.failure:  # the run ended short of its budget, or diverged (run_end.py)
        print(f"minips server: error: {srv.failure}", file=sys.stderr)
        return 3
    return 0


def _cmd_group(args: argparse.Namespace) -> int:
    from minips.serve.group_process import run_group_process

    shost, sport = checks.check_address("--connect", args.connect, 7070)
    host, port = checks.check_address("--listen", args.listen, 7071, listen=True)
    checks.check_tls_server(args.tls_cert, args.tls_key)
    checks.check_tls_client(args.tls_ca)
    cfg = GroupConfig(server_host=shost, server_port=sport, host=host, port=port,
                      advertise_host=args.advertise, token=_token(), tls_cert=args.tls_cert,
                      tls_key=args.tls_key, tls_ca=args.tls_ca, run_dir=args.run_dir,
                      reconnect_s=args.reconnect, insecure=args.insecure)
    run_group_process(cfg)
    return 0


def _worker_config(args: argparse.Namespace) -> WorkerConfig:
    host, port = checks.check_address("--connect", args.connect, 7070)
    checks.check_tls_client(args.tls_ca)
    checks.check_dir("--data-dir", args.data_dir)
    return WorkerConfig(server_host=host, server_port=port, token=_token(), tls_ca=args.tls_ca,
                        worker_id=args.id, slowdown=args.slowdown, bandwidth_bps=args.bandwidth,
                        bandwidth_down_bps=getattr(args, "bandwidth_down", 0.0),
                        latency_s=args.latency, run_dir=args.run_dir, data_dir=args.data_dir,
                        torch_threads=args.threads, connect_timeout_s=args.timeout,
                        reconnect_s=args.reconnect, device=getattr(args, "device", "auto"),
                        amp=getattr(args, "amp", False))


def _cmd_worker(args: argparse.Namespace) -> int:
    from minips.worker import run_worker

    run_worker(_worker_config(args))
    return 0


def _cmd_evaluator(args: argparse.Namespace) -> int:
    from minips.client.evaluator import run_evaluator

    run_evaluator(_worker_config(args))
    return 0


def _check_watch(args: argparse.Namespace) -> None:
    """Before anything starts: --dashboard needs its extra and a well-formed address."""
    if args.dashboard:
        from minips.dashboard import check_extra

        parse_address(args.dashboard)
        check_extra()


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from minips.dashboard.monitor import serve_replay

    serve_replay(args.run_dir, args.listen, speed=None if args.follow else args.speed,
                 token=_token(), insecure=args.insecure)
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from minips.run.plot import plot_runs

    for path in plot_runs(args.run_dirs, out_dir=args.out):
        print(path)
    return 0


def _cmd_ray(args: argparse.Namespace) -> int:
    return cli_ray.command(args, run_config_from_args(args))


def _cmd_simulate(args: argparse.Namespace) -> int:
    return cli_simulate.command(args, run_config_from_args(args))


COMMANDS = {"local": _cmd_local, "server": _cmd_server, "group": _cmd_group,
            "worker": _cmd_worker, "evaluator": _cmd_evaluator, "plot": _cmd_plot,
            "ray": _cmd_ray, "simulate": _cmd_simulate, "dashboard": _cmd_dashboard}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `minips` command; returns the exit status."""
    lifeline.watch_parent()  # started by a launcher: do not outlive it
    args = build_parser().parse_args(argv)
    try:
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
            and not getattr(args, "tls_ca", None)):
        host, port = parse_address(args.connect)
        if checks.speaks_tls(host, port):
            return (f"{args.connect}: the server speaks TLS; pass --tls-ca CA_FILE (the CA or "
                    f"the server's own certificate)")
    return str(exc)


if __name__ == "__main__":
    sys.exit(main())
