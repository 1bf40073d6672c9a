"""A role core speaks in plain data: no public method of a class in minips/core/ takes or
returns a transport, a channel or a peer object (the shells hold those; issue 57 item 2).

Read from the source with ``ast`` (the annotations are strings under ``from __future__ import
annotations``), so a type named only for checking counts too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "minips" / "core"
# what a shell holds: a connection, a stream, a socket, or a peer behind one
SHELL_TYPE = re.compile(r"\b(Channel|Transport|Server|StreamReader|StreamWriter|socket|"
                        r"\w*Peer|NoGroup|\w*Link)\b|\b(transport|channel|asyncio|net)\.")


def shell_shaped() -> dict[str, str]:
    """``{"file Class.method": "arg: annotation"}`` for every public method (``__init__``
    included) of a class in minips/core/ whose parameter or return names a shell type."""
    found: dict[str, str] = {}
    for path in sorted(CORE.glob("*.py")):
        for cls in ast.parse(path.read_text()).body:
            if not isinstance(cls, ast.ClassDef):
                continue
            for fn in cls.body:
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or \
                        (fn.name.startswith("_") and fn.name != "__init__"):
                    continue
                args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
                hints = [(a.arg, a.annotation) for a in args] + [("return", fn.returns)]
                for name, hint in hints:
                    if hint is not None and SHELL_TYPE.search(ast.unparse(hint)):
                        found[f"{path.name} {cls.name}.{fn.name}"] = \
                            f"{name}: {ast.unparse(hint)}"
    return found


def test_no_core_method_takes_or_returns_a_transport_channel_or_peer() -> None:
    found = shell_shaped()
    assert len(list(CORE.glob("*.py"))) > 10  # the cores were read
    assert found == {}


def test_the_check_sees_a_channel_in_a_hint() -> None:
    for hint in ("Channel", "transport.Channel | None", "list[GroupPeer]", "NoGroup",
                 "asyncio.StreamWriter", "InProcLink"):
        assert SHELL_TYPE.search(hint), hint
    for hint in ("int", "messages.GlobalWeights", "GroupHandle", "dict[str, int]", "Roster"):
        assert not SHELL_TYPE.search(hint), hint
