"""The package's shape: no import loop, no module over ~300 lines, architecture.md true to the tree.

Imports are read from the source (ast), not by importing: an import inside a function or under
`if TYPE_CHECKING:` is an edge too, since it ties the two modules together just the same.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "minips"
MAX_LINES = 320  # "about 300": a module this long is read in one sitting


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def imported(node: ast.AST, here: str, known: set[str]) -> set[str]:
    """The minips modules one import statement names (a `from pkg import sub` names pkg.sub)."""
    out: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.startswith("minips"):
                out.add(alias.name)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the module's package, up level - 1 more
            base = ".".join(here.split(".")[: -node.level] + ([base] if base else []))
        if not base.startswith("minips"):
            return out
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            out.add(sub if sub in known else base)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            edges |= imported(node, name, known)
        graph[name] = {e for e in edges if e in known and e != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop as a list of modules, or None (iterative depth-first search)."""
    state: dict[str, int] = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph[child]))))
    return None


def test_the_cycle_finder_finds_a_loop_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_type_checking_and_function_level_imports():
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from minips.x import Y\n" \
          "def f():\n    from minips import z\n"
    edges: set[str] = set()
    for node in ast.walk(ast.parse(src)):
        edges |= imported(node, "minips.w", {"minips.x", "minips.z", "minips.w"})
    assert edges == {"minips.x", "minips.z"}


def test_no_import_loop_in_the_package():
    graph = import_graph()
    assert len(graph) > 40
    assert find_cycle(graph) is None, f"import loop: {' -> '.join(find_cycle(graph) or [])}"


def test_no_module_is_over_about_300_lines():
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_card_faces_and_subpackages_are_where_users_look():
    for face in ("server.py", "worker.py", "grouping.py", "sparse.py", "__init__.py"):
        assert (PKG / face).is_file(), face
    packages = {p.parent.name for p in PKG.glob("*/__init__.py")}
    assert {"wire", "net", "core", "compress", "serve", "ml", "run", "sim"} <= packages
    flat = {p.stem for p in PKG.glob("*.py")}
    assert flat <= {"__init__", "__main__", "server", "worker", "grouping", "sparse", "errors"}


def test_architecture_md_names_every_module_and_its_reading_order_exists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    order = text.split("## Reading order", 1)[1].split("\n## ", 1)[0]
    paths = re.findall(r"`(minips/[\w/]+\.py)`", order)
    assert len(paths) >= 5
    for p in paths:
        assert (ROOT / p).is_file(), f"architecture.md's reading order names {p}, not in the tree"
    missing = [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")
               if p.name != "__init__.py" and str(p.relative_to(ROOT)) not in text]
    assert not missing, f"modules architecture.md does not name: {missing}"


def test_the_public_api_is_explicit_and_light():
    import subprocess
    import sys
    code = ("import sys, minips; names = minips.__all__; "
            "assert 'torch' not in sys.modules, 'import minips pulled torch'; "
            "torchy = ('Worker', 'run_worker', 'train_reference'); "
            "[getattr(minips, n) for n in names if n not in torchy]; "
            "assert 'torch' not in sys.modules, 'a server-side name pulled torch'; "
            "[getattr(minips, n) for n in torchy]; print(len(names))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 10


def test_pyproject_ships_every_subpackage():
    """A non-editable install copies only the packages pyproject.toml lists."""
    text = (ROOT / "pyproject.toml").read_text()  # no tomllib: Python 3.10 has none
    block = re.search(r"^packages = \[(.*?)\]", text, re.S | re.M)
    assert block, "pyproject.toml lists no packages"
    listed = set(re.findall(r'"([\w.]+)"', block.group(1)))
    present = {module_name(p) for p in PKG.rglob("__init__.py")}
    assert listed == present, (sorted(present - listed), sorted(listed - present))
