"""`minips ray` on a local multi-node Ray cluster (ray.cluster_utils.Cluster): two simulated nodes,
a head with the custom resource ``minips_server`` and a node with ``jetson``. A short run
finishes, the global server lands on the head and the workers on the jetson node, and a worker
actor that is killed is restarted by Ray and rejoins the run. Runs only where the ``ray`` extra
is installed (`make test` installs it). Every Ray process and every role's process ends with the
test, also when it fails.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed: pip install 'minips[ray]'")

from ray.cluster_utils import Cluster  # noqa: E402

from minips.core.config import RunConfig  # noqa: E402
from minips.run.ray_cluster import (  # noqa: E402
    RayConfig,
    collect,
    free_port,
    parse_placement,
    start_roles,
    stop_roles,
    wait_server,
)

WALL_S = 30.0  # training seconds: long enough for a killed worker to come back
DEADLINE_S = 120.0  # for each wait below


@pytest.fixture
def cluster() -> Iterator[dict[str, str]]:
    """Two nodes; yields resource name -> node id. Ray is shut down whatever happens."""
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"minips_server": 1}, "include_dashboard": False})
    try:
        c.add_node(num_cpus=2, resources={"jetson": 2})
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes()
        yield {r: n["NodeID"] for n in ray.nodes() if n["Alive"]
               for r in ("minips_server", "jetson") if r in n["Resources"]}
    finally:
        ray.shutdown()
        c.shutdown()


def _pushes(actor: Any, name: str) -> list[dict[str, Any]]:
    """The step records in a role's metrics file, read through its actor."""
    data = ray.get(actor.collect.remote()).get(f"{name}.jsonl", b"")
    return [r for r in map(json.loads, data.decode().splitlines())
            if "step_time" in r and "event" not in r]


def _wait_for(what: str, check: Any) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.5)
    raise AssertionError(f"{what} within {DEADLINE_S} s")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # a zombie has ended too


def test_ray_run_places_roles_and_restarts_a_killed_worker(
        cluster: dict[str, str], tmp_path: Path) -> None:
    t0 = time.monotonic()
    run = RunConfig(model="lenet5", dataset="fashion-mnist", mode="asp", workers=2,
                    wall_s=WALL_S, lease_s=6.0, heartbeat_s=1.0, eval_limit=500)
    cfg = RayConfig(run=run, server_port=free_port(), evaluate=False, max_restarts=2,
                    server=parse_placement("minips_server=1"),
                    workers=parse_placement("jetson=1"), checkpoint_every_s=5.0,
                    out_dir=str(tmp_path))
    roles: dict[str, Any] = {}
    run_id = "test-" + secrets.token_hex(3)
    try:
        roles = start_roles(cfg, run_id, secrets.token_hex(16))
        where = {n: ray.get(a.where.remote()) for n, a in roles.items()}
        assert where["server"]["node_id"] == cluster["minips_server"]
        assert {where[f"worker-{i}"]["node_id"] for i in range(2)} == {cluster["jetson"]}

        victim = roles["worker-0"]
        _wait_for("worker 0 pushing", lambda: _pushes(victim, "worker-0"))
        ray.kill(victim, no_restart=False)  # the actor and, with it, its worker process die
        again = _wait_for("worker 0's actor restarted", lambda: _restarted(victim))
        assert again["restarted"] and again["pid"] != where["worker-0"]["pid"]
        assert _gone(where["worker-0"]["pid"])
        before = len(_pushes(victim, "worker-0"))
        _wait_for("the restarted worker 0 pushing", lambda: len(_pushes(victim, "worker-0"))
                  > before)

        assert wait_server(roles, WALL_S + DEADLINE_S) == 0  # the run finished its budget
        assert collect(roles, tmp_path) == []  # every role ended cleanly
        assert (tmp_path / "global.jsonl").exists() and (tmp_path / "logs").is_dir()
        pids = [ray.get(a.where.remote())["pid"] for a in roles.values()]
    finally:
        stop_roles(roles)
        shutil.rmtree(Path(tempfile.gettempdir()) / "minips-ray" / run_id, ignore_errors=True)
    assert all(_gone(p) for p in pids)
    print(f"ray test wall time {time.monotonic() - t0:.1f} s (after Ray start-up)")


def _restarted(actor: Any) -> dict[str, Any] | None:
    try:
        info = ray.get(actor.where.remote(), timeout=5)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
        return None
    return info if info["restarted"] else None
