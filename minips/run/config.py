"""Configuration: one dataclass per role, filled by the CLI, checked once in ``validate()``.

``RunConfig`` holds what every role of one training run must agree on (model, data, optimizer,
mode, compressor, budget). The global server owns it and sends it to every client in
WELCOME.info (``to_info`` / ``from_info``), so a worker or group server needs nothing but the
global server's address and the shared secret. The other dataclasses hold what is local to one
process (addresses, emulated slowness, files). Addresses, TLS and the bind check are in
endpoints.py, the named presets in flags.py (both re-exported here).

Invariants: ``validate()`` raises ``ConfigError`` naming the field; ``from_info(to_info(c)) == c``.
Units are in each field's comment; times are seconds, sizes bytes, rates bytes per second.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from minips.compress.base import Compressor
from minips.compress.registry import is_sparse, make_compressor
from minips.core.optim import SCHEDULES
from minips.core.sync import MODES, SyncPolicy, policy
from minips.errors import ConfigError

__all__ = [
    "RunConfig",
    "ServerConfig",
    "FieldError",
    "GroupConfig",
    "WorkerConfig",
    "LaunchConfig",
    "parse_slowdowns",
]


@dataclass
class RunConfig:
    """Settings shared by every role of one run; travels in WELCOME.info."""

    model: str = "lenet5"  # models.build_model name
    dataset: str = "fashion-mnist"  # data.load_dataset name
    data_dir: str | None = None  # directory of the data files; None = the loader's default
    batch_size: int = 64  # samples per worker step
    lr: float = 0.05  # SGD learning rate of one step over all workers' batches (see group.py)
    momentum: float = 0.9  # SGD momentum (group servers keep the velocity)
    weight_decay: float = 5e-4  # L2 coefficient added to the gradient
    lr_warmup: float = 0.3  # epochs (whole cluster) over which lr ramps up linearly; 0 = none
    lr_schedule: str = "constant"  # constant | cosine (to 0 over the epochs budget)
    mode: str = "gssp"  # bsp | ssp | asp | gssp
    staleness: int = 3  # SSP bound s in clocks (bsp forces 0, asp has none)
    groups: int = 0  # GSSP group count k; 0 = chosen from the gaps between step times
    max_groups: int = 4  # upper bound on k when it is chosen automatically
    sync_every: int = 4  # a group server exchanges with the global one every this many pushes
    merge: str = "mean"  # global adds each group delta / k ("mean", k = groups) or whole ("sum")
    compressor: str = "none"  # sparse.make_compressor name
    ratio: float = 0.01  # kept fraction of coordinates for sparse compressors (0..1]
    xchg_ratio: float | None = None  # group <-> global exchange kept fraction; None = auto
    # kept fraction of each publish of a group's weights to its workers (downlink.py); None: the
    # run's ratio with a sparse compressor, dense (1.0) with none / fp16; 1.0: dense
    down_ratio: float | None = None
    compressor_opts: dict[str, Any] = field(default_factory=dict)  # extra compressor kwargs
    gdtopk_alpha: float = 1.0  # exponent of the per-group ratio policy
    gdtopk_direction: str = "slower-more"  # slower groups upload more (released code's choice)
    seed: int = 0  # model init, data order, compressor sampling
    workers: int = 4  # number of workers the global server waits for before grouping
    base_step_s: float = 0.04  # emulated base step time; a step takes max(compute, F x this)
    calib_steps: int = 5  # steps timed before a worker reports its speed (the fastest counts)
    epochs: float = 0.0  # budget: epochs over the training set, all workers together; 0 = none
    wall_s: float = 0.0  # budget: seconds of training; 0 = none
    max_steps: int = 0  # per-worker cap on pushes; 0 = none (reference tests)
    eval_every_s: float = 5.0  # evaluator pull period
    eval_limit: int = 0  # test samples the evaluator uses; 0 = the whole test set
    lease_s: float = 10.0  # a peer silent this long is dropped (a worker: from its group's SSP)
    heartbeat_s: float = 2.0  # workers and group servers send HEARTBEAT this often (< lease)
    train_size: int = 0  # training samples, for the epoch budget; 0 = known from the data set
    t0: float = 0.0  # unix time the run started (set by the global server)

    def validate(self) -> RunConfig:
        """Check value ranges; return self so calls chain."""
        _check(self.mode in MODES, "mode", self.mode, f"one of {MODES}")
        _check(self.batch_size > 0, "batch_size", self.batch_size, "> 0")
        _check(0 < self.lr < math.inf, "lr", self.lr, "> 0 and finite")
        _check(self.lr_schedule in SCHEDULES, "lr_schedule", self.lr_schedule,
               f"one of {SCHEDULES}")
        _check(self.lr_schedule == "constant" or self.epochs > 0, "lr_schedule",
               self.lr_schedule, "constant unless there is an epochs budget (--epochs)")
        _check(0 <= self.momentum < 1, "momentum", self.momentum, "in [0, 1)")
        _check(self.staleness >= 0, "staleness", self.staleness, ">= 0")
        _check(self.groups >= 0, "groups", self.groups, ">= 0")
        _check(self.sync_every >= 1, "sync_every", self.sync_every, ">= 1")
        _check(self.merge in ("mean", "sum"), "merge", self.merge, "mean | sum")
        _check(0 < self.ratio <= 1, "ratio", self.ratio, "in (0, 1]")
        _check(self.xchg_ratio is None or 0 < self.xchg_ratio <= 1, "xchg_ratio",
               self.xchg_ratio, "in (0, 1] (or unset: automatic)")
        _check(self.down_ratio is None or 0 < self.down_ratio <= 1, "down_ratio",
               self.down_ratio, "in (0, 1]")
        _check(self.workers >= 1, "workers", self.workers, ">= 1")
        _check(self.groups <= self.workers, "groups", self.groups,
               f"at most the number of workers ({self.workers})")
        _check(self.eval_every_s > 0, "eval_every_s", self.eval_every_s, "> 0")
        for name in ("eval_limit", "max_steps", "lr_warmup", "weight_decay"):
            _check(getattr(self, name) >= 0, name, getattr(self, name), ">= 0")
        _check(self.gdtopk_direction in ("slower-more", "slower-less"), "gdtopk_direction",
               self.gdtopk_direction, "slower-more | slower-less")
        _check(self.base_step_s >= 0, "base_step_s", self.base_step_s, ">= 0")
        _check(self.epochs >= 0 and self.wall_s >= 0, "budget", (self.epochs, self.wall_s), ">= 0")
        _check(0 < 2 * self.heartbeat_s <= self.lease_s, "heartbeat_s", self.heartbeat_s,
               f"> 0 and at most half of lease_s = {self.lease_s}")
        return self

    @property
    def sync(self) -> SyncPolicy:
        """What this run's mode decides (``sync.POLICIES``)."""
        return policy(self.mode)

    @property
    def staleness_bound(self) -> int | None:
        """The SSP bound inside a group: 0 for BSP, None (unbounded) for ASP."""
        return self.sync.staleness_bound(self.staleness)

    @property
    def in_rounds(self) -> bool:
        """Pushes are applied per complete round (a bound of 0: BSP, or SSP with s = 0)."""
        return self.sync.in_rounds(self.staleness)

    def downlink_ratio(self) -> float:
        """The downlink's kept fraction: ``down_ratio``, or when None the run's ``ratio`` for
        a sparse compressor and 1.0 (dense) for a dense one (``none``, ``fp16``; its
        declared wire encoding, ``compress.is_sparse``)."""
        if self.down_ratio is not None:
            return self.down_ratio
        return self.ratio if is_sparse(self.compressor) else 1.0

    def worker_compressor(self, size: int, worker: int) -> Compressor:
        """The compressor worker ``worker`` builds for ``size`` coordinates (its seed:
        ``seed * 1000 + worker``); worker.py and the simulator both take it."""
        return make_compressor(self.compressor, size, ratio=self.ratio,
                               seed=self.seed * 1000 + worker, **self.compressor_opts)

    @property
    def fixed_groups(self) -> int:
        """Group count: 1 for the single-group modes, ``groups`` (0 = auto) for GSSP."""
        return self.sync.group_count(self.groups)

    def to_info(self) -> dict[str, Any]:
        """Plain map for WELCOME.info and config.json."""
        return dataclasses.asdict(self)

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> RunConfig:
        """Inverse of ``to_info``; unknown keys (from a newer server) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in info.items() if k in names})


@dataclass
class ServerConfig:
    """The global server process."""

    run: RunConfig = field(default_factory=RunConfig)  # the run it serves
    host: str = "127.0.0.1"  # listen address
    port: int = 7070  # listen port; 0 = any free port
    token: str = ""  # shared secret (MINIPS_TOKEN)
    tls_cert: str | None = None  # PEM certificate file; None = plain TCP
    tls_key: str | None = None  # PEM key file for tls_cert
    run_dir: str = "runs/server"  # where metrics, config.json and final weights go
    init_path: str | None = None  # .npy initial flat weights; None = take them from a worker
    external_groups: int = 0  # group servers expected as separate processes; 0 = in-process
    # host told to workers for in-process group servers (they listen on ``host``); None: the host
    # each worker reached this server at (ASSIGN carries ":port")
    advertise_host: str | None = None
    calib_timeout_s: float = 60.0  # group the workers that reported after this long
    ready_file: str | None = None  # write "host port" here once listening (launcher)
    linger_s: float = 15.0  # after the budget, wait this long for the final evaluator pull
    rejoin_wait_s: float = 120.0  # every worker gone with budget left: wait this long for them
    checkpoint_path: str | None = None  # checkpoint file; None = <run_dir>/checkpoint.npz
    checkpoint_every_s: float = 30.0  # seconds between checkpoints; 0 = none
    resume: bool = False  # start from checkpoint_path instead of init_path / a worker
    insecure: bool = False  # allow a non-loopback listen address without a secret
    dashboard: str = ""  # HOST:PORT of the live web dashboard and /metrics; "" = none
    tensorboard: str = ""  # directory for TensorBoard event files; "" = none


@dataclass
class GroupConfig:
    """A group server running as its own process (`minips group`)."""

    server_host: str = "127.0.0.1"  # global server address
    server_port: int = 7070  # global server port
    host: str = "127.0.0.1"  # listen address for this group's workers
    port: int = 7071  # listen port; 0 = any free port
    # host told to workers; None: ``host``, or, when that is a wildcard, the address the global
    # server sees this process connect from
    advertise_host: str | None = None
    token: str = ""  # shared secret (MINIPS_TOKEN)
    tls_cert: str | None = None  # PEM certificate to serve workers with
    tls_key: str | None = None  # key for tls_cert
    tls_ca: str | None = None  # CA file to verify the global server; None = plain TCP
    run_dir: str = "runs/group"  # metrics directory
    connect_timeout_s: float = 10.0  # give up on an unreachable global server after this
    reconnect_s: float = 120.0  # how long to keep trying when the global server is lost
    insecure: bool = False  # allow a non-loopback listen address without a secret


@dataclass
class WorkerConfig:
    """One worker (or evaluator) process."""

    server_host: str = "127.0.0.1"  # global server address
    server_port: int = 7070  # global server port
    token: str = ""  # shared secret (MINIPS_TOKEN)
    tls_ca: str | None = None  # CA file to verify servers with; None = plain TCP
    worker_id: int = -1  # requested id; -1 = the server picks the next free one
    slowdown: float = 1.0  # emulated factor F: a step takes at least F x base_step_s
    bandwidth_bps: float = 0.0  # paced uplink (sends) of the group connection, bytes/s; 0 = none
    bandwidth_down_bps: float = 0.0  # paced downlink (reads) of it, bytes/s; 0 = none
    latency_s: float = 0.0  # emulated one-way latency added to every send
    run_dir: str = "runs/worker"  # metrics directory
    data_dir: str | None = None  # overrides the run's data_dir on this machine
    torch_threads: int = 1  # intra-op threads; 1 keeps many workers off each other's cores
    device: str = "cpu"  # cpu | cuda | cuda:N | mps | auto (CUDA, MPS, CPU); CLI default: auto
    amp: bool = False  # mixed precision (autocast) where the device supports it
    compress_on_device: bool | None = None  # select with torch on the device; None: off the CPU
    connect_timeout_s: float = 10.0  # give up on an unreachable server after this
    reconnect_s: float = 120.0  # how long to keep trying when a server is lost mid-run


@dataclass
class LaunchConfig:
    """`minips local`: a whole cluster of processes on this machine."""

    run: RunConfig = field(default_factory=RunConfig)  # the run's settings
    slowdowns: list[float] = field(default_factory=list)  # factor F per worker; [] = all 1.0
    link: str = ""  # --link profile of the workers' links (links.py); "" = not limited
    link_shaping: str = "auto"  # auto | kernel (namespaces + tc) | pacer (token buckets)
    out_dir: str = "runs"  # parent of the run directory
    name: str | None = None  # run directory name; None = mode-compressor-time
    progress: bool = True  # draw the one-line progress display
    evaluator: bool = True  # start the evaluator process
    plot: bool = True  # draw the PNGs at the end
    timeout_s: float = 0.0  # hard stop of the whole cluster; 0 = budget + a margin
    grace_s: float = 5.0  # SIGTERM to SIGKILL delay when stopping children
    dashboard: str = ""  # HOST:PORT of the server's live dashboard; "" = none
    tensorboard: str = ""  # directory for the server's TensorBoard event files; "" = none
    devices: list[str] = field(default_factory=lambda: ["auto"])  # per worker; last repeats
    amp: bool = False  # workers use mixed precision where their device supports it

    def factors(self) -> list[float]:
        """Slowdown factor of each of the run's workers (missing ones are 1.0)."""
        given = list(self.slowdowns)[: self.run.workers]
        return given + [1.0] * (self.run.workers - len(given))

    def device(self, worker: int) -> str:
        """``--device`` of worker ``worker``: its entry in ``devices``, else the last one."""
        return self.devices[min(worker, len(self.devices) - 1)] if self.devices else "auto"


def parse_slowdowns(text: str) -> list[float]:
    """'1,1,2x2,4' → [1, 1, 2, 2, 4]; 'FxN' repeats F N times."""
    out: list[float] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        factor, _, count = part.partition("x")
        try:
            out += [float(factor)] * int(count or 1)
        except ValueError:
            raise ConfigError(f"bad slowdown {part!r}, expected F or FxN") from None
    if any(f <= 0 for f in out):
        raise ConfigError(f"slowdown factors must be > 0, got {out}")
    return out


class FieldError(ConfigError):
    """A RunConfig field out of range (the CLI names the field's flag instead of the field)."""

    def __init__(self, name: str, got: Any, expected: str) -> None:
        super().__init__(f"config field {name} = {got!r}, expected {expected}")
        self.name, self.got, self.expected = name, got, expected


def _check(ok: bool, name: str, got: Any, expected: str) -> None:
    if not ok:
        raise FieldError(name, got, expected)
