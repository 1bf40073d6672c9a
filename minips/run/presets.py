"""Named sets of defaults (``--preset``): partial run configs (``"run"``: RunConfig fields) and
`minips local`'s per-worker slowdowns; flags given explicitly override them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

# Presets are named partial configs; CLI flags given explicitly override them. The demo is the
# README's main job: 5 epochs at lr 0.05 end near 85% test accuracy in about a minute of training
# on 2 cores (3 epochs at lr 0.1 ended at 79-82%). No DGC warm-up (at 25% kept it was ~70 MB of
# the upload) and float16 values: about 27 MB up and 54 MB down (sparse downlink) for 85.8%.
PRESETS: dict[str, dict[str, Any]] = {
    "demo": {
        "run": {"model": "lenet5", "dataset": "fashion-mnist", "mode": "gssp",
                "compressor": "gdtopk", "workers": 8, "epochs": 5.0, "wall_s": 180.0,
                "staleness": 3, "sync_every": 4, "base_step_s": 0.04, "lr": 0.05,
                "lr_schedule": "cosine", "gdtopk_direction": "slower-less",
                "compressor_opts": {"warmup_epochs": 0, "value_dtype": "f16"}},
        "slowdowns": [1, 1, 1.5, 1.5, 2, 2, 4, 4],
    },
}
