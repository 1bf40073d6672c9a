"""The models minips knows by name, the length of each one's flat weight vector, and the
training set sizes of the known data sets (no torch).

``models.py`` builds the models with torch; the servers and the command line, which never import
torch, check a ``--model`` name and the size of an ``--init`` file against this table.

Invariant: ``PARAM_COUNTS[name] == models.param_count(name)`` for every name (tests/test_models.py).
"""

from __future__ import annotations

from minips.errors import ConfigError

__all__ = ["MODEL_NAMES", "PARAM_COUNTS", "DEFAULT_DATASET", "TRAIN_SIZES", "dataset_train_size"]

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
