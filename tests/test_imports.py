"""The package's own import graph has no cycle, lazy (function-level) imports counted.

Every module under moe_trainer/ is parsed (not imported) and every import of a moe_trainer
module is an edge: top-level or inside a function, `import moe_trainer.a`, `from . import a`,
`from .a import b` (b a module: an edge to a.b, else to a). Importing a.b runs the package
a's __init__ first, so that is an edge to a too, unless a is a package above the importer
(already imported before it). A cycle is a strongly connected component of two or more
modules, or a module importing itself; each is named with the imports that close it.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "moe_trainer"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """{'moe_trainer.hf.read': path, 'moe_trainer.hf': path of hf/__init__.py, ...}"""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _absolute(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name of `from <level dots><module> import ...` written in `importer`."""
    if level == 0:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """{imported moe_trainer module: line of the first import of it} for one module."""
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        # the target and the packages on its way that are not the importer's own ancestors
        parts = target.split(".")
        for i in range(2, len(parts) + 1):
            mod = ".".join(parts[:i])
            above = name == mod or name.startswith(mod + ".")
            if mod in modules and (not above or i == len(parts)) and mod != name:
                found.setdefault(mod, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, is_package, node.level, node.module)
            if base.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else base, node.lineno)
    return found


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of two or more modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, {})))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def describe(comp: list[str], graph: dict[str, dict[str, int]]) -> str:
    """One cycle as its modules and the imports between them (module:line -> module)."""
    inside = set(comp)
    edges = [f"    {a.removeprefix(PACKAGE + '.')}:{line} -> {b.removeprefix(PACKAGE + '.')}"
             for a in comp for b, line in sorted(graph[a].items()) if b in inside]
    names = ", ".join(m.removeprefix(PACKAGE + ".") or PACKAGE for m in comp)
    return f"{len(comp)} modules in one cycle: {names}\n" + "\n".join(edges)


def test_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles among moe_trainer's modules:\n" + "\n".join(describe(c, graph) for c in found)


def test_config_and_rope_are_the_ground_floor():
    """config.py parses, types and validates from its YAML alone (resolve.py, above it, reads what a
    config names), and RoPE's maths sits below both the models and the kernels: neither imports any
    module of the package, lazily or not."""
    graph = import_graph()
    assert graph[f"{PACKAGE}.config"] == {}
    assert graph[f"{PACKAGE}.rope"] == {}


def test_checker_sees_lazy_relative_and_package_imports(tmp_path):
    """The checker itself: a ring closed only by a lazy `from .. import x` inside a function, and
    one closed through a package's __init__, are found; a line is not."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.c import f\n")
    (pkg / "sub" / "__init__.py").write_text("from .c import f\n")
    (pkg / "sub" / "c.py").write_text("def f():\n    from .. import a\n    return a\n")
    (pkg / "b.py").write_text("import moe_trainer.sub.c\n")
    (pkg / "d.py").write_text("from .e import g\n")
    (pkg / "e.py").write_text("g = 1\n")
    graph = import_graph(pkg)
    assert graph[f"{PACKAGE}.sub.c"] == {f"{PACKAGE}.a": 2}
    assert graph[f"{PACKAGE}.sub"] == {f"{PACKAGE}.sub.c": 1}
    assert f"{PACKAGE}.sub" in graph[f"{PACKAGE}.b"]  # importing sub.c runs sub/__init__.py first
    assert cycles(graph) == [[f"{PACKAGE}.a", f"{PACKAGE}.sub", f"{PACKAGE}.sub.c"]]
    (pkg / "sub" / "c.py").write_text("def f():\n    return 1\n")
    assert cycles(import_graph(pkg)) == []
