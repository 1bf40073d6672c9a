"""checkpoint.py: exact round trips, atomic replacement, damaged files, config fingerprints."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minips import checkpoint
from minips.errors import ConfigError, DataError

RUN = {"model": "lenet5", "dataset": "fashion-mnist", "mode": "gssp", "workers": 4, "groups": 2,
       "batch_size": 64, "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "staleness": 3,
       "sync_every": 4, "merge": "mean", "compressor": "dgc", "ratio": 0.01, "seed": 0}


def _state(size: int = 10) -> dict:
    rng = np.random.default_rng(0)
    return {
        "format": checkpoint.FORMAT,
        "fingerprint": checkpoint.fingerprint(RUN, size),
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
    assert checkpoint.save(path, state) == path.stat().st_size > 0
    back = checkpoint.load(path)
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
    checkpoint.save(path, _state())
    bad = _state()
    bad["unserialisable"] = object()  # json cannot encode it: the save fails before any rename
    with pytest.raises(TypeError):
        checkpoint.save(path, bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.npz"]
    assert checkpoint.load(path)["version"] == 17  # the previous checkpoint is intact
    newer = _state()
    newer["version"] = 18
    checkpoint.save(path, newer)
    assert checkpoint.load(path)["version"] == 18
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.npz"]


def test_missing_truncated_and_garbage_files_raise_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no checkpoint"):
        checkpoint.load(tmp_path / "absent.npz")
    good = tmp_path / "good.npz"
    checkpoint.save(good, _state())
    raw = good.read_bytes()
    for name, data in (("truncated", raw[: len(raw) // 2]), ("garbage", b"\x00not a zip" * 50),
                       ("header-only", raw[:30]), ("empty", b"")):
        bad = tmp_path / f"{name}.npz"
        bad.write_bytes(data)
        with pytest.raises(DataError, match="damaged"):
            checkpoint.load(bad)


def test_fingerprint_accepts_the_same_run_and_names_every_difference() -> None:
    state = _state(size=10)
    checkpoint.check_compatible(state, dict(RUN), 10)
    other = {**RUN, "model": "resnet18", "lr": 0.1}
    with pytest.raises(ConfigError) as info:
        checkpoint.check_compatible(state, other, 10)
    assert "model" in str(info.value) and "lr" in str(info.value)
    assert "mode:" not in str(info.value)  # fields that agree are not named
    with pytest.raises(ConfigError, match="size"):
        checkpoint.check_compatible(state, dict(RUN), 11)
    with pytest.raises(ConfigError, match="format"):
        checkpoint.check_compatible({**state, "format": 999}, dict(RUN), 10)
