"""The edge path's check and its --amp fallback, as far as the default run can see them.

scripts/check_arm64.py itself (an arm64 root under qemu, minutes) is run by ``make check-arm64``;
here: its argument checks and its skip line, and that ``--amp`` on a CPU without bfloat16 keeps
float32 with one line of its own (the Cortex-A76/A78AE case, faked by patching the check).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from torch import nn

from minips.ml import device

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_arm64.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_arm64", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_unknown_step_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    check = load_script()
    assert check.parse_steps("core, tests") == ["core", "tests"]
    assert check.main(["--steps", "core,bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown step bogus" in err and "root, core" in err


def test_a_machine_without_qemu_or_root_is_skipped_with_its_reason(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    check = load_script()
    assert check.missing_tools(lambda tool: f"/usr/bin/{tool}", euid=0) is None
    assert "needs root" in check.missing_tools(lambda tool: "/bin/x", euid=1000)
    no_qemu = check.missing_tools(lambda tool: None if "qemu" in tool else "/bin/x", euid=0)
    assert no_qemu == ("qemu-aarch64-static not found (apt-get install -y qemu-user-static "
                       "binfmt-support)")
    monkeypatch.setattr(check, "missing_tools", lambda: "debootstrap not found (...)")
    assert check.main([]) == 0
    assert capsys.readouterr().out == "check_arm64: skipped: debootstrap not found (...)\n"
    assert check.main(["--strict"]) == 3  # a skip that a caller wants to see as a failure


def tiny_net() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))


def test_amp_on_a_cpu_without_bfloat16_stays_float32_and_says_so_once(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(device, "cpu_has_bf16", lambda: False)
    amp = device.Trainer(tiny_net(), "tiny", cpu, amp=True)
    plain = device.Trainer(tiny_net(), "tiny", cpu)
    line = capsys.readouterr().err
    assert line == (f"minips: --amp: this CPU ({os.uname().machine}) has no "
                    "bfloat16 instructions; the forward pass stays float32\n")
    assert amp.dtype is None and amp.scale == 1.0
    assert device.describe(cpu, amp=True)["amp_dtype"] == "float32"
    rng = np.random.default_rng(0)
    xb = rng.standard_normal((8, 1, 8, 8)).astype(np.float32)
    yb = rng.integers(0, 10, 8).astype(np.int64)
    loss_a, g_a = amp.gradient(xb, yb)
    loss_p, g_p = plain.gradient(xb, yb)
    assert loss_a == pytest.approx(loss_p, rel=1e-6)
    assert torch.allclose(g_a, g_p, rtol=1e-5, atol=1e-7)  # float32, not a bfloat16 rounding


def test_the_bf16_check_answers_for_this_cpu() -> None:
    has = device.cpu_has_bf16()
    assert isinstance(has, bool)
    expected = torch.bfloat16 if has else None
    assert device.amp_dtype(torch.device("cpu")) is expected
    if sys.platform == "linux" and not has:  # the kernel's flags agree with torch's answer
        flags = Path("/proc/cpuinfo").read_text()
        assert "avx512_bf16" not in flags and "amx_bf16" not in flags


def test_the_worker_run_is_judged_by_the_grouping_the_server_recorded(tmp_path: Path) -> None:
    check = load_script()
    (tmp_path / "global.jsonl").write_text(
        '{"t": 1, "event": "joined"}\n'
        '{"t": 9, "event": "groups", "assignment": {"0": 1, "1": 0, "2": 0}, '
        '"iteration_s": {"0": 0.9, "1": 0.05, "2": 0.05}, "compute_s": {}, "addresses": {}}\n')
    seen = check.grouping(tmp_path)
    assert seen["assignment"] == {"0": 1, "1": 0, "2": 0} and "addresses" not in seen
    assert check.apart_from_the_rest({**seen, "worker_id": 0}) is None
    assert check.apart_from_the_rest({**seen, "worker_id": 2}) == (
        "the arm64 worker 2 shares its group with ['1']")
    assert "no grouping" in check.apart_from_the_rest({**seen, "worker_id": None})
