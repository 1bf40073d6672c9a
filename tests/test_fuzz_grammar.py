"""A short run of scripts/fuzz_grammar.py against a real `minips server` process: frames built
from docs/protocol.md's grammar (sections 1-3) by hand, on authenticated sessions, while a good
worker trains. No crash (no exit, no traceback, no ERROR ``internal``), the good worker still
served, memory within the documented budget. The 1M-input run is the script's default."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from minips.net import channel
from minips.wire import kinds, messages

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_grammar.py"


def script() -> Any:
    spec = importlib.util.spec_from_file_location("fuzz_grammar", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_grammar_read_from_the_document_is_the_protocol() -> None:
    """The fuzzer takes kinds, numbers and keys from the document alone; they must be the ones
    the servers speak, or the fuzz would test another protocol."""
    fg = script()
    spec_kinds = fg.grammar()
    assert ({s.number: name for name, s in spec_kinds.items()}
            == {int(k): k.name for k in messages.Kind})
    for name, spec in spec_kinds.items():
        assert set(spec.keys) == set(kinds.meta_keys(messages.Kind[name])), name
        assert all(t for t in spec.keys.values()), name
    assert fg.encodings() == ["dense-f32", "dense-f16", "sparse-v1"]
    assert fg.frame_layout() == (b"MNPS", messages.PROTOCOL_VERSION)


@pytest.mark.timeout(240)
def test_a_short_grammar_fuzz_of_a_live_server_crashes_nothing() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--inputs", "4000", "--concurrency", "8",
                          "--max-seconds", "150"], capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    print(json.dumps(res))
    assert res["crashes"] == 0, res
    assert res["inputs"] >= 4000 and set(res["by_target"]) == {"evaluator", "control",
                                                                 "group_worker"}
    # the grammar's frames reach past the framing into the sessions' checks
    assert {"protocol_error", "invalid"} <= set(res["error_codes"]), res["error_codes"]
    assert res["good_served_after"] and not res["good_error"]
    # docs/operations.md: RSS at rest + (workers + groups + 1 + other connections)
    # x (2 x the model's frame + the receive queue's 16 MiB)
    frame_mb = 4 * 61_706 / (1 << 20)
    budget = res["rss_rest_mb"] + (2 + 1 + 1 + res["concurrency"]) * (
        2 * frame_mb + channel.MAX_QUEUED_BYTES / (1 << 20))
    assert res["rss_peak_mb"] <= budget, (res["rss_peak_mb"], budget)
