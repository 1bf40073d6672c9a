"""Reproduce the paper's comparisons: GSSP vs BSP / SSP / ASP, GDTopK, and the compressors.

    python scripts/reproduce.py --quick        # LeNet-5 / Fashion-MNIST, 8 workers, ~20 min
    python scripts/reproduce.py --full         # 16 workers, 3 seeds, CIFAR-10 / seq2seq if present
    python scripts/reproduce.py --smoke        # two tiny runs (what the test executes)
    python scripts/reproduce.py --link-suite   # fmnist8 over 20 mbit links: dense, 1%, local steps
    python scripts/reproduce.py --link-suite-5mbit   # the same over 5 mbit links
    python scripts/reproduce.py --link-suite-mixed   # links that follow speeds: 100 to 5 mbit
    python scripts/reproduce.py --link-suite-links   # equal compute, links 6x100 and 2x5 mbit
    python scripts/reproduce.py --link-suite --repeat 3   # each seed 3 times, the median
    python scripts/reproduce.py --ablation-suite     # where compression's accuracy goes
    python scripts/reproduce.py --losscomp-sweep     # LossComp's votes tuned on a validation split
    python scripts/reproduce.py --changing-suite   # speeds that change: DDP, BSP, LB-BSP, GSSP
    python scripts/reproduce.py --quick --link 10mbit   # any suite over shaped links
    python scripts/reproduce.py --quick --table-only   # rebuild table + plots from the runs
    python scripts/reproduce.py --quick --only ddp,lbbsp   # rerun some rows, keep the others
    python scripts/reproduce.py --quick --optimizer-at worker   # SGD on the workers, every run

Every run is a real `minips local` cluster (``minips.run.launch.run_local``) started one after
another, never in parallel, so that their wall times compare. A *suite* fixes the model, the
slowdown profile, the optimizer (lr, momentum, weight decay, batch), the seed(s), the initial
weights (written from the seed by the launcher) and the samples budget; its *experiments* change
only the mode and the compressor. A suite may also put its workers behind bandwidth-limited
links (``link``, a `minips local --link` profile, docs/links.md; ``--link`` sets one for every
suite run). A row's overrides are RunConfig fields, so a row may also say where the optimizer
runs and which of DGC's pieces are on (``optimizer_at``, ``momentum_masking``, ``grad_clip``,
``compressor_opts`` ``warmup_fraction``). Output under ``results/<name>/``:

    runs/<suite>-<experiment>-s<seed>/   the run directory (config.json, launch.json = the full
                                         config with the seed, metrics, summary.json) plus
                                         reproduce.json (suite, experiment, CPU load,
                                         re-evaluation); a seed's repeats beyond its first
                                         (--repeat K) end -r<k>
    table.json, table.md                 per experiment: medians over seeds (spread = [min, max])
                                         and every seed (per_seed: the median of its K runs, with
                                         runs and runs_spread); rows of the earlier table
                                         with no run here are kept, marked † (--fresh-table
                                         drops them); runs that overran their emulated step by
                                         more than 1.05 are flagged (⚠ CPU)
    <suite>-accuracy_vs_time.png         all modes on one chart
    <suite>-accuracy_vs_bytes.png        the compressors

Invariants: an experiment differs from its suite only in the fields listed in its overrides;
time to accuracy counts from the training start (the ``groups`` event), as ``metrics`` does;
``final_accuracy`` is, for every row (minips, LB-BSP, DDP), the weights once the same samples
budget is spent and applied, evaluated on the whole test set (repro_table.py's docstring);
one run is not a seed's figure: ``--repeat K`` makes it the median of K.

This module holds the suites, the runs and the command line; the table, Markdown and charts
are in ``repro_table.py`` next to it (its public names are re-exported here).

A suite's speeds may change during a run (``profile``: `minips local --slowdown` schedules,
``throttle``: `--throttle`; core/slowdown.py), and a row may be torch DDP instead of minips
(``Experiment.ddp_hook``: scripts/bench_ddp.py on the suite's profile, model, data, optimizer
and epochs; its JSON goes to the row's run directory as ddp.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from minips.core.config import OPTIMIZER_PLACES, RunConfig
from minips.core.optim import SCHEDULES
from minips.core.slowdown import parse_schedules
from minips.errors import MiniPSError
from minips.net.links import SHAPINGS, parse_profile
from minips.run.checks import argtype, checked_text
from minips.run.flags import PRESETS
from minips.run.launch import LaunchConfig

# The table module sits next to this file; a test loads this file by path, without scripts/ on
# sys.path, so put it there before importing (running as a script has it already).
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from repro_table import (  # noqa: E402  (needs the sys.path line above)
    OVERRUN_LIMIT,
    TAIL_POINTS,
    Experiment,
    Suite,
    add_speedups,
    aggregate,
    build_table,
    carry_rows,
    overrun_flags,
    plot_suite,
    profile_ceiling,
    run_done,
    run_figures,
    run_name,
    suite_slowdowns,
    table_markdown,
)

__all__ = ["Experiment", "Suite", "paper_experiments", "baseline_experiments",
           "changing_experiments", "suites_for",
           "run_suite", "run_ddp",
           "build_table", "table_markdown", "main",
           # re-exported from repro_table (tests and callers import them from here)
           "TAIL_POINTS", "add_speedups", "aggregate", "plot_suite", "run_done", "run_figures",
           "run_name", "profile_ceiling", "suite_slowdowns"]

ROOT = Path(__file__).resolve().parent.parent
RATIO = 0.01  # matched average kept fraction of every sparse compressor (the paper's 1%)
STALENESS = 3  # SSP bound, inside GSSP groups too
QUICK_PROFILE = [1, 1, 1.5, 1.5, 2, 2, 4, 4]  # slowdown factor per worker
FULL_PROFILE = [1.0] * 4 + [1.5] * 4 + [2.0] * 4 + [4.0] * 4


# What the ablation found best at 1% (docs/results.md, "Where compression's accuracy goes"):
# the optimizer on the workers (momentum correction), the upload and the exchange compressed,
# no momentum-factor masking, no clipping, no warm-up; and the exact downlink (the entries
# changed since the worker's version: higher and sooner to 85% than the compressed one on the
# quick suite and behind 20 and 5 mbit links, docs/results.md, "Compressed rows at DDP's
# accuracy"), its updates' values in float16 (a quarter fewer bytes, level in accuracy and
# time: "The exact downlink's values in float16"). Every sparse row runs with `make demo`'s
# own (run/flags.py's preset); --down-mode auto gives them the compressed downlink back
# (drift bound down_drift).
SPARSE_DEFAULTS: dict[str, Any] = {
    k: PRESETS["demo"]["run"][k]
    for k in ("optimizer_at", "down_mode", "down_drift", "down_values")}


def paper_experiments(groups: int) -> list[Experiment]:
    """BSP, SSP, ASP, GSSP, GSSP+GDTopK (both directions), and the compressors at GSSP. Sparse
    compressors send float16 values (as `make demo` does), with ``SPARSE_DEFAULTS``."""
    gssp = {"mode": "gssp", "groups": groups, "staleness": STALENESS}
    # see docs/results.md: runs are too short for DGC's 4 epochs of warm-up
    no_warmup = {"warmup_epochs": 0, "value_dtype": "f16"}
    exps = [Experiment("bsp", {"mode": "bsp"}), Experiment("ssp", {"mode": "ssp"}),
            Experiment("asp", {"mode": "asp"}), Experiment("gssp", gssp)]
    for direction in ("slower-more", "slower-less"):
        exps.append(Experiment(f"gssp+gdtopk-{direction}", {
            **gssp, **SPARSE_DEFAULTS, "compressor": "gdtopk", "gdtopk_direction": direction,
            "ratio": RATIO,  # the push-weighted mean kept fraction (minips/compress/ratios.py)
            "compressor_opts": no_warmup}))
    for comp in ("topk", "dgc", "losscomp"):
        exps.append(Experiment(f"gssp+{comp}", {**gssp, **SPARSE_DEFAULTS, "compressor": comp,
                                                "ratio": RATIO,
                                                "compressor_opts": {"value_dtype": "f16"}},
                               part="compression"))
    return exps


def baseline_experiments() -> list[Experiment]:
    """The baselines a user would pick instead: torch DDP over gloo (dense, fp16 hook, PowerSGD
    hook; scripts/bench_ddp.py) and LB-BSP (batch sizes proportional to speed), dense and with
    the compressor the GSSP rows use (Top-K at ``RATIO``, float16 values, ``SPARSE_DEFAULTS``):
    the same compressor given to LB-BSP, so that a GSSP row's lead is the grouping's."""
    return [Experiment("ddp", {"mode": "bsp"}, ddp_hook="none"),
            Experiment("ddp-fp16", {"mode": "bsp"}, ddp_hook="fp16"),
            Experiment("ddp-powersgd", {"mode": "bsp"}, ddp_hook="powersgd"),
            Experiment("lbbsp", {"mode": "lbbsp"}),
            Experiment("lbbsp+topk", {"mode": "lbbsp", **SPARSE_DEFAULTS, "compressor": "topk",
                                      "ratio": RATIO, "compressor_opts": {"value_dtype": "f16"}},
                       part="compression")]


def changing_experiments(groups: int) -> list[Experiment]:
    """The changing-speeds suite's rows: DDP (dense all-reduce), BSP, LB-BSP, SSP, GSSP with
    regrouping on and off, GSSP with the compressor that did best over links (GDTopK
    slower-less, docs/results.md), and LB-BSP with Top-K (the same compression, no grouping)."""
    gssp = {"mode": "gssp", "groups": groups, "staleness": STALENESS}
    best = next(e for e in paper_experiments(groups) if e.label == "gssp+gdtopk-slower-less")
    return [Experiment("ddp", {"mode": "bsp"}, ddp_hook="none"),
            Experiment("bsp", {"mode": "bsp"}), Experiment("lbbsp", {"mode": "lbbsp"}),
            Experiment("ssp", {"mode": "ssp"}), Experiment("gssp", gssp),
            Experiment("gssp-fixed-groups", {**gssp, "regroup": False}),
            Experiment(best.label, best.overrides),
            next(e for e in baseline_experiments() if e.label == "lbbsp+topk")]


def _fmnist(name: str, profile: list[float], epochs: float, seeds: list[int]) -> Suite:
    # lr, its schedule and momentum: from a sweep shared by every mode (docs/results.md)
    run = {"model": "lenet5", "dataset": "fashion-mnist", "batch_size": 64, "lr": 0.05,
           "lr_schedule": "cosine", "momentum": 0.9, "weight_decay": 5e-4,
           "staleness": STALENESS, "sync_every": 4, "epochs": epochs, "base_step_s": 0.1,
           "eval_every_s": 2.0, "eval_limit": 5000, "calib_steps": 5,
           "wall_s": 100.0 * epochs}  # wall_s: a cap far above BSP's time
    return Suite(name, run, profile, paper_experiments(4), seeds,
                 targets=(0.70, 0.75, 0.80, 0.85))


def _cifar_present() -> bool:
    from minips.ml import data

    try:
        data.load_dataset("cifar10", "test", download=False, fallback=False)
    except MiniPSError:
        return False
    return True


def _full_suites() -> list[Suite]:
    seeds = [0, 1, 2]
    suites = [_fmnist("fmnist16", FULL_PROFILE, 10.0, seeds)]
    suites[0].run["base_step_s"] = 0.2  # twice the workers: keep the 2 cores below saturation
    modes_only = [e for e in paper_experiments(4) if e.part == "modes"]
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


LINK_PROFILE = "20mbit"  # the link suite's links, every worker, both directions
LINK5_PROFILE = "5mbit"  # --link-suite-5mbit's: the same suite on a harsher link
LINK_WHY = (
    "fmnist8 (LeNet-5, Fashion-MNIST, slowdowns 1,1,1.5,1.5,2,2,4,4, lr 0.05 cosine) with the "
    "demo's budget and speed (5 epochs, 40 ms base step), every worker behind a 20 mbit link "
    "each way. A dense LeNet-5 push or pull is 247 kB, 0.1 s at 20 mbit: measured (kernel "
    "shaping, 0.5 epoch) a dense push took 91 ms and a pull 91 ms against a 40-160 ms step, and "
    "dense GSSP trained 0.5 epoch in 27 s against 14 s unshaped, so dense training is "
    "communication-bound; a 1% Top-K push took 0.9 ms. At 10 mbit a dense BSP run would pass "
    "the 240 s cap. 5 epochs, not the quick suite's 4: at 4 the 1% rows end at 84-85% and "
    "time to 85% says little. The row gssp-unlinked is dense GSSP without a link limit, the "
    "accuracy the compressed rows are held to.")


def local_steps_experiments(gssp: dict[str, Any]) -> list[Experiment]:
    """GSSP with local steps (docs/compression.md, "Local steps"; the optimizer on the
    workers): H = 8 averaged, H = 8 with DiLoCo's Nesterov outer step, H per group from its
    speed (auto, at most 8), and H = 8 with Top-K of the 8-step change (error feedback) at
    8 x RATIO a push: the bytes per step of gssp+topk (a push carries 8 steps; at RATIO a
    push the simulator's quadratic diverged, docs/compression.md); H = 4 dense and with
    Top-K at 4 x RATIO; H = 8 with Top-K at 2 x RATIO (a quarter of the bytes); H = 8 with
    Top-K and the Nesterov outer step."""
    local = {**gssp, "optimizer_at": "worker", "local_steps": 8}
    return [
        Experiment("gssp+local8", local),
        Experiment("gssp+local8+nesterov", {**local, "outer_optimizer": "nesterov",
                                            "outer_lr": 0.7, "outer_momentum": 0.9}),
        Experiment("gssp+localauto", {**local, "local_steps": 0, "local_steps_max": 8}),
        Experiment("gssp+local8+topk", {**local, "compressor": "topk", "ratio": 8 * RATIO,
                                        "compressor_opts": {"value_dtype": "f16"}},
                   part="compression"),
        # fewer local steps (less drift between pushes), and H = 8 at a quarter of the bytes
        Experiment("gssp+local4", {**local, "local_steps": 4}),
        Experiment("gssp+local4+topk", {**local, "local_steps": 4, "compressor": "topk",
                                        "ratio": 4 * RATIO,
                                        "compressor_opts": {"value_dtype": "f16"}},
                   part="compression"),
        Experiment("gssp+local8+topk2", {**local, "compressor": "topk", "ratio": 2 * RATIO,
                                         "compressor_opts": {"value_dtype": "f16"}},
                   part="compression"),
        Experiment("gssp+local8+nesterov+topk", {
            **local, "outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9,
            "compressor": "topk", "ratio": 8 * RATIO, "compressor_opts": {"value_dtype": "f16"}},
                   part="compression"),
    ]


F32_DOWN = "+f32down"  # the best row whose exact downlink sends float32 values (the control)
DENSE_END = {"dense_end_fraction": 0.25, "dense_end_factor": 4.0}  # 4x the ratio at the end
_F, _X = DENSE_END["dense_end_fraction"], DENSE_END["dense_end_factor"]
DENSE_END_BYTES = 1 - _F + _F * (_X - 1) / math.log(_X)  # its mean ratio multiplier (1.29)


XCHG_RATIOS = (0.02, 0.04)  # the group <-> global exchange denser than the upload's 1%
GDTOPK_ALPHAS = (0.5, 2.0)  # GDTopK's spread of the groups' ratios (1: the default)


def compressed_tuning_experiments(best: Experiment) -> list[Experiment]:
    """The best per-step compressed row (``best``, GDTopK slower-less) tuned one piece at a
    time: a denser final phase (``DENSE_END``: the kept fraction rising to 4x over the last
    quarter of the run, as the cosine lr decays), its control at the same upload bytes (a
    flat ratio ``DENSE_END_BYTES`` x ``RATIO``, the downlink kept at ``RATIO``), and DGC's
    warm-up over 5% of the run with the optimizer on the workers (the ablation measured it
    only with masking and clipping), and the exact downlink's updates with float32 values
    (``+f32down``: 4 bytes a value instead of the default's 2; the workers then hold the
    weights bit for bit, not to float16's rounding); the group <-> global exchange at 2% and
    4% (``+xchg2%``, ``+xchg4%``: a group of two takes in up to 8% of the entries between two
    exchanges and passes on 1% of them, the rest waiting in its residual); GDTopK's ratios
    spread less and more between the groups (``+alpha0.5``, ``+alpha2``). The compressed
    downlink is ``--down-mode both``'s twin."""
    opts = best.overrides["compressor_opts"]

    def tuned(suffix: str, **changes: Any) -> Experiment:
        return Experiment(best.label + suffix, {**best.overrides, **changes}, part="compression")

    return [
        tuned("+dense-end", compressor_opts={**opts, **DENSE_END}),
        tuned("@1.3%", ratio=round(DENSE_END_BYTES * RATIO, 4), down_ratio=RATIO),
        tuned("+warmup", compressor_opts={**opts, "warmup_fraction": 0.05}),
        tuned(F32_DOWN, down_values="f32"),
        *(tuned(f"+xchg{round(100 * r)}%", xchg_ratio=r) for r in XCHG_RATIOS),
        *(tuned(f"+alpha{a:g}", gdtopk_alpha=a) for a in GDTOPK_ALPHAS),
    ]


def _link_suite(profile: str = LINK_PROFILE) -> Suite:
    """`--link-suite`: GSSP dense vs the compressors and local steps when the links, not the
    CPUs, limit; `--link-suite-5mbit` the same behind 5 mbit links (a dense push 0.4 s)."""
    suite = _fmnist("link" if profile == LINK_PROFILE else f"link{profile}", QUICK_PROFILE,
                    5.0, [0])
    suite.run.update(base_step_s=0.04, wall_s=240.0 if profile == LINK_PROFILE else 600.0)
    suite.experiments = [e for e in suite.experiments if e.label not in ("ssp", "asp")]
    gssp = next(e for e in suite.experiments if e.label == "gssp")
    suite.experiments.append(Experiment("gssp-unlinked", gssp.overrides, link=""))
    suite.experiments += local_steps_experiments(gssp.overrides)
    best = next(e for e in suite.experiments if e.label == "gssp+gdtopk-slower-less")
    suite.experiments += compressed_tuning_experiments(best)
    suite.experiments += baseline_experiments()  # DDP (each rank behind its link) and LB-BSP
    suite.link = profile
    # dense GSSP is link-bound here: the rows compared are the best per-step and local-steps ones
    suite.leads = ("gssp+gdtopk-slower-less", "gssp+local8+topk")
    suite.description = LINK_WHY if profile == LINK_PROFILE else (
        f"the link suite behind {profile} links each way (4x slower than 20 mbit: a dense "
        "LeNet-5 push or pull about 0.4 s against a 40-160 ms step); wall cap 600 s")
    return suite


ABLATION_CLIP = 10.0  # --grad-clip of the ablation's clipping rows (x sqrt(workers) per worker)
ABLATION_WHY = (
    "where compression's accuracy goes, on the quick suite's fmnist8 (4 epochs, 40 ms x "
    "slowdowns 1,1,1.5,1.5,2,2,4,4 at a 100 ms base step, GSSP in 4 groups): DGC's sampled "
    "top-k at 1% a push (float16 values, no warm-up unless a row says so) on the upload only "
    "(dense downlink and exchange), then with the compressed downlink, then with the "
    "compressed group <-> global exchange too; each with SGD on the servers and on the workers "
    "(momentum correction); then DGC's other pieces one by one on the workers: momentum-factor "
    f"masking, local gradient clipping (--grad-clip {ABLATION_CLIP:g}), a warm-up over 5% of "
    "the run. Every sparse row keeps the same 1% a push, so bytes compare row to row.")


def ablation_experiments(groups: int) -> list[Experiment]:
    """The ablation's rows (``ABLATION_WHY``): what each hop's compression and each of DGC's
    pieces costs or gives back."""
    gssp = {"mode": "gssp", "groups": groups, "staleness": STALENESS}
    dgc = {**gssp, "compressor": "dgc", "ratio": RATIO,
           "compressor_opts": {"warmup_epochs": 0, "value_dtype": "f16"}}
    hops = {"up": {"down_ratio": 1.0, "xchg_ratio": 1.0}, "up+down": {"xchg_ratio": 1.0},
            "all": {}}
    exps = [Experiment("dense", gssp),
            Experiment("dense@worker", {**gssp, "optimizer_at": "worker"})]
    for where in ("server", "worker"):
        for name, more in hops.items():
            label = name if where == "server" else f"{name}@worker"
            exps.append(Experiment(label, {**dgc, **more, "optimizer_at": where},
                                   part="compression"))
    on_worker = {**dgc, "optimizer_at": "worker", "momentum_masking": True}
    exps.append(Experiment("all@worker+mask", on_worker, part="compression"))
    clipped = {**on_worker, "grad_clip": ABLATION_CLIP}
    exps.append(Experiment("all@worker+mask+clip", clipped, part="compression"))
    warm = {**clipped, "compressor_opts": {"warmup_fraction": 0.05, "value_dtype": "f16"}}
    exps.append(Experiment("all@worker+mask+clip+warmup", warm, part="compression"))
    return exps


def _ablation_suite() -> Suite:
    """`--ablation-suite`: the quick suite's set-up, ``ablation_experiments``' rows."""
    suite = _fmnist("ablation", QUICK_PROFILE, 4.0, [0])
    suite.experiments = ablation_experiments(4)
    suite.description, suite.leads = ABLATION_WHY, ("dense",)
    return suite


VAL_SIZE = 5000  # the tuning suites' validation samples, held out of the 60,000 training ones
VOTE_WEIGHTS = (0.1, 0.3, 0.6)  # LossComp's vote_weight, swept (0: the votes do not steer)
VOTE_WINDOWS = (0.25, 1.0)  # its vote_window, epochs
LOSSCOMP_WHY = (
    "LossComp's votes tuned without the test set: the quick suite's fmnist8 with "
    f"{VAL_SIZE} training samples held out (--val-size; the same for every seed), which no "
    "worker trains on and the evaluator scores instead of the test set; every figure of this "
    "table is a validation figure and the final weights are not scored on the test set. Rows: "
    f"LossComp at 1% with vote_weight 0 (votes kept, not steering) and {VOTE_WEIGHTS} x "
    f"vote_window {VOTE_WINDOWS} epochs. The setting with the best validation tail accuracy "
    "is the one compared on the test set against Top-K, DGC and dense, 3 seeds.")


def losscomp_sweep_experiments(groups: int) -> list[Experiment]:
    """LossComp's vote weight x window (``LOSSCOMP_WHY``), at 1% a push as the quick suite's."""
    base = next(e for e in paper_experiments(groups) if e.label == "gssp+losscomp")
    exps = [Experiment("losscomp-w0", base.overrides, part="compression")]
    for weight in VOTE_WEIGHTS:
        for window in VOTE_WINDOWS:
            opts = {**base.overrides["compressor_opts"], "vote_weight": weight,
                    "vote_window": window}
            exps.append(Experiment(f"losscomp-w{weight:g}-win{window:g}",
                                   {**base.overrides, "compressor_opts": opts},
                                   part="compression"))
    return exps


# The sweep's winner on the validation split (results/losscomp-sweep, seed 0: the best tail
# accuracy, 84.15% against 83.98% with the votes not steering); the quick suite's row
# gssp+losscomp-votes puts it on the test set beside Top-K, DGC and dense, 3 seeds
LOSSCOMP_TUNED = {"vote_weight": 0.1, "vote_window": 0.25}


def losscomp_tuned_experiment(groups: int) -> Experiment:
    """gssp+losscomp with ``LOSSCOMP_TUNED``'s votes."""
    base = next(e for e in paper_experiments(groups) if e.label == "gssp+losscomp")
    opts = {**base.overrides["compressor_opts"], **LOSSCOMP_TUNED}
    return Experiment("gssp+losscomp-votes", {**base.overrides, "compressor_opts": opts},
                      part="compression")


def _losscomp_sweep_suite() -> Suite:
    """`--losscomp-sweep`: ``losscomp_sweep_experiments`` on a validation split."""
    suite = _fmnist("losscomp-sweep", QUICK_PROFILE, 4.0, [0])
    suite.run["val_size"] = VAL_SIZE
    suite.experiments = losscomp_sweep_experiments(4)
    suite.description, suite.final_test = LOSSCOMP_WHY, False
    return suite


# The mixed edge profile: each worker's link follows its speed (lab PCs on wired 100 mbit,
# laptops on 50 mbit Wi-Fi, boards on 20 mbit, the slowest boards on a crowded 5 mbit Wi-Fi)
MIXED_PROFILE = "100,100,50,50,20,20,5,5mbit"
MIXED_WHY = (
    "the link suite's fmnist8 where each worker's link follows its speed, as on an edge "
    f"cluster ({MIXED_PROFILE} each way for slowdowns 1,1,1.5,1.5,2,2,4,4: wired lab PCs, "
    "laptops on Wi-Fi, boards, the slowest boards on a crowded Wi-Fi): the slowest worker is "
    "slower still behind its link (a dense LeNet-5 push about 0.4 s at 5 mbit), which BSP and "
    "DDP wait for every round and GSSP's speed groups keep apart. Rows: dense BSP and GSSP, the "
    "best per-step compressed row of the 20 mbit suite, local steps alone and with "
    "compression, DDP with its fp16 hook, dense GSSP without links; wall cap 600 s")


def _mixed_suite() -> Suite:
    """`--link-suite-mixed`: the link suite's rows that matter behind ``MIXED_PROFILE``."""
    suite = _link_suite(LINK5_PROFILE)
    keep = ("bsp", "gssp", "gssp+gdtopk-slower-less", "gssp+local8", "gssp+local8+topk",
            "ddp-fp16", "gssp-unlinked")
    suite.name, suite.link, suite.description = "linkmixed", MIXED_PROFILE, MIXED_WHY
    suite.experiments = [e for e in suite.experiments if e.label in keep]
    return suite


# The link-only profile: every worker computes at the same speed, two of them sit behind slow
# links (boards on a crowded Wi-Fi beside wired PCs), so only a link makes a worker slow
LINKS_PROFILE = "100,100,100,100,100,100,5,5mbit"
# its base step: the cluster asks the CPUs for as many steps a second as the link suite's
# 40 ms x 1,1,1.5,1.5,2,2,4,4 (8 equal workers would otherwise ask 1.66x as much of 2 cores)
LINKS_BASE_STEP = round(0.04 * len(QUICK_PROFILE) / sum(1 / f for f in QUICK_PROFILE), 3)
LINKS_WHY = (
    "the link suite's fmnist8 with equal compute (slowdown 1 for all 8 workers, a "
    f"{LINKS_BASE_STEP * 1000:g} ms base step: as many steps a second of the CPUs as the "
    "link suite's profile asks) and links that alone make two workers slow "
    f"({LINKS_PROFILE} each way: a dense LeNet-5 push or pull 20 ms at 100 mbit, about 0.4 s "
    "at 5 mbit). BSP, LB-BSP and DDP wait for the two slow links every round; LB-BSP's "
    "smaller batches do not shorten a push; GSSP's groups, formed on the iteration a group "
    "waits on, keep them apart. Rows: dense BSP, LB-BSP, dense GSSP, GSSP + GDTopK "
    "slower-less, DDP with its fp16 hook, dense GSSP without links; wall cap 900 s")


def _links_suite() -> Suite:
    """`--link-suite-links`: ``LINKS_PROFILE`` with equal compute (``LINKS_WHY``)."""
    suite = _link_suite(LINK5_PROFILE)
    keep = ("bsp", "lbbsp", "gssp", "gssp+gdtopk-slower-less", "ddp-fp16", "gssp-unlinked")
    suite.name, suite.link, suite.description = "linkonly", LINKS_PROFILE, LINKS_WHY
    suite.slowdowns = [1.0] * len(QUICK_PROFILE)
    suite.run.update(base_step_s=LINKS_BASE_STEP, wall_s=900.0)
    suite.experiments = [e for e in suite.experiments if e.label in keep]
    suite.leads = ("gssp", "gssp+gdtopk-slower-less")
    return suite


# fmnist8's profile, three of whose workers change speed: worker 0 throttles (a hot board) from
# 60 s on, worker 3 doubles its factor from 30 s to 90 s, worker 7 recovers at 60 s; every worker
# is also throttled in one 10 s interval out of ten, by 2-5x
CHANGING_PROFILE = "1@0,4@60s,1,1.5,1.5@0,3@30s,1.5@90s,2,2,4,4@0,1@60s"
CHANGING_THROTTLE = "0.1,2-5,10"
CHANGING_WHY = (
    "fmnist8 (LeNet-5, Fashion-MNIST, lr 0.05 cosine, 4 epochs) whose speeds change: worker 0 "
    "slows from 1x to 4x at 60 s, worker 3 from 1.5x to 3x between 30 s and 90 s, worker 7 "
    "speeds up from 4x to 1x at 60 s, and every worker is throttled by 2-5x in about one 10 s "
    "interval out of ten (seeded). Rows: torch DDP, BSP, LB-BSP (batch sizes re-balanced every "
    "5 rounds), SSP, GSSP with and without regrouping, GSSP with GDTopK slower-less. The "
    "ceiling averages the profile's rates over the BSP row's training time.")


def _changing_suite() -> Suite:
    """`--changing-suite`: speeds that change during the run (core/slowdown.py)."""
    suite = _fmnist("changing", QUICK_PROFILE, 4.0, [0])
    suite.experiments = changing_experiments(4)
    suite.profile, suite.throttle = CHANGING_PROFILE, CHANGING_THROTTLE
    suite.slowdowns = [s.first for s in parse_schedules(CHANGING_PROFILE)]
    suite.description = CHANGING_WHY
    return suite


def suites_for(size: str) -> list[Suite]:
    """The suites of ``--quick``, ``--full``, ``--smoke``, ``--link-suite`` ("link") or
    ``--link-suite-5mbit`` ("link5"), ``--link-suite-mixed`` ("linkmixed"),
    ``--link-suite-links`` ("linkonly"),
    ``--ablation-suite`` ("ablation"), ``--losscomp-sweep`` ("losscomp-sweep"),
    ``--changing-suite`` ("changing")."""
    if size == "changing":
        return [_changing_suite()]
    if size == "quick":
        suite = _fmnist("fmnist8", QUICK_PROFILE, 4.0, [0])
        suite.experiments += [losscomp_tuned_experiment(4), *baseline_experiments()]
        return [suite]
    if size == "full":
        return _full_suites()
    if size == "link":
        return [_link_suite()]
    if size == "link5":
        return [_link_suite(LINK5_PROFILE)]
    if size == "linkmixed":
        return [_mixed_suite()]
    if size == "linkonly":
        return [_links_suite()]
    if size == "ablation":
        return [_ablation_suite()]
    if size == "losscomp-sweep":
        return [_losscomp_sweep_suite()]
    return [_smoke_suite()]


# -- running -----------------------------------------------------------------------------------


def _launch_config(suite: Suite, exp: Experiment, seed: int, runs_dir: Path,
                   repeat: int = 0) -> LaunchConfig:
    fields = {**suite.run, **exp.overrides, "seed": seed, "workers": len(suite.slowdowns)}
    return LaunchConfig(run=RunConfig(**fields).validate(), slowdowns=list(suite.slowdowns),
                        schedules=parse_schedules(suite.profile) if suite.profile else [],
                        throttle=suite.throttle,
                        out_dir=str(runs_dir), name=run_name(suite, exp, seed, repeat),
                        progress=False, plot=False,
                        link=suite.link if exp.link is None else exp.link,
                        link_shaping=suite.link_shaping)


STOPPED = ("terminated", "interrupted")  # a run's status when its launcher was told to stop


def run_one(suite: Suite, exp: Experiment, seed: int, runs_dir: Path, resume: bool,
            repeat: int = 0) -> Path:
    """One cluster run (``repeat``: which of the seed's runs) to the end of its budget;
    returns its run directory."""
    run_dir = runs_dir / run_name(suite, exp, seed, repeat)
    if resume and run_done(run_dir):
        return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    if exp.ddp_hook:
        return run_ddp(suite, exp, seed, run_dir)
    cfg = _launch_config(suite, exp, seed, runs_dir, repeat)
    load_before, started = os.getloadavg(), time.time()
    from minips.run.launch import run_local  # imports torch lazily, only when a run starts

    summary = run_local(cfg)
    extra = {"suite": suite.name, "experiment": asdict(exp), "seed": seed, "repeat": repeat,
             "targets": suite.targets, "argv": sys.argv, "elapsed_s": time.time() - started,
             "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
             "status": summary.get("status"),
             "final_full_test": _evaluate_final(run_dir, cfg.run) if suite.final_test
             else None}
    (run_dir / "reproduce.json").write_text(json.dumps(extra, indent=2) + "\n")
    if summary.get("status") in STOPPED:  # SIGTERM or Ctrl-C ends the suite, not one run
        raise SystemExit(f"reproduce: {run_dir.name} {summary['status']}; the suite stops here "
                         "(--resume keeps the runs that finished)")
    return run_dir


def ddp_argv(suite: Suite, exp: Experiment, seed: int) -> list[str]:
    """scripts/bench_ddp.py's command line for a DDP row: the suite's profile (schedules and
    throttling), model, data, optimizer, lr schedule and its warm-up (RunConfig's
    ``lr_warmup``, as every minips row has it), samples budget, evaluation and links."""
    r = {**suite.run, **exp.overrides}
    warmup = r.get("lr_warmup", RunConfig().lr_warmup)
    profile = suite.profile or ",".join(f"{f:g}" for f in suite.slowdowns)
    link = suite.link if exp.link is None else exp.link
    return [sys.executable, str(ROOT / "scripts" / "bench_ddp.py"), "--hook", exp.ddp_hook,
            "--seed", str(seed), "--epochs", str(r["epochs"]), "--profile", profile,
            "--throttle", suite.throttle, "--base-step", str(r["base_step_s"]),
            "--model", r["model"], "--dataset", r["dataset"],
            "--batch-size", str(r["batch_size"]), "--lr", str(r["lr"]),
            "--lr-schedule", r.get("lr_schedule", "constant"), "--lr-warmup", str(warmup),
            "--momentum", str(r["momentum"]),
            "--weight-decay", str(r["weight_decay"]), "--eval-every-s", str(r["eval_every_s"]),
            "--eval-limit", str(r["eval_limit"]), "--wall-s", str(r["wall_s"]),
            *(["--link", link] if link else [])]


def run_ddp(suite: Suite, exp: Experiment, seed: int, run_dir: Path) -> Path:
    """A DDP row: bench_ddp.py to its end; its JSON is the run directory's ddp.json, with a
    summary.json that says it finished (``run_done``)."""
    import subprocess

    run_dir.mkdir(parents=True)
    argv = ddp_argv(suite, exp, seed)
    started = time.time()
    proc = subprocess.run(argv, capture_output=True, text=True,
                          timeout=float(suite.run["wall_s"]) + 600)
    (run_dir / "ddp.stderr").write_text(proc.stderr)
    if proc.returncode:
        raise SystemExit(f"reproduce: {run_dir.name}: bench_ddp.py failed "
                         f"({proc.returncode}); see {run_dir / 'ddp.stderr'}")
    (run_dir / "ddp.json").write_text(proc.stdout.strip().splitlines()[-1] + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"status": "done", "runner": "ddp"}) + "\n")
    extra = {"suite": suite.name, "experiment": asdict(exp), "seed": seed, "argv": argv,
             "elapsed_s": time.time() - started, "status": "done"}
    (run_dir / "reproduce.json").write_text(json.dumps(extra, indent=2) + "\n")
    return run_dir


def _evaluate_final(run_dir: Path, run: RunConfig) -> dict[str, float] | None:
    """Accuracy and loss of the final global weights on the whole test set."""
    path = run_dir / "final_weights.npy"
    if not path.exists():
        return None
    import torch

    from minips.ml import data, models

    torch.set_num_threads(1)
    test = data.load_dataset(run.dataset, "test", run.data_dir)
    acc, loss = models.evaluate(run.model, np.load(path), test)
    return {"accuracy": float(acc), "loss": float(loss), "samples": len(test)}


def run_suite(suite: Suite, runs_dir: Path, *, resume: bool = False,
              only: set[str] | None = None) -> list[Path]:
    """Every experiment x seed x repeat of ``suite``, one after another; a seed's repeats
    are interleaved with the other rows' (round k of every row, then round k + 1), so that a
    drift of the machine's speed over the suite falls on every row alike."""
    paths = []
    for seed in suite.seeds:
        for repeat in range(max(1, suite.repeats)):
            for exp in suite.experiments:
                if only is None or exp.label in only:
                    print(f"reproduce: {run_name(suite, exp, seed, repeat)}", file=sys.stderr,
                          flush=True)
                    paths.append(run_one(suite, exp, seed, runs_dir, resume, repeat))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    size = ("full" if args.full else "smoke" if args.smoke else
            "link" if args.link_suite else "link5" if args.link_suite_5mbit
            else "linkmixed" if args.link_suite_mixed
            else "linkonly" if args.link_suite_links
            else "ablation" if args.ablation_suite
            else "losscomp-sweep" if args.losscomp_sweep
            else "changing" if args.changing_suite else "quick")
    stretched = f"-x{args.time_scale:g}" if args.time_scale != 1.0 else ""  # never mixed
    out = Path(args.out or ROOT / "results" / f"{size}{stretched}")
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    suites = suites_for(size)
    if args.suite:
        names = set(args.suite.split(","))
        unknown = names - {s.name for s in suites}
        if unknown:
            print(f"reproduce: no suite {sorted(unknown)} in --{size} "
                  f"(there are {[s.name for s in suites]})", file=sys.stderr)
            return 2
        suites = [s for s in suites if s.name in names]
    for suite in suites:
        _apply_overrides(suite, args)
    only = set(args.only.split(",")) if args.only else None
    unknown = (only or set()) - {e.label for s in suites for e in s.experiments}
    if unknown:  # a row that is not there would be skipped without a word
        print(f"reproduce: no row {sorted(unknown)} in --{size} (with --down-mode both an "
              "exact row's twin is LABEL+compressed, a compressed row's LABEL+exact)",
              file=sys.stderr)
        return 2
    for suite in suites:
        if not args.table_only:
            run_suite(suite, runs_dir, resume=args.resume, only=only)
    table = {"name": size, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
             "suites": {s.name: build_table(s, runs_dir) for s in suites}}
    earlier = out / "table.json"
    if earlier.exists() and not args.fresh_table:  # rows not rerun here stay, marked
        with contextlib.suppress(ValueError):
            carry_rows(table, json.loads(earlier.read_text()))
    (out / "table.json").write_text(json.dumps(table, indent=2, default=str) + "\n")
    markdown = table_markdown(str(out.relative_to(ROOT) if out.is_relative_to(ROOT) else out),
                              table)
    (out / "table.md").write_text(markdown)
    if not args.no_plot:
        for suite in suites:
            plot_suite(suite, runs_dir, out)
    print(json.dumps(table) if args.json else markdown)
    for flag in overrun_flags(table):  # these runs measured the CPU, not the method
        print(f"reproduce: ⚠ {flag} > {OVERRUN_LIMIT} (workers slower than emulated)",
              file=sys.stderr)
    return 0


def _apply_overrides(suite: Suite, args: argparse.Namespace) -> None:
    """--epochs / --lr / --lr-schedule / --momentum / --optimizer-at / --base-step /
    --sync-every / --group-momentum / --seeds (tuning and partial reruns), --link /
    --link-shaping (every run of the suite), --down-values (every sparse row, its
    ``+f32down`` control too). A larger --epochs makes the wall cap as many
    times longer."""
    if args.epochs is not None and args.epochs > suite.run["epochs"] and "wall_s" in suite.run:
        # the wall cap stays as far above the run's time as it was: it grows with the budget
        suite.run["wall_s"] *= args.epochs / suite.run["epochs"]
    for flag, key in (("epochs", "epochs"), ("lr", "lr"), ("lr_schedule", "lr_schedule"),
                      ("momentum", "momentum"), ("optimizer_at", "optimizer_at"),
                      ("base_step", "base_step_s"), ("sync_every", "sync_every"),
                      ("group_momentum", "group_momentum")):
        if getattr(args, flag) is not None:
            suite.run[key] = getattr(args, flag)
    if args.seeds:
        suite.seeds = [int(s) for s in args.seeds.split(",")]
    suite.repeats = args.repeat
    if args.link is not None:
        suite.link = args.link
    if args.link_shaping is not None:
        suite.link_shaping = args.link_shaping
    if args.time_scale != 1.0:
        stretch_time(suite, args.time_scale)
    if args.down_values is not None:  # the rows that name their downlink's values: sparse ones
        suite.experiments = [_overriding(e, down_values=args.down_values)
                             if "down_values" in e.overrides else e for e in suite.experiments]
    with_downlink(suite, args.down_mode)
    with_exchange(suite, args.xchg_mode)


EXACT = "+exact"  # the label suffix of a row's twin with the exact downlink (--down-mode both)
COMPRESSED = "+compressed"  # ... and of an exact row's twin with the compressed one


def with_downlink(suite: Suite, mode: str | None) -> None:
    """``--down-mode``: ``exact`` answers every minips run's PULLs with the exact downlink (the
    changes since the worker's version at their values now, docs/compression.md), ``auto``
    with RunConfig's (the compressed downlink where a row's kept fraction is below 1), so the
    sparse rows, exact by default (``SPARSE_DEFAULTS``), get the compressed one back; ``both``
    adds, after each minips row, its twin with the other downlink (``LABEL+exact``, or
    ``LABEL+compressed`` for a row that is exact), so a table holds the two side by side; None
    leaves the suite as it is."""
    if mode in ("exact", "auto"):
        suite.run["down_mode"] = mode
        suite.experiments = [e if e.ddp_hook else _overriding(e, down_mode=mode)
                             for e in suite.experiments]
    elif mode == "both":
        suite.experiments = [twin for e in suite.experiments
                             for twin in ([e] if e.ddp_hook else [e, _other_downlink(suite, e)])]


def _other_downlink(suite: Suite, exp: Experiment) -> Experiment:
    """``exp`` with the other downlink: exact for a row that answers PULLs ``auto``, and the
    other way round."""
    exact = exp.overrides.get("down_mode", suite.run.get("down_mode", "auto")) == "exact"
    return replace(_overriding(exp, down_mode="auto" if exact else "exact"),
                   label=exp.label + (COMPRESSED if exact else EXACT))


XEXACT = "+xexact"  # the label suffix of a row's twin with the exact exchange (--xchg-mode both)


def with_exchange(suite: Suite, mode: str | None) -> None:
    """``--xchg-mode``: ``topk`` or ``exact`` for every minips run's group <-> global exchange
    (``RunConfig.xchg_mode``, core/exchange.py); ``both`` adds, after each minips row, its twin
    with the exact exchange (``LABEL+xexact``); None leaves the suite as it is."""
    if mode in ("topk", "exact"):
        suite.run["xchg_mode"] = mode
        suite.experiments = [e if e.ddp_hook else _overriding(e, xchg_mode=mode)
                             for e in suite.experiments]
    elif mode == "both":
        suite.experiments = [
            twin for e in suite.experiments for twin in ([e] if e.ddp_hook else [
                e, replace(_overriding(e, xchg_mode="exact"), label=e.label + XEXACT)])]


def _overriding(exp: Experiment, **changes: Any) -> Experiment:
    """``exp`` with ``changes`` on top of its RunConfig overrides (a new Experiment: suites
    share their rows' dicts, so none is written to)."""
    return replace(exp, overrides={**exp.overrides, **changes})


def stretch_time(suite: Suite, k: float) -> None:
    """``--time-scale K``: the suite on a clock K times slower. The base step, the wall cap
    and the evaluation interval are K times longer and every link K times slower (a byte
    takes K times as long), so compute and communication keep their proportions and every
    time in the table is K times the unstretched suite's, while each worker's step asks 1/K
    of the CPU: a machine whose cores cannot hold the suite's pace (its workers overrun
    their emulated steps) can run it at K > 1. What stays real-time is the servers' and the
    workers' own CPU work per message, which becomes a smaller share of a step."""
    if not k > 0:
        raise SystemExit(f"reproduce: --time-scale {k!r}: expected a factor > 0")
    for key in ("base_step_s", "wall_s", "eval_every_s"):
        if key in suite.run:
            suite.run[key] = suite.run[key] * k
    if suite.link:
        suite.link = parse_profile(suite.link).slowed(k)
    suite.experiments = [replace(e, link=parse_profile(e.link).slowed(k)) if e.link else e
                         for e in suite.experiments]
    stretched = (f"Time stretched {k:g}x (--time-scale {k:g}): a {suite.run['base_step_s']:g} s "
                 f"base step, links {suite.link or 'none'}, a {suite.run.get('wall_s', 0):g} s "
                 f"wall cap; every time is {k:g}x the unstretched suite's, ratios unchanged")
    suite.description = f"{suite.description.rstrip('. ')}. {stretched}"


_link = argtype(checked_text(parse_profile))  # a --link profile, checked, kept as text


def _runs(text: str) -> int:
    """--repeat K: a whole number of runs, at least 1."""
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of runs, 1 or more")
    return k


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="8 workers, LeNet-5 (default)")
    size.add_argument("--full", action="store_true", help="16 workers, 3 seeds, more models")
    size.add_argument("--smoke", action="store_true", help="two tiny runs (tests)")
    size.add_argument("--link-suite", action="store_true",
                      help=f"fmnist8 over {LINK_PROFILE} links: BSP, GSSP, the compressors, "
                      "local steps")
    size.add_argument("--link-suite-5mbit", action="store_true",
                      help=f"the link suite over {LINK5_PROFILE} links")
    size.add_argument("--link-suite-mixed", action="store_true",
                      help=f"the link suite's main rows behind {MIXED_PROFILE} links "
                      "(each worker's link follows its speed)")
    size.add_argument("--link-suite-links", action="store_true",
                      help=f"equal compute behind {LINKS_PROFILE} links (only a link makes "
                      "a worker slow): BSP, LB-BSP, GSSP, GSSP + GDTopK, DDP + fp16")
    size.add_argument("--ablation-suite", action="store_true",
                      help="the quick set-up: each hop's compression and each of DGC's pieces, "
                      "with the optimizer on the servers and on the workers")
    size.add_argument("--losscomp-sweep", action="store_true",
                      help="LossComp's vote weight and window on a validation split of the "
                      "training set (the test set unseen)")
    size.add_argument("--changing-suite", action="store_true",
                      help="fmnist8 whose speeds change: DDP, BSP, LB-BSP, SSP, GSSP")
    p.add_argument("--out", help="output directory (default results/<size>)")
    p.add_argument("--suite", help="comma-separated suite names to run (e.g. fmnist16)")
    p.add_argument("--only", help="comma-separated experiment labels to run")
    p.add_argument("--resume", action="store_true", help="keep runs that already finished")
    p.add_argument("--table-only", action="store_true", help="rebuild table and plots only")
    p.add_argument("--fresh-table", action="store_true",
                   help="drop the earlier table.json's rows that have no run here (by default "
                        "they are kept, marked † with their table's date)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG charts")
    p.add_argument("--json", action="store_true", help="print table.json instead of table.md")
    p.add_argument("--epochs", type=float, help="override the samples budget, epochs")
    p.add_argument("--lr", type=float, help="override the learning rate (every experiment)")
    p.add_argument("--lr-schedule", choices=SCHEDULES,
                   help="override the lr schedule (every experiment)")
    p.add_argument("--momentum", type=float, help="override the momentum (every experiment)")
    p.add_argument("--sync-every", type=int, metavar="PUSHES",
                   help="override how many pushes of a group between its exchanges with the "
                        "global server (every experiment; default 4)")
    p.add_argument("--group-momentum", choices=("group", "cluster"),
                   help="override how a GSSP group's momentum decays: per push of the group "
                        "(default) or of the cluster (every experiment)")
    p.add_argument("--optimizer-at", choices=OPTIMIZER_PLACES,
                   help="where SGD runs in every experiment: server (default) or worker")
    p.add_argument("--down-values", choices=("f32", "f16"),
                   help="the values of every sparse row's downlink updates: f16 (the presets' "
                   "default since 2026-12-04 evening) or f32 (as the runs before it sent)")
    p.add_argument("--xchg-mode", choices=("topk", "exact", "both"),
                   help="the group <-> global exchange of every minips run: topk (today's "
                   "default), exact (every change, both ways) or both (each row and its twin "
                   "with the exact exchange: LABEL+xexact); default: as each row says")
    p.add_argument("--down-mode", choices=("auto", "exact", "both"),
                   help="how PULLs are answered in every minips run: auto (the compressed "
                   "downlink of the sparse rows), exact (the changes since, "
                   "docs/compression.md; the sparse rows' default) or both (each row and its "
                   "twin with the other: LABEL+exact or LABEL+compressed); default: as each "
                   "row says")
    p.add_argument("--base-step", type=float, help="override the emulated base step, s")
    p.add_argument("--seeds", help="override the seeds, e.g. 0,1,2")
    p.add_argument("--repeat", type=_runs, default=1, metavar="K",
                   help="run each seed K times; the table's figure of a seed is the median of "
                   "its K runs, with K and their spread beside it (default 1)")
    p.add_argument("--link", type=_link, help="workers' links for every run, e.g. 10mbit "
                   "(a `minips local --link` profile; docs/links.md)")
    p.add_argument("--link-shaping", choices=SHAPINGS, help="auto (default), kernel or pacer")
    p.add_argument("--time-scale", type=float, default=1.0, metavar="K",
                   help="run the suites on a clock K times slower: base step, wall cap and "
                   "evaluation interval x K, every link rate / K (for a machine too slow to "
                   "hold the suite's pace; every time in the table is then K x, ratios hold)")
    return p


if __name__ == "__main__":
    sys.exit(main())
