"""The `minips` argument parser: one sub-command per role, errors in one line, help that shows
the defaults. ``build_parser`` is all cli.py needs; the run settings' flags are in cli_flags.py.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from minips.net.links import SHAPINGS
from minips.run import cli_checks as checks
from minips.run import cli_ray, cli_simulate
from minips.run.cli_checks import at_least, int_at_least, slowdown_factors
from minips.run.cli_flags import add_run_flags

__all__ = ["build_parser", "DESCRIPTION"]

Subparsers = argparse._SubParsersAction  # what add_subparsers returns: one add_parser per command
DESCRIPTION = "`minips` command line: server, group, worker, evaluator, local, plot."


def _add_tls(p: argparse.ArgumentParser, *, server: bool, client: bool) -> None:
    if server:
        p.add_argument("--tls-cert", help="PEM certificate; enables TLS")
        p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    if client:
        p.add_argument("--tls-ca", help="CA file to verify the server; enables TLS")


def _add_insecure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--insecure", action="store_true",
                   help="allow listening beyond loopback without MINIPS_TOKEN (anyone may join)")


def _add_local(sub: Subparsers) -> None:
    """`minips local`: a whole cluster on this machine."""
    loc = sub.add_parser("local", help="a whole cluster on this machine")
    add_run_flags(loc)
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


def _add_server(sub: Subparsers) -> None:
    """`minips server`: the global server."""
    srv = sub.add_parser("server", help="the global server (numpy only)")
    add_run_flags(srv)
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


def _add_group(sub: Subparsers) -> None:
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


def _add_clients(sub: Subparsers) -> None:
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


def _add_dashboard(sub: Subparsers) -> None:
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


def _add_plot(sub: Subparsers) -> None:
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
    p = _OneLine(prog="minips", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_add_local, _add_server, _add_group, _add_clients, _add_plot,
                _add_dashboard):
        add(sub)
    cli_ray.add_parser(sub, add_run_flags)
    cli_simulate.add_parser(sub, add_run_flags)
    return p
