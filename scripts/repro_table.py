"""Tables and charts of scripts/reproduce.py: per-run figures, medians over seeds, Markdown, PNGs.

The suite types (``Experiment``, ``Suite``) live here, so this module imports nothing of
reproduce.py. Reads only what a finished run left on disk (summary via
``minips.record.metrics``, launch.json, reproduce.json, eval.jsonl); never starts a run and
never imports torch.

Invariants: a run directory is ``<runs>/<suite>-<experiment>-s<seed>`` (``run_name``; the
repeats of a seed beyond its first, ``--repeat K``, add ``-r<k>``) and counts only when its
summary.json says ``"status": "done"`` (``run_done``); unfinished runs are left out of the
table and listed under ``missing``; a seed's figure is the median of its finished repeats
(``seed_figures``: identical runs of one seed differ, so one run is not the seed's figure),
with how many there were (``runs``) and their spread (``runs_spread``); a time to accuracy
that a run or a seed never reached counts as infinitely slow in the median; speedups compare
the highest target both rows reached.

The final accuracy of every row, minips, DDP and LB-BSP alike, is taken at the same point:
the weights once the samples budget (``epochs`` of the training set, all workers together)
is spent and every update of it applied (minips: the global weights the server saves at the
end, after every group's last exchange; DDP: rank 0's after its last step, bench_ddp.py
training the same budget), scored on the whole test set (``final_samples`` says on how many
samples; ``final_note`` says it under each table). The curve figures (times to the targets,
tail, best) are the periodic evaluations on the first ``eval_limit`` test samples, every row
alike.
Bytes: ``bytes_up`` / ``bytes_down`` are the worker <-> group hop; the ``BYTE_FIGURES``
add the group <-> global hop and ``bytes_total`` (tables made before them show –).

The ceiling: a fully asynchronous cluster does sum 1/F_i worker-steps per base step, BSP
N / max F_i (every round waits for the slowest), so no mode can beat BSP by more than their
ratio (2.42x for 1,1,1.5,1.5,2,2,4,4; ``profile_ceiling``). With speeds that change (a
schedule, throttling) both rates are averaged over the BSP row's training time, second by
second. Every row's speed-up over BSP is also given as a share of it (``ceiling_share``).
Every row keeps each seed's figures (``per_seed``); table.md shows every seed, flags a run
whose workers overran their emulated step by more than ``OVERRUN_LIMIT`` (⚠ CPU: it measured
the machine, not the method), and gives GSSP's time to the highest target against each row,
seed by seed (``against``). A row run by scripts/bench_ddp.py (torch DDP) leaves ``ddp.json``;
``run_figures`` reads its times, accuracy and overrun, and gives None for what DDP does not
measure (staleness, hops).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minips.core.slowdown import Schedule, Slowdown, parse_schedules, parse_throttle
from minips.record.metrics import BYTE_FIGURES, Run, load_run, summarize

__all__ = ["Experiment", "Suite", "TAIL_POINTS", "run_name", "run_done", "run_figures",
           "aggregate", "add_speedups",
           "profile_ceiling", "suite_slowdowns", "add_ceiling_shares", "build_table",
           "OVERRUN_LIMIT", "overrun_cell", "overrun_flags", "against", "carry_rows",
           "table_markdown", "plot_suite", "seed_figures", "runs_spread_cell", "final_note"]

TAIL_POINTS = 5  # evaluations averaged into tail_accuracy (10 s at the quick eval period)
# the table's columns beyond MB up / down (worker <-> group): tables made before them show –
GLOBAL_HOPS = ("bytes_group_global", "bytes_global_group", "bytes_total")


@dataclass(frozen=True)
class Experiment:
    """One row of the table: a mode and a compressor on top of the suite's settings."""

    label: str  # row name, e.g. "gssp+gdtopk-slower-more"
    overrides: dict[str, Any]  # RunConfig fields that differ from the suite
    part: str = "modes"  # "modes" (accuracy vs time chart) or "compression" (vs bytes)
    link: str | None = None  # this row's links (`minips local --link`); None = the suite's
    ddp_hook: str = ""  # "": a minips run; none | fp16 | powersgd: torch DDP (bench_ddp.py)


@dataclass
class Suite:
    """Settings shared by every experiment of one comparison (scripts/reproduce.py builds them)."""

    name: str  # prefix of the run directories and charts
    run: dict[str, Any]  # RunConfig fields (model, data, optimizer, budget, ...)
    slowdowns: list[float]  # emulated factor per worker
    experiments: list[Experiment]
    seeds: list[int] = field(default_factory=lambda: [0])
    targets: tuple[float, ...] = (0.80, 0.85)  # accuracies for time-to-accuracy
    link: str = ""  # the workers' links (`minips local --link`); "" = not limited
    link_shaping: str = "auto"  # auto | kernel | pacer (`minips local --link-shaping`)
    description: str = ""  # why the suite is set up as it is (table.json says it)
    profile: str = ""  # `minips local --slowdown` schedules (speeds that change); "" = slowdowns
    throttle: str = ""  # `minips local --throttle P,MIN-MAX,SECONDS`; "" = none
    # the final weights scored on the whole test set too; False for a tuning suite (val_size):
    # its every figure is then a validation figure, and the test set stays unseen
    final_test: bool = True
    # the rows whose time to the highest target is set against every other row, seed by seed
    leads: tuple[str, ...] = ("gssp",)
    repeats: int = 1  # runs of each seed (--repeat); a seed's figure is their median


# -- run directories ---------------------------------------------------------------------------


def run_name(suite: Suite, exp: Experiment, seed: int, repeat: int = 0) -> str:
    """Directory name of one run: ``<suite>-<experiment>-s<seed>``, and ``-r<repeat>`` after
    it for a seed's repeats beyond the first (the first keeps the name runs had before)."""
    return f"{suite.name}-{exp.label}-s{seed}" + (f"-r{repeat}" if repeat else "")


def run_done(run_dir: Path) -> bool:
    """Whether the run finished (its summary.json says so)."""
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("status") == "done"
    except (OSError, ValueError):
        return False


# -- table -------------------------------------------------------------------------------------


def _overrun(run: Run, slowdowns: list[float], base: float, batch: int = 0) -> float | None:
    """Largest ratio over workers of mean step time to its emulated time (1.0: sleep set the
    pace): F x base x samples / batch, F the step's own (``slowdown`` in its record, which
    changes with a schedule) or the profile's. A push of H local steps records the mean of
    its H steps' times and the samples of all H: its emulated step is F x base x samples /
    (H x batch)."""
    worst = None
    for w, recs in run.workers.items():
        if not (isinstance(w, int) and w < len(slowdowns) and base > 0):
            continue
        ratios = [r["step_time"] / (r.get("slowdown", slowdowns[w]) * base
                                    * (r.get("samples", batch) / batch
                                       / max(1, r.get("local_steps") or 1) if batch else 1.0))
                  for r in recs if isinstance(r.get("step_time"), (int, float))
                  and r.get("samples", 1)]
        if ratios:
            worst = max(float(np.mean(ratios)), worst or 0.0)
    return worst


def run_figures(run_dir: Path, targets: Sequence[float]) -> dict[str, Any]:
    """The table's figures of one run directory (a DDP row's: ``_ddp_figures``)."""
    if (run_dir / "ddp.json").exists():
        return _ddp_figures(run_dir, targets)
    s = summarize(run_dir, targets=targets, write=False)
    launch = json.loads((run_dir / "launch.json").read_text())
    extra = _read_json(run_dir / "reproduce.json")
    run = load_run(run_dir)
    done = [e for e in run.events if e.get("event") == "done"]
    final = extra.get("final_full_test") or {}
    return {
        "time_to_accuracy": s["time_to_accuracy"],
        # the final weights on the whole test set; without them (an older run, a tuning suite
        # scored on its validation split) the evaluator's last point, on eval_limit samples
        "final_accuracy": final.get("accuracy", s["final_accuracy"]),
        "final_samples": final.get("samples") or launch["run"].get("eval_limit") or None,
        "best_accuracy": s["best_accuracy"], "curve_final_accuracy": s["final_accuracy"],
        "tail_accuracy": _tail_mean(run.eval, TAIL_POINTS),
        "samples": s["samples"], "bytes_up": s["bytes_up"], "bytes_down": s["bytes_down"],
        **{hop: s[hop] for hop in BYTE_FIGURES},  # every hop (bytes_up/down: worker <-> group)
        "mean_staleness": s["mean_staleness"], "max_staleness": s["max_staleness"],
        "mean_wait_s": s["mean_wait_s"], "mean_kept_fraction": s["mean_kept_fraction"],
        "train_s": s["train_s"], "samples_per_s": s["samples_per_s"], "groups": s["groups"],
        "done_reason": done[-1].get("reason") if done else None,
        "status": extra.get("status"),
        "step_overrun": _overrun(run, launch["slowdowns"], launch["run"]["base_step_s"],
                                 launch["run"].get("batch_size", 0)),
    }


FIGURES = ("time_to_accuracy", "final_accuracy", "final_samples", "best_accuracy",
           "curve_final_accuracy", "tail_accuracy", "samples", "bytes_up", "bytes_down",
           *BYTE_FIGURES,
           "mean_staleness", "max_staleness", "mean_wait_s", "mean_kept_fraction", "train_s",
           "samples_per_s", "groups", "done_reason", "status", "step_overrun")  # run_figures' keys


def _ddp_figures(run_dir: Path, targets: Sequence[float]) -> dict[str, Any]:
    """The figures of a bench_ddp.py row (its ddp.json); None where DDP has no such figure."""
    d = json.loads((run_dir / "ddp.json").read_text())
    curve = d.get("curve", [])
    reach = {f"{t:.2f}": next((c["t"] for c in curve if c["accuracy"] >= t), None)
             for t in targets}
    accs = [c["accuracy"] for c in curve]
    last = curve[-1]["samples"] if curve else None
    out: dict[str, Any] = dict.fromkeys(FIGURES)
    out.update(time_to_accuracy=reach, final_accuracy=d.get("final_full_test"),
               final_samples=d.get("final_full_test_samples"),
               best_accuracy=max(accs, default=None), curve_final_accuracy=d.get("final_accuracy"),
               tail_accuracy=float(np.mean(accs[-TAIL_POINTS:])) if accs else None,
               samples=last, train_s=d.get("train_s"), mean_staleness=0, max_staleness=0,
               samples_per_s=last / d["train_s"] if last and d.get("train_s") else None,
               bytes_total=d.get("bytes_total"), status="done", step_overrun=d.get("overrun_max"),
               done_reason="epochs" if d.get("steps") == d.get("total_steps") else "wall")
    return out


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


def suite_slowdowns(suite: Suite, seed: int = 0) -> list[Slowdown]:
    """Each worker's emulated factor over time in ``suite``: its ``profile`` schedules (else
    the flat ``slowdowns``) with its ``throttle``."""
    profile = getattr(suite, "profile", "")
    schedules = (parse_schedules(profile) if profile
                 else [Schedule.flat(f) for f in suite.slowdowns])
    text = getattr(suite, "throttle", "")
    throttle = parse_throttle(text) if text else None
    return [Slowdown(s, throttle, seed=seed, worker=w) for w, s in enumerate(schedules)]


def profile_ceiling(slowdowns: Sequence[Slowdown], horizon_s: float = 0.0,
                    step_s: float = 1.0) -> float:
    """The throughput ceiling over BSP: (sum 1/F_i) / (N / max F_i), at the start, or averaged
    over ``horizon_s`` seconds of training (each rate summed at every ``step_s``)."""
    times = [0.0] if horizon_s <= 0 else list(np.arange(0.0, horizon_s, step_s))
    async_rate = bsp_rate = 0.0
    for t in times:
        factors = [s.factor(float(t)) for s in slowdowns]
        async_rate += sum(1.0 / f for f in factors)
        bsp_rate += len(factors) / max(factors)
    return async_rate / bsp_rate


def add_ceiling_shares(rows: dict[str, dict[str, Any]], ceiling: float) -> None:
    """``ceiling_share``: each row's speed-up over BSP as a share of the profile's ceiling."""
    for row in rows.values():
        up = row.get("speedup_vs_bsp")
        row["ceiling_share"] = up / ceiling if up is not None and ceiling > 0 else None


RUN_KEYS = ("runs", "runs_spread")  # a seed's figures about its repeats, not a run's


def seed_figures(figures: list[dict[str, Any]]) -> dict[str, Any]:
    """One seed's figures from its finished runs (``--repeat``): the median of each figure
    (a time never reached counts as infinitely slow), ``runs`` (how many) and ``runs_spread``
    ([min, max] of each figure over them; empty for one run)."""
    row = aggregate(figures)
    spread = row.pop("spread")
    del row["seeds"]
    return {**row, "runs": len(figures), "runs_spread": spread}


def _seed_runs(suite: Suite, exp: Experiment, seed: int, runs_dir: Path) -> list[Path]:
    return [runs_dir / run_name(suite, exp, seed, k)
            for k in range(max(1, getattr(suite, "repeats", 1)))]


def build_table(suite: Suite, runs_dir: Path) -> dict[str, Any]:
    """The suite's rows from its run directories (missing runs are left out); each seed's
    figures are the median of its repeats (``seed_figures``), a row's the median of its
    seeds'."""
    rows: dict[str, dict[str, Any]] = {}
    missing = []  # runs that are absent or did not finish (a crash, a timeout): left out
    for exp in suite.experiments:
        done = {}
        for seed in suite.seeds:
            dirs = _seed_runs(suite, exp, seed, runs_dir)
            missing += [d.name for d in dirs if not run_done(d)]
            figs = [run_figures(d, suite.targets) for d in dirs if run_done(d)]
            if figs:
                done[seed] = seed_figures(figs)
        if done:
            plain = [{k: v for k, v in f.items() if k not in RUN_KEYS} for f in done.values()]
            rows[exp.label] = {"part": exp.part, "overrides": exp.overrides,
                               **aggregate(plain),
                               "per_seed": {str(seed): f for seed, f in done.items()}}
    add_speedups(rows, suite.targets)
    horizon = rows.get("bsp", {}).get("train_s") or 0.0  # a changing profile: over BSP's time
    changes = bool(getattr(suite, "profile", "") or getattr(suite, "throttle", ""))
    ceiling = profile_ceiling(suite_slowdowns(suite, suite.seeds[0]),
                              horizon if changes else 0.0)
    add_ceiling_shares(rows, ceiling)
    return {"config": {**suite.run, "slowdowns": suite.slowdowns, "seeds": suite.seeds,
                       "ceiling": ceiling, "profile": getattr(suite, "profile", "") or None,
                       "throttle": getattr(suite, "throttle", "") or None,
                       "targets": list(suite.targets), "link": suite.link or None,
                       "description": suite.description or None,
                       "leads": list(getattr(suite, "leads", ("gssp",))),
                       "repeats": max(1, getattr(suite, "repeats", 1))},
            "rows": rows, "missing": missing}


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


OVERRUN_LIMIT = 1.05  # a row whose workers overran their emulated step by more measured the CPU


def overrun_cell(x: Any) -> str:
    """The overrun figure, flagged when it passes ``OVERRUN_LIMIT``."""
    return _fmt(x) + (" ⚠ CPU" if isinstance(x, (int, float)) and x > OVERRUN_LIMIT else "")


def overrun_flags(table: dict[str, Any]) -> list[str]:
    """'suite/row seed S: overrun X' for every run whose workers overran ``OVERRUN_LIMIT``."""
    out = []
    for sname, suite in table["suites"].items():
        for label, r in suite["rows"].items():
            for seed, f in (r.get("per_seed") or {}).items():
                x = f.get("step_overrun")
                if isinstance(x, (int, float)) and x > OVERRUN_LIMIT:
                    out.append(f"{sname}/{label} seed {seed}: overrun {x:.3f}")
    return out


def runs_spread_cell(f: dict[str, Any], target: str) -> str:
    """A seed's spread over its repeats: final accuracy (points) and time to ``target``
    (seconds; "never" for a run that did not reach it), each min–max; – for a single run."""
    spread = f.get("runs_spread") or {}
    acc, t = spread.get("final_accuracy"), spread.get(f"time_to_{target}")
    if not acc and not t:
        return "–"
    cells = []
    if acc:
        cells.append(f"{100 * acc[0]:.2f}–{100 * acc[1]:.2f} %")
    if t:  # a run that never reached the target: "never" (the slowest)
        cells.append("–".join("never" if x is None else f"{_fmt(x)} s" for x in t))
    return " / ".join(cells)


def _per_seed_markdown(suite: dict[str, Any], targets: list[str]) -> list[str]:
    """Every seed of every row: times to the targets, final accuracy, bytes, overrun, and the
    runs its figures are the median of with their spread (final accuracy, time to the highest
    target)."""
    top = max(targets)
    head = (["experiment", "seed"] + [f"t→{float(t):.0%} (s)" for t in targets]
            + ["final acc %", "MB total", "overrun", "runs",
               f"spread (final acc / t→{float(top):.0%})"])
    out = ["Every seed (each figure the median of the seed's runs):\n",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, r in suite["rows"].items():
        for seed, f in (r.get("per_seed") or {}).items():
            out.append("| " + " | ".join(
                [label, seed] + [_fmt(f["time_to_accuracy"].get(t)) for t in targets]
                + [_fmt(f["final_accuracy"], "pct"), _fmt(f.get("bytes_total"), "mb"),
                   overrun_cell(f.get("step_overrun")), str(f.get("runs", 1)),
                   runs_spread_cell(f, top)]) + " |")
    return out


def final_note(suite: dict[str, Any]) -> str:
    """What ``final acc %`` is, for every row alike: which weights, which test samples
    (``final_samples``); rows scored on fewer samples than the others are named."""
    cfg = suite["config"]
    counts = {label: r.get("final_samples") for label, r in suite["rows"].items()}
    most = max((n for n in counts.values() if isinstance(n, (int, float))), default=None)
    fewer = sorted(label for label, n in counts.items()
                   if isinstance(n, (int, float)) and most and n < most)
    split = "validation" if cfg.get("val_size") else "test"  # a tuning suite never sees test
    where = f"all {int(most):,} {split} samples" if most else f"the whole {split} set"
    note = (f"`final acc %`: every row's weights once its samples budget ({cfg['epochs']} "
            "epochs of the training set, all workers together) is spent and all of it applied "
            "(minips and LB-BSP: the global weights saved at the end, every group's last "
            f"exchange merged; DDP: rank 0's after its last step), scored on {where}. The times, "
            f"`tail` and `best`: the periodic evaluations on the first {cfg.get('eval_limit')} "
            f"{split} samples, every row alike.")
    if fewer:
        note += (f" Scored on fewer samples (no final weights kept: the evaluator's last "
                 f"point): {', '.join(fewer)}.")
    return note


def against(suite: dict[str, Any], ref: str, target: str) -> dict[str, dict[str, float | None]]:
    """{row: {seed: row's time to ``target`` / ``ref``'s, the same seed}}: how many times sooner
    ``ref`` got there (None where either never did)."""
    base = (suite["rows"].get(ref) or {}).get("per_seed") or {}
    out: dict[str, dict[str, float | None]] = {}
    for label, r in suite["rows"].items():
        if label == ref or not r.get("per_seed"):  # a carried row has medians only
            continue
        cells: dict[str, float | None] = {}
        for seed, f in (r.get("per_seed") or {}).items():
            a = f["time_to_accuracy"].get(target)
            b = (base.get(seed) or {}).get("time_to_accuracy", {}).get(target)
            cells[seed] = a / b if a is not None and b else None
        out[label] = cells
    return out


def _against_markdown(suite: dict[str, Any], ref: str, target: str) -> list[str]:
    ratios = against(suite, ref, target)
    seeds = [str(s) for s in suite["config"]["seeds"]]
    out = [f"{ref}'s time to {float(target):.0%} against each row, per seed (the row's time / "
           f"{ref}'s; – where one never got there):\n",
           "| row | " + " | ".join(f"seed {s}" for s in seeds) + " |",
           "|" + "---|" * (len(seeds) + 1)]
    for label, cells in ratios.items():
        out.append(f"| {label} | " + " | ".join(_fmt(cells.get(s), "x") for s in seeds) + " |")
    return out


def carry_rows(table: dict[str, Any], earlier: dict[str, Any]) -> None:
    """Rows of ``earlier`` (the table.json this one replaces) whose experiment has no finished
    run here (run directories stay on the machine that ran them) are kept, each marked with the
    date of the table it comes from (``carried_from``): a suite can be rerun row by row
    (``--only``) without losing the rest. Their runs leave ``missing``."""
    for sname, suite in table["suites"].items():
        old = (earlier.get("suites") or {}).get(sname) or {}
        for label, row in (old.get("rows") or {}).items():
            if label in suite["rows"]:
                continue
            suite["rows"][label] = {**row, "carried_from": row.get("carried_from")
                                    or earlier.get("created")}
            suite["missing"] = [m for m in suite.get("missing", [])
                                if not m.startswith(f"{sname}-{label}-s")]


def table_markdown(where: str, table: dict[str, Any]) -> str:
    """table.md: one Markdown table per suite (medians over seeds), then every seed of it; an
    overrun past ``OVERRUN_LIMIT`` is flagged (⚠ CPU: that run measured the machine). ``where``
    is the title: the directory the table lies in."""
    out = [f"# {where}\n"]
    for sname, suite in table["suites"].items():
        cfg = suite["config"]
        targets = [f"{t:.2f}" for t in cfg["targets"]]
        runs = cfg.get("repeats") or 1
        out.append(f"## {sname}: {cfg['model']} on {cfg['dataset']}, slowdowns "
                   f"{cfg['slowdowns']}, {cfg['epochs']} epochs, lr {cfg['lr']} "
                   f"({cfg.get('lr_schedule', 'constant')}), seeds {cfg['seeds']}, "
                   f"{runs} run{'s' if runs > 1 else ''} a seed (its figures the median)"
                   f"{', links ' + cfg['link'] if cfg.get('link') else ''}\n")
        if cfg.get("description"):
            out.append(f"{cfg['description']}\n")
        if cfg.get("ceiling"):  # tables made before it have none
            out.append(f"Throughput ceiling of the profile over BSP: {cfg['ceiling']:.2f}× "
                       "(Σ 1/Fᵢ against N / max Fᵢ); `of ceiling %` is `vs BSP` as a share of "
                       "it.\n")
        head = (["experiment"] + [f"t→{float(t):.0%} (s)" for t in targets]
                + ["final acc %", "tail acc %", "best acc %", "samples", "MB up", "MB down",
                   "MB to global", "MB from global", "MB total", "kept %", "staleness",
                   "wait s", "vs BSP", "vs SSP", "of ceiling %", "overrun"])
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for label, r in suite["rows"].items():
            mark = " †" if r.get("carried_from") else ""
            cells = ([label + mark] + [_fmt(r["time_to_accuracy"].get(t)) for t in targets]
                     + [_fmt(r["final_accuracy"], "pct"), _fmt(r["tail_accuracy"], "pct"),
                        _fmt(r["best_accuracy"], "pct"),
                        _fmt(r["samples"]), _fmt(r["bytes_up"], "mb"),
                        _fmt(r["bytes_down"], "mb"),
                        *(_fmt(r.get(hop), "mb") for hop in GLOBAL_HOPS),  # older tables: –
                        _fmt(r["mean_kept_fraction"], "pct"),
                        _fmt(r["mean_staleness"]), _fmt(r["mean_wait_s"]),
                        _fmt(r["speedup_vs_bsp"], "x"), _fmt(r["speedup_vs_ssp"], "x"),
                        _fmt(r.get("ceiling_share"), "pct"), overrun_cell(r["step_overrun"])])
            out.append("| " + " | ".join(cells) + " |")
        out.append("\n" + final_note(suite))
        carried = sorted({r["carried_from"] for r in suite["rows"].values()
                          if r.get("carried_from")})
        if carried:
            out.append(f"\n† not rerun: kept from the table of {', '.join(carried)} (medians "
                       "only; that table's code)")
        if any(r.get("per_seed") for r in suite["rows"].values()):
            out += ["", *_per_seed_markdown(suite, targets)]
            for lead in cfg.get("leads") or ["gssp"]:
                if lead in suite["rows"]:
                    out += ["", *_against_markdown(suite, lead, max(targets))]
        if suite.get("missing"):
            out.append(f"\nLeft out (absent or not finished): {', '.join(suite['missing'])}")
        out.append("")
    return "\n".join(out)


def _curve(run_dir: Path, x: str) -> tuple[list[float], list[float]]:
    """(x, accuracy) of a run's evaluations; x = seconds since the training start or MB up
    (a DDP row: its snapshots' curve against time; none against bytes)."""
    if (run_dir / "ddp.json").exists():
        curve = json.loads((run_dir / "ddp.json").read_text()).get("curve", []) if x == "t" else []
        return [c["t"] for c in curve], [c["accuracy"] for c in curve]
    run = load_run(run_dir)
    pts = [(r[x], r["accuracy"]) for r in run.eval
           if isinstance(r.get(x), (int, float)) and isinstance(r.get("accuracy"), float)]
    x0, scale = (run.start_t, 1.0) if x == "t" else (0.0, 1e-6)
    return [(a - x0) * scale for a, _ in pts], [b for _, b in pts]


def _median_curve(suite: Suite, runs_dir: Path, exp: Experiment,
                  x: str) -> tuple[list[float], list[float]] | None:
    """The curve of ``exp``'s median run: of its seeds' runs (each seed's first, with
    ``--repeat``), the one whose last evaluation is the median (the lower one of the middle
    two for an even count); None without runs."""
    curves = []
    for seed in suite.seeds:
        run_dir = runs_dir / run_name(suite, exp, seed)
        if (run_dir / "eval.jsonl").exists() or (run_dir / "ddp.json").exists():
            xs, acc = _curve(run_dir, x)
            if acc:
                curves.append((acc[-1], seed, (xs, acc)))
    if not curves:
        return None
    curves.sort()
    return curves[(len(curves) - 1) // 2][2]


def _which_seed(suite: Suite) -> str:
    if len(suite.seeds) == 1:
        return f"seed {suite.seeds[0]}"
    return f"median of seeds {', '.join(map(str, suite.seeds))} per row"


def _chart(suite: Suite, runs_dir: Path, x: str, exps: list[Experiment], path: Path) -> Path:
    from matplotlib.figure import Figure  # lazy: only the charts need matplotlib

    fig = Figure(figsize=(7.0, 4.2), layout="constrained")
    ax = fig.subplots()
    for exp in exps:
        curve = _median_curve(suite, runs_dir, exp, x)
        if curve is not None:
            style = "--" if exp.part == "compression" and x == "t" else "-"
            ax.plot(*curve, style, marker=".", ms=3, lw=1.2, label=exp.label)
    for target in suite.targets:
        ax.axhline(target, color="grey", lw=0.6, ls=":")
    xlabel = "training time (s)" if x == "t" else "MB uploaded by the workers"
    if x != "t":
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel="test accuracy", ylim=(max(0.0, min(suite.targets) - 0.3), None),
           title=f"{suite.name} ({_which_seed(suite)}): accuracy vs {xlabel.split(' (')[0]}")
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
