"""The package layout is the architecture: core, features and tools, dependencies one way.

* ``torch_tp/core/``: applying a plan (``api``, ``plan``, the styles, their contracts and
  registry, layouts and regions, the RNG tracker the styles draw dropout masks from);
* ``torch_tp/features/``: what training needs beside it (``loss``, ``checkpoint``, ``clip``);
* ``torch_tp/tools/``: what helps to write and check plans (the report, the CLI, the demo).

The core imports neither features nor tools; features do not import tools. The public module
paths (``torch_tp.plan``, ``torch_tp.checkpoint``, ...) are one-line re-exports, and nothing
inside the package imports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import torch_tp

PACKAGE = Path(torch_tp.__file__).resolve().parent
# the public module paths, each re-exporting one module of core, features or tools
PUBLIC_ALIASES = (
    "api",
    "plan",
    "style",
    "contract",
    "random",
    "loss",
    "checkpoint",
    "report",
)
# what each layer may not import
FORBIDDEN = {
    "core": ("torch_tp.features", "torch_tp.tools", "torch_tp.plans", "torch_tp.models"),
    "features": ("torch_tp.tools", "torch_tp.plans", "torch_tp.models"),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports (at any depth), absolute, with its line."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _layer_files(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_dependencies_point_one_way(layer):
    files = _layer_files(layer)
    assert files, f"torch_tp/{layer}/ is empty"
    aliases = tuple(f"torch_tp.{name}" for name in PUBLIC_ALIASES)
    bad = [
        f"{path.relative_to(PACKAGE)}:{line} imports {module}"
        for path in files
        for line, module in _imports(path)
        if module.startswith(FORBIDDEN[layer]) or module in aliases
    ]
    assert not bad, "\n".join(bad)


def test_tools_import_no_public_alias():
    aliases = {f"torch_tp.{name}" for name in PUBLIC_ALIASES}
    bad = [
        f"{path.relative_to(PACKAGE)}:{line} imports {module}"
        for path in _layer_files("tools")
        for line, module in _imports(path)
        if module in aliases
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", PUBLIC_ALIASES)
def test_public_paths_are_re_exports(name):
    """``torch_tp.<name>`` re-exports one module, all of its public names, and holds no code."""
    path = PACKAGE / f"{name}.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = [n for n in tree.body if not isinstance(n, ast.Expr)]  # the docstring aside
    stars = [n.module for n in body if isinstance(n, ast.ImportFrom) and n.names[0].name == "*"]
    assert len(stars) == 1, f"{path.name} re-exports from {stars}"
    (source,) = stars
    assert source.startswith(("torch_tp.core.", "torch_tp.features.", "torch_tp.tools."))
    assert all(isinstance(n, (ast.ImportFrom, ast.Assign)) for n in body), path.name
    public = __import__(f"torch_tp.{name}", fromlist=["__all__"])
    origin = __import__(source, fromlist=["__all__"])
    assert public.__all__ == origin.__all__
    assert all(getattr(public, item) is getattr(origin, item) for item in origin.__all__)


@pytest.mark.slow  # a Python process of its own
def test_public_paths_come_with_the_package():
    """``import torch_tp`` alone makes every public module path an attribute (a fresh
    interpreter: here, other tests may have imported them already)."""
    import subprocess
    import sys

    names = ", ".join(repr(name) for name in PUBLIC_ALIASES)
    code = f"import torch_tp; [getattr(torch_tp, name) for name in ({names})]"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
