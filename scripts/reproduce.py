"""Reproduce the paper's comparisons: GSSP vs BSP / SSP / ASP, GDTopK, and the compressors.

    python scripts/reproduce.py --quick        # LeNet-5 / Fashion-MNIST, 8 workers, ~20 min
    python scripts/reproduce.py --full         # 16 workers, 3 seeds, CIFAR-10 / seq2seq if present
    python scripts/reproduce.py --smoke        # two tiny runs (what the test executes)
    python scripts/reproduce.py --quick --table-only   # rebuild table + plots from the runs

Every run is a real `minips local` cluster (``minips.launch.run_local``) started one after
another, never in parallel, so that their wall times compare. A *suite* fixes the model, the
slowdown profile, the optimizer (lr, momentum, weight decay, batch), the seed(s), the initial
weights (written from the seed by the launcher) and the samples budget; its *experiments* change
only the mode and the compressor. Output under ``results/<name>/``:

    runs/<suite>-<experiment>-s<seed>/   the run directory (config.json, launch.json = the full
                                         config with the seed, metrics, summary.json) plus
                                         reproduce.json (suite, experiment, CPU load, re-evaluation)
    table.json, table.md                 per experiment: medians over seeds (spread = [min, max])
    <suite>-accuracy_vs_time.png         all modes on one chart
    <suite>-accuracy_vs_bytes.png        the compressors

Invariants: an experiment differs from its suite only in the fields listed in its overrides;
time to accuracy counts from the training start (the ``groups`` event), as ``metrics`` does;
``final_accuracy`` is the final global weights evaluated on the whole test set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minips import metrics
from minips.config import LaunchConfig, RunConfig
from minips.errors import MiniPSError

__all__ = ["Experiment", "Suite", "paper_experiments", "suites_for", "run_suite",
           "build_table", "table_markdown", "main"]

ROOT = Path(__file__).resolve().parent.parent
RATIO = 0.01  # matched average kept fraction of every sparse compressor (the paper's 1%)
STALENESS = 3  # SSP bound, inside GSSP groups too
QUICK_PROFILE = [1, 1, 1.5, 1.5, 2, 2, 4, 4]  # slowdown factor per worker
FULL_PROFILE = [1.0] * 4 + [1.5] * 4 + [2.0] * 4 + [4.0] * 4
TAIL_POINTS = 5  # evaluations averaged into tail_accuracy (10 s at the quick eval period)


@dataclass(frozen=True)
class Experiment:
    """One row of the table: a mode and a compressor on top of the suite's settings."""

    label: str  # row name, e.g. "gssp+gdtopk-slower-more"
    overrides: dict[str, Any]  # RunConfig fields that differ from the suite
    part: str = "modes"  # "modes" (accuracy vs time chart) or "compression" (vs bytes)


@dataclass
class Suite:
    """Settings shared by every experiment of one comparison."""

    name: str  # prefix of the run directories and charts
    run: dict[str, Any]  # RunConfig fields (model, data, optimizer, budget, ...)
    slowdowns: list[float]  # emulated factor per worker
    experiments: list[Experiment]
    seeds: list[int] = field(default_factory=lambda: [0])
    targets: tuple[float, ...] = (0.80, 0.85)  # accuracies for time-to-accuracy


def matched_floor(slowdowns: Sequence[float], direction: str, ratio: float = RATIO) -> float:
    """GDTopK floor whose push-weighted mean kept fraction is ``ratio``.

    Groups are the distinct slowdown factors; a group of n workers at factor F makes a share
    n / F of the pushes; its kept fraction is floor * F / F_min (slower-more) or
    floor * F_max / F (slower-less), the policy of ``compressors.gdtopk_ratios`` with alpha 1.
    """
    factors = sorted(set(slowdowns))
    share = {f: slowdowns.count(f) / f for f in factors}
    total = sum(share.values())
    if direction == "slower-more":
        mean = sum(s * f / factors[0] for f, s in share.items()) / total
    else:
        mean = sum(s * factors[-1] / f for f, s in share.items()) / total
    return ratio / mean


def paper_experiments(slowdowns: Sequence[float], groups: int) -> list[Experiment]:
    """BSP, SSP, ASP, GSSP, GSSP+GDTopK (both directions), and the compressors at GSSP."""
    gssp = {"mode": "gssp", "groups": groups, "staleness": STALENESS}
    no_warmup = {"warmup_epochs": 0}  # see docs/results.md: runs are too short for DGC's 4 epochs
    exps = [Experiment("bsp", {"mode": "bsp"}), Experiment("ssp", {"mode": "ssp"}),
            Experiment("asp", {"mode": "asp"}), Experiment("gssp", gssp)]
    for direction in ("slower-more", "slower-less"):
        exps.append(Experiment(f"gssp+gdtopk-{direction}", {
            **gssp, "compressor": "gdtopk", "gdtopk_direction": direction,
            "ratio": round(matched_floor(slowdowns, direction), 6),
            "compressor_opts": no_warmup}))
    for comp in ("topk", "dgc", "losscomp"):
        exps.append(Experiment(f"gssp+{comp}", {**gssp, "compressor": comp, "ratio": RATIO},
                               part="compression"))
    return exps


def _fmnist(name: str, profile: list[float], epochs: float, seeds: list[int]) -> Suite:
    # lr and momentum: the best of a shared sweep (docs/results.md), the same for every mode
    run = {"model": "lenet5", "dataset": "fashion-mnist", "batch_size": 64, "lr": 0.05,
           "momentum": 0.9, "weight_decay": 5e-4, "staleness": STALENESS, "sync_every": 4,
           "epochs": epochs, "base_step_s": 0.1, "eval_every_s": 2.0, "eval_limit": 5000,
           "calib_steps": 5, "wall_s": 100.0 * epochs}  # wall_s: a cap far above BSP's time
    return Suite(name, run, profile, paper_experiments(profile, 4), seeds,
                 targets=(0.70, 0.75, 0.80, 0.85))


def _cifar_present() -> bool:
    from minips import data

    try:
        data.load_dataset("cifar10", "test", download=False, fallback=False)
    except MiniPSError:
        return False
    return True


def _full_suites() -> list[Suite]:
    seeds = [0, 1, 2]
    suites = [_fmnist("fmnist16", FULL_PROFILE, 10.0, seeds)]
    suites[0].run["base_step_s"] = 0.2  # twice the workers: keep the 2 cores below saturation
    modes_only = [e for e in paper_experiments(FULL_PROFILE, 4) if e.part == "modes"]
    slow = {"base_step_s": 1.0, "eval_every_s": 30.0, "eval_limit": 2000, "calib_steps": 3,
            "momentum": 0.9, "weight_decay": 5e-4, "batch_size": 64, "staleness": STALENESS}
    if _cifar_present():
        for model in ("resnet9", "vgg19"):
            run = {**slow, "model": model, "dataset": "cifar10", "lr": 0.02, "epochs": 20.0}
            suites.append(Suite(f"cifar10-{model}", run, FULL_PROFILE, modes_only, seeds))
    else:
        print("reproduce: no CIFAR-10 files found; skipping ResNet-9 / VGG-19", file=sys.stderr)
    run = {**slow, "model": "seq2seq", "dataset": "translation", "train_size": 20000,
           "lr": 0.02, "epochs": 10.0, "base_step_s": 0.3, "eval_every_s": 10.0}
    suites.append(Suite("seq2seq", run, FULL_PROFILE, modes_only, seeds, targets=(0.5, 0.8)))
    return suites


def _smoke_suite() -> Suite:
    run = {**_fmnist("x", QUICK_PROFILE, 1, [0]).run, "epochs": 0.02, "base_step_s": 0.02,
           "eval_every_s": 1.0, "eval_limit": 1000, "calib_steps": 2, "lr": 0.05}
    exps = [Experiment("bsp", {"mode": "bsp"}),
            Experiment("gssp+topk", {"mode": "gssp", "groups": 2, "compressor": "topk",
                                     "ratio": RATIO}, part="compression")]
    return Suite("smoke", run, [1.0, 2.0], exps, [0], targets=(0.3, 0.5))


def suites_for(size: str) -> list[Suite]:
    """The suites of ``--quick``, ``--full`` or ``--smoke``."""
    if size == "quick":
        return [_fmnist("fmnist8", QUICK_PROFILE, 4.0, [0])]
    if size == "full":
        return _full_suites()
    return [_smoke_suite()]


# -- running -----------------------------------------------------------------------------------


def _run_name(suite: Suite, exp: Experiment, seed: int) -> str:
    return f"{suite.name}-{exp.label}-s{seed}"


def _launch_config(suite: Suite, exp: Experiment, seed: int, runs_dir: Path) -> LaunchConfig:
    fields = {**suite.run, **exp.overrides, "seed": seed, "workers": len(suite.slowdowns)}
    return LaunchConfig(run=RunConfig(**fields).validate(), slowdowns=list(suite.slowdowns),
                        out_dir=str(runs_dir), name=_run_name(suite, exp, seed),
                        progress=False, plot=False)


def _done(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("status") == "done"
    except (OSError, ValueError):
        return False


def run_one(suite: Suite, exp: Experiment, seed: int, runs_dir: Path, resume: bool) -> Path:
    """One cluster run to the end of its budget; returns its run directory."""
    run_dir = runs_dir / _run_name(suite, exp, seed)
    if resume and _done(run_dir):
        return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = _launch_config(suite, exp, seed, runs_dir)
    load_before, started = os.getloadavg(), time.time()
    from minips.launch import run_local  # imports torch lazily, only when a run starts

    summary = run_local(cfg)
    extra = {"suite": suite.name, "experiment": asdict(exp), "seed": seed,
             "targets": suite.targets, "argv": sys.argv, "elapsed_s": time.time() - started,
             "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
             "status": summary.get("status"),
             "final_full_test": _evaluate_final(run_dir, cfg.run)}
    (run_dir / "reproduce.json").write_text(json.dumps(extra, indent=2) + "\n")
    return run_dir


def _evaluate_final(run_dir: Path, run: RunConfig) -> dict[str, float] | None:
    """Accuracy and loss of the final global weights on the whole test set."""
    path = run_dir / "final_weights.npy"
    if not path.exists():
        return None
    import torch

    from minips import data, models

    torch.set_num_threads(1)
    test = data.load_dataset(run.dataset, "test", run.data_dir)
    acc, loss = models.evaluate(run.model, np.load(path), test)
    return {"accuracy": float(acc), "loss": float(loss), "samples": len(test)}


def run_suite(suite: Suite, runs_dir: Path, *, resume: bool = False,
              only: set[str] | None = None) -> list[Path]:
    """Every experiment x seed of ``suite``, one after another."""
    paths = []
    for seed in suite.seeds:
        for exp in suite.experiments:
            if only is None or exp.label in only:
                print(f"reproduce: {_run_name(suite, exp, seed)}", file=sys.stderr, flush=True)
                paths.append(run_one(suite, exp, seed, runs_dir, resume))
    return paths


# -- table -------------------------------------------------------------------------------------


def _overrun(run: metrics.Run, slowdowns: list[float], base: float) -> float | None:
    """Largest ratio over workers of mean step time to F x base (1.0: sleep set the pace)."""
    worst = None
    for w, recs in run.workers.items():
        times = [r["step_time"] for r in recs if isinstance(r.get("step_time"), (int, float))]
        if times and isinstance(w, int) and w < len(slowdowns) and base > 0:
            ratio = float(np.mean(times)) / (slowdowns[w] * base)
            worst = ratio if worst is None else max(worst, ratio)
    return worst


def run_figures(run_dir: Path, targets: Sequence[float]) -> dict[str, Any]:
    """The table's figures of one run directory."""
    s = metrics.summarize(run_dir, targets=targets, write=False)
    launch = json.loads((run_dir / "launch.json").read_text())
    extra = _read_json(run_dir / "reproduce.json")
    run = metrics.load_run(run_dir)
    done = [e for e in run.events if e.get("event") == "done"]
    final = extra.get("final_full_test") or {}
    return {
        "time_to_accuracy": s["time_to_accuracy"],
        "final_accuracy": final.get("accuracy", s["final_accuracy"]),
        "best_accuracy": s["best_accuracy"], "curve_final_accuracy": s["final_accuracy"],
        "tail_accuracy": _tail_mean(run.eval, TAIL_POINTS),
        "samples": s["samples"], "bytes_up": s["bytes_up"], "bytes_down": s["bytes_down"],
        "mean_staleness": s["mean_staleness"], "max_staleness": s["max_staleness"],
        "mean_wait_s": s["mean_wait_s"], "mean_kept_fraction": s["mean_kept_fraction"],
        "train_s": s["train_s"], "samples_per_s": s["samples_per_s"], "groups": s["groups"],
        "done_reason": done[-1].get("reason") if done else None,
        "status": extra.get("status"),
        "step_overrun": _overrun(run, launch["slowdowns"], launch["run"]["base_step_s"]),
    }


def _tail_mean(evals: list[dict[str, Any]], n: int) -> float | None:
    """Mean accuracy of the last ``n`` evaluations: the end of a noisy curve, less noisy."""
    accs = [r["accuracy"] for r in evals if isinstance(r.get("accuracy"), (int, float))]
    return float(np.mean(accs[-n:])) if accs else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _median(values: list[Any]) -> tuple[Any, list[Any] | None]:
    """(median, [min, max]) of the numbers; None when no seed gave one; strings: the first."""
    nums = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not nums:
        return (values[0] if values and isinstance(values[0], str) else None), None
    return statistics.median(nums), [min(nums), max(nums)]


def _median_time(values: list[float | None]) -> tuple[float | None, list[float | None]]:
    """Median time to a target, a seed that never reached it counting as infinitely slow."""
    times = sorted(math.inf if v is None else float(v) for v in values)
    med = statistics.median(times)
    finite = [None if math.isinf(t) else t for t in (times[0], times[-1])]
    return (None if math.isinf(med) else med), finite


def aggregate(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over seeds of every figure; ``spread`` holds [min, max] when seeds > 1."""
    row: dict[str, Any] = {"seeds": len(per_seed), "spread": {}}
    for key in per_seed[0]:
        if key == "time_to_accuracy":
            row[key] = {}
            for t in per_seed[0][key]:
                row[key][t], times = _median_time([f[key][t] for f in per_seed])
                if len(per_seed) > 1:
                    row["spread"][f"time_to_{t}"] = times
            continue
        row[key], spread = _median([f[key] for f in per_seed])
        if len(per_seed) > 1 and spread is not None:
            row["spread"][key] = spread
    return row


def _speedup(ref: dict[str, Any], row: dict[str, Any], target: str) -> float | None:
    a, b = ref["time_to_accuracy"].get(target), row["time_to_accuracy"].get(target)
    return a / b if a is not None and b else None


def add_speedups(rows: dict[str, dict[str, Any]], targets: Sequence[float]) -> None:
    """speedup_vs_bsp / _vs_ssp at the primary target (the highest one the pair both reached)."""
    keys = [f"{t:.2f}" for t in sorted(targets, reverse=True)]
    for row in rows.values():
        for ref_name in ("bsp", "ssp"):
            ref = rows.get(ref_name)
            by_target = {k: _speedup(ref, row, k) for k in keys} if ref else {}
            hit = next((k for k in keys if by_target.get(k) is not None), None)
            row[f"speedup_vs_{ref_name}"] = by_target.get(hit) if hit else None
            row[f"speedup_vs_{ref_name}_target"] = hit
            row[f"speedups_vs_{ref_name}"] = by_target


def build_table(suite: Suite, runs_dir: Path) -> dict[str, Any]:
    """The suite's rows from its run directories (missing runs are left out)."""
    rows: dict[str, dict[str, Any]] = {}
    missing = []  # runs that are absent or did not finish (a crash, a timeout): left out
    for exp in suite.experiments:
        dirs = [runs_dir / _run_name(suite, exp, s) for s in suite.seeds]
        missing += [d.name for d in dirs if not _done(d)]
        figures = [run_figures(d, suite.targets) for d in dirs if _done(d)]
        if figures:
            rows[exp.label] = {"part": exp.part, "overrides": exp.overrides,
                               **aggregate(figures)}
    add_speedups(rows, suite.targets)
    return {"config": {**suite.run, "slowdowns": suite.slowdowns, "seeds": suite.seeds,
                       "targets": list(suite.targets)}, "rows": rows, "missing": missing}


# -- output ------------------------------------------------------------------------------------


def _fmt(x: Any, kind: str = "") -> str:
    if x is None:
        return "–"
    if kind == "pct":
        return f"{100 * x:.2f}"
    if kind == "mb":
        return f"{x / 1e6:.1f}"
    if kind == "x":
        return f"{x:.2f}×"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def table_markdown(name: str, table: dict[str, Any]) -> str:
    """table.md: one Markdown table per suite."""
    out = [f"# results/{name}\n"]
    for sname, suite in table["suites"].items():
        cfg = suite["config"]
        targets = [f"{t:.2f}" for t in cfg["targets"]]
        out.append(f"## {sname}: {cfg['model']} on {cfg['dataset']}, slowdowns "
                   f"{cfg['slowdowns']}, {cfg['epochs']} epochs, seeds {cfg['seeds']}\n")
        head = (["experiment"] + [f"t→{float(t):.0%} (s)" for t in targets]
                + ["final acc %", "tail acc %", "best acc %", "samples", "MB up", "MB down",
                   "kept %", "staleness", "wait s", "vs BSP", "vs SSP", "overrun"])
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for label, r in suite["rows"].items():
            cells = ([label] + [_fmt(r["time_to_accuracy"].get(t)) for t in targets]
                     + [_fmt(r["final_accuracy"], "pct"), _fmt(r["tail_accuracy"], "pct"),
                        _fmt(r["best_accuracy"], "pct"),
                        _fmt(r["samples"]), _fmt(r["bytes_up"], "mb"),
                        _fmt(r["bytes_down"], "mb"), _fmt(r["mean_kept_fraction"], "pct"),
                        _fmt(r["mean_staleness"]), _fmt(r["mean_wait_s"]),
                        _fmt(r["speedup_vs_bsp"], "x"), _fmt(r["speedup_vs_ssp"], "x"),
                        _fmt(r["step_overrun"])])
            out.append("| " + " | ".join(cells) + " |")
        if suite.get("missing"):
            out.append(f"\nLeft out (absent or not finished): {', '.join(suite['missing'])}")
        out.append("")
    return "\n".join(out)


def _curve(run_dir: Path, x: str) -> tuple[list[float], list[float]]:
    """(x, accuracy) of a run's evaluations; x = seconds since the training start or MB up."""
    run = metrics.load_run(run_dir)
    pts = [(r[x], r["accuracy"]) for r in run.eval
           if isinstance(r.get(x), (int, float)) and isinstance(r.get("accuracy"), float)]
    x0, scale = (run.start_t, 1.0) if x == "t" else (0.0, 1e-6)
    return [(a - x0) * scale for a, _ in pts], [b for _, b in pts]


def _chart(suite: Suite, runs_dir: Path, x: str, exps: list[Experiment], path: Path) -> Path:
    from matplotlib.figure import Figure  # lazy: only the charts need matplotlib

    fig = Figure(figsize=(7.0, 4.2), layout="constrained")
    ax = fig.subplots()
    for exp in exps:
        run_dir = runs_dir / _run_name(suite, exp, suite.seeds[0])
        if (run_dir / "eval.jsonl").exists():
            style = "--" if exp.part == "compression" and x == "t" else "-"
            ax.plot(*_curve(run_dir, x), style, marker=".", ms=3, lw=1.2, label=exp.label)
    for target in suite.targets:
        ax.axhline(target, color="grey", lw=0.6, ls=":")
    xlabel = "training time (s)" if x == "t" else "MB uploaded by the workers"
    if x != "t":
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel="test accuracy", ylim=(max(0.0, min(suite.targets) - 0.3), None),
           title=f"{suite.name} (seed {suite.seeds[0]}): accuracy vs {xlabel.split(' (')[0]}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=80)
    return path


def plot_suite(suite: Suite, runs_dir: Path, out: Path) -> list[Path]:
    """accuracy vs training time (every experiment) and vs MB uploaded (the compressors)."""
    squeezed = [e for e in suite.experiments if e.part == "compression" or e.label == "gssp"
                or "gdtopk" in e.label]
    return [_chart(suite, runs_dir, "t", suite.experiments,
                   out / f"{suite.name}-accuracy_vs_time.png"),
            _chart(suite, runs_dir, "bytes_up", squeezed or suite.experiments,
                   out / f"{suite.name}-accuracy_vs_bytes.png")]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    size = "full" if args.full else "smoke" if args.smoke else "quick"
    out = Path(args.out or ROOT / "results" / size)
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    suites = suites_for(size)
    for suite in suites:
        _apply_overrides(suite, args)
        if not args.table_only:
            run_suite(suite, runs_dir, resume=args.resume,
                      only=set(args.only.split(",")) if args.only else None)
    table = {"name": size, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
             "suites": {s.name: build_table(s, runs_dir) for s in suites}}
    (out / "table.json").write_text(json.dumps(table, indent=2, default=str) + "\n")
    (out / "table.md").write_text(table_markdown(size, table))
    if not args.no_plot:
        for suite in suites:
            plot_suite(suite, runs_dir, out)
    print(json.dumps(table) if args.json else table_markdown(size, table))
    return 0


def _apply_overrides(suite: Suite, args: argparse.Namespace) -> None:
    """--epochs / --lr / --momentum / --base-step / --seeds (tuning and partial reruns)."""
    for flag, key in (("epochs", "epochs"), ("lr", "lr"), ("momentum", "momentum"),
                      ("base_step", "base_step_s")):
        if getattr(args, flag) is not None:
            suite.run[key] = getattr(args, flag)
    if args.seeds:
        suite.seeds = [int(s) for s in args.seeds.split(",")]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="8 workers, LeNet-5 (default)")
    size.add_argument("--full", action="store_true", help="16 workers, 3 seeds, more models")
    size.add_argument("--smoke", action="store_true", help="two tiny runs (tests)")
    p.add_argument("--out", help="output directory (default results/<size>)")
    p.add_argument("--only", help="comma-separated experiment labels to run")
    p.add_argument("--resume", action="store_true", help="keep runs that already finished")
    p.add_argument("--table-only", action="store_true", help="rebuild table and plots only")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG charts")
    p.add_argument("--json", action="store_true", help="print table.json instead of table.md")
    p.add_argument("--epochs", type=float, help="override the samples budget, epochs")
    p.add_argument("--lr", type=float, help="override the learning rate (every experiment)")
    p.add_argument("--momentum", type=float, help="override the momentum (every experiment)")
    p.add_argument("--base-step", type=float, help="override the emulated base step, s")
    p.add_argument("--seeds", help="override the seeds, e.g. 0,1,2")
    return p


if __name__ == "__main__":
    sys.exit(main())
