"""The dashboard counts what the servers see, wherever the workers and groups run.

A real `minips server --dashboard` on loopback, an external `minips group` process and two real
workers, each with a run directory of its own (as on other machines: the server's directory
holds none of their metrics files). While they train, Prometheus' text parser reads /metrics:
the workers' pushes, the answered pulls' staleness and SSP waits, per-worker series, the
group <-> global bytes and the exchanges' staleness between groups are all there, and /state
says that no evaluator runs and fills each worker's row (clock, step time, staleness, SSP wait,
bytes per push, upload) from what the servers saw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for

from minips.net import lifeline
from minips.run.launch import write_init

pytest.importorskip("aiohttp", reason="the dashboard extra is not installed")
parser = pytest.importorskip("prometheus_client.parser")

TOKEN = "remote-dashboard-secret"
RUN = ("--workers", "2", "--external-groups", "1", "--groups", "1", "--mode", "ssp",
       "--staleness", "1", "--compressor", "none", "--epochs", "0.3", "--calib-timeout", "120",
       "--sync-every", "4")


class Cluster:
    """The processes of the test, each writing its log under ``tmp``; all killed at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.env = lifeline.child_env({**os.environ, "MINIPS_TOKEN": TOKEN})
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        (self.tmp / name).mkdir()
        with open(self.tmp / f"{name}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "minips", *args, "--run-dir",
                                     str(self.tmp / name)], env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(url + "metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in parser.text_string_to_metric_families(text) for s in f.samples}


def _sum(m: dict[tuple[str, Any], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in m.items()
               if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


@pytest.mark.timeout(240)
def test_metrics_count_the_pushes_pulls_and_exchange_bytes_of_remote_groups_and_workers(
        cluster: Cluster, tmp_path: Path) -> None:
    write_init(tmp_path, "lenet5", 0)
    server = cluster.start("server", "server", "--port", "0", "--quiet", "--ready-file",
                           str(tmp_path / "server.addr"), "--init", str(tmp_path / "init.npy"),
                           "--dashboard", "127.0.0.1:0", *RUN)
    url_file = tmp_path / "server" / "dashboard.url"
    wait_for("the server and its dashboard", lambda: (tmp_path / "server.addr").exists()
             and url_file.exists(), 60, (server,))
    host, port = (tmp_path / "server.addr").read_text().split()
    address = f"{host}:{port}"
    group = cluster.start("group", "group", "--connect", address, "--listen", "127.0.0.1:0")
    workers = [cluster.start(f"worker-{i}", "worker", "--connect", address, "--id", str(i))
               for i in range(2)]
    url = url_file.read_text().strip()

    def counted() -> dict[Any, float] | None:
        try:
            m = scrape(url)
        except OSError:  # the run is over and its page gone: wait_for names the exit
            return None
        # 40: the page's bytes per push of a remote worker spans 32 pushes or more
        enough = (_sum(m, "minips_pushes_total") >= 40
                  and _sum(m, "minips_staleness_steps_count") >= 8
                  and _sum(m, "minips_ssp_wait_seconds_count") >= 8
                  and _sum(m, "minips_bytes_total", hop="group_to_global") > 0
                  and _sum(m, "minips_bytes_total", hop="global_to_group") > 0)
        return m if enough else None

    m = wait_for("remote pushes, pulls and exchange bytes in /metrics", counted, 150,
                 (server, group, *workers))
    assert _sum(m, "minips_bytes_total", hop="worker_to_group") > 0
    assert {dict(ls)["worker"] for (n, ls) in m if n == "minips_worker_clock"} == {"0", "1"}
    assert _sum(m, "minips_worker_pulls_total") == _sum(m, "minips_staleness_steps_count")
    # the staleness between groups of the group process's exchanges, counted from its PULL and
    # each reply: one group has no other group's merge to miss
    merged = _sum(m, "minips_exchange_missed_merges_count", group="0")
    assert merged >= 1 and _sum(m, "minips_exchange_missed_merges_sum") == 0
    assert _sum(m, "minips_exchange_base_age_seconds_count", group="0") == merged
    assert _sum(m, "minips_exchange_base_age_seconds_sum") > 0
    assert m[("minips_run_info", (("compressor", "none"), ("dataset", "fashion-mnist"),
                                  ("mode", "ssp"), ("model", "lenet5"), ("staleness", "1"),
                                  ("sync_every", "4"), ("workers", "2")))] == 1
    assert _sum(m, "process_resident_memory_bytes") > 0
    with urllib.request.urlopen(url + "state", timeout=10) as r:
        state = json.loads(r.read())
    assert state["evaluator"] is False  # the page says so: no accuracy is coming
    rows = {r["id"]: r for r in state["workers"]}
    assert set(rows) == {0, 1}
    for r in rows.values():  # what the servers saw fills the row: no "–" all run
        assert r["seen"] == "servers" and r["clock"] > 0 and r["step_time"] > 0, r
        assert r["staleness"] is not None and r["wait_s"] is not None, r
        assert r["bytes_per_push"] > 0 and 0.5 < r["upload_ratio"] <= 1.1, r  # dense pushes
    assert not list((tmp_path / "server").glob("worker-*.jsonl"))  # nothing from their files
    for p in (server, group, *workers):
        assert p.wait(timeout=120) == 0, (tmp_path / "server.log").read_text()[-2000:]
