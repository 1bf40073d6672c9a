"""The run settings on the command line: one flag per ``RunConfig`` field (``RUN_FLAGS``), and
``run_config_from_args``, which resolves them: RunConfig defaults, then ``--run-config``, then
``--preset``, then explicit flags, checked with errors that name the flag.

``add_run_flags`` adds them to a sub-command (`local`, `server`, `ray`, `simulate`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from minips.errors import ConfigError
from minips.run import cli_checks as checks
from minips.run.cli_checks import finite
from minips.run.config import PRESETS, FieldError, RunConfig

__all__ = ["RUN_FLAGS", "FLAG_OF", "add_run_flags", "run_config_from_args"]

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


def add_run_flags(p: argparse.ArgumentParser) -> None:
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
