"""`minips` command line: server, group, worker, evaluator, local, plot.

The CLI only parses flags into the config dataclasses of ``minips.config`` and calls one entry
point per role; it holds no logic of its own. torch is imported lazily (workers, the evaluator and
`local`), so `minips server` and `minips group` run on machines without it. The shared secret comes
from the environment (MINIPS_TOKEN), never from a flag, so it does not show in `ps`.

Run settings resolve in this order: RunConfig defaults, then ``--preset``, then explicit flags.
Errors the user can fix (bad flag, unreachable address, wrong secret) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from minips import cli_checks as checks
from minips import cli_ray, cli_simulate, lifeline
from minips.cli_checks import at_least, finite, int_at_least, slowdown_factors
from minips.config import (
    PRESETS,
    FieldError,
    GroupConfig,
    LaunchConfig,
    RunConfig,
    ServerConfig,
    WorkerConfig,
    parse_address,
)
from minips.errors import ConfigError, MiniPSError
from minips.links import SHAPINGS

__all__ = ["main", "build_parser", "run_config_from_args"]

TOKEN_ENV = "MINIPS_TOKEN"

# (flag, RunConfig field, type, help) for the run settings shared by `local` and `server`.
RUN_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--model", "model", str, "model name (lenet5, resnet9, resnet18, vgg19, ...)"),
    ("--dataset", "dataset", str, "data set (fashion-mnist, mnist, cifar10)"),
    ("--data-dir", "data_dir", str, "directory of the data set files (default: "
     "~/.cache/minips/<name>, then system directories)"),
    ("--mode", "mode", str, "bsp | ssp | asp | gssp"),
    ("--compressor", "compressor", str, "none | fp16 | topk | dgc | randomk | gdtopk | losscomp"),
    ("--ratio", "ratio", finite, "kept fraction of gradient coordinates (0..1]"),
    ("--xchg-ratio", "xchg_ratio", finite, "kept fraction of the group <-> global exchange, "
     "both ways (0..1]; 1 = dense; default: --ratio with a sparse compressor, else dense"),
    ("--down-ratio", "down_ratio", finite, "kept fraction of each publish of a group's weights "
     "to its workers (0..1]; 1 = dense; default: --ratio with a sparse compressor, else dense"),
    ("--workers", "workers", int, "number of workers"),
    ("--groups", "groups", int, "GSSP groups (0 = chosen from the step times)"),
    ("--staleness", "staleness", int, "SSP bound, clocks"),
    ("--sync-every", "sync_every", int, "pushes between group <-> global exchanges"),
    ("--merge", "merge", str, "global merge of group deltas: mean | sum"),
    ("--batch-size", "batch_size", int, "samples per worker step"),
    ("--lr", "lr", finite, "learning rate"),
    ("--lr-warmup", "lr_warmup", finite, "epochs of linear lr warm-up (0 = none)"),
    ("--lr-schedule", "lr_schedule", str, "constant | cosine (lr to 0 over the epochs budget)"),
    ("--momentum", "momentum", finite, "SGD momentum"),
    ("--weight-decay", "weight_decay", finite, "L2 weight decay"),
    ("--seed", "seed", int, "random seed"),
    ("--epochs", "epochs", finite, "budget: epochs over the training set (0 = none)"),
    ("--wall-s", "wall_s", finite, "budget: seconds of training (0 = none)"),
    ("--max-steps", "max_steps", int, "cap on each worker's pushes (0 = none)"),
    ("--base-step", "base_step_s", finite, "emulated base step time, seconds"),
    ("--eval-every", "eval_every_s", finite, "evaluator period, seconds"),
    ("--eval-limit", "eval_limit", int, "test samples per evaluation (0 = all)"),
    ("--alpha", "gdtopk_alpha", finite, "GDTopK ratio exponent"),
    ("--direction", "gdtopk_direction", str, "GDTopK: slower-more | slower-less"),
    ("--lease", "lease_s", finite, "a worker silent this long stops holding its group; a "
     "silent group server or group process is dropped, s"),
    ("--heartbeat", "heartbeat_s", finite, "HEARTBEAT period of workers and group servers, s "
     "(at most lease / 2)"),
]
# the flag of each RunConfig field validate() may name (the budget check names two)
FLAG_OF = {dest: flag for flag, dest, _, _ in RUN_FLAGS} | {"budget": "--epochs/--wall-s"}


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), help="named set of defaults")
    p.add_argument("--copt", action="append", type=_key_value, metavar="KEY=VALUE",
                   help="compressor option, e.g. warmup_epochs=1 (repeatable)")
    defaults = RunConfig()
    for flag, dest, typ, help_ in RUN_FLAGS:
        shown = getattr(defaults, dest)  # the flag's own default is None: "not given"
        p.add_argument(flag, dest=dest, type=typ, default=None,
                       help=help_ if shown is None else f"{help_} (default {shown})")


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    """RunConfig defaults, then --run-config file, then the preset, then explicit flags;
    checked (``ConfigError`` naming the flag)."""
    values: dict[str, Any] = {}
    if getattr(args, "run_config", None):
        values.update(RunConfig.from_info(checks.load_run_config(args.run_config)).to_info())
    preset = PRESETS.get(getattr(args, "preset", None) or "", {})
    values.update(preset.get("run", {}))
    for _, dest, _, _ in RUN_FLAGS:
        if getattr(args, dest, None) is not None:
            values[dest] = getattr(args, dest)
    if getattr(args, "copt", None):
        values["compressor_opts"] = {**values.get("compressor_opts", {}), **dict(args.copt)}
    try:
        run = RunConfig(**values).validate()
    except FieldError as exc:
        raise ConfigError(f"{FLAG_OF.get(exc.name, exc.name)} {exc.got!r}: expected "
                          f"{exc.expected}") from None
    except TypeError as exc:  # a --run-config value of the wrong type ("workers": "four")
        raise ConfigError(f"--run-config {args.run_config}: a value has the wrong type "
                          f"({exc})") from None
    checks.check_run(run)
    return run


def _key_value(text: str) -> tuple[str, Any]:
    """'k=v' -> (k, v) with v parsed as JSON when it parses (numbers, booleans), else text."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _add_tls(p: argparse.ArgumentParser, *, server: bool, client: bool) -> None:
    if server:
        p.add_argument("--tls-cert", help="PEM certificate; enables TLS")
        p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    if client:
        p.add_argument("--tls-ca", help="CA file to verify the server; enables TLS")


def _add_insecure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--insecure", action="store_true",
                   help="allow listening beyond loopback without MINIPS_TOKEN (anyone may join)")


def _add_local(sub: Any) -> None:
    """`minips local`: a whole cluster on this machine."""
    loc = sub.add_parser("local", help="a whole cluster on this machine")
    _add_run_flags(loc)
    loc.add_argument("--slowdown", type=slowdown_factors, help="factors F per worker: 1,1,2x2,4")
    loc.add_argument("--link", metavar="PROFILE",
                     help="the workers' links: 10mbit, 10mbit/40mbit (up/down), "
                          "100,50,10mbit (per worker, last repeats), +5ms latency, or a file "
                          "(docs/links.md)")
    loc.add_argument("--link-shaping", choices=SHAPINGS, default="auto",
                     help="kernel: namespaces + tc (root); pacer: token buckets in the workers; "
                          "auto: kernel when possible (default)")
    loc.add_argument("--bandwidth", type=at_least(0), default=0.0,
                     help="deprecated: --link RATE (this in bytes/s, both directions)")
    loc.add_argument("--latency", type=at_least(0), default=0.0,
                     help="deprecated: --link +LATENCY (this in s)")
    _add_device(loc, per_worker=True)
    loc.add_argument("--out", default="runs", help="parent directory of the run directory")
    loc.add_argument("--name", help="run directory name (default: time-mode-compressor)")
    loc.add_argument("--timeout", type=at_least(0), default=0.0,
                     help="hard stop, s (0 = budget+margin)")
    loc.add_argument("--no-progress", action="store_true", help="no progress line")
    loc.add_argument("--no-eval", action="store_true", help="do not start the evaluator")
    loc.add_argument("--no-plot", action="store_true", help="do not draw PNGs at the end")
    _add_watch(loc)


def _add_watch(p: argparse.ArgumentParser) -> None:
    """--dashboard and --tensorboard (minips.dashboard; served by the global server)."""
    p.add_argument("--dashboard", default="", metavar="HOST:PORT",
                   help="serve a live web dashboard and Prometheus /metrics here (needs "
                   "minips[dashboard]; beyond loopback it asks for MINIPS_TOKEN; default off)")
    p.add_argument("--tensorboard", default="", metavar="DIR",
                   help="write the run's series as TensorBoard scalars to DIR (default off)")


def _add_server(sub: Any) -> None:
    """`minips server`: the global server."""
    srv = sub.add_parser("server", help="the global server (numpy only)")
    _add_run_flags(srv)
    srv.add_argument("--host", default="127.0.0.1",
                     help="listen address (non-loopback needs MINIPS_TOKEN or --insecure)")
    srv.add_argument("--port", type=checks.port, default=7070, help="listen port (0 = any free)")
    srv.add_argument("--run-dir", default="runs/server", help="metrics and final weights")
    srv.add_argument("--init", help=".npy initial flat weights (default: from the first worker)")
    srv.add_argument("--external-groups", type=int_at_least(0), default=0,
                     help="group servers that connect as `minips group` (0 = in-process)")
    srv.add_argument("--advertise", help="address workers use to reach in-process group servers")
    srv.add_argument("--ready-file", help="write 'host port' here once listening")
    srv.add_argument("--calib-timeout", type=at_least(0, strict=True), default=60.0,
                     help="grouping deadline, s")
    srv.add_argument("--eval", action="store_true",
                     help="also start an evaluator process (not with --tls-cert)")
    srv.add_argument("--run-config", help="JSON file of run settings (flags override it)")
    srv.add_argument("--quiet", action="store_true", help="do not print how to join")
    srv.add_argument("--checkpoint", help="checkpoint file (default RUN_DIR/checkpoint.npz)")
    srv.add_argument("--checkpoint-every", type=at_least(0), default=30.0,
                     help="seconds between atomic checkpoints (0 = none)")
    srv.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    srv.add_argument("--rejoin-wait", type=at_least(0), default=120.0,
                     help="every worker gone with budget left: wait this long for them to "
                     "rejoin before the run ends short (exit 3), s")
    _add_watch(srv)
    _add_insecure(srv)
    _add_tls(srv, server=True, client=False)


def _add_group(sub: Any) -> None:
    """`minips group`: a group server near its workers."""
    grp = sub.add_parser("group", help="a group server near its workers (numpy only)")
    grp.add_argument("--connect", required=True, help="global server HOST:PORT")
    grp.add_argument("--listen", default="127.0.0.1:7071", help="HOST:PORT for workers")
    grp.add_argument("--advertise", help="HOST workers use to reach this group server")
    grp.add_argument("--run-dir", default="runs/group", help="metrics directory")
    grp.add_argument("--reconnect", type=at_least(0), default=120.0,
                     help="keep trying this long when the global server is lost, s")
    _add_insecure(grp)
    _add_tls(grp, server=True, client=True)


def _add_clients(sub: Any) -> None:
    """`minips worker` and `minips evaluator`."""
    for name, help_ in (("worker", "a training worker (PyTorch)"),
                        ("evaluator", "pulls the global weights and measures test accuracy")):
        w = sub.add_parser(name, help=help_)
        w.add_argument("--connect", required=True, help="global server HOST:PORT")
        w.add_argument("--id", type=int_at_least(-1), default=-1,
                       help="worker id (-1 = assigned)")
        w.add_argument("--slowdown", type=at_least(0, strict=True), default=1.0,
                       help="emulated factor F")
        w.add_argument("--bandwidth", type=at_least(0), default=0.0,
                       help="paced uplink, bytes/s (0 = none)")
        w.add_argument("--bandwidth-down", type=at_least(0), default=0.0,
                       help="paced downlink, bytes/s (0 = none)")
        w.add_argument("--latency", type=at_least(0), default=0.0,
                       help="added latency per send, s")
        w.add_argument("--run-dir", default=f"runs/{name}", help="metrics directory")
        w.add_argument("--data-dir", help="data set directory on this machine")
        w.add_argument("--threads", type=int_at_least(1), default=1,
                       help="torch intra-op threads")
        if name == "worker":
            _add_device(w)
        w.add_argument("--timeout", type=at_least(0, strict=True), default=10.0,
                       help="connect timeout, s")
        w.add_argument("--reconnect", type=at_least(0), default=120.0,
                       help="keep trying this long when a server is lost mid-run, s")
        _add_tls(w, server=False, client=True)


def _add_dashboard(sub: Any) -> None:
    """`minips dashboard`: replay a finished run in the browser."""
    d = sub.add_parser("dashboard", help="replay a finished run directory on the web dashboard")
    d.add_argument("run_dir", help="run directory to replay (runs/<run>)")
    d.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT of the page")
    d.add_argument("--speed", type=float, default=1.0,
                   help="replay speed, x real time (0 = the whole run at once)")
    d.add_argument("--follow", action="store_true",
                   help="follow a run directory that is still being written, live")
    _add_insecure(d)


def _add_device(p: argparse.ArgumentParser, per_worker: bool = False) -> None:
    each = "; a comma list gives one per worker (the last repeats)" if per_worker else ""
    p.add_argument("--device", default="auto",
                   help=f"auto | cpu | cuda | cuda:N | mps; auto takes CUDA, then MPS, then the "
                        f"CPU{each}")
    p.add_argument("--amp", action="store_true",
                   help="mixed precision: bfloat16 autocast where the device has it, else "
                        "float16 with loss scaling")


def _add_plot(sub: Any) -> None:
    """`minips plot`."""
    plt = sub.add_parser("plot", help="PNG charts from run directories")
    plt.add_argument("run_dirs", nargs="+", help="run directories to draw")
    plt.add_argument("--out", help="where to write the PNGs (default: the first run dir)")


class _ShowDefaults(argparse.HelpFormatter):
    """Help that ends each option with its default, unless there is none to show (None, False,
    or none at all as for --help) or the text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or "default" in text):
            return text
        return f"{text} (default %(default)s)"


class _OneLine(argparse.ArgumentParser):
    """A parser whose errors are one line (no usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Parser(_OneLine):
    """A sub-command's parser: its help shows the defaults."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(formatter_class=_ShowDefaults, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The `minips` argument parser with one sub-command per role."""
    p = _OneLine(prog="minips", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_add_local, _add_server, _add_group, _add_clients, _add_plot,
                _add_dashboard):
        add(sub)
    cli_ray.add_parser(sub, _add_run_flags)
    cli_simulate.add_parser(sub, _add_run_flags)
    return p


def _token() -> str:
    return os.environ.get(TOKEN_ENV, "")


def _cmd_local(args: argparse.Namespace) -> int:
    from minips.device import pick_device
    from minips.launch import run_local

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
    from minips.launch import run_server

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
    from minips.group_process import run_group_process

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
    from minips.worker import run_evaluator

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
    from minips.plot import plot_runs

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
