"""checkpoint.py: exact round trips, atomic replacement, damaged files, config fingerprints."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from minips.core.snapshot import FORMAT, check_compatible, fingerprint
from minips.errors import ConfigError, DataError
from minips.record.checkpoint import load, save

RUN = {"model": "lenet5", "dataset": "fashion-mnist", "mode": "gssp", "workers": 4, "groups": 2,
       "batch_size": 64, "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "staleness": 3,
       "sync_every": 4, "merge": "mean", "compressor": "dgc", "ratio": 0.01, "seed": 0}


def _state(size: int = 10) -> dict:
    rng = np.random.default_rng(0)
    return {
        "format": FORMAT,
        "fingerprint": fingerprint(RUN, size),
        "version": 17,
        "weights": rng.standard_normal(size).astype(np.float32),
        "groups": {"0": {"weights": rng.standard_normal(size).astype(np.float32),
                         "momentum": np.zeros(size, np.float32), "clocks": {"3": 5, "4": 6}},
                   "1": {"weights": np.arange(size, dtype=np.float32), "clocks": {}}},
        "assignment": [[0, 0], [1, 1]],
        "counters": {"bytes_up": 12345, "samples": np.int64(640)},
    }


def test_round_trip_is_exact(tmp_path: Path) -> None:
    state = _state()
    path = tmp_path / "ckpt.npz"
    assert save(path, state) == path.stat().st_size > 0
    back = load(path)
    np.testing.assert_array_equal(back["weights"], state["weights"])
    assert back["weights"].dtype == np.float32
    np.testing.assert_array_equal(back["groups"]["0"]["weights"], state["groups"]["0"]["weights"])
    np.testing.assert_array_equal(back["groups"]["1"]["weights"], np.arange(10, dtype=np.float32))
    assert back["groups"]["0"]["clocks"] == {"3": 5, "4": 6}
    assert back["assignment"] == [[0, 0], [1, 1]]
    assert back["counters"] == {"bytes_up": 12345, "samples": 640}
    assert back["version"] == 17


def test_save_replaces_atomically_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.npz"
    save(path, _state())
    bad = _state()
    bad["unserialisable"] = object()  # json cannot encode it: the save fails before any rename
    with pytest.raises(TypeError):
        save(path, bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.npz"]
    assert load(path)["version"] == 17  # the previous checkpoint is intact
    newer = _state()
    newer["version"] = 18
    save(path, newer)
    assert load(path)["version"] == 18
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.npz"]


def test_missing_truncated_and_garbage_files_raise_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no checkpoint"):
        load(tmp_path / "absent.npz")
    good = tmp_path / "good.npz"
    save(good, _state())
    raw = good.read_bytes()
    for name, data in (("truncated", raw[: len(raw) // 2]), ("garbage", b"\x00not a zip" * 50),
                       ("header-only", raw[:30]), ("empty", b"")):
        bad = tmp_path / f"{name}.npz"
        bad.write_bytes(data)
        with pytest.raises(DataError, match="damaged"):
            load(bad)


def test_fingerprint_accepts_the_same_run_and_names_every_difference() -> None:
    state = _state(size=10)
    check_compatible(state, dict(RUN), 10)
    other = {**RUN, "model": "resnet18", "lr": 0.1}
    with pytest.raises(ConfigError) as info:
        check_compatible(state, other, 10)
    assert "model" in str(info.value) and "lr" in str(info.value)
    assert "mode:" not in str(info.value)  # fields that agree are not named
    with pytest.raises(ConfigError, match="size"):
        check_compatible(state, dict(RUN), 11)
    with pytest.raises(ConfigError, match="format"):
        check_compatible({**state, "format": 999}, dict(RUN), 10)


def test_a_resume_keeps_where_the_optimizer_runs() -> None:
    """The group servers' velocity exists with the optimizer on them only: a checkpoint of one
    placement is refused for the other; one written before the field existed counts as
    ``server``."""
    server, worker = {**RUN, "optimizer_at": "server"}, {**RUN, "optimizer_at": "worker"}
    state = {"format": FORMAT, "fingerprint": fingerprint(server, 10)}
    with pytest.raises(ConfigError, match="optimizer_at: checkpoint 'server', this run 'worker'"):
        check_compatible(state, worker, 10)
    older = {"format": FORMAT, "fingerprint": {k: v for k, v in fingerprint(server, 10).items()
                                                if k != "optimizer_at"}}
    check_compatible(older, server, 10)
    with pytest.raises(ConfigError, match="optimizer_at"):
        check_compatible(older, worker, 10)


async def test_the_server_removes_temp_files_of_writes_killed_midway(tmp_path: Path) -> None:
    """A server killed while writing leaves `.checkpoint.npz.tmp<pid>`; the next server start
    deletes those of dead processes and keeps one a live process may still be writing."""
    import subprocess
    import sys

    from conftest import records

    from minips.core.config import RunConfig
    from minips.server import GlobalServer, ServerConfig

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True, timeout=30)
    stale = tmp_path / f".checkpoint.npz.tmp{int(dead.stdout)}"
    live = tmp_path / f".checkpoint.npz.tmp{os.getpid()}"
    for f in (stale, live):
        f.write_bytes(b"\0" * 1000)  # half a checkpoint
    srv = GlobalServer(ServerConfig(run=RunConfig(workers=1), port=0, run_dir=str(tmp_path)),
                       np.zeros(4, np.float32))
    await srv.start()
    await srv.close()
    assert not stale.exists() and live.exists()
    removed = records(tmp_path / "global.jsonl", event="checkpoint_temps_removed")
    assert removed and removed[0]["files"] == [str(stale)]
