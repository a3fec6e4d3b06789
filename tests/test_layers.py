"""The import contract of the tree (issue 15): layers import one way, no import cycle, no module over 600 lines.

Layers, bottom to top: ``kernelctl`` (wire contract, vocabulary, settings, console, operator client, process
launcher) <- ``kernelpack`` <- ``controller`` and ``agents`` (never each other) <- ``cli`` and ``sim`` (``cli``
mounts the simulators; ``sim`` never imports ``cli``). Every import counts, also one inside a function: a lazy
import of a higher layer is still a wrong-way dependency (the tree's old cycle was one). Nothing outside
``tests`` imports ``tests``; scripts are checked like modules. Read from the source with ``ast``: no import runs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernelctl", "kernelpack", "controller", "agents", "cli", "sim")
# What each layer may import of the project (its own package always).
ALLOWED: dict[str, set[str]] = {
    "kernelctl": set(),
    "kernelpack": {"kernelctl"},
    "controller": {"kernelctl", "kernelpack"},
    "agents": {"kernelctl", "kernelpack"},
    "sim": {"kernelctl", "kernelpack", "controller", "agents"},
    "cli": {"kernelctl", "kernelpack", "controller", "agents", "sim"},
    "scripts": {"kernelctl", "kernelpack", "controller", "agents", "cli", "sim"},
}
MAX_LINES = 600


def _python_files() -> Iterator[Path]:
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))
    for script in sorted((ROOT / "scripts").iterdir()):
        if script.is_file() and script.read_text(errors="replace").startswith("#!/usr/bin/env python"):
            yield script


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, *, names: bool = True) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, at any depth; with ``names``, also
    ``pkg.name`` for each ``from pkg import name`` (the name may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            yield node.lineno, mod
            for alias in node.names if names else ():  # ``from pkg import module`` imports the module
                yield node.lineno, f"{mod}.{alias.name}"


def _layer(path: Path) -> str:
    return path.relative_to(ROOT).parts[0]


def test_layers_import_one_way() -> None:
    wrong = []
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        layer = _layer(path)
        for line, mod in _imports(path, names=False):
            top = mod.split(".")[0]
            if top == "tests":
                wrong.append(f"{rel}:{line} imports {mod} (nothing outside tests/ may import tests)")
            elif top in PACKAGES and top != layer and top not in ALLOWED[layer]:
                wrong.append(f"{rel}:{line} imports {mod} ({layer} may import only "
                             f"{', '.join(sorted(ALLOWED[layer])) or 'itself'})")
    assert not sorted(set(wrong)), "imports that run the wrong way:\n" + "\n".join(sorted(set(wrong)))


def _module_graph() -> dict[str, set[str]]:
    files = [p for p in _python_files() if p.suffix == ".py"]
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {mod for _, mod in _imports(path) if mod in modules and mod != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycle() -> None:
    """No two modules import each other, directly or through others (lazy imports included)."""
    cycles = _cycles(_module_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_cycle() -> None:
    """The check above can fail: a known cycle is reported."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("limit", [MAX_LINES])
def test_no_module_over_600_lines(limit: int) -> None:
    roots = [*PACKAGES, "scripts", "migrations"]
    big = []
    for root in roots:
        for path in sorted((ROOT / root).rglob("*")):
            if path.is_file() and (path.suffix == ".py" or path.parent.name == "scripts"):
                n = len(path.read_text(errors="replace").splitlines())
                if n > limit:
                    big.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not big, f"modules over {limit} lines (split them by job):\n" + "\n".join(big)


def test_images_copy_every_package() -> None:
    """Each container image copies every package the console script needs (a new layer is not forgotten)."""
    for dockerfile in sorted((ROOT / "docker").glob("*.Dockerfile")):
        text = dockerfile.read_text()
        missing = [p for p in PACKAGES if f"COPY {p}/ {p}/" not in text]
        assert not missing, f"{dockerfile.name} does not copy {', '.join(missing)}"


def _message_branches(path: Path) -> Iterator[int]:
    """Lines that test an exception's message text (``"..." in str(exc)``) instead of its type."""
    tree = ast.parse(path.read_text(), filename=str(path))
    caught = {h.name for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler) and h.name} | {"exc", "err", "error"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) \
                and isinstance(node.left.value, str) and all(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
            for right in node.comparators:
                if isinstance(right, ast.Call) and isinstance(right.func, ast.Name) and right.func.id == "str" \
                        and right.args and isinstance(right.args[0], ast.Name) and right.args[0].id in caught:
                    yield node.lineno


def test_errors_are_told_apart_by_type_not_message() -> None:
    found = [f"{p.relative_to(ROOT)}:{line}" for p in _python_files() for line in _message_branches(p)]
    assert not found, "code that matches an exception's message text (raise a typed error instead):\n" + \
        "\n".join(found)
