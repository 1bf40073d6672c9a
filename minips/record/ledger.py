"""The run's figures, counted once: every number an operator reads comes from here.

One ``Ledger`` lives in the global server's process. The shells feed it from what they really
send and receive: the bytes of each hop and direction (a group server's channels, a group
process's reported counters, the exchanges' frames), the samples and pushes merged, each
worker's own steps, the evaluator's accuracy points. The console line, the dashboard, ``/metrics``
and summary.json all read it (in memory in the server; the others through the ``figures`` every
global.jsonl line carries), so a figure shown in two places is the same number in both.

Invariant: every counter only goes up. A source reports *cumulative* counters that may start
again from 0 (a channel reconnected, a group adopted by a new process, a resumed server's
group); ``count`` adds only what is new since the source's last report and banks a drop as a
restart. A resume restores the ledger from the checkpoint and then takes, figure by figure, the
larger of that and the last figures the run's record had written (``catch_up``): bytes that
crossed the network after the checkpoint were sent, whatever the resume rolls back.

No IO, no clocks: times come in as arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["HOPS", "FIGURES", "Ledger", "progress_text"]

# bytes of each hop and direction, as summary.json, /metrics and the dashboard name them
HOPS = ("bytes_worker_group", "bytes_group_worker", "bytes_group_global", "bytes_global_group")
# every figure a global.jsonl line carries (``Ledger.figures``)
# (pushes_merged and merges_done, not "pushes": a merge line keeps its own "pushes" since the
# last exchange beside the ledger's figures)
FIGURES = (*HOPS, "bytes_total", "pushes_merged", "merges_done", "samples_trained")
MAX_SOURCES = 4096  # sources whose last report a ledger keeps (each group process session one)


class Ledger:
    """Monotone run totals fed by cumulative or incremental counts (see the module)."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {k: 0 for k in FIGURES if k != "bytes_total"}
        self.last: dict[str, dict[str, int]] = {}  # source -> its last cumulative report
        self.workers: dict[int, dict[str, int]] = {}  # worker -> its own steps, pushes, samples
        self.accuracy: list[dict[str, Any]] = []  # {t, accuracy, loss, samples, final}

    # -- feeding -----------------------------------------------------------------------------

    def add(self, figure: str, n: int) -> None:
        """``n`` more of ``figure`` (n < 0 is ignored: a counter never falls)."""
        if n > 0:
            self.totals[figure] = self.totals.get(figure, 0) + int(n)

    def count(self, source: str, cumulative: Mapping[str, int]) -> None:
        """``source``'s running counters (``{figure: value so far}``): the part new since its
        last report is added; a value below the last one is a restart from 0 (all of it new)."""
        seen = self.last.setdefault(source, {})
        for figure, value in cumulative.items():
            value = int(value)
            before = seen.get(figure, 0)
            self.add(figure, value - before if value >= before else value)
            seen[figure] = value
        while len(self.last) > MAX_SOURCES:
            del self.last[next(iter(self.last))]

    def worker(self, w: int, **own: int) -> None:
        """Worker ``w``'s own counters so far (steps, pushes, samples): they only go up."""
        mine = self.workers.setdefault(int(w), {})
        for k, v in own.items():
            mine[k] = max(mine.get(k, 0), int(v))

    def scored(self, t: float, accuracy: float, loss: float | None = None,
               samples: int | None = None, final: bool = False) -> None:
        """An evaluation point at run time ``t``."""
        self.accuracy.append({"t": t, "accuracy": float(accuracy), "loss": loss,
                              "samples": samples, "final": bool(final)})
        del self.accuracy[:-1000]  # the last ones are what anyone reads

    # -- reading -----------------------------------------------------------------------------

    def figures(self) -> dict[str, int]:
        """Every counter, as a global.jsonl line carries it (``FIGURES``; ``bytes_total`` is the
        hops' sum)."""
        return {**self.totals, "bytes_total": sum(self.totals[h] for h in HOPS)}

    def last_accuracy(self) -> dict[str, Any] | None:
        return self.accuracy[-1] if self.accuracy else None

    # -- across a resume ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"totals": dict(self.totals), "last": {k: dict(v) for k, v in self.last.items()},
                "workers": {str(w): dict(c) for w, c in
                                                         self.workers.items()},
                "accuracy": list(self.accuracy[-10:])}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's ledger (absent in older checkpoints: nothing), with each source's last
        report: a source whose count goes on across the resume (a group's saved traffic) adds
        only what is new; one that starts from 0 in the new process should be named anew."""
        for k, v in (state.get("totals") or {}).items():
            if k in self.totals:
                self.totals[str(k)] = int(v)
        for w, c in (state.get("workers") or {}).items():
            self.worker(int(w), **{k: int(v) for k, v in c.items()})
        self.last = {str(k): {str(f): int(v) for f, v in c.items()}
                     for k, c in (state.get("last") or {}).items()}
        self.accuracy = list(state.get("accuracy") or [])

    def catch_up(self, written: Mapping[str, Any]) -> None:
        """The figures the run's record last wrote before a restart: none falls below them."""
        for k in self.totals:
            v = written.get(k)
            if isinstance(v, (int, float)) and v > self.totals.get(k, 0):
                self.totals[k] = int(v)


def progress_text(clock: str, mode: str, compressor: str, figures: Mapping[str, Any],
                  acc: float | None, data_kind: str | None, train_size: int) -> str:
    """The progress line: ``[clock] mode/compressor  data  epochs  merges  test acc  MB ...``
    from the ledger's ``figures`` (with ``version`` and ``samples``: the model's), the last
    score ``acc`` and the data's ``verdict`` (None: still loading)."""
    epochs = int(figures.get("samples", 0) or 0) / max(1, train_size)
    acc_s = f"{100 * acc:5.1f}%" if acc is not None else "  -  "
    mb = {k: (figures.get(k, 0) or 0) / 1e6 for k in HOPS}
    data_s = ("SYNTHETIC DATA" if data_kind in ("synthetic", "mixed")
              else f"data {data_kind or 'loading'}")
    return (f"[{clock}] {mode}/{compressor}  {data_s}  epochs {epochs:5.2f}  merges "
            f"{figures.get('version', 0):>5}  test acc {acc_s}  MB up "
            f"{mb['bytes_worker_group']:.1f} down {mb['bytes_group_worker']:.1f} to-global "
            f"{mb['bytes_group_global']:.1f} from-global {mb['bytes_global_group']:.1f} "
            f"total {sum(mb.values()):.1f}")
