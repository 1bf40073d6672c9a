"""The `minips` command line's flags: presets, the run settings, the `ray` and `simulate`
sub-commands, and the argument parser that holds them all.

The file holds, in order:

- Named sets of defaults (``--preset``, ``PRESETS``): partial run configs (``"run"``:
  RunConfig fields) and `minips local`'s per-worker slowdowns; flags given explicitly override
  them.
- The run settings: one flag per ``RunConfig`` field (``RUN_FLAGS``), and
  ``run_config_from_args``, which resolves them: RunConfig defaults, then ``--run-config``, then
  ``--preset``, then explicit flags, checked with errors that name the flag. ``add_run_flags``
  adds them to a sub-command (`local`, `server`, `ray`, `simulate`).
- `minips ray` flags: the run flags of `minips local` plus where each role goes on Ray
  (``add_ray_parser``, ``ray_command``), so the Ray options read in one place. Nothing here
  imports ray: ``minips ray --help`` works without it installed (``ray_command`` imports
  ray_cluster.py when it runs).
- `minips simulate` flags: the run flags of `minips local` plus the simulation's models
  (``add_simulate_parser``, ``simulate_command``).
- The `minips` argument parser: one sub-command per role, errors in one line, help that shows
  the defaults. ``build_parser`` is all cli.py needs to parse; it calls ``ray_command`` and
  ``simulate_command`` for those two sub-commands.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from minips import __version__
from minips.compress.registry import compressor_options
from minips.core.config import FieldError, RunConfig, place_optimizer
from minips.core.slowdown import Schedule
from minips.errors import ConfigError
from minips.net.links import SHAPINGS
from minips.run.checks import (
    at_least,
    check_run,
    finite,
    int_at_least,
    link_changes,
    load_run_config,
    local_steps_arg,
    on_off,
    port,
    ports,
    slowdown_schedules,
    throttle_spec,
    worker_slowdown,
)
from minips.run.launch import parse_slowdowns
from minips.run.trace_cmd import add_trace_flags, add_trace_parser
from minips.sim.timing import Failure, parse_failures

__all__ = [
    "PRESETS",
    "RUN_FLAGS",
    "FLAG_OF",
    "add_run_flags",
    "run_config_from_args",
    "say_default_budget",
    "DEFAULT_EPOCHS",
    "add_ray_parser",
    "ray_command",
    "add_simulate_parser",
    "simulate_command",
    "build_parser",
    "DESCRIPTION",
    "CONFIG_COMMANDS",
    "with_config",
]


# -- named sets of defaults (--preset) -------------------------------------------------------------

# Presets are named partial configs; CLI flags given explicitly override them. The demo is the
# README's main job: 5 epochs at lr 0.05 end near 85-86% test accuracy in about a minute of
# training on 2 cores (3 epochs at lr 0.1 ended at 79-82%). DGC's sampled top-k at 1% with the
# optimizer on the workers (momentum correction), every hop compressed, float16 values both ways,
# the downlink published once a round within 3%: 85.67 / 86.01 / 85.53% for 38.1-38.7 MB over all
# hops (10.2 up, 16.9-17.4 down, 11 between the servers), seeds 0-2. GDTopK slower-less with the
# same settings ended 85.24 / 85.01 / 85.39% (docs/results.md, "make demo"). No warm-up (at 25%
# kept it was ~70 MB of the upload; warmup_epochs 0 keeps `--compressor gdtopk` without its own).
PRESETS: dict[str, dict[str, Any]] = {
    "demo": {
        "run": {"model": "lenet5", "dataset": "fashion-mnist", "mode": "gssp",
                "compressor": "dgc", "ratio": 0.01, "workers": 8, "epochs": 5.0,
                "wall_s": 180.0, "staleness": 3, "sync_every": 4, "base_step_s": 0.04,
                "lr": 0.05, "lr_schedule": "cosine", "gdtopk_direction": "slower-less",
                "compressor_opts": {"warmup_epochs": 0, "value_dtype": "f16"},
                "down_values": "f16", "optimizer_at": "worker", "down_drift": 0.03,
                # the exact downlink: higher and sooner to 85% than the compressed one, on
                # the LAN and behind links (docs/results.md, "Compressed rows at DDP's
                # accuracy"), its values in float16 (down_values: a quarter fewer bytes,
                # level, "The exact downlink's values in float16"); --down-mode auto gives
                # the compressed one (f16, within 3%)
                "down_mode": "exact"},
        "slowdowns": [1, 1, 1.5, 1.5, 2, 2, 4, 4],
    },
}


# -- the run settings: one flag per RunConfig field ------------------------------------------------

def _name(text: str) -> str:
    """A name from a fixed set (mode, compressor, ...): case does not matter (GSSP is gssp)."""
    return text.strip().lower()


# (flag, RunConfig field, type, help) for the run settings shared by `local` and `server`.
RUN_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--model", "model", str, "model name (lenet5, resnet9, resnet18, vgg19, ...)"),
    ("--dataset", "dataset", str, "data set (fashion-mnist, mnist, cifar10)"),
    ("--data-dir", "data_dir", str, "directory of the data set files (default: "
     "~/.cache/minips/<name>, then system directories)"),
    ("--mode", "mode", _name, "bsp | ssp | asp | gssp | lbbsp (BSP, batch sizes follow the "
     "workers' speeds)"),
    ("--regroup", "regroup", on_off, "GSSP: regroup when speeds drift: on | off"),
    ("--balance-every", "balance_every", int, "LB-BSP: rounds between re-balancings of the "
     "batch sizes"),
    ("--compressor", "compressor", _name, "none | fp16 | topk | dgc | randomk | gdtopk | losscomp"),
    ("--ratio", "ratio", finite, "kept fraction of gradient coordinates (0..1]"),
    ("--xchg-ratio", "xchg_ratio", finite, "kept fraction of the group <-> global exchange, "
     "both ways (0..1]; 1 = dense; default: --ratio with a sparse compressor, else dense"),
    ("--xchg-mode", "xchg_mode", _name, "the group <-> global exchange: topk (the largest "
     "--xchg-ratio of what changed, both ways; the rest goes later) | exact (every entry "
     "changed since the last exchange, both ways: no residual, O(changes))"),
    ("--down-ratio", "down_ratio", finite, "kept fraction of each publish of a group's weights "
     "to its workers (0..1]; 1 = dense; default: --ratio with a sparse compressor, else dense"),
    ("--down-values", "down_values", str, "f32 | f16: the values of a downlink update to the "
     "workers; f16 rounds them and sends 2 bytes each (compressed downlink: the rounding stays "
     "in its residual; exact downlink: the workers hold the weights to float16's rounding)"),
    ("--down-drift", "down_drift", finite, "bound on how far a group's published weights may "
     "lag its own (relative L2); a publish sends more coordinates when the bound needs them"),
    ("--down-mode", "down_mode", str, "how PULLs are answered: auto (compressed when "
     "--down-ratio < 1, else dense) | exact (the entries changed since the worker's version, "
     "at their values: no residual, no drift)"),
    ("--publish-every", "publish_every", int, "pushes between two publishes of a group's "
     "weights to its workers (compressed downlink): 0 = once a round of the group's members, "
     "1 = every turn; sooner whenever --down-drift would be passed"),
    ("--workers", "workers", int, "number of workers"),
    ("--groups", "groups", int, "GSSP groups (0 = chosen from the step times)"),
    ("--staleness", "staleness", int, "SSP bound, clocks"),
    ("--sync-every", "sync_every", int, "pushes between group <-> global exchanges"),
    ("--merge", "merge", _name, "global merge of group deltas: mean | sum"),
    ("--group-momentum", "group_momentum", _name, "a GSSP group server's momentum decays per "
     "push of the group (group) or of the whole cluster (cluster: momentum^(1/share), lr to "
     "match; for groups that the links keep at one pace)"),
    ("--batch-size", "batch_size", int, "samples per worker step"),
    ("--lr", "lr", finite, "learning rate"),
    ("--lr-warmup", "lr_warmup", finite, "epochs of linear lr warm-up (0 = none)"),
    ("--lr-schedule", "lr_schedule", _name, "constant | cosine (lr to 0 over the epochs budget)"),
    ("--momentum", "momentum", finite, "SGD momentum"),
    ("--weight-decay", "weight_decay", finite, "L2 weight decay"),
    ("--optimizer-at", "optimizer_at", str, "where SGD runs: server (workers push gradients) | "
     "worker (each worker keeps its momentum and pushes its update; DGC's momentum correction); "
     "not given: worker for a model of 10M parameters and up (resnet18, vgg19)"),
    ("--grad-clip", "grad_clip", finite, "local gradient clipping (with --optimizer-at worker): "
     "each worker clips its gradient's L2 norm to this / sqrt(workers); 0 = off"),
    ("--momentum-masking", "momentum_masking", on_off, "DGC's momentum-factor masking (with "
     "--optimizer-at worker): a worker clears its velocity where it sent: on | off"),
    ("--local-steps", "local_steps", local_steps_arg, "optimizer steps a worker runs on its "
     "local weights per push (with --optimizer-at worker; docs/compression.md): H, or auto "
     "(per group from its speed, at most --local-steps-max; shown as 0)"),
    ("--local-steps-max", "local_steps_max", int, "H of the fastest group with --local-steps "
     "auto"),
    ("--outer-optimizer", "outer_optimizer", str, "how a group server applies pushed updates "
     "(with --optimizer-at worker): avg (outer SGD at --outer-lr) | nesterov (DiLoCo)"),
    ("--outer-lr", "outer_lr", finite, "outer step size (with --optimizer-at worker; "
     "DiLoCo's Nesterov uses 0.7)"),
    ("--outer-momentum", "outer_momentum", finite, "Nesterov momentum of the outer step "
     "(--outer-optimizer nesterov)"),
    ("--seed", "seed", int, "random seed"),
    ("--epochs", "epochs", finite, "budget: epochs over the training set (0 = none)"),
    ("--wall-s", "wall_s", finite, "budget: seconds of training (0 = none)"),
    ("--max-steps", "max_steps", int, "cap on each worker's pushes (0 = none)"),
    ("--base-step", "base_step_s", finite, "emulated base step time, seconds"),
    ("--eval-every", "eval_every_s", finite, "evaluator period, seconds"),
    ("--eval-limit", "eval_limit", int, "test samples per evaluation (0 = all)"),
    ("--val-size", "val_size", int, "training samples held out for validation: no worker "
     "trains on them and the evaluator scores them instead of the test set (tuning); 0 = none"),
    ("--alpha", "gdtopk_alpha", finite, "GDTopK ratio exponent"),
    ("--direction", "gdtopk_direction", _name, "GDTopK: slower-more | slower-less"),
    ("--lease", "lease_s", finite, "a worker silent this long stops holding its group; a "
     "silent group server or group process is dropped, s"),
    ("--heartbeat", "heartbeat_s", finite, "HEARTBEAT period of workers and group servers, s "
     "(at most lease / 2)"),
]
# the flag of each RunConfig field validate() may name (the budget check names two)
FLAG_OF = {dest: flag for flag, dest, _, _ in RUN_FLAGS} | {"budget": "--epochs/--wall-s"}


def add_run_flags(p: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """The run flags, on a sub-command whose own ``defaults`` (RunConfig fields) replace
    RunConfig's (``run_config_from_args`` starts from them)."""
    p.add_argument("--config", metavar="FILE.toml",
                   help="TOML file of this command's flags, one key per flag (wall-s = 60, "
                   "slowdown = [1, 2], [copt] table); flags given here override it")
    p.add_argument("--preset", choices=sorted(PRESETS), help="named set of defaults")
    p.add_argument("--copt", action="append", type=_key_value, metavar="KEY=VALUE",
                   help="compressor option, e.g. warmup_epochs=1 (repeatable)")
    p.set_defaults(run_defaults=defaults or {})
    base = RunConfig(**(defaults or {}))
    for flag, dest, typ, help_ in RUN_FLAGS:
        shown = getattr(base, dest)  # the flag's own default is None: "not given"
        if isinstance(shown, bool):  # a switch says it as it is given: on | off
            shown = "on" if shown else "off"
        p.add_argument(flag, dest=dest, type=typ, default=None,
                       help=help_ if shown is None else f"{help_} (default {shown})")


# A run with no budget at all (no --epochs, --wall-s or --max-steps anywhere) would train until
# someone stops it: it gets this one, said on the console. --epochs 0 given explicitly is "no
# budget, I know": the run ends when its workers leave.
DEFAULT_EPOCHS = 1.0
BUDGET_FIELDS = ("epochs", "wall_s", "max_steps")


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    """RunConfig defaults, then --run-config file, then the preset, then explicit flags;
    checked (``ConfigError`` naming the flag). No budget named anywhere: ``DEFAULT_EPOCHS``."""
    values: dict[str, Any] = dict(getattr(args, "run_defaults", None) or {})
    if getattr(args, "run_config", None):  # the keys it names (unknown ones are ignored)
        names = {f.name for f in dataclasses.fields(RunConfig)}
        values.update({k: v for k, v in load_run_config(args.run_config).items() if k in names})
    preset = PRESETS.get(getattr(args, "preset", None) or "", {})
    preset_run = preset.get("run", {})
    values.update(preset_run)
    for _, dest, _, _ in RUN_FLAGS:
        if getattr(args, dest, None) is not None:
            values[dest] = getattr(args, dest)
    if "compressor_opts" in preset_run and values.get("compressor") != preset_run.get("compressor"):
        # --compressor replaced the preset's: keep the preset's options the new one takes
        takes = compressor_options(str(values.get("compressor")))
        values["compressor_opts"] = {k: v for k, v in preset_run["compressor_opts"].items()
                                     if k in takes}
    if getattr(args, "copt", None):
        values["compressor_opts"] = {**values.get("compressor_opts", {}), **dict(args.copt)}
    args.optimizer_note = place_optimizer(values)  # a large model: the workers' (said at start)
    if not any(k in values for k in BUDGET_FIELDS) and not getattr(args, "max_pushes", 0):
        values["epochs"] = DEFAULT_EPOCHS
        args.default_budget = True  # said once the command starts (``say_default_budget``)
    try:
        run = RunConfig(**values).validate()
    except FieldError as exc:
        raise ConfigError(f"{FLAG_OF.get(exc.name, exc.name)} {exc.got!r}: expected "
                          f"{exc.expected}") from None
    except TypeError as exc:  # a --run-config value of the wrong type ("workers": "four")
        raise ConfigError(f"--run-config {args.run_config}: a value has the wrong type "
                          f"({exc})") from None
    check_run(run)
    return run


def say_default_budget(args: argparse.Namespace) -> None:
    """One console line when the run got ``DEFAULT_EPOCHS`` because it named no budget (none
    with ``--quiet``)."""
    if getattr(args, "default_budget", False) and not getattr(args, "quiet", False):
        print(f"minips {args.command}: no budget given: training stops after "
              f"{DEFAULT_EPOCHS:g} epoch (--epochs; or --wall-s, --max-steps; --epochs 0 "
              "trains until the workers leave)", file=sys.stderr, flush=True)
    if getattr(args, "optimizer_note", "") and not getattr(args, "quiet", False):
        print(f"minips {args.command}: {args.optimizer_note}", file=sys.stderr, flush=True)


def _key_value(text: str) -> tuple[str, Any]:
    """'k=v' -> (k, v) with v parsed as JSON when it parses (numbers, booleans), else text."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


# -- --config run.toml: a file of flags ----------------------------------------------------------

CONFIG_COMMANDS = ("local", "server", "simulate", "ray")  # the commands that take --config


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _load_toml(path: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the same parser, as a package before 3.11
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None


# what a --config key's TOML value must be, by the argparse type of its flag: (the kind named in
# an error, the TOML value types that give it); a flag whose type is none of these takes text
# (a string, a number, or a list it joins with commas)
_SWITCH = ("true or false", (bool,))
_INTEGER = ("an integer", (int,))
_NUMBER = ("a number", (int, float))
_KINDS: dict[Any, tuple[str, tuple[type, ...]]] = {
    on_off: ('true or false (or "on" / "off")', (bool, str)),
    local_steps_arg: ('an integer or "auto"', (int, str)),
}


def _toml_kind(action: argparse.Action) -> tuple[str, tuple[type, ...]]:
    """The kind of TOML value ``action``'s flag takes (``_KINDS``' terms)."""
    if action.nargs == 0:  # a switch: --eval, --force
        return _SWITCH
    if action.type in _KINDS:
        return _KINDS[action.type]
    returns = action.type if action.type in (int, float) else getattr(
        action.type, "__annotations__", {}).get("return")  # int_at_least, at_least, port ...
    if returns in (int, "int"):
        return _INTEGER
    if returns in (float, "float"):
        return _NUMBER
    return "text (a string, a number or a list)", (str, int, float, list)


def _tokens(path: str, key: str, value: Any, actions: dict[str, argparse.Action]) -> list[str]:
    """The command-line tokens of one key of a --config file; a value of the wrong TOML type
    is refused naming the file, the key and what it takes (``ConfigError``)."""
    flag = "--" + key.replace("_", "-")
    if flag not in actions or flag == "--config":
        raise ConfigError(f"--config {path}: {key!r} is not a flag of this command")
    if key == "copt" and isinstance(value, dict):
        return [t for k, v in value.items() for t in (flag, f"{k}={json.dumps(v)}")]
    if isinstance(value, dict):
        raise ConfigError(f"--config {path}: {key!r} is a table; only [copt] is one")
    expected, types = _toml_kind(actions[flag])
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ConfigError(f"--config {path}: {key} = {_toml(value)}: expected {expected}")
    if isinstance(value, bool):
        if actions[flag].nargs == 0:
            return [flag] if value else []
        return [flag, "on" if value else "off"]
    if isinstance(value, list):
        return [flag, ",".join(str(v) for v in value)]
    return [flag, str(value)]


def _toml(value: Any) -> str:
    """``value`` as it reads in a TOML file (true, "0.05", 3)."""
    return json.dumps(value) if isinstance(value, (bool, str)) else str(value)


def with_config(argv: list[str]) -> list[str]:
    """``argv`` with the flags of its --config TOML file put in front of the command's own, so
    that a flag on the command line overrides the file's (argparse keeps the last)."""
    path = _config_path(argv)
    if not argv or argv[0] not in CONFIG_COMMANDS or path is None:
        return argv
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    actions = sub.choices[argv[0]]._option_string_actions
    tokens = [t for k, v in _load_toml(path).items() for t in _tokens(path, k, v, actions)]
    return [argv[0], *tokens, *argv[1:]]


# -- `minips ray` flags: the run flags plus where each role goes on Ray ----------------------------

ROLES = ("server", "group", "worker", "evaluator")
DEFAULT_RESOURCES = {"server": "", "group": "", "worker": "CPU=1", "evaluator": ""}
WORKER_SHARE = (" (default CPU=1; on the Ray instance minips starts here, an equal share of its "
                "CPUs when that is less: 3 workers on 2 CPUs ask CPU=0.66 each; what cannot be "
                "placed there is refused at once)")


def add_ray_parser(sub: Any, add_run_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    """The `ray` sub-command with every option and its default."""
    p = sub.add_parser("ray", help="run the cluster on Ray: roles as Ray actors (minips[ray])",
                       description="Global server, group servers, evaluator and workers as Ray "
                       "actors, each running its normal `minips` role as a process (minips' "
                       "TCP protocol and MINIPS_TOKEN as always); Ray places them by resources "
                       "and node labels and restarts those that die.")
    add_run_flags(p)
    p.add_argument("--address", help="Ray cluster to join: 'auto' or HOST:PORT of its head "
                   "(default: start a Ray instance on this machine)")
    p.add_argument("--port", type=int, default=7070,
                   help="global server port on its node (fixed, so a restarted server is "
                   "found at the same address)")
    for role in ROLES:  # a worker's default is decided by run_ray (WORKER_SHARE)
        p.add_argument(f"--{role}-resources",
                       default=None if role == "worker" else DEFAULT_RESOURCES[role],
                       help=f"Ray resources each {role} actor asks for, NAME=AMOUNT,... "
                       "(CPU and GPU are Ray's; others are custom node resources such as "
                       "jetson=1)" + (WORKER_SHARE if role == "worker" else " (default: none)"))
        p.add_argument(f"--{role}-labels", default="",
                       help=f"node labels a {role} actor's node must carry, KEY=VALUE,... "
                       "(default: any node)")
    p.add_argument("--external-groups", type=int, default=0,
                   help="group servers as their own actors (placed by --group-*); 0 = in the "
                   "global server's process")
    p.add_argument("--slowdown", type=parse_slowdowns, help="emulated factor F per worker: 1,1,2x2")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="times Ray restarts a role that died (the server resumes from its "
                   "checkpoint, a worker rejoins)")
    p.add_argument("--checkpoint-every", type=float, default=10.0,
                   help="global server checkpoint period, s (what a restart resumes from)")
    p.add_argument("--no-eval", action="store_true", help="do not start the evaluator")
    p.add_argument("--out", default="runs", help="parent of the run directory on this machine")
    p.add_argument("--name", help="run directory name (default: time-mode-compressor)")
    p.add_argument("--timeout", type=float, default=0.0,
                   help="hard stop, s, waiting for the actors to be placed included (0 = the "
                   "wall budget, or 30 min, + 2 min)")


def ray_command(args: argparse.Namespace, run: RunConfig) -> int:
    """Build the RayConfig from the flags and run; exit status 0 when the run finished."""
    try:
        from minips.run.ray_cluster import RayConfig, parse_placement, run_ray
    except ImportError as exc:  # ray missing: say how to get it
        raise ConfigError(f"minips ray needs Ray: pip install 'minips[ray]' ({exc})") from None
    given = {r: getattr(args, f"{r}_resources") for r in ROLES}  # None: not given
    places = {r: parse_placement(DEFAULT_RESOURCES[r] if given[r] is None else given[r],
                                 getattr(args, f"{r}_labels")) for r in ROLES}
    slowdowns = args.slowdown or []
    if args.workers is None and slowdowns:
        run.workers = len(slowdowns)
    say_default_budget(args)
    cfg = RayConfig(run=run, address=args.address, server_port=args.port,
                    server=places["server"], groups=places["group"],
                    workers=places["worker"], evaluator=places["evaluator"],
                    share_cpus=given["worker"] is None,
                    external_groups=args.external_groups, evaluate=not args.no_eval,
                    slowdowns=slowdowns, max_restarts=args.max_restarts,
                    checkpoint_every_s=args.checkpoint_every, out_dir=args.out,
                    name=args.name, timeout_s=args.timeout)
    return 0 if run_ray(cfg).get("status") == "done" else 1


# -- `minips simulate` flags: the run flags plus the simulation's models ---------------------------

def add_simulate_parser(sub: Any, add_run_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    """The `simulate` sub-command with every option and its default."""
    p = sub.add_parser("simulate", help="the cluster as a discrete-event simulation (seconds "
                       "for thousands of workers)",
                       description="The global server's and the group servers' own rules "
                       "(global_core.py, group_core.py) driven by an event queue in simulated "
                       "time: workers with compute times, links and failures, gradients of a "
                       "synthetic objective or of the run's real model. Writes a run directory "
                       "like `minips local`.")
    add_run_flags(p)
    p.add_argument("--throttle", type=throttle_spec, default="", metavar="P,MIN-MAX,SECONDS",
                   help="random throttling, in simulated seconds (see minips local)")
    p.add_argument("--slowdown", type=slowdown_schedules, help="factors F per worker: 1,1,2x2,4 "
                   "or schedules 4@0,1@60s (simulated seconds; a "
                   "step takes F x --base-step; the last repeats; default 1)")
    p.add_argument("--jitter", type=at_least(0), default=0.0,
                   help="relative spread of a step's compute time (default 0: workers of "
                   "one speed stay in step, staleness 0; the course's labs use 0.1)")
    p.add_argument("--link-mbit", type=at_least(0), default=0.0,
                   help="each worker's link, mbit/s each way (default 0: no limit)")
    p.add_argument("--latency-ms", type=at_least(0), default=0.0,
                   help="one-way latency of each message, ms (default 0)")
    p.add_argument("--latency-jitter-ms", type=at_least(0), default=0.0,
                   help="plus this times |N(0,1)| on each message, ms (default 0)")
    p.add_argument("--fail", type=failures, default=[],
                   help="workers that drop: W@T (worker W at T simulated s, for good) or "
                   "W@T+D (rejoins D s later), comma separated (default none)")
    p.add_argument("--objective", choices=("synthetic", "model"), default="synthetic",
                   help="gradients of a synthetic quadratic (cheap, thousands of workers) or "
                   "of the run's --model on its --dataset, as real workers (torch; default "
                   "synthetic)")
    p.add_argument("--xchg-latency-ms", type=at_least(0), default=0.0,
                   help="delay of a group's exchange with the global server, ms (default 0)")
    p.add_argument("--dim", type=int, default=1000,
                   help="coordinates of the synthetic objective (default 1000)")
    p.add_argument("--noise", type=at_least(0), default=1.0,
                   help="gradient noise of one sample per coordinate (default 1)")
    p.add_argument("--max-pushes", type=int, default=0,
                   help="stop after this many pushes (default 0: the --epochs budget)")
    p.add_argument("--no-plot", action="store_true", help="do not draw PNGs at the end")
    p.add_argument("--json", action="store_true", help="print the summary's headline as one "
                   "JSON line instead of sentences")
    p.add_argument("--out", default="runs", help="parent directory of the run directory")
    p.add_argument("--name", help="run directory name (default: time-sim-mode-compressor)")


def failures(text: str) -> list[Failure]:
    """Type of --fail (``timing.parse_failures``, sim/timing.py)."""
    try:
        return parse_failures(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def simulate_command(args: argparse.Namespace, run: RunConfig) -> int:
    """Run the simulation; print its summary (as JSON with --json)."""
    from minips.record.plot import plot_run
    from minips.sim.simulate import HEADLINE, SimConfig, objective_note, report, simulate

    if args.dim < 1 or args.max_pushes < 0:
        raise ConfigError(f"--dim {args.dim} / --max-pushes {args.max_pushes}: expected "
                          "--dim >= 1 and --max-pushes >= 0")
    preset = PRESETS.get(getattr(args, "preset", None) or "", {})
    schedules = (args.slowdown or [Schedule.flat(float(f)) for f in preset.get("slowdowns", [])]
                 or [Schedule.flat(1.0)])
    slowdowns = [s.first for s in schedules]
    if args.workers is None and (args.slowdown or preset.get("slowdowns")):
        run.workers = len(slowdowns)
    real = args.objective == "model"
    print(objective_note(run, real, args.dim), file=sys.stderr, flush=True)
    if not real and run.dataset != "synthetic" and not run.train_size:
        run.dataset = "synthetic"  # the objective is synthetic: so are its samples
    say_default_budget(args)
    cfg = SimConfig(run=run, slowdowns=slowdowns, schedules=schedules, throttle=args.throttle,
                    jitter=args.jitter,
                    rate=args.link_mbit * 1e6 / 8, latency_s=args.latency_ms / 1e3,
                    latency_jitter_s=args.latency_jitter_ms / 1e3, failures=args.fail,
                    real=real, xchg_latency_s=args.xchg_latency_ms / 1e3, dim=args.dim,
                    noise=args.noise,
                    max_pushes=args.max_pushes, eval_every_s=run.eval_every_s,
                    out_dir=args.out, name=args.name or "")
    summary = simulate(cfg)
    plots = [] if args.no_plot else plot_run(summary["run_dir"], "minips simulate")
    if args.json:
        json.dump({**{k: summary.get(k) for k in HEADLINE}, "plots": plots}, sys.stdout)
        print()
    else:
        print(report(summary, plots))
    return 0


# -- the `minips` argument parser: one sub-command per role ----------------------------------------

Subparsers = argparse._SubParsersAction  # what add_subparsers returns: one add_parser per command
DESCRIPTION = ("`minips` command line: local, server, group, worker, evaluator, simulate, ray, "
               "plot, dashboard, trace.")


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
    loc.add_argument("--slowdown", type=slowdown_schedules,
                     help="factors F per worker: 1,1,2x2,4; a schedule F@T,F@T: 4@0,1@60s "
                          "(4x until 60 s of training, then 1x)")
    loc.add_argument("--throttle", type=throttle_spec, default="", metavar="P,MIN-MAX,SECONDS",
                     help="random throttling: each SECONDS interval, a worker is slowed with "
                          "probability P by a factor in [MIN, MAX] (seeded by --seed)")
    loc.add_argument("--data", choices=("real", "synthetic"), default="real",
                     help="the workers' data: real files (refused when missing) or the "
                     "synthetic stand-in")
    loc.add_argument("--link", metavar="PROFILE",
                     help="the workers' links: 10mbit, 10mbit/40mbit (up/down), "
                          "100,50,10mbit (per worker, last repeats), +5ms latency, or a file "
                          "(docs/links.md)")
    loc.add_argument("--link-change", metavar="W:RATE@T,...", default="", type=link_changes,
                     help="links that change during training (kernel shaping): "
                          "3:5mbit@60s,3:50mbit@120s (worker 3; * = every worker; T: s of "
                          "training)")
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
    loc.add_argument("--force", action="store_true",
                     help="a --name directory holding an earlier run: move it aside to "
                     "NAME.old-N (without this it is refused)")
    loc.add_argument("--timeout", type=at_least(0), default=0.0,
                     help="hard stop, s (0 = budget+margin)")
    loc.add_argument("--no-progress", action="store_true", help="no progress line")
    loc.add_argument("--no-eval", action="store_true", help="do not start the evaluator")
    loc.add_argument("--no-plot", action="store_true", help="do not draw PNGs at the end")
    loc.add_argument("--groups-in-process", action="store_true",
                     help="a large model's (10M parameters or more) group servers stay in the "
                     "global server's process (default: a `minips group` process each)")
    _add_watch(loc)
    add_trace_flags(loc, local=True)


def _add_watch(p: argparse.ArgumentParser) -> None:
    """--dashboard and --tensorboard (minips.dashboard; served by the global server)."""
    p.add_argument("--dashboard", default="", metavar="HOST:PORT",
                   help="serve a live web dashboard and Prometheus /metrics here (needs "
                   "minips[dashboard]; default off). Beyond loopback every page asks for the "
                   "dashboard's own read-only token: MINIPS_DASHBOARD_TOKEN, or one made at "
                   "start and printed in the URL; MINIPS_TOKEN opens nothing there")
    p.add_argument("--tensorboard", default="", metavar="DIR",
                   help="write the run's series as TensorBoard scalars to DIR (default off)")


def _add_server(sub: Subparsers) -> None:
    """`minips server`: the global server."""
    srv = sub.add_parser("server", help="the global server (numpy only)")
    # real speeds: workers on their own machines are not stretched to an emulated step time
    # (`minips local` emulates one, 0.04 s); --base-step S asks for it
    add_run_flags(srv, {"base_step_s": 0.0})
    srv.add_argument("--host", default="127.0.0.1",
                     help="listen address (non-loopback needs MINIPS_TOKEN or --insecure)")
    srv.add_argument("--port", type=port, default=7070, help="listen port (0 = any free)")
    srv.add_argument("--run-dir", default="runs/server", help="metrics and final weights")
    srv.add_argument("--init", help=".npy initial flat weights (default: from the first worker)")
    srv.add_argument("--external-groups", type=int_at_least(0), default=0,
                     help="group servers that connect as `minips group` (0 = in-process)")
    srv.add_argument("--advertise", help="address workers use to reach in-process group servers")
    srv.add_argument("--group-ports", type=ports, default=[], metavar="PORTS",
                     help="ports of the in-process group servers, group g on the g-th: "
                     "7071,7072 or 7071-7074 (default: free ports; a group beyond the list "
                     "takes one)")
    srv.add_argument("--ready-file", help="write 'host port' here once listening")
    srv.add_argument("--calib-timeout", type=at_least(0, strict=True), default=60.0,
                     help="grouping deadline, s")
    srv.add_argument("--eval", action="store_true",
                     help="also start an evaluator process (under TLS it verifies this "
                     "server with the CA beside --tls-cert)")
    srv.add_argument("--run-config", help="JSON file of run settings (flags override it)")
    srv.add_argument("--quiet", action="store_true",
                     help="print neither how to join, the progress line every 10 s, nor "
                     "the note on a default budget")
    srv.add_argument("--checkpoint", help="checkpoint file (default RUN_DIR/checkpoint.npz)")
    srv.add_argument("--checkpoint-every", type=at_least(0), default=30.0,
                     help="seconds between atomic checkpoints (0 = none)")
    srv.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    srv.add_argument("--force", action="store_true",
                     help="a --run-dir holding an earlier run: move it aside to RUN_DIR.old-N "
                     "(without this or --resume it is refused)")
    srv.add_argument("--rejoin-wait", type=at_least(0), default=120.0,
                     help="every worker gone with budget left: wait this long for them to "
                     "rejoin before the run ends short (exit 3), s")
    _add_watch(srv)
    _add_insecure(srv)
    _add_tls(srv, server=True, client=False)
    add_trace_flags(srv)


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
    add_trace_flags(grp)


def _add_clients(sub: Subparsers) -> None:
    """`minips worker` and `minips evaluator`."""
    for name, help_ in (("worker", "a training worker (PyTorch)"),
                        ("evaluator", "pulls the global weights and measures test accuracy")):
        w = sub.add_parser(name, help=help_)
        w.add_argument("--connect", required=True, help="global server HOST:PORT")
        if name == "worker":  # the evaluator trains nothing: no id, slowdown or paced link
            _add_worker_only(w)
        w.add_argument("--run-dir", default=f"runs/{name}", help="metrics directory")
        w.add_argument("--data-dir", help="data set directory on this machine")
        w.add_argument("--data", choices=("real", "synthetic"), default="real",
                       help="real: the data set's files must be found here (else it refuses "
                       "to start, saying which files go where); synthetic: train on the "
                       "synthetic stand-in")
        w.add_argument("--threads", type=int_at_least(1), default=1,
                       help="torch intra-op threads")
        if name == "worker":
            _add_device(w)
        w.add_argument("--timeout", type=at_least(0), default=10.0,
                       help="keep trying to reach the global server this long at the start, "
                       "s (0 = until it answers)")
        w.add_argument("--reconnect", type=at_least(0), default=120.0,
                       help="keep trying this long when a server is lost mid-run, s")
        _add_tls(w, server=False, client=True)
        add_trace_flags(w)


def _add_worker_only(w: argparse.ArgumentParser) -> None:
    """`minips worker`'s flags that `minips evaluator` has no use for."""
    w.add_argument("--id", type=int_at_least(-1), default=-1, help="worker id (-1 = assigned)")
    w.add_argument("--slowdown", type=worker_slowdown, default=Schedule.flat(1.0),
                   help="emulated factor F, or a schedule F@T,F@T (T: s of training); "
                   "default 1 (not slowed)")
    w.add_argument("--throttle", type=throttle_spec, default="",
                   metavar="P,MIN-MAX,SECONDS", help="random throttling (see minips local)")
    w.add_argument("--bandwidth", type=at_least(0), default=0.0,
                   help="paced uplink, bytes/s (0 = none)")
    w.add_argument("--bandwidth-down", type=at_least(0), default=0.0,
                   help="paced downlink, bytes/s (0 = none)")
    w.add_argument("--latency", type=at_least(0), default=0.0, help="added latency per send, s")


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
    """A parser whose errors are one line (no usage block), exit status 2, and that takes a
    flag only as it is spelled: `--epoch 1` is an error, not `--epochs 1` (argparse's prefix
    matching would start a run with a typo in it)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"allow_abbrev": False, **kwargs})

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Parser(_OneLine):
    """A sub-command's parser: its help shows the defaults."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(formatter_class=_ShowDefaults, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The `minips` argument parser with one sub-command per role."""
    p = _OneLine(prog="minips", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"minips {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_add_local, _add_server, _add_group, _add_clients, _add_plot,
                _add_dashboard):
        add(sub)
    add_ray_parser(sub, add_run_flags)
    add_simulate_parser(sub, add_run_flags)
    add_trace_parser(sub)
    return p
