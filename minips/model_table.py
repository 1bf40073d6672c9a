"""The models minips knows by name and the length of each one's flat weight vector (no torch).

``models.py`` builds the models with torch; the servers and the command line, which never import
torch, check a ``--model`` name and the size of an ``--init`` file against this table.

Invariant: ``PARAM_COUNTS[name] == models.param_count(name)`` for every name (tests/test_models.py).
"""

from __future__ import annotations

__all__ = ["MODEL_NAMES", "PARAM_COUNTS", "DEFAULT_DATASET"]

MODEL_NAMES = ("lenet5", "resnet18", "vgg19", "resnet9", "seq2seq")
PARAM_COUNTS = {"lenet5": 61_706, "resnet18": 11_173_962, "vgg19": 20_040_522,
                "resnet9": 6_573_120, "seq2seq": 109_499}  # float32 elements of the flat vector
DEFAULT_DATASET = {"lenet5": "fashion-mnist", "resnet18": "cifar10", "vgg19": "cifar10",
                   "resnet9": "cifar10", "seq2seq": "translation"}
