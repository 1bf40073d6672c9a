"""The package's shape: layers point one way, no module only forwards, the cores stay light.

Imports are read from the source (ast), not by importing: an import inside a function or under
`if TYPE_CHECKING:` is an edge too, since it ties the two modules together just the same. What a
core *loads* is measured by importing it in a fresh interpreter.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "minips"
SANS_IO = ("minips.core", "minips.wire", "minips.sparse", "minips.grouping")
IO_MODULES = {"asyncio", "socket", "ssl", "selectors", "torch", "threading", "subprocess"}
CORE_LOAD_BOUND = 21  # minips modules importing a role core may load (package __init__s aside);
# 16 since LB-BSP (core/balance.py) and local steps (core/local_steps.py) joined the group core,
# 17 since the change log (core/changelog.py) bounds the work per message, 20 since the frame
# checks (wire/checks.py), the control messages (wire/control.py) and the table of kinds
# (wire/kinds.py) left frames.py and messages.py, 21 since the round trip (core/merge.py) left
# global_core.py


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def packages() -> set[str]:
    return {module_name(p) for p in PKG.rglob("__init__.py")}


def package_of(module: str) -> str:
    """The layer a module belongs to: its subpackage, or itself for a top-level module."""
    parts = module.split(".")
    return ".".join(parts[:2])


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


def package_graph() -> dict[str, set[str]]:
    """Layer -> the layers it imports (the root package's public API list aside)."""
    out: dict[str, set[str]] = {}
    for mod, edges in import_graph().items():
        if mod == "minips":
            continue
        here = package_of(mod)
        out.setdefault(here, set()).update(package_of(e) for e in edges if e != "minips")
        out[here].discard(here)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop as a list of nodes, or None (iterative depth-first search)."""
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
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def top_level(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """(names a module defines itself, names it imports from minips -> the module named)."""
    defined: set[str] = set()
    imports: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minips"):
            for alias in node.names:
                imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return defined, imports


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


def test_no_import_loop_between_modules():
    graph = import_graph()
    assert len(graph) > 40
    assert find_cycle(graph) is None, f"import loop: {' -> '.join(find_cycle(graph) or [])}"


def script_graph() -> dict[str, set[str]]:
    """scripts/*.py -> the other scripts it imports (by their top-level names, as they do)."""
    paths = {p.stem: p for p in (ROOT / "scripts").glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                edges.add(node.module or "")
        graph[name] = (edges & set(paths)) - {name}
    return graph


def test_no_import_loop_between_scripts():
    """The scripts import each other by name (reproduce -> repro_table); that graph has no loop
    either, TYPE_CHECKING imports included."""
    graph = script_graph()
    assert "repro_table" in graph["reproduce"]
    cycle = find_cycle(graph)
    assert cycle is None, f"import loop among scripts: {' -> '.join(cycle or [])}"


def test_layers_point_one_way():
    """No loop between packages (and the top-level faces): each layer imports only those
    below it, so a reader can start at the bottom and never meet a name from above."""
    graph = package_graph()
    assert {"minips.core", "minips.wire", "minips.net", "minips.run"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, f"package loop: {' -> '.join(cycle or [])}"


def test_the_sans_io_layers_import_no_io_and_nothing_above_them():
    allowed = {"minips.core", "minips.wire", "minips.sparse", "minips.grouping", "minips.errors",
               "minips.compress"}
    graph = import_graph()  # once: it parses every module
    for name, path in modules().items():
        if not name.startswith(SANS_IO):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not roots & IO_MODULES, f"{name} imports {roots & IO_MODULES}"
        above = {package_of(e) for e in graph[name]} - allowed
        assert not above, f"{name} (sans-IO) imports {above}"


def test_no_module_only_forwards_and_every_import_names_the_defining_module():
    """`from minips.M import X` finds X defined in M (or M.X is a module); `__all__` lists only
    what its module defines (the package's public list in minips/__init__.py aside)."""
    mods = modules()
    info = {name: top_level(ast.parse(path.read_text())) for name, path in mods.items()}
    forwarded = []
    for path in [*PKG.rglob("*.py"), *(ROOT / "tests").glob("*.py"),
                 *(ROOT / "scripts").glob("*.py")]:
        here = module_name(path) if path.is_relative_to(PKG) else str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minips"):
                defined = info.get(node.module, (set(), {}))[0]
                for alias in node.names:
                    if alias.name not in defined and f"{node.module}.{alias.name}" not in mods:
                        forwarded.append(f"{here}: {node.module}.{alias.name}")
    assert not forwarded, f"imports that do not name the defining module: {forwarded}"
    for name, path in mods.items():
        if name == "minips":
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                                                    for t in node.targets):
                listed = {e.value for e in node.value.elts}  # type: ignore[attr-defined]
                assert listed <= info[name][0], f"{name} re-exports {listed - info[name][0]}"
        body = [n for n in tree.body[1:] if not isinstance(n, (ast.Import, ast.ImportFrom))
                and not (isinstance(n, ast.AnnAssign | ast.Assign)
                         and "__all__" in ast.unparse(n))]
        has_imports = any(isinstance(n, ast.Import | ast.ImportFrom) and
                          getattr(n, "module", "") != "__future__" for n in tree.body)
        assert body or not has_imports, f"{name} only imports"


def test_a_role_core_loads_only_the_rules_below_it():
    """Importing a role core loads core/, wire/, the sparse codec and numpy: a reader of the
    rules meets nothing else."""
    for core in ("minips.core.group_core", "minips.core.global_core"):
        code = (f"import sys, {core}; pk = {sorted(packages())!r}; "
                "print(' '.join(sorted(m for m in sys.modules "
                "if m.startswith('minips') and m not in pk)))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        loaded = out.stdout.split()
        assert core in loaded
        assert len(loaded) <= CORE_LOAD_BOUND, f"{core} loads {len(loaded)}: {loaded}"
        assert not [m for m in loaded if not m.startswith(SANS_IO + ("minips.errors",
                                                                     "minips.compress"))], loaded


def test_the_card_faces_and_subpackages_are_where_users_look():
    for face in ("server.py", "worker.py", "grouping.py", "sparse.py", "__init__.py"):
        assert (PKG / face).is_file(), face
    subpackages = {p.parent.name for p in PKG.glob("*/__init__.py")}
    assert {"wire", "net", "core", "compress", "serve", "ml", "run", "sim"} <= subpackages


def test_architecture_md_reading_path_names_real_files():
    text = (ROOT / "docs" / "architecture.md").read_text()
    order = text.split("## Reading path", 1)[1].split("\n## ", 1)[0]
    paths = re.findall(r"`(minips/[\w/]+\.py)`", order)
    assert len(paths) >= 5
    for p in paths:
        assert (ROOT / p).is_file(), f"architecture.md's reading path names {p}, not in the tree"


def architecture_table() -> dict[str, set[str]]:
    """docs/architecture.md's table of what each package imports: layer -> the layers it names
    (`errors.py`, imported by all, is left out there)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("| package | imports |", 1)[1].split("\n\n", 1)[0]
    out: dict[str, set[str]] = {}
    for row in re.findall(r"^\| (.+?) \| (.+?) \|$", table, re.M):
        named = {"minips." + n.strip("/").removesuffix(".py")
                 for n in re.findall(r"`([\w./]+)`", row[1])}
        for package in re.findall(r"`([\w./]+)`", row[0]):
            out["minips." + package.strip("/").removesuffix(".py")] = named
    return out


def test_architecture_md_import_table_is_the_import_graph():
    """The page says "exactly, each package imports these": computed here from the source, so
    the page cannot go stale when a package gains or loses an arrow."""
    table = architecture_table()
    assert "minips.core" in table and "minips.wire" in table, sorted(table)
    graph = {k: v - {"minips.errors"} for k, v in package_graph().items()
             if k not in ("minips.errors", "minips.__main__")}
    assert table == graph, {k: (sorted(table.get(k, ())), sorted(graph.get(k, ())))
                            for k in set(table) | set(graph) if table.get(k) != graph.get(k)}


def test_the_public_api_is_explicit_and_light():
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
    assert listed == packages(), (sorted(packages() - listed), sorted(listed - packages()))

