"""The rules without IO (group_core.py, global_core.py): no asyncio, socket, ssl, time or torch;
driven in one thread with a fake clock they are synchronous SGD in BSP, and they reach the same
weights and answers as the asyncio group server for the same order of events."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

from minips import optim, protocol, sparse
from minips.config import RunConfig
from minips.group import GroupServer
from minips.group_core import GroupCore

N = 500


class NoLink:
    """The core never calls its link (the shell exchanges); a GroupLink that says so."""

    async def exchange(self, group: int, delta: Any, stats: dict[str, Any]) -> Any:
        raise AssertionError("the core does not exchange")


def push(clock: int, grad: np.ndarray | sparse.SparseGrad, samples: int = 8) -> protocol.Push:
    enc, codec, bufs = sparse.encode_gradient(grad)
    return protocol.Push(clock=clock, samples=samples, encoding=enc, codec=codec,
                         buffers=tuple(bufs))


def drive(core: GroupCore, rounds: int, seed: int) -> list[protocol.Weights]:
    """Two workers in lock step: each pulls (the version it holds) and pushes; returns every
    answer in order."""
    rng = np.random.default_rng(seed)
    held = {0: -1, 1: -1}
    answers = []
    for r in range(rounds):
        for w in (0, 1):
            assert core.may_answer(w)
            core.publish()
            msg = core.weights_message(w, [], held[w])
            held[w] = msg.version
            answers.append(msg)
        for w in (0, 1):
            idx = np.sort(rng.choice(N, 10, replace=False)).astype(np.uint32)
            grad = sparse.SparseGrad(idx, rng.standard_normal(10).astype(np.float32), N)
            core.on_push(w, push(r + 1, grad))
    return answers


def run(mode: str, compressor: str = "none") -> RunConfig:
    return RunConfig(workers=2, mode=mode, compressor=compressor, ratio=0.02, lr=0.1,
                     momentum=0.9, weight_decay=5e-4, lr_warmup=0, sync_every=10_000)


def test_the_cores_import_no_asyncio_socket_ssl_time_or_torch() -> None:
    """A fresh interpreter that refuses those imports to minips drives a cluster in one thread
    with a fake clock: a global core and two group cores of two workers each, exchanging."""
    script = textwrap.dedent("""
        import sys
        import numpy as np  # allowed, and it loads time (datetime) for itself
        BLOCKED = {"asyncio", "socket", "_socket", "ssl", "selectors", "time", "torch"}
        for name in list(sys.modules):
            if name.split(".")[0] in BLOCKED:
                del sys.modules[name]

        class Block:
            \"\"\"Refuses those modules to minips' own imports; the stdlib may load them.\"\"\"
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    f = sys._getframe(1)
                    while f is not None and "importlib" in f.f_globals.get("__name__", ""):
                        f = f.f_back
                    importer = "" if f is None else f.f_globals.get("__name__", "")
                    if importer.startswith("minips"):
                        raise ImportError(f"{importer} imported {name}")
                    if name.split(".")[0] in {"asyncio", "torch"}:  # not even through the stdlib
                        raise ImportError(f"{importer} imported {name}")
                return None

        sys.meta_path.insert(0, Block())
        from minips import protocol, sparse
        from minips.config import RunConfig
        from minips.global_core import GlobalCore
        from minips.group_core import GroupCore
        from minips.roster import GroupHandle

        t = [0.0]
        run = RunConfig(workers=4, mode="gssp", groups=2, lr=0.1, lr_warmup=0, sync_every=4)
        glob = GlobalCore(run, np.zeros(100, np.float32), regroup=False,
                          clock=lambda: t[0], wall=lambda: 1e9 + t[0])
        cores = {}
        for g in (0, 1):
            glob.groups[g] = GroupHandle(g, "")
            cores[g] = GroupCore(g, run, glob.weights, object(), members=[2 * g, 2 * g + 1],
                                 clock=lambda: t[0])
        for r in range(20):
            for g, core in cores.items():
                for w in (2 * g, 2 * g + 1):
                    t[0] += 0.1
                    enc, codec, bufs = sparse.encode_gradient(np.ones(100, np.float32))
                    core.on_push(w, protocol.Push(clock=r + 1, samples=8, encoding=enc,
                                                  codec=codec, buffers=tuple(bufs)))
                if core.run.sync.exchange_due(core.xchg.since["pushes"], run.sync_every):
                    out = core.begin_exchange()
                    res = glob.merge_counted(g, core.xchg.delta(out), out.stats)
                    core.exchanged(out, res, 0.0)
        print(glob.version, glob.samples, float(glob.weights[0]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    merges, samples, first = out.stdout.split()
    # 2 groups x 2 workers x 20 steps = 80 pushes of 8 samples, an exchange every 4 pushes
    assert (int(merges), int(samples)) == (20, 640) and float(first) < 0  # against the gradient


def test_two_workers_in_bsp_are_synchronous_sgd_on_the_core() -> None:
    core = GroupCore(0, run("bsp"), np.zeros(N, np.float32), NoLink(), members=[0, 1],
                     clock=lambda: 0.0)
    drive(core, 30, seed=1)
    ref_w, opt = np.zeros(N, np.float32), optim.SGD(N, lr=0.1, momentum=0.9, weight_decay=5e-4)
    rng = np.random.default_rng(1)
    for _ in range(30):
        grads = []
        for _ in (0, 1):
            idx = np.sort(rng.choice(N, 10, replace=False)).astype(np.uint32)
            grads.append(sparse.SparseGrad(idx, rng.standard_normal(10).astype(np.float32), N))
        opt.step(ref_w, (grads[0].to_dense() + grads[1].to_dense()) / np.float32(2))  # the mean
    assert core.version == 30
    np.testing.assert_allclose(core.weights, ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode,compressor", [("bsp", "none"), ("ssp", "none"),
                                             ("gssp", "topk")])
async def test_the_asyncio_server_answers_as_the_core_does(mode: str, compressor: str) -> None:
    """Same events in the same order: the same weights, versions and answers, bit for bit
    (with topk, the compressed downlink's sparse answers too)."""
    core = GroupCore(0, run(mode, compressor), np.zeros(N, np.float32), NoLink(),
                     members=[0, 1], clock=lambda: 0.0)
    server = GroupServer(0, run(mode, compressor), np.zeros(N, np.float32), NoLink(),
                         members=[0, 1], clock=lambda: 0.0)
    try:
        a, b = drive(core, 12, seed=2), drive(server, 12, seed=2)
        assert np.array_equal(core.weights, server.weights) and core.version == server.version
        for x, y in zip(a, b, strict=True):
            assert (x.version, x.since, x.encoding) == (y.version, y.since, y.encoding)
            assert all(bytes(p) == bytes(q) for p, q in zip(x.buffers, y.buffers, strict=True))
        assert compressor == "none" or any(x.since >= 0 for x in a)  # updates, not only dense
    finally:
        await server.close()
