"""Flags as a user types them: no prefix matching, a --config file's keys type-checked with the
file named, `local`'s reuse message naming only flags it has, and help text that says what the
code does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from minips.run.cli import main
from minips.run.flags import build_parser

DOCS = Path(__file__).resolve().parents[1] / "docs"


def run_minips(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`minips ARGV` as a process (exit status and stderr as a user sees them)."""
    return subprocess.run([sys.executable, "-m", "minips", *argv], capture_output=True,
                          text=True, timeout=60, cwd=cwd)


@pytest.mark.parametrize("argv", [
    ["server", "--worker", "4"], ["local", "--epoch", "1"], ["worker", "--connect", "h:1",
                                                              "--time", "3"],
    ["simulate", "--max-push", "10"]])
def test_a_prefix_of_a_flag_is_an_error_not_that_flag(argv: list[str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`--worker 4` on `minips server` once started a server with --workers 4."""
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {argv[-2]} {argv[-1]}" in err and err.count("\n") == 1


@pytest.mark.parametrize("line, expected", [
    ("epochs = true", "epochs = true: expected a number"),
    ('lr = "0.05"', 'lr = "0.05": expected a number'),
    ("workers = 4.5", "workers = 4.5: expected an integer"),
    ('workers = "4"', 'workers = "4": expected an integer'),
    ("no-plot = 1", "no-plot = 1: expected true or false"),
    ("mode = true", "mode = true: expected text")])
def test_a_config_key_of_the_wrong_type_is_one_line_naming_file_and_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, expected: str) -> None:
    """Before: `epochs = true` gave "expected one argument" naming no file; `lr = "0.05"`
    was taken."""
    path = tmp_path / "run.toml"
    path.write_text(line + "\n")
    assert main(["local", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"minips: error: --config {path}: {expected}"), err
    assert err.count("\n") == 1, err


def test_config_values_of_the_right_type_are_taken(tmp_path: Path) -> None:
    """Integers for a number, a TOML boolean for an on/off flag, "auto" for --local-steps, a
    list for --slowdown: the same flags as typed on the command line."""
    from minips.run.flags import run_config_from_args, with_config

    path = tmp_path / "run.toml"
    path.write_text('lr = 1\nregroup = false\nlocal-steps = "auto"\noptimizer-at = "worker"\n'
                    'workers = 2\n'
                    'slowdown = [1, 2]\nno-plot = true\nepochs = 0.5\n')
    args = build_parser().parse_args(with_config(["local", "--config", str(path)]))
    run = run_config_from_args(args)
    assert (run.lr, run.regroup, run.local_steps, run.workers, run.epochs) == (
        1.0, False, 0, 2, 0.5)
    assert [s.first for s in args.slowdown] == [1.0, 2.0] and args.no_plot


def test_local_reuse_message_names_what_local_takes(tmp_path: Path) -> None:
    """`minips local --name` on a directory holding a run: the message named --resume, which
    `local` rejects as an unrecognized argument; now it names --force and --name, and each
    works."""
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "runs" / "r1" / "config.json").write_text("{}\n")
    done = run_minips("local", "--name", "r1", "--workers", "1", "--epochs", "0.01",
                      cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--resume" not in done.stderr
    assert "--force" in done.stderr and "--name" in done.stderr
    # every flag the message names is one `local` takes
    named = {w.strip("(),.;") for w in done.stderr.split() if w.startswith("--")}
    for flag in named:
        with pytest.raises(SystemExit) as stop:  # --help exits 0 once every flag is known
            build_parser().parse_args(["local", flag, *(["x"] if flag == "--name" else []),
                                       "--help"])
        assert stop.value.code == 0, flag


def help_of(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines at any word


def test_dashboard_help_names_the_dashboards_token_as_the_doc_does(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The help said "beyond loopback it asks for MINIPS_TOKEN"; the code asks for the
    dashboard's own token (dashboard_secret) and docs/dashboard.md says MINIPS_TOKEN opens
    nothing there: help and doc now say the same."""
    doc = " ".join((DOCS / "dashboard.md").read_text().replace("`", "").split())
    for command in ("server", "local"):
        text = help_of(command, capsys)
        assert "asks for MINIPS_TOKEN" not in text
        assert "MINIPS_DASHBOARD_TOKEN" in text and "MINIPS_TOKEN opens nothing there" in text
    assert "MINIPS_TOKEN opens nothing there" in doc and "MINIPS_DASHBOARD_TOKEN" in doc


def test_worker_slowdown_default_reads_as_a_factor(capsys: pytest.CaptureFixture[str]) -> None:
    """It showed `(default Schedule(steps=((0.0, 1.0),)))`."""
    text = help_of("worker", capsys)
    assert "Schedule(" not in text
    assert "(T: s of training); default 1 (not slowed)" in text


def test_down_mode_exact_reaches_the_run_and_a_bad_mode_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--down-mode exact` picks the exact downlink (core/group_core.py); another word is
    refused by the run's own check, in one line."""
    from minips.run.flags import run_config_from_args

    run = run_config_from_args(build_parser().parse_args(["local", "--down-mode", "exact"]))
    assert run.down_mode == "exact"
    assert run_config_from_args(build_parser().parse_args(["local"])).down_mode == "auto"
    assert main(["local", "--down-mode", "sideways", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "--down-mode 'sideways'" in err and "auto | exact" in err and err.count("\n") == 1, err
