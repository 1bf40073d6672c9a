"""`minips ray` flags: every option has help, placements parse, bad ones are one-line errors.
Needs no Ray: the parser and the placement parsing never import it."""

from __future__ import annotations

import pytest

from minips.errors import ConfigError
from minips.run import cli, flags
from minips.run.flags import ROLES
from minips.run.ray_cluster import Placement, parse_placement


def test_every_ray_option_has_help_with_its_default():
    parser = flags.build_parser()
    ray_parser = parser._subparsers._group_actions[0].choices["ray"]  # type: ignore[union-attr]
    text = ray_parser.format_help()
    for action in ray_parser._actions:
        assert action.help, action.option_strings
    for role in ROLES:
        assert f"--{role}-resources" in text and f"--{role}-labels" in text
    assert "(default 3)" in text and "(default 7070)" in text  # --max-restarts, --port


def test_placement_maps_cpu_and_gpu_to_rays_keywords():
    p = parse_placement("jetson=1,GPU=1,CPU=2", "site=lab2,zone=a")
    assert p == Placement({"jetson": 1.0, "GPU": 1.0, "CPU": 2.0}, {"site": "lab2", "zone": "a"})
    assert p.options() == {"num_cpus": 2.0, "num_gpus": 1.0, "resources": {"jetson": 1.0},
                           "label_selector": {"site": "lab2", "zone": "a"}}
    assert parse_placement("").options() == {"num_cpus": 0, "num_gpus": 0}


@pytest.mark.parametrize("resources, labels", [("jetson", ""), ("jetson=x", ""),
                                               ("=1", ""), ("jetson=-1", ""), ("", "site")])
def test_bad_placements_are_refused(resources, labels):
    with pytest.raises(ConfigError):
        parse_placement(resources, labels)


def test_bad_placement_on_the_command_line_is_a_one_line_error(capsys):
    assert cli.main(["ray", "--worker-resources", "jetson", "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "NAME=AMOUNT" in err


def test_local_steps_reach_the_ray_servers_run_config():
    """`minips ray --local-steps auto --outer-optimizer nesterov`: the run config every actor
    gets (the server's --run-config file, then WELCOME) carries them."""
    from minips.core.config import RunConfig

    args = flags.build_parser().parse_args(
        ["ray", "--optimizer-at", "worker", "--local-steps", "auto", "--local-steps-max", "6",
         "--outer-optimizer", "nesterov", "--outer-lr", "0.7"])
    run = flags.run_config_from_args(args)
    again = RunConfig.from_info(run.to_info())  # what run.json and WELCOME carry
    assert (again.local_steps, again.local_steps_max, again.outer_optimizer, again.outer_lr) \
        == (0, 6, "nesterov", 0.7)
    assert again.local_steps_auto
