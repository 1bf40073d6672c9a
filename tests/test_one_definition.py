"""One name, one meaning: no public class or function name (nor a constant in ``__all__``) is
defined in two modules of minips/ (STYLE.md, "Names and merges"; issue 57 item 3)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minips"


def public_names(tree: ast.Module) -> set[str]:
    """A module's public defs and classes at module level, and the names of its ``__all__``
    that it assigns itself (a name only imported is the defining module's)."""
    defined: set[str] = set()
    assigned: set[str] = set()
    listed: set[object] = set()  # __all__'s constants (str, unless the module is malformed)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if not node.name.startswith("_"):
                defined.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if not isinstance(t, ast.Name):
                    continue
                if t.id == "__all__" and isinstance(node.value, ast.List | ast.Tuple):
                    listed |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
                else:
                    assigned.add(t.id)
    return defined | (assigned & listed)


def definitions() -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in public_names(ast.parse(path.read_text())):
            where[name].append(path.relative_to(PACKAGE).as_posix())
    return where


def test_no_public_name_is_defined_in_two_modules() -> None:
    where = definitions()
    assert len(where) > 500  # the package was read
    twice = {name: sorted(paths) for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"defined in more than one module: {twice}"


def test_the_check_sees_a_name_defined_twice() -> None:
    one = public_names(ast.parse("class Reply: ...\nX = 1\n__all__ = ['Reply', 'X', 'Y']\n"
                                 "from a import Y\ndef _hidden(): ...\n"))
    assert one == {"Reply", "X"}
