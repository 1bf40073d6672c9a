"""`minips ray` flags: every option has help, placements parse, bad ones are one-line errors;
what the actors ask for against what the nodes have (``unplaceable``, ``share_cpus``), and a local
instance too small refused in one line. Starts no Ray instance (ray_cluster.py imports ray)."""

from __future__ import annotations

import pytest

from minips.core.config import RunConfig
from minips.errors import ConfigError
from minips.run import cli, flags
from minips.run.flags import ROLES
from minips.run.ray_cluster import (
    Placement,
    RayConfig,
    parse_placement,
    share_cpus,
    unplaceable,
)


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


# -- what the actors ask for against what the nodes have (no Ray started) ----------------------

def _nodes(*cpus: float, **extra: float) -> list[dict]:
    """Nodes of ``cpus`` CPUs each; ``extra`` custom resources on the first one."""
    return [{"resources": {"CPU": c, **(extra if i == 0 else {})}, "labels": {"zone": "a"}}
            for i, c in enumerate(cpus)]


def _cfg(n: int, resources: str = "CPU=1", **kw) -> RayConfig:
    kw.setdefault("workers", parse_placement(resources))
    return RayConfig(run=RunConfig(workers=n), **kw)


def test_three_workers_asking_a_cpu_each_on_two_cpus_are_refused_in_one_sentence():
    assert unplaceable(_cfg(3), _nodes(2)) == [
        "3 workers ask CPU=1 each; the cluster has 2 CPUs: give --worker-resources CPU=0.66 "
        "or add nodes"]
    assert unplaceable(_cfg(2), _nodes(2)) == []  # they fit
    assert unplaceable(_cfg(3, "jetson=1"), _nodes(4)) == [
        "3 workers ask jetson=1 each; the cluster has no jetson: add a node with jetson or "
        "change --worker-resources"]
    assert unplaceable(_cfg(3, "jetson=1"), _nodes(4, jetson=2))[0].startswith(
        "3 workers ask jetson=1 each; the cluster has 2 jetson: give --worker-resources "
        "jetson=0.66")


def test_what_one_node_cannot_hold_and_what_the_roles_ask_together_are_refused():
    assert unplaceable(_cfg(1, "CPU=2"), _nodes(1, 1)) == [
        "a worker asks CPU=2; no node has that much of all of it at once: change "
        "--worker-resources"]
    both = _cfg(2, server=parse_placement("CPU=1"))
    assert unplaceable(both, _nodes(2)) == [
        "the roles ask CPU=3 in all (server 1, 2 workers 1 each); the cluster has 2 CPUs: "
        "lower their --*-resources or add nodes"]
    labelled = _cfg(1, workers=parse_placement("CPU=1", "zone=b"))
    assert unplaceable(labelled, _nodes(2)) == [
        "the worker asks for a node labelled zone=b; no node has those labels"]


def test_workers_given_no_resources_share_a_local_instances_cpus():
    """3 workers on 2 CPUs: 0.66 each, and then everything fits; what the other roles ask
    comes off first; workers given resources keep them."""
    for workers, server_cpu, share in ((3, 0, 0.66), (1, 0, 1.0), (3, 1, 0.33), (8, 0, 0.25)):
        cfg = _cfg(workers, share_cpus=True, server=parse_placement(f"CPU={server_cpu}"))
        share_cpus(cfg, _nodes(2))
        assert cfg.workers.resources == {"CPU": share}
        assert unplaceable(cfg, _nodes(2)) == []
    given = _cfg(3, share_cpus=False)
    share_cpus(given, _nodes(2))
    assert given.workers.resources == {"CPU": 1.0}


def test_the_flags_share_cpus_only_when_no_worker_resources_are_given(monkeypatch):
    seen = {}
    monkeypatch.setattr("minips.run.ray_cluster.run_ray",
                        lambda cfg: seen.setdefault("cfg", cfg) and {"status": "done"})
    for argv, share, res in ((["ray"], True, {"CPU": 1.0}),
                             (["ray", "--worker-resources", "CPU=1"], False, {"CPU": 1.0}),
                             (["ray", "--worker-resources", ""], False, {})):
        seen.clear()
        assert cli.main([*argv, "--workers", "3"]) == 0
        assert (seen["cfg"].share_cpus, seen["cfg"].workers.resources) == (share, res)


def test_a_local_instance_too_small_is_refused_in_one_line_before_ray_starts(
        monkeypatch, capsys, tmp_path):
    """`minips ray --workers 3 --worker-resources CPU=1` on a 2-CPU machine: one line, exit 2,
    no Ray instance started, no run directory, within a second or two."""
    import time

    import ray

    from minips.run import ray_cluster

    monkeypatch.setattr(ray_cluster.os, "cpu_count", lambda: 2)
    inits = []
    monkeypatch.setattr(ray_cluster.ray, "init", lambda *a, **kw: inits.append(kw))
    t0 = time.monotonic()
    code = cli.main(["ray", "--workers", "3", "--max-steps", "100", "--worker-resources", "CPU=1",
                     "--out", str(tmp_path / "runs")])
    assert (code, inits, ray.is_initialized()) == (2, [], False)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["minips ray: error: 3 workers ask CPU=1 each; the cluster has 2 CPUs: give "
                   "--worker-resources CPU=0.66 or add nodes"]
    assert not (tmp_path / "runs").exists() and time.monotonic() - t0 < 5
