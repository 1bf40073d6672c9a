"""Roles started by hand on separate machines: what a user types and what the command does
with it (the flags' meanings, the run directory, the budget, the connect timeout, the
in-process group servers' ports)."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from minips.core.config import RunConfig, WorkerConfig
from minips.errors import ConfigError
from minips.record.rundir import claim
from minips.run.cli import main
from minips.run.flags import DESCRIPTION, build_parser, run_config_from_args, say_default_budget
from minips.run.launch import parse_slowdowns
from minips.server import GlobalServer, ServerConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- flags ---------------------------------------------------------------------------------------

def test_mode_and_compressor_names_ignore_case() -> None:
    args = build_parser().parse_args(["server", "--mode", "GSSP", "--compressor", "GDTopK",
                                      "--epochs", "1"])
    run = run_config_from_args(args)
    assert (run.mode, run.compressor) == ("gssp", "gdtopk")


def test_slowdown_entries_are_trimmed_and_an_empty_one_is_refused() -> None:
    assert parse_slowdowns("1, 2") == [1.0, 2.0]  # spaces around an entry: the same list
    for bad in ("1,,2", "1,", ","):
        with pytest.raises(ConfigError, match="an empty entry"):
            parse_slowdowns(bad)


def test_a_connect_address_with_two_ports_is_a_usage_error_at_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    t = time.monotonic()
    assert main(["worker", "--connect", "127.0.0.1:7070:1", "--timeout", "30"]) == 2
    assert "--connect 127.0.0.1:7070:1: expected HOST:PORT with one ':'" in capsys.readouterr().err
    assert time.monotonic() - t < 5  # not retried as a network error


def test_the_top_level_help_names_every_command_and_there_is_a_version(
        capsys: pytest.CaptureFixture[str]) -> None:
    commands = ("local", "server", "group", "worker", "evaluator", "simulate", "ray", "plot",
                "dashboard")
    assert all(c in DESCRIPTION for c in commands)
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("minips ")


def test_a_refused_listen_address_leaves_no_run_directory(tmp_path: Path, monkeypatch:
                                                          pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MINIPS_TOKEN", raising=False)
    run_dir = tmp_path / "server"
    assert main(["server", "--host", "0.0.0.0", "--epochs", "1", "--run-dir", str(run_dir)]) == 2
    assert not run_dir.exists()


# -- a budget always; real speeds on separate machines -------------------------------------------

@pytest.mark.parametrize("command", ["server", "local", "simulate", "ray"])
def test_a_run_without_a_budget_gets_one_and_says_so(command: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args([command])
    run = run_config_from_args(args)
    assert run.epochs == 1.0
    say_default_budget(args)
    assert "no budget given: training stops after 1 epoch" in capsys.readouterr().err
    explicit = run_config_from_args(build_parser().parse_args([command, "--epochs", "0"]))
    assert explicit.epochs == 0.0  # asked for: train until the workers leave
    capped = run_config_from_args(build_parser().parse_args([command, "--max-steps", "9"]))
    assert (capped.epochs, capped.max_steps) == (0.0, 9)


def test_hand_started_workers_run_at_their_real_speed() -> None:
    server = run_config_from_args(build_parser().parse_args(["server", "--epochs", "1"]))
    assert server.base_step_s == 0.0  # no emulated floor: each machine's own step time
    local = run_config_from_args(build_parser().parse_args(["local", "--epochs", "1"]))
    assert local.base_step_s == RunConfig().base_step_s > 0  # `minips local` emulates
    asked = build_parser().parse_args(["server", "--epochs", "1", "--base-step", "0.05"])
    assert run_config_from_args(asked).base_step_s == 0.05


# -- one run, one directory ----------------------------------------------------------------------

def test_a_server_run_directory_holding_a_run_is_refused_unless_resumed_or_forced(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = tmp_path / "live1"
    old.mkdir()
    (old / "config.json").write_text("{}")
    (old / "global.jsonl").write_text('{"t": 0, "event": "joined"}\n')
    assert main(["server", "--epochs", "1", "--run-dir", str(old)]) == 2
    assert f"--run-dir {old}: it holds an earlier run" in capsys.readouterr().err
    assert (old / "config.json").read_text() == "{}"  # untouched
    assert claim(old, resume=True) is None and (old / "config.json").exists()
    aside = claim(old, force=True)
    assert aside == tmp_path / "live1.old-1" and (aside / "global.jsonl").exists()
    assert not old.exists()
    assert claim(old) is None  # nothing there any more: a new run may have it


def test_a_fresh_server_will_not_overwrite_an_existing_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "keep.npz"
    ckpt.write_bytes(b"resumable")
    assert main(["server", "--epochs", "1", "--run-dir", str(tmp_path / "new"),
                 "--checkpoint", str(ckpt)]) == 2
    assert f"--checkpoint {ckpt}: the file exists" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_local_refuses_a_named_run_directory_holding_a_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "live1").mkdir()
    (tmp_path / "live1" / "worker-3.jsonl").write_text("{}\n")
    code = main(["local", "--name", "live1", "--out", str(tmp_path), "--workers", "1",
                 "--max-steps", "1", "--no-eval", "--no-plot", "--device", "cpu"])
    assert code == 2
    assert "--name" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "live1").iterdir()) == ["worker-3.jsonl"]


# -- the connect timeout is honoured ---------------------------------------------------------------

@pytest.mark.timeout(30)
async def test_a_worker_keeps_trying_its_server_for_the_whole_timeout() -> None:
    from minips.worker import connect_role

    port = _free_port()  # nothing listens: every attempt is refused at once
    cfg = WorkerConfig(server_port=port, connect_timeout_s=2.5)
    t = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"127.0.0.1:{port} within 2.5 s \(\d+ attempts"):
        await connect_role(cfg, "127.0.0.1", port, "worker", -1)
    assert time.monotonic() - t >= 2.0  # not a cap of a few attempts


@pytest.mark.timeout(30)
async def test_a_worker_started_before_its_server_joins_when_it_comes_up() -> None:
    from minips.net import transport
    from minips.worker import connect_role

    port = _free_port()
    cfg = WorkerConfig(server_port=port, connect_timeout_s=20.0)
    joining = asyncio.ensure_future(connect_role(cfg, "127.0.0.1", port, "worker", -1))
    await asyncio.sleep(2.0)  # the board booted first: the server comes up 2 s later
    assert not joining.done()
    server = await transport.serve("127.0.0.1", port, accept=lambda hello: {},
                                   handler=lambda ch: ch.wait_closed(), token="")
    try:
        ch = await asyncio.wait_for(joining, 10)
        await ch.close()
    finally:
        server.close()
        await server.wait_closed()


# -- in-process group servers on pinned ports ----------------------------------------------------

@pytest.mark.timeout(30)
async def test_group_ports_pin_the_in_process_group_servers(tmp_path: Path) -> None:
    pinned = [_free_port(), _free_port()]
    cfg = ServerConfig(run=RunConfig(workers=3, epochs=1.0), port=0, run_dir=str(tmp_path),
                       group_ports=pinned)
    srv = GlobalServer(cfg, np.zeros(4, np.float32))
    await srv.start()
    try:
        handles = [await srv.open_group(g, []) for g in range(3)]
        assert [h.address for h in handles[:2]] == [f":{p}" for p in pinned]
        assert handles[2].address.startswith(":")  # beyond the list: a free port
        for h in handles:
            await srv.peers[h.id].close()
    finally:
        await srv.close()


def test_group_ports_flag_takes_lists_and_ranges() -> None:
    args = build_parser().parse_args(["server", "--group-ports", "7071-7073,7080"])
    assert args.group_ports == [7071, 7072, 7073, 7080]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["server", "--group-ports", "7071,7071"])


# -- the printed commands work verbatim, and every role reports ----------------------------------

def test_join_lines_name_a_reachable_address_and_every_flag(tmp_path: Path) -> None:
    from conftest import make_certificate

    from minips.run.cli import join_commands

    cert, key = make_certificate(tmp_path, "IP:127.0.0.1")  # self-signed: it is its own CA
    cfg = ServerConfig(host="0.0.0.0", external_groups=1, tls_cert=str(cert), tls_key=str(key))
    lines = join_commands(cfg, 7070)
    assert lines[0].startswith("join: minips worker --connect ")
    assert all("0.0.0.0:7070" not in ln and "<this-host>" not in ln for ln in lines)
    assert all(f"--tls-ca {cert}" in ln for ln in lines)
    assert lines[1].startswith("group: minips group --connect ") and "GROUP_CERT" in lines[1]
    advertised = join_commands(ServerConfig(host="0.0.0.0", advertise_host="pc-7"), 7070)
    assert advertised == ["join: minips worker --connect pc-7:7070"]  # no group line: in-process


@pytest.mark.timeout(120)
def test_a_worker_started_from_the_printed_line_trains_and_the_server_reports(
        tmp_path: Path) -> None:
    import os
    import shlex
    import subprocess
    import sys

    from minips.net import lifeline

    env = lifeline.child_env({**os.environ, "MINIPS_TOKEN": "s" * 32})
    server = subprocess.Popen(
        [sys.executable, "-m", "minips", "server", "--host", "0.0.0.0", "--port", "0",
         "--advertise", "127.0.0.1", "--workers", "1", "--max-steps", "4", "--batch-size", "16",
         "--dashboard", "0.0.0.0:0", "--run-dir", str(tmp_path / "run")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    worker = None
    try:
        assert server.stdout is not None
        seen = []
        for ln in iter(server.stdout.readline, ""):  # bounded by the test's timeout
            seen.append(ln)
            if ln.startswith("join: "):
                break
        join = seen[-1]
        assert "real speeds" in next(ln for ln in seen if "listening on" in ln)
        dashboard = next(ln for ln in seen if "dashboard at" in ln)
        assert "//127.0.0.1:" in dashboard and "0.0.0.0" not in dashboard  # one to open
        argv = shlex.split(join.removeprefix("join: "))  # 'minips worker ...' as printed
        assert argv[0] == "minips"
        worker = subprocess.Popen([sys.executable, "-m", *argv], env=env,
                                  cwd=tmp_path, stderr=subprocess.PIPE, text=True)
        out = seen + server.communicate(timeout=90)[0].splitlines(keepends=True)
        assert server.returncode == 0, "".join(out)
        text = "".join(out)
        assert "worker 0 joined" in text and "1 group(s) by speed: 0 = worker 0 (" in text
        assert "minips server: done (workers left)" in text
        assert (tmp_path / "run" / "summary.json").exists()
        err = worker.communicate(timeout=30)[1]
        # its own steps and pushes, and its group's clock named as such (one worker: equal)
        assert worker.returncode == 0 and "minips worker 0: done after 4 steps of its own in " \
            "4 pushes" in err and "(its group's clock 4)" in err, err
        events = (tmp_path / "runs" / "worker" / "worker-0.jsonl").read_text()
        assert '"group_lost"' not in events  # the group server closing at the end is no loss
    finally:
        for p in (server, worker):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()


# -- no silent synthetic data ----------------------------------------------------------------------

def test_a_worker_without_its_data_refuses_unless_asked_for_synthetic(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from minips.errors import DataError
    from minips.record.metrics import read
    from minips.worker import build

    monkeypatch.setenv("MINIPS_CACHE_DIR", str(tmp_path / "cache"))  # nothing there
    monkeypatch.setenv("MINIPS_DATA_MIRROR", (tmp_path / "no-mirror").as_uri() + "/")
    run = RunConfig(dataset="mnist", data_dir=str(tmp_path / "none"), workers=1)
    cfg = WorkerConfig(run_dir=str(tmp_path / "run"), device="cpu")
    with pytest.raises(DataError, match="--data synthetic"):
        build(cfg, run, 0)
    cfg.data = "synthetic"
    build(cfg, run, 0).writer.close()
    assert read(tmp_path / "run")["worker-0"]["synthetic"] is True  # asked for, and recorded


# -- a file describes a run ----------------------------------------------------------------------

def test_a_toml_config_gives_flags_and_the_command_line_overrides_it(tmp_path: Path) -> None:
    from minips.run.flags import with_config

    path = tmp_path / "run.toml"
    path.write_text('mode = "SSP"\ncompressor = "dgc"\nworkers = 3\nslowdown = [1, 2, 2]\n'
                    'wall_s = 60\nno-plot = true\n[copt]\nwarmup_epochs = 0\n')
    args = build_parser().parse_args(with_config(["local", "--config", str(path),
                                                  "--wall-s", "30"]))
    run = run_config_from_args(args)
    assert (run.mode, run.workers, run.wall_s) == ("ssp", 3, 30.0)  # the flag wins
    assert [s.first for s in args.slowdown] == [1.0, 2.0, 2.0] and args.no_plot
    assert run.compressor_opts == {"warmup_epochs": 0}


def test_a_toml_key_that_is_no_flag_is_refused_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.toml"
    path.write_text("workerz = 3\n")
    assert main(["server", "--config", str(path)]) == 2
    assert "'workerz' is not a flag of this command" in capsys.readouterr().err


def test_the_course_example_is_a_valid_run_for_local_and_simulate() -> None:
    from minips.run.flags import with_config

    course = Path(__file__).parent.parent / "examples" / "course.toml"
    for command in ("local", "simulate"):
        args = build_parser().parse_args(with_config([command, "--config", str(course)]))
        run = run_config_from_args(args)
        assert (run.mode, run.compressor, run.workers, run.epochs) == ("gssp", "gdtopk", 4, 1.0)


def test_a_worker_joining_another_run_moves_the_earlier_files_aside(tmp_path: Path) -> None:
    from minips.record.rundir import join_run

    own = tmp_path / "worker"
    first = RunConfig(t0=1000.0).to_info()
    assert join_run(own, first) is None  # a fresh directory: the run's config is written
    (own / "worker-0.jsonl").write_text('{"t": 1, "clock": 1}\n')
    assert join_run(own, first) is None  # the same run (a rejoin): its files stay
    assert (own / "worker-0.jsonl").exists()
    aside = join_run(own, RunConfig(t0=2000.0).to_info())  # the next run
    assert aside == tmp_path / "worker.old-1" and (aside / "worker-0.jsonl").exists()
    assert sorted(p.name for p in own.iterdir()) == ["config.json"]


def test_a_url_on_a_wildcard_address_names_one_to_open() -> None:
    from minips.net.endpoints import reachable_url

    assert reachable_url("http://0.0.0.0:8080/", "10.0.0.5") == "http://10.0.0.5:8080/"
    assert reachable_url("http://[::]:8080/m?x=1", "fd00::2") == "http://[fd00::2]:8080/m?x=1"
    assert reachable_url("http://127.0.0.1:8080/", "10.0.0.5") == "http://127.0.0.1:8080/"
