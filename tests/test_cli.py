"""The `minips` command line: flag resolution, clear errors within seconds, plot."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_ready_file

from minips.core.config import RunConfig
from minips.errors import ConfigError
from minips.net.endpoints import format_address, parse_address, reachable
from minips.run.cli import main
from minips.run.flags import PRESETS, build_parser, run_config_from_args
from minips.run.launch import parse_slowdowns


def test_preset_then_flags_override() -> None:
    args = build_parser().parse_args(["local", "--preset", "demo", "--mode", "ssp",
                                      "--copt", "warmup_epochs=2"])
    run = run_config_from_args(args)
    assert run.mode == "ssp"  # flag wins
    assert run.compressor == PRESETS["demo"]["run"]["compressor"]  # preset kept
    preset_opts = PRESETS["demo"]["run"]["compressor_opts"]
    assert run.compressor_opts == {**preset_opts, "warmup_epochs": 2}  # --copt wins its key


def test_another_compressor_keeps_only_the_preset_options_it_takes() -> None:
    """--preset demo --compressor topk: plain Top-K has no warm-up, so the preset's
    warmup_epochs is dropped (it failed in the compressor's constructor) and value_dtype kept;
    a --copt the compressor does not take still fails at start-up."""
    from minips.compress.registry import compressor_options, make_compressor

    args = build_parser().parse_args(["local", "--preset", "demo", "--compressor", "topk"])
    run = run_config_from_args(args)
    assert run.compressor == "topk" and run.compressor_opts == {"value_dtype": "f16"}
    make_compressor(run.compressor, 100, ratio=run.ratio, **run.compressor_opts)
    assert "warmup_epochs" in compressor_options("gdtopk")
    assert "warmup_epochs" not in compressor_options("topk")
    gd = run_config_from_args(build_parser().parse_args(
        ["local", "--preset", "demo", "--compressor", "gdtopk"]))
    assert gd.compressor_opts == PRESETS["demo"]["run"]["compressor_opts"]  # kept: it takes both
    bad = build_parser().parse_args(["local", "--preset", "demo", "--compressor", "topk",
                                     "--copt", "warmup_epochs=2"])
    with pytest.raises(ConfigError, match="warmup_epochs"):
        run = run_config_from_args(bad)
        make_compressor(run.compressor, 100, ratio=run.ratio, **run.compressor_opts)


def test_run_config_file_is_the_base(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"mode": "asp", "workers": 3, "unknown": 1}))
    args = build_parser().parse_args(["server", "--run-config", str(path), "--workers", "5"])
    run = run_config_from_args(args)
    assert (run.mode, run.workers) == ("asp", 5)


def help_of(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines at any word


def test_help_shows_each_default_once(capsys: pytest.CaptureFixture[str]) -> None:
    worker = help_of("worker", capsys)
    assert "(0 = until it answers) (default 10.0)" in worker
    assert "paced uplink, bytes/s (0 = none) (default 0.0)" in worker  # a zero default is shown too
    assert "HOST:PORT (default" not in worker  # --connect is required: no default
    server = help_of("server", capsys)
    assert "listen port (0 = any free) (default 7070)" in server
    assert server.count("(default lenet5)") == 1  # run flags say theirs already
    assert "(default None)" not in server and "(default False)" not in server
    assert "(default: from the first worker)" in server
    assert "HOST:PORT for workers (default 127.0.0.1:7071)" in help_of("group", capsys)


def test_slowdowns_and_addresses() -> None:
    assert parse_slowdowns("1,1,2x2,4") == [1.0, 1.0, 2.0, 2.0, 4.0]
    assert parse_address("example.org:7000") == ("example.org", 7000)
    assert parse_address(":81") == ("127.0.0.1", 81)
    assert parse_address("[::1]:82") == ("::1", 82) and parse_address("[::1]") == ("::1", 7070)
    assert format_address("::1", 82) == "[::1]:82" and format_address("h", 1) == "h:1"
    assert reachable("0.0.0.0:7071", "10.0.0.5") == "10.0.0.5:7071"
    assert reachable("[::]:7071", "fe80::1") == "[fe80::1]:7071"
    assert reachable("myhost", "other") == "myhost"  # no port: not a wildcard host
    assert reachable("gpu-3:7071", "10.0.0.5") == "gpu-3:7071"  # a real name stays
    with pytest.raises(ConfigError):
        parse_slowdowns("1,zero")
    with pytest.raises(ConfigError):
        parse_address("host:port")


def test_bad_mode_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["server", "--mode", "fast"]) == 2
    assert "mode" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(60)
def test_worker_with_unreachable_server_fails_fast(tmp_path: Path) -> None:
    port = _free_port()  # nothing listens there
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "minips", "worker", "--connect",
                           f"127.0.0.1:{port}", "--timeout", "2", "--run-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2
    assert f"127.0.0.1:{port}" in proc.stderr and "could not connect" in proc.stderr
    assert time.monotonic() - t < 40  # torch import included


@pytest.mark.timeout(60)
def test_server_prints_how_to_join_and_refuses_a_wrong_secret(tmp_path: Path) -> None:
    env = {**os.environ, "MINIPS_TOKEN": "right"}
    ready = tmp_path / "addr"
    server = subprocess.Popen([sys.executable, "-m", "minips", "server", "--host", "127.0.0.1",
                               "--port", "0", "--workers", "1", "--run-dir", str(tmp_path),
                               "--ready-file", str(ready)],
                              env=env, stdout=subprocess.PIPE, text=True)
    try:
        port = wait_ready_file(ready, server)[1]
        assert server.stdout is not None
        assert f"minips worker --connect 127.0.0.1:{port}" in server.stdout.readline() + \
            server.stdout.readline()
        proc = subprocess.run([sys.executable, "-m", "minips", "evaluator", "--connect",
                               f"127.0.0.1:{port}", "--run-dir", str(tmp_path)],
                              env={**env, "MINIPS_TOKEN": "wrong"}, capture_output=True,
                              text=True, timeout=50)
        assert proc.returncode == 2 and "error" in proc.stderr
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_plot_command_on_an_empty_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"mode": "bsp", "compressor": "none"}))
    assert main(["plot", str(tmp_path)]) == 0


def test_lr_schedule_flag_and_its_checks() -> None:
    args = build_parser().parse_args(["server", "--lr-schedule", "cosine", "--epochs", "2"])
    assert run_config_from_args(args).lr_schedule == "cosine"
    with pytest.raises(ConfigError, match="lr_schedule"):
        RunConfig(lr_schedule="cosine").validate()  # no epochs budget to decay over
    with pytest.raises(ConfigError, match="lr_schedule"):
        RunConfig(lr_schedule="step", epochs=1).validate()
