"""Tests of minips.record.plot: PNG charts from run directories written with
minips.record.metrics."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from minips.record.plot import plot_runs
from minips.record.rundir import RunDir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _make_run(path: Path, mode: str, compressor: str, bytes_per_push: int) -> Path:
    """A tiny run written through the metrics API: 3 workers, 2 groups, 5 evaluations."""
    rd = RunDir(path, t0=0.0)
    rd.write_config({"mode": mode, "compressor": compressor, "workers": 3})
    with rd.writer("eval") as ev:
        for i in range(1, 6):
            ev.write({"t": 2.0 * i, "version": i, "samples": 640 * i, "accuracy": 0.5 + 0.07 * i,
                      "loss": 1.0 / i, "bytes_up": bytes_per_push * 10 * i,
                      "bytes_down": 10**6 * i})
    for w in range(3):
        with rd.writer(f"worker-{w}") as wr:
            for c in range(1, 4 * (3 - w)):
                wr.write({"t": c * 0.8 * (w + 1), "worker": w, "group": min(w, 1), "clock": c,
                          "staleness": w % 2, "wait_s": 0.0, "bytes_wire": bytes_per_push})
    return path


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.timeout(120)
def test_plot_runs_writes_small_pngs(tmp_path):
    dense = _make_run(tmp_path / "bsp", "bsp", "none", 400_000)
    sparse = _make_run(tmp_path / "gssp", "gssp", "gdtopk", 3_000)
    paths = plot_runs([dense, sparse], tmp_path / "charts")
    names = sorted(p.name for p in paths)
    assert names == ["accuracy_vs_bytes.png", "accuracy_vs_time.png",
                     "bsp-workers.png", "gssp-workers.png"]
    for p in paths:
        assert p.parent == tmp_path / "charts" and _is_png(p)
        assert 5_000 < p.stat().st_size < 300_000


def _add_hops_and_ratios(path: Path) -> Path:
    """Group files with every hop's running totals and GDTopK ratio events, as a run writes."""
    rd = RunDir(path)
    for g in (0, 1):
        with rd.writer(f"group-{g}") as gw:
            for i in range(1, 12):
                gw.write({"t": 1.0 * i, "event": "exchange", "group": g, "bytes_in": 1000 * i,
                          "bytes_out": 40_000 * i, "bytes_to_global": 500 * i,
                          "bytes_from_global": 900 * i})
    with rd.writer("global") as gl:
        gl.write({"t": 0.5, "event": "groups", "ratios": {"0": 0.01, "1": 0.01}})
        for i in range(1, 6):
            gl.write({"t": 0.5 + 2 * i, "event": "ratios",
                      "ratios": {"0": 0.01 - 0.001 * i, "1": 0.01 + 0.001 * i},
                      "iter_time": {"0": 0.1, "1": 0.1 + 0.02 * i}})
    return path


@pytest.mark.timeout(120)
def test_plot_total_bytes_and_gdtopk_ratio_charts(tmp_path):
    gdt = _add_hops_and_ratios(_make_run(tmp_path / "gdt", "gssp", "gdtopk", 3_000))
    topk = _add_hops_and_ratios(_make_run(tmp_path / "topk", "gssp", "topk", 3_000))
    plain = _make_run(tmp_path / "plain", "ssp", "none", 400_000)  # no group files
    paths = {p.name: p for p in plot_runs([gdt, topk, plain], tmp_path / "charts")}
    assert {"accuracy_vs_total_bytes.png", "gdt-ratios.png"} <= set(paths)
    assert "topk-ratios.png" not in paths and "plain-ratios.png" not in paths  # not GDTopK
    for name in ("accuracy_vs_total_bytes.png", "gdt-ratios.png"):
        assert _is_png(paths[name]) and 5_000 < paths[name].stat().st_size < 300_000
    assert not any(p.name == "accuracy_vs_total_bytes.png" for p in plot_runs([plain]))


@pytest.mark.timeout(120)
def test_plot_defaults_to_first_run_dir_and_skips_empty_charts(tmp_path):
    run = _make_run(tmp_path / "a", "ssp", "topk", 1000)
    empty = tmp_path / "b"
    empty.mkdir()
    paths = plot_runs([run, empty])
    assert {p.name for p in paths} == {"accuracy_vs_time.png", "accuracy_vs_bytes.png",
                                       "a-workers.png"}
    assert all(p.parent == run for p in paths)
    assert plot_runs([empty], tmp_path / "out") == []
    assert plot_runs([]) == []


def test_importing_plot_does_not_import_matplotlib():
    code = ("import sys, minips.record.plot, minips.record.metrics; "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False"
