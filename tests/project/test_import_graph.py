"""The import graph of the pycollectives package (strategies/ included, as
pycollectives.strategies): every module imports alone, in a fresh
interpreter, and no subpackage has an import circle among its modules.

A circle is read from the source (`ast`), every import counted: at the top,
inside functions (a lazy import that breaks a circle at run time still ties
the two files together) and under `if TYPE_CHECKING:`. Within a package P,
the nodes are P's direct children (its modules, and its subpackages as one
node each); an import from inside one child to inside another is an edge.
Imports of P itself (its `__init__`) are not edges: a package re-exports its
children.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pycollectives
import pycollectives.strategies

# The two circles left (outside the layout work of issue 32): a circle found
# must lie inside one of these (a shrinking one passes). Do not add to this
# list: take the circle apart.
KNOWN_CIRCLES: list[tuple[str, set[str]]] = [
    (
        "pycollectives.torch_backend",
        {f"pycollectives.torch_backend.{m}" for m in ("process_group", "registration")},
    ),
    (
        "pycollectives.strategies.checkpoint",
        {f"pycollectives.strategies.checkpoint.{m}" for m in ("format", "validate")},
    ),
]

_IMPORT_ALONE = r"""
import importlib, json, os, sys, traceback
import numpy, torch  # not ours: loaded once, before the fork, to save time
failed = {}
for name in json.loads(sys.argv[1]):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(name)
            code = 0
        except BaseException:
            os.write(w, traceback.format_exc()[-2000:].encode())
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed[name] = out or f"wait status {status}"
print(json.dumps(failed))
"""


def _modules() -> dict[str, Path]:
    """Every module of the package: its dotted name -> its file."""
    roots = {
        "pycollectives": Path(pycollectives.__path__[0]),
        "pycollectives.strategies": Path(pycollectives.strategies.__path__[0]),
    }
    out: dict[str, Path] = {}
    for prefix, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("").parts
            if "__pycache__" in rel or (
                rel and rel[0] == "strategies" and prefix == "pycollectives"
            ):
                continue  # strategies/ is walked from its own root
            if rel[-1] == "__main__":
                continue  # runs when imported
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            out[".".join((prefix, *parts))] = path
    return out


def _is_package(name: str, mods: dict[str, Path]) -> bool:
    return mods[name].name == "__init__.py"


def _imports(name: str, mods: dict[str, Path]) -> set[str]:
    """The modules of the package that module `name` imports, anywhere in its source."""
    tree = ast.parse(mods[name].read_text(), str(mods[name]))
    package = name if _is_package(name, mods) else name.rpartition(".")[0]
    found: set[str] = set()

    def known(target: str) -> str | None:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        return target or None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            if node.level:
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
            ]
        else:
            continue
        found.update(t for t in map(known, targets) if t is not None)
    return found


def _circles(mods: dict[str, Path]) -> list[tuple[str, set[str]]]:
    """(package, its children in one circle) for every circle in every package."""
    imports = {m: _imports(m, mods) for m in mods}
    found = []
    for pkg in (m for m in mods if _is_package(m, mods)):

        def child(m: str, pkg: str = pkg) -> str | None:
            if not m.startswith(pkg + "."):
                return None
            return pkg + "." + m[len(pkg) + 1 :].split(".")[0]

        edges: dict[str, set[str]] = {}
        for m, targets in imports.items():
            a = child(m)
            if a is None:
                continue
            for t in targets:
                b = child(t)
                if b is not None and b != a:
                    edges.setdefault(a, set()).add(b)
        found += [(pkg, scc) for scc in _strongly_connected(edges) if len(scc) > 1]
    return found


def _strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of the graph `edges`."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.add(w)
                if w == v:
                    break
            out.append(scc)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_inside_a_package() -> None:
    mods = _modules()
    assert "pycollectives.strategies.pipeline.runtime" in mods, sorted(mods)
    new = [
        f"{pkg}: {' <-> '.join(sorted(m.rpartition('.')[2] for m in scc))}"
        for pkg, scc in _circles(mods)
        if not any(pkg == kp and scc <= ks for kp, ks in KNOWN_CIRCLES)
    ]
    assert not new, "import circles:\n  " + "\n  ".join(new)


def test_the_check_sees_a_circle(tmp_path: Path) -> None:
    """The walk finds a circle through a lazy import and one under TYPE_CHECKING."""
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n    return g\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
    )
    (pkg / "c.py").write_text("from p.a import f\n")
    mods = {"p": pkg / "__init__.py", **{f"p.{x}": pkg / f"{x}.py" for x in "abc"}}
    assert _imports("p.c", mods) == {"p.a"}
    assert _circles(mods) == [("p", {"p.a", "p.b"})]


@pytest.mark.timeout(600)
def test_every_module_imports_alone() -> None:
    names = sorted(_modules())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALONE, json.dumps(names)],
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failed, "\n\n".join(f"{n}:\n{tb}" for n, tb in failed.items())
