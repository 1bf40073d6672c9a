"""Where the optimizer of a large model goes when the run names no place (issue 41 item 2).

ResNet-18 (11.2M parameters) and VGG-19 (20M) get the workers' optimizer unless the user asks
for the servers', and with it the exact downlink unless ``--down-mode`` is given; the command
says why in one console line; smaller models keep the servers' optimizer and the compressed
downlink (RunConfig's defaults); an explicit ``--optimizer-at`` or ``--down-mode`` always wins.
"""

from __future__ import annotations

import argparse

import pytest

from minips.core.config import LARGE_MODEL_PARAMS, PARAM_COUNTS, RunConfig
from minips.run import flags
from minips.run.flags import build_parser


def configured(*argv: str) -> tuple[RunConfig, argparse.Namespace]:
    args = build_parser().parse_args(["server", "--epochs", "1", *argv])
    return flags.run_config_from_args(args), args


@pytest.mark.parametrize("model", ["resnet18", "vgg19"])
def test_a_large_model_gets_the_workers_optimizer_and_the_run_says_why(
        model: str, capsys: pytest.CaptureFixture[str]) -> None:
    run, args = configured("--model", model)
    assert run.optimizer_at == "worker" and run.optimizer_on_worker
    assert run.down_mode == "exact"
    flags.say_default_budget(args)
    lines = capsys.readouterr().err.splitlines()
    said = [line for line in lines if "optimizer" in line]
    assert len(said) == 1, lines
    assert f"--model {model}" in said[0] and "--optimizer-at server" in said[0]
    assert "--down-mode auto" in said[0]


def test_a_large_model_keeps_the_downlink_it_names_and_the_workers_optimizer_it_was_given(
        capsys: pytest.CaptureFixture[str]) -> None:
    run, args = configured("--model", "resnet18", "--down-mode", "auto")
    assert (run.optimizer_at, run.down_mode) == ("worker", "auto")
    run, args = configured("--model", "resnet18", "--optimizer-at", "worker")
    assert run.down_mode == "exact" and "--down-mode auto" in args.optimizer_note
    assert "--optimizer-at server" not in args.optimizer_note  # the place was given: not said


def test_an_explicit_place_is_kept_and_nothing_is_said(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    run, args = configured("--model", "resnet18", "--optimizer-at", "server")
    assert run.optimizer_at == "server" and run.down_mode == "auto"  # exact needs the workers'
    flags.say_default_budget(args)
    assert "optimizer" not in capsys.readouterr().err


@pytest.mark.parametrize("model", ["lenet5", "resnet9"])
def test_a_smaller_model_keeps_the_servers_optimizer(model: str) -> None:
    assert PARAM_COUNTS[model] < LARGE_MODEL_PARAMS
    run, args = configured("--model", model)
    assert run.optimizer_at == "server" and args.optimizer_note == ""
    assert configured("--model", model, "--optimizer-at", "worker")[0].down_mode == "auto"


def test_quiet_says_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    _, args = configured("--model", "vgg19", "--quiet")
    flags.say_default_budget(args)
    assert capsys.readouterr().err == ""
