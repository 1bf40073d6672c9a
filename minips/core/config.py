"""A run's rules as data: the synchronization modes, the run's configuration, the models and
data sets it names (no IO, no torch).

The file holds, in order:

- The modes as one table. A mode is a ``SyncPolicy``; the servers ask it rather than compare
  mode names, so a new mode is one row of ``POLICIES`` (and its tests):

  | mode | bound in a group | a push is applied | groups | regrouping |
  |---|---|---|---|---|
  | bsp  | 0 | with its round: one step on the round's mean | 1 | no |
  | ssp  | ``--staleness`` s | on arrival, 1/(workers) of a step | 1 | no |
  | asp  | none | on arrival, 1/(workers) of a step | 1 | no |
  | gssp | ``--staleness`` s | on arrival, 1/(group's workers) of a step | k (``--groups``) | yes |
  | lbbsp | 0 | with its round: one step on the round's sample-weighted mean | 1 | no |

  LB-BSP (``balanced``) is BSP whose workers' batch sizes follow their speeds, the same total
  samples per round (``core/balance.py``: every ``balance_every`` rounds, from a moving average of
  each worker's seconds per sample), so a round takes about as long on every worker. GSSP
  regroups only with ``regroup`` on (``--regroup off`` keeps the first groups).

  Every mode exchanges with the global server every ``sync_every`` pushes of a group
  (``exchange_due``) and merges a group's delta by ``--merge`` (``merge_scale``: mean over
  groups or sum; with one group the two are the same). A bound of 0 (BSP, or SSP with
  ``--staleness 0``) applies pushes in rounds: one SGD step on the mean of a round's gradients,
  which is synchronous SGD (``reference.train``).
- The model table: the models minips knows by name (``MODEL_NAMES``), the length of each one's
  flat weight vector (``PARAM_COUNTS``), each one's default data set, and the training set sizes
  of the known data sets (``TRAIN_SIZES``). ``ml/models.py`` builds the models with torch; the
  servers and the command line, which never import torch, check a ``--model`` name and the size
  of an ``--init`` file against this table.
- ``RunConfig``: what every role of one training run must agree on (model, data, optimizer,
  mode, compressor, budget). The global server owns it and sends it to every client in
  WELCOME.info (``to_info`` / ``from_info``), so a worker or group server needs nothing but the
  global server's address and the shared secret. The compressor plug-ins it names are looked up
  when a run is set up (``downlink_ratio``, ``worker_compressor``), not when the rules load.
  ``optimizer_at`` says where SGD runs: on the group servers (``server``, the default: workers
  push gradients) or on the workers (``worker``: each keeps its velocity and pushes the update
  it would apply, ``core/worker_opt.py``; DGC's momentum correction, clipping and masking). A
  run that names no place and trains a model of ``LARGE_MODEL_PARAMS`` or more gets the
  workers', and then the exact downlink unless it names a ``down_mode`` (``place_optimizer``,
  called by the command line, which says so).
  With it there, ``local_steps`` H lets a worker run H steps on its local weights per push and
  ``outer_optimizer`` says how its group server applies what arrives (``core/local_steps.py``).
- ``FieldError``, and ``WorkerConfig``: what is local to a worker process (addresses, emulated
  slowness, files); it lives here, not in worker.py, so that `minips server` can build it
  without torch. The other roles' configs live with their role (``server.ServerConfig``,
  ``group_process.GroupConfig``, ``launch.LaunchConfig``).

Addresses, TLS and the bind check are in net/endpoints.py, the named presets in run/flags.py;
this module imports neither (the rules never import the launcher, the CLI or net/).

Invariants:
- ``PARAM_COUNTS[name] == models.param_count(name)`` for every name (tests/test_models.py).
- ``validate()`` raises ``ConfigError`` (a ``FieldError``) naming the field;
  ``from_info(to_info(c)) == c``.
- Units are in each field's comment; times are seconds, sizes bytes, rates bytes per second.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from minips.core.optim import SCHEDULES
from minips.errors import ConfigError

if TYPE_CHECKING:
    from minips.compress.base import Compressor

__all__ = [
    "MODES",
    "POLICIES",
    "SyncPolicy",
    "policy",
    "MODEL_NAMES",
    "PARAM_COUNTS",
    "DEFAULT_DATASET",
    "TRAIN_SIZES",
    "dataset_train_size",
    "OPTIMIZER_PLACES",
    "LARGE_MODEL_PARAMS",
    "place_optimizer",
    "OUTER_OPTIMIZERS",
    "XCHG_MODES",
    "RunConfig",
    "FieldError",
    "WorkerConfig",
]


# -- the modes as one table ------------------------------------------------------------------------

@dataclass(frozen=True)
class SyncPolicy:
    """One synchronization mode: its row of ``POLICIES``."""

    name: str
    bound: str  # "zero", "staleness" (the run's s) or "none" (unbounded)
    grouped: bool  # workers are split into speed groups (k of them); else one group of all
    regroup: bool  # groups are recomputed when the workers' speeds drift
    balanced: bool = False  # batch per worker proportional to its speed (LB-BSP, balance.py)

    def staleness_bound(self, staleness: int) -> int | None:
        """The SSP bound inside a group: 0, the run's ``staleness``, or None (no bound)."""
        return {"zero": 0, "none": None}.get(self.bound, staleness)

    def in_rounds(self, staleness: int) -> bool:
        """Pushes wait for their round and apply as one step (a bound of 0)."""
        return self.staleness_bound(staleness) == 0

    def group_count(self, groups: int) -> int:
        """Groups of a run: ``groups`` (0 = chosen from the step times) or 1."""
        return groups if self.grouped else 1

    def exchange_due(self, pushes: int, sync_every: int) -> bool:
        """A group exchanges with the global server after ``sync_every`` pushes (every mode)."""
        return pushes >= sync_every

    def merge_scale(self, merge: str, groups: int) -> float:
        """The factor a group's delta is added to the global weights with: 1/k for ``mean``
        over k > 1 groups, else 1 (``sum``, or one group: the delta is the whole update)."""
        return 1.0 / groups if merge == "mean" and groups > 1 else 1.0


POLICIES: dict[str, SyncPolicy] = {p.name: p for p in (
    SyncPolicy("bsp", bound="zero", grouped=False, regroup=False),
    SyncPolicy("ssp", bound="staleness", grouped=False, regroup=False),
    SyncPolicy("asp", bound="none", grouped=False, regroup=False),
    SyncPolicy("gssp", bound="staleness", grouped=True, regroup=True),
    SyncPolicy("lbbsp", bound="zero", grouped=False, regroup=False, balanced=True),
)}
MODES = tuple(POLICIES)  # ("bsp", "ssp", "asp", "gssp", "lbbsp")


def policy(mode: str) -> SyncPolicy:
    """The policy of ``mode``; ValueError names the modes there are."""
    try:
        return POLICIES[mode]
    except KeyError:
        raise ValueError(f"unknown mode {mode!r}: one of {MODES}") from None


# -- the models and data sets minips knows ---------------------------------------------------------

MODEL_NAMES = ("lenet5", "resnet18", "vgg19", "resnet9", "seq2seq")
PARAM_COUNTS = {"lenet5": 61_706, "resnet18": 11_173_962, "vgg19": 20_040_522,
                "resnet9": 6_573_120, "seq2seq": 109_499}  # float32 elements of the flat vector
DEFAULT_DATASET = {"lenet5": "fashion-mnist", "resnet18": "cifar10", "vgg19": "cifar10",
                   "resnet9": "cifar10", "seq2seq": "translation"}


# Training set sizes of the known data sets (samples), for the epoch budget on the server,
# which never loads data. A data set not listed here needs RunConfig.train_size. "synthetic" is
# data.py's stand-in (10,000 training images, data._SYNTH_SIZES), not a copy of a real set's size.
TRAIN_SIZES = {"fashion-mnist": 60000, "mnist": 60000, "cifar10": 50000, "synthetic": 10000}


def dataset_train_size(name: str, override: int = 0) -> int:
    """Samples in the training split of ``name`` (``override`` wins when > 0)."""
    if override > 0:
        return override
    if name not in TRAIN_SIZES:
        raise ConfigError(f"unknown training set size of {name!r}; set train_size")
    return TRAIN_SIZES[name]


# Where SGD (momentum, weight decay, the lr schedule) runs; RunConfig.optimizer_at.
OPTIMIZER_PLACES = ("server", "worker")
# From this many parameters (ResNet-18's 11.2M, VGG-19's 20M) a run that names no place for the
# optimizer gets the workers' (``place_optimizer``): on the servers momentum and weight
# decay make every push a few dense passes over all the weights (~13 ms for ResNet-18, one core),
# which caps a group server near 75 pushes/s whatever was pushed (docs/performance.md).
LARGE_MODEL_PARAMS = 10_000_000


def place_optimizer(values: dict[str, Any]) -> str:
    """Where the optimizer of a run given as RunConfig ``values`` goes when they name no place,
    and how its PULLs are answered when they name no ``down_mode``: for a model of
    ``LARGE_MODEL_PARAMS`` or more the workers' optimizer, and with it the exact downlink (O(the
    changes) a PULL, no published copy; on ResNet-18 it carried 1.5x the pushes of the compressed
    one with in-process groups and 3.3x with group processes, docs/performance.md), else
    RunConfig's defaults. Returns the console
    line that says what was chosen and why ("" when nothing was)."""
    model = str(values.get("model", RunConfig.model))
    size = PARAM_COUNTS.get(model, 0)
    if size < LARGE_MODEL_PARAMS:
        return ""
    said = []
    if "optimizer_at" not in values:
        values["optimizer_at"] = "worker"
        said.append(f"--model {model} has {size / 1e6:.1f}M parameters: the optimizer runs on "
                    "the workers (--optimizer-at worker), since on the servers every push would "
                    "take dense passes over all of them; --optimizer-at server keeps it there")
    if values["optimizer_at"] == "worker" and "down_mode" not in values:
        values["down_mode"] = "exact"
        said.append("PULLs get the exact downlink (--down-mode exact: the entries changed since "
                    "the worker's version, O(changes) for the server); --down-mode auto keeps "
                    "the compressed one")
    return "; ".join(said)


# How a group server applies the updates workers push (optimizer_at worker): avg (outer SGD at
# outer_lr, 1: as pushed) or nesterov (DiLoCo's outer Nesterov momentum); core/local_steps.py.
OUTER_OPTIMIZERS = ("avg", "nesterov")

# How a group and the global server exchange; RunConfig.xchg_mode: the top-k both ways
# (exchange.py), or every change both ways (exact_exchange.py).
XCHG_MODES = ("topk", "exact")


# -- the configuration of a run and of one worker --------------------------------------------------

@dataclass
class RunConfig:
    """Settings shared by every role of one run; travels in WELCOME.info."""

    model: str = "lenet5"  # models.build_model name
    dataset: str = "fashion-mnist"  # data.load_dataset name
    data_dir: str | None = None  # directory of the data files; None = the loader's default
    batch_size: int = 64  # samples per worker step
    lr: float = 0.05  # SGD learning rate of one step over all workers' batches (see group.py)
    momentum: float = 0.9  # SGD momentum (kept where the optimizer lives: optimizer_at)
    weight_decay: float = 5e-4  # L2 coefficient added to the gradient
    # where SGD runs: "server" (group servers keep the velocity, workers push gradients) or
    # "worker" (each worker keeps its own velocity and pushes its update; core/worker_opt.py)
    optimizer_at: str = "server"
    grad_clip: float = 0.0  # local clipping (optimizer_at worker): max |g|_2 x sqrt(workers); 0 off
    momentum_masking: bool = False  # clear a worker's velocity where its push sent (worker only)
    # local steps (optimizer_at worker; core/local_steps.py): a worker runs H optimizer steps on
    # its local weights, then pushes their summed change; 1: a push every step; 0: auto (per group
    # from its speed, at most local_steps_max)
    local_steps: int = 1
    local_steps_max: int = 8  # H of the fastest group with local_steps 0 (auto)
    outer_optimizer: str = "avg"  # how a group server applies pushed updates: avg | nesterov
    outer_lr: float = 1.0  # outer step size (optimizer_at worker); 1 with avg: as pushed
    outer_momentum: float = 0.9  # Nesterov momentum of the outer step (outer_optimizer nesterov)
    lr_warmup: float = 0.3  # epochs (whole cluster) over which lr ramps up linearly; 0 = none
    lr_schedule: str = "constant"  # constant | cosine (to 0 over the epochs budget)
    mode: str = "gssp"  # bsp | ssp | asp | gssp | lbbsp
    staleness: int = 3  # SSP bound s in clocks (bsp forces 0, asp has none)
    groups: int = 0  # GSSP group count k; 0 = chosen from the gaps between step times
    max_groups: int = 4  # upper bound on k when it is chosen automatically
    regroup: bool = True  # GSSP: regroup when the speeds drift; False: the first groups stay
    balance_every: int = 5  # LB-BSP: rounds between two re-balancings of the batch sizes
    sync_every: int = 4  # a group server exchanges with the global one every this many pushes
    merge: str = "mean"  # global adds each group delta / k ("mean", k = groups) or whole ("sum")
    # a group server's momentum (optimizer on the servers): "group" decays it per push of the
    # group (k groups at one pace then carry k times the momentum of one group); "cluster" per
    # push of the whole cluster (m^(1/share) and lr to match, GroupCore._cluster_momentum in
    # core/group_core.py): about half of dense GSSP's loss behind links back, 0.2-1.3 point
    # lost per seed where the groups' speeds differ (docs/results.md)
    group_momentum: str = "group"
    compressor: str = "none"  # registry.make_compressor name
    ratio: float = 0.01  # kept fraction of coordinates for sparse compressors (0..1]
    # group <-> global exchange kept fraction; None: as down_ratio's (``kept_or_default``)
    xchg_ratio: float | None = None
    # the group <-> global exchange (XCHG_MODES): "topk" the top xchg_ratio both ways, the rest
    # left for later (exchange.py); "exact" every entry changed since the last one, both ways,
    # O(changes) (exact_exchange.py)
    xchg_mode: str = "topk"
    # kept fraction of each publish of a group's weights to its workers (downlink.py); None: the
    # run's ratio with a sparse compressor, dense (1.0) with none / fp16 (``kept_or_default``)
    down_ratio: float | None = None
    down_values: str = "f32"  # "f16": a downlink update's values go as float16, 2 bytes each
    down_drift: float = 0.01  # bound on ||weights - published|| / ||weights|| (downlink.py)
    # PULL answers (downlink.py): "auto" compressed when down_ratio (as resolved) < 1, else
    # dense; "exact": the entries changed since the worker's version, at their values
    down_mode: str = "auto"
    # pushes between two publishes of a group's weights to its workers: 0 = one a round of the
    # group's live members (each pull then brings about one publish), 1 = one every turn that
    # answers PULLs; a publish comes sooner whenever the drift bound would be passed
    publish_every: int = 0
    compressor_opts: dict[str, Any] = field(default_factory=dict)  # extra compressor kwargs
    gdtopk_alpha: float = 1.0  # exponent of the per-group ratio policy
    gdtopk_direction: str = "slower-more"  # slower groups upload more (released code's choice)
    seed: int = 0  # model init, data order, compressor sampling
    workers: int = 4  # number of workers the global server waits for before grouping
    base_step_s: float = 0.04  # emulated base step time; a step takes max(compute, F x this)
    calib_steps: int = 5  # steps timed at least before a worker reports its speed (worker.py)
    epochs: float = 0.0  # budget: epochs over the training set, all workers together; 0 = none
    wall_s: float = 0.0  # budget: seconds of training; 0 = none
    max_steps: int = 0  # per-worker cap on pushes; 0 = none (reference tests)
    eval_every_s: float = 5.0  # evaluator pull period
    eval_limit: int = 0  # test samples the evaluator uses; 0 = the whole test set
    lease_s: float = 10.0  # a peer silent this long is dropped (a worker: from its group's SSP)
    heartbeat_s: float = 2.0  # workers and group servers send HEARTBEAT this often (< lease)
    train_size: int = 0  # training samples, for the epoch budget; 0 = known from the data set
    # training samples held out for validation (data.validation_split): no worker trains on
    # them and the evaluator scores them instead of the test set (tuning never sees the test
    # set); 0 = none, evaluate on the test set
    val_size: int = 0
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
        self._check_optimizer_place()
        _check(self.staleness >= 0, "staleness", self.staleness, ">= 0")
        _check(self.groups >= 0, "groups", self.groups, ">= 0")
        _check(self.sync_every >= 1, "sync_every", self.sync_every, ">= 1")
        _check(self.balance_every >= 1, "balance_every", self.balance_every, ">= 1")
        _check(self.merge in ("mean", "sum"), "merge", self.merge, "mean | sum")
        _check(self.group_momentum in ("cluster", "group"), "group_momentum",
               self.group_momentum, "cluster | group")
        _check(0 < self.ratio <= 1, "ratio", self.ratio, "in (0, 1]")
        _check(self.xchg_ratio is None or 0 < self.xchg_ratio <= 1, "xchg_ratio",
               self.xchg_ratio, "in (0, 1] (or unset: automatic)")
        _check(self.xchg_mode in XCHG_MODES, "xchg_mode", self.xchg_mode, " | ".join(XCHG_MODES))
        _check(self.down_ratio is None or 0 < self.down_ratio <= 1, "down_ratio",
               self.down_ratio, "in (0, 1]")
        _check(self.down_values in ("f32", "f16"), "down_values", self.down_values, "f32 | f16")
        _check(0 <= self.down_drift <= 1, "down_drift", self.down_drift, "in [0, 1]")
        _check(self.down_mode in ("auto", "exact"), "down_mode", self.down_mode, "auto | exact")
        _check(self.publish_every >= 0, "publish_every", self.publish_every,
               ">= 0 (0: once a round of the group's members)")
        _check(self.workers >= 1, "workers", self.workers, ">= 1")
        _check(self.groups <= self.workers, "groups", self.groups,
               f"at most the number of workers ({self.workers})")
        _check(self.eval_every_s > 0, "eval_every_s", self.eval_every_s, "> 0")
        for name in ("eval_limit", "max_steps", "lr_warmup", "weight_decay", "val_size"):
            _check(getattr(self, name) >= 0, name, getattr(self, name), ">= 0")
        if self.val_size and self.dataset in TRAIN_SIZES:
            left = TRAIN_SIZES[self.dataset] - self.val_size
            _check(left >= self.workers * self.batch_size, "val_size", self.val_size,
                   f"small enough to leave every worker a batch ({left} samples left)")
        _check(self.gdtopk_direction in ("slower-more", "slower-less"), "gdtopk_direction",
               self.gdtopk_direction, "slower-more | slower-less")
        _check(self.base_step_s >= 0, "base_step_s", self.base_step_s, ">= 0")
        _check(self.epochs >= 0 and self.wall_s >= 0, "budget", (self.epochs, self.wall_s), ">= 0")
        _check(0 < 2 * self.heartbeat_s <= self.lease_s, "heartbeat_s", self.heartbeat_s,
               f"> 0 and at most half of lease_s = {self.lease_s}")
        return self

    def _check_optimizer_place(self) -> None:
        _check(self.optimizer_at in OPTIMIZER_PLACES, "optimizer_at", self.optimizer_at,
               " | ".join(OPTIMIZER_PLACES))
        _check(0 <= self.grad_clip < math.inf, "grad_clip", self.grad_clip, ">= 0 and finite")
        on_worker = self.optimizer_on_worker
        _check(on_worker or self.grad_clip == 0, "grad_clip", self.grad_clip,
               "0 unless the optimizer is on the worker (--optimizer-at worker)")
        _check(on_worker or not self.momentum_masking, "momentum_masking",
               self.momentum_masking, "off unless the optimizer is on the worker "
               "(--optimizer-at worker)")
        self._check_local_steps()
        for name in ("warmup_fraction", "dense_end_fraction"):  # fractions of the budget
            part = float(self.compressor_opts.get(name, 0) or 0)
            _check(part == 0 or self.epochs > 0 or self.max_steps > 0, name, part,
                   "0 unless the run has an --epochs or --max-steps budget (its fraction of it)")

    def _check_local_steps(self) -> None:
        """Local steps and the outer optimizer need the optimizer on the worker: with it on
        the servers a worker has no update of its own to apply H times (refused, not implied,
        so a run's optimizer never moves without being asked)."""
        on_worker, why = self.optimizer_on_worker, " unless --optimizer-at worker"
        _check(self.local_steps >= 0, "local_steps", self.local_steps, ">= 1, or 0 (auto)")
        _check(self.local_steps_max >= 1, "local_steps_max", self.local_steps_max, ">= 1")
        _check(on_worker or self.local_steps == 1, "local_steps", self.local_steps, "1" + why)
        _check(self.outer_optimizer in OUTER_OPTIMIZERS, "outer_optimizer",
               self.outer_optimizer, " | ".join(OUTER_OPTIMIZERS))
        _check(on_worker or self.outer_optimizer == "avg", "outer_optimizer",
               self.outer_optimizer, "avg" + why)
        _check(0 < self.outer_lr < math.inf, "outer_lr", self.outer_lr, "> 0 and finite")
        _check(on_worker or self.outer_lr == 1, "outer_lr", self.outer_lr, "1" + why)
        _check(0 < self.outer_momentum < 1, "outer_momentum", self.outer_momentum, "in (0, 1)")

    @property
    def local_steps_auto(self) -> bool:
        """Each group's H is set by the global server from the group's speed
        (``local_steps`` 0; core/local_steps.py)."""
        return self.local_steps == 0

    @property
    def optimizer_on_worker(self) -> bool:
        """Workers keep the optimizer state and push updates (``optimizer_at`` ``worker``);
        the group servers then add what arrives as it is."""
        return self.optimizer_at == "worker"

    def epoch_samples(self) -> int:
        """Samples of one epoch: the training set less the held-out validation samples."""
        return dataset_train_size(self.dataset, self.train_size) - self.val_size

    def budget_samples(self) -> float:
        """The run's length in samples, all workers together: ``epochs`` of the training set,
        else ``max_steps`` pushes of every worker (of H batches each with local steps; H_max
        when auto), else 0 (a wall-clock budget or none)."""
        if self.epochs > 0:
            return self.epochs * self.epoch_samples()
        steps = self.local_steps_max if self.local_steps_auto else self.local_steps
        return float(self.max_steps * self.workers * self.batch_size * steps)

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

    def kept_or_default(self, setting: float | None) -> float:
        """The kept fraction of a hop between the servers and their copies (the exchange's
        ``xchg_ratio``, the downlink's ``down_ratio``): ``setting``, or when None the workers'
        ``ratio`` with a sparse compressor and 1.0 (dense) with a dense one (``none``,
        ``fp16``; its declared wire encoding, ``registry.is_sparse``)."""
        if setting is not None:
            return setting
        from minips.compress.registry import (
            is_sparse,  # the plug-ins load with a run, not the rules
        )

        return self.ratio if is_sparse(self.compressor) else 1.0

    def downlink_ratio(self) -> float:
        """The downlink's kept fraction (``kept_or_default`` of ``down_ratio``)."""
        return self.kept_or_default(self.down_ratio)

    def worker_compressor(self, size: int, worker: int) -> Compressor:
        """The compressor worker ``worker`` builds for ``size`` coordinates (its seed:
        ``seed * 1000 + worker``); worker.py and the simulator both take it."""
        from minips.compress.registry import make_compressor

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


class FieldError(ConfigError):
    """A RunConfig field out of range (the CLI names the field's flag instead of the field)."""

    def __init__(self, name: str, got: Any, expected: str) -> None:
        super().__init__(f"config field {name} = {got!r}, expected {expected}")
        self.name, self.got, self.expected = name, got, expected


def _check(ok: bool, name: str, got: Any, expected: str) -> None:
    if not ok:
        raise FieldError(name, got, expected)


@dataclass
class WorkerConfig:
    """One worker (or evaluator) process."""

    server_host: str = "127.0.0.1"  # global server address
    server_port: int = 7070  # global server port
    token: str = ""  # shared secret (MINIPS_TOKEN)
    tls_ca: str | None = None  # CA file to verify servers with; None = plain TCP
    worker_id: int = -1  # requested id; -1 = the server picks the next free one
    slowdown: float = 1.0  # emulated factor F: b samples take >= F x base_step_s x b / batch_size
    slowdown_schedule: str = ""  # F@T,... (core/slowdown.py): F over training time; "" = flat
    throttle: str = ""  # P,MIN-MAX,SECONDS random throttling (core/slowdown.py); "" = none
    bandwidth_bps: float = 0.0  # paced uplink (sends) of the group connection, bytes/s; 0 = none
    bandwidth_down_bps: float = 0.0  # paced downlink (reads) of it, bytes/s; 0 = none
    latency_s: float = 0.0  # emulated one-way latency added to every send
    run_dir: str = "runs/worker"  # metrics directory
    data_dir: str | None = None  # overrides the run's data_dir on this machine
    # "real": the data set's files must be here (no silent stand-in); "synthetic": train on the
    # synthetic stand-in, asked for (`--data synthetic`)
    data: str = "real"
    torch_threads: int = 1  # intra-op threads; 1 keeps many workers off each other's cores
    device: str = "cpu"  # cpu | cuda | cuda:N | mps | auto (CUDA, MPS, CPU); CLI default: auto
    amp: bool = False  # mixed precision (autocast) where the device supports it
    compress_on_device: bool | None = None  # select with torch on the device; None: off the CPU
    connect_timeout_s: float = 10.0  # keep trying an unreachable server this long; inf = no end
    reconnect_s: float = 120.0  # how long to keep trying when a server is lost mid-run
