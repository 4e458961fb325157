"""The package layout is the architecture: each public module holds its code, and the imports
between modules point one way, with no cycles.

The layers are named by module, not by folder (``LAYERS``):

* the core applies a plan: ``api``, ``plan``, the styles (``style``) with their contracts and
  registry, layouts and regions, the shape check, and the RNG tracker the styles draw dropout
  masks from;
* the features are what training needs beside it: ``loss``, ``clip``, ``meta``,
  ``checkpoint``, ``pipeline``. Each imports the core, never another feature;
* the tools help to write and check plans: the dry-run ``report`` and the command line
  (``cli``, ``__main__``). They import the core and the features;
* ``plans``, ``models`` and ``testing`` are leaves: nothing in the layers above imports them.

Every module of the package is in exactly one layer (a new module must be placed), every
module is under 1,000 lines, no module but a package's ``__init__`` is only a re-export, and the
graph of all imports (lazy ones inside functions included, ``TYPE_CHECKING`` blocks aside) has
no cycle. No function has over 100 lines of code, and no docstring over 60 lines.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

import torch_tp

PACKAGE = Path(torch_tp.__file__).resolve().parent

# each layer: the module names (dotted, under torch_tp) it is made of; a name covers its
# submodules
LAYERS = {
    "core": (
        "api",
        "plan",
        "plan_checks",  # what a resolved plan must pass on its mesh
        "_names",
        "style",
        "contract",
        "registry",
        "random",
        "shapes",
        "_forward_check",
        "_forward_errors",
        "_repeats",
        "runtime",  # the style kit (public) and the runtimes a style computes with
        "_ring",
        "_torch_compat",
        "_buffers",  # non-persistent buffers computed again: meta and checkpoint share it
        "_state_dict",  # full tensors into DTensor parameters through load_state_dict
    ),
    "features": ("loss", "clip", "meta", "checkpoint", "pipeline"),
    "tools": ("report", "cli", "__main__"),
    "leaves": ("plans", "models", "testing"),
}
# the layers each layer may import (a feature, of its own layer, only its own modules); the
# tools and the leaves use the public API as users do, the package root included
ALLOWED = {
    "core": ("core",),
    "features": ("core", "features"),
    "tools": ("core", "features", "tools", "leaves"),
    "leaves": ("core", "features", "tools", "leaves"),
}
MAX_LINES = 1000


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {
    _module_name(path): path
    for path in sorted(PACKAGE.rglob("*.py"))
    if "__pycache__" not in path.parts
}


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(module: str, path: Path) -> list[tuple[int, str]]:
    """The torch_tp modules ``module`` imports, at any depth outside ``TYPE_CHECKING`` blocks,
    with their lines. ``from a import b`` imports ``a.b`` where that is a module, else ``a``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if sub in MODULES else base))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    torch_tp_only = [(line, name) for line, name in found if name.split(".")[0] == "torch_tp"]
    return sorted(set(torch_tp_only))


def _layer(module: str) -> tuple[str, str] | None:
    """(layer, top-level name) of a torch_tp module; None for the package itself."""
    if module == "torch_tp":
        return None
    top = module.split(".")[1]
    for layer, names in LAYERS.items():
        if top in names:
            return layer, top
    raise AssertionError(f"{module} is in no layer of test_layout.LAYERS: place it")


GRAPH = {module: _imported(module, path) for module, path in MODULES.items()}


def test_every_module_is_in_one_layer():
    placed = [name for names in LAYERS.values() for name in names]
    assert len(placed) == len(set(placed))
    for module in MODULES:
        _layer(module)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_dependencies_point_one_way(layer):
    bad = []
    for module, imports in GRAPH.items():
        if module == "torch_tp" or _layer(module)[0] != layer:
            continue
        own = _layer(module)[1]
        for line, target in imports:
            if target == "torch_tp":
                if layer in ("tools", "leaves"):
                    continue
                bad.append(f"{module}:{line} imports the package root; import the module")
                continue
            target_layer, target_top = _layer(target)
            if target_layer not in ALLOWED[layer]:
                bad.append(f"{module}:{line} ({layer}) imports {target} ({target_layer})")
            elif layer == "features" and target_layer == "features" and target_top != own:
                bad.append(f"{module}:{line} imports another feature, {target}")
    assert not bad, "\n".join(bad)


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), and
    modules that import themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for _, target in GRAPH.get(node, ()):
            if target not in GRAPH:
                continue
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or any(t == node for _, t in GRAPH[node]):
                found.append(sorted(component))

    for node in GRAPH:
        if node not in index:
            connect(node)
    return found


def test_no_import_cycles():
    cycles = _cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle():
    """The check itself: two modules importing each other are one cycle."""
    saved = dict(GRAPH)
    try:
        GRAPH["torch_tp.api"] = [*GRAPH["torch_tp.api"], (0, "torch_tp.report")]
        GRAPH["torch_tp.report"] = [*GRAPH["torch_tp.report"], (0, "torch_tp.api")]
        assert any({"torch_tp.api", "torch_tp.report"} <= set(c) for c in _cycles())
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_past_one_sitting(module):
    lines = len(MODULES[module].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module].relative_to(PACKAGE)} has {lines} lines"


def _functions(module: str) -> list[tuple[str, ast.AST, list[str]]]:
    """(qualified name, node, the module's lines) of every function and class in ``module``."""
    source = MODULES[module].read_text(encoding="utf-8")
    lines, found = source.splitlines(), []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.append((prefix + child.name, child, lines))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _code_lines(node: ast.AST, lines: list[str]) -> int:
    """A function's lines of code: its body without the docstring, blank lines and comments."""
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    if not body:
        return 0
    text = lines[body[0].lineno - 1 : node.end_lineno]
    return sum(1 for line in text if line.strip() and not line.strip().startswith("#"))


def _docstring_lines(node: ast.AST) -> int:
    if ast.get_docstring(node) is None:
        return 0
    return node.body[0].end_lineno - node.body[0].lineno + 1


MAX_FUNCTION_LINES = 100
MAX_DOCSTRING_LINES = 60


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_function_is_over_a_hundred_lines_of_code(module):
    long = {
        name: n
        for name, node, lines in _functions(module)
        if not isinstance(node, ast.ClassDef)
        and (n := _code_lines(node, lines)) > MAX_FUNCTION_LINES
    }
    assert not long, f"{module}: split into named steps: {long}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_docstrings_are_at_most_sixty_lines(module):
    found = {f"{module}:{name}": _docstring_lines(node) for name, node, _ in _functions(module)}
    found[module] = _docstring_lines(ast.parse(MODULES[module].read_text(encoding="utf-8")))
    long = {name: n for name, n in found.items() if n > MAX_DOCSTRING_LINES}
    assert not long, (
        f"docstrings over {MAX_DOCSTRING_LINES} lines: {long}; keep a summary, Args, Returns, "
        "Raises and an Example, and move the semantics into the guide's pages"
    )


def test_the_length_rules_find_what_they_count():
    """The counters above on a function of known size (a check that counts nothing passes)."""
    body = "\n".join(f"    x{i} = {i}  # code" for i in range(101))
    source = f'def f():\n    """Doc\n\n    more.\n    """\n    # a comment\n\n{body}\n'
    node = ast.parse(source).body[0]
    assert _code_lines(node, source.splitlines()) == 101
    assert _docstring_lines(node) == 4
    assert "torch_tp.api:parallelize_module" in {
        f"torch_tp.api:{name}" for name, _, _ in _functions("torch_tp.api")
    }


@pytest.mark.parametrize("module", sorted(m for m, p in MODULES.items() if p.name != "__init__.py"))
def test_no_module_is_only_a_re_export(module):
    """A module that is not a package's ``__init__`` defines something of its own."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    own = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    assert any(isinstance(node, own) for node in tree.body), module


# how many private names one torch_tp module may take from another, in all: the styles use
# the public style kit (torch_tp.runtime, torch_tp.style.base), the checkpoint formats their
# staging module's public names; what is left is a module's own helpers shared with the one
# or two modules beside it
MAX_PRIVATE_IMPORTS = 60  # 47 in December 2026; issue 42 asked for at most 100


def _private_imports(module: str, source: str) -> list[str]:
    """The private names ``module`` takes from other torch_tp modules, as ``source.name``:
    each underscore name imported (``from torch_tp import _names`` and ``from
    torch_tp.style.base import _helper`` alike) and each underscore attribute read off an
    imported torch_tp module (``_names._helper``). Dunder names are not private."""

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    package = module if module in _PACKAGES else module.rpartition(".")[0]
    taken, aliases = [], {}
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        if base.split(".")[0] != "torch_tp" or base == module:
            continue
        for alias in node.names:
            if private(alias.name):
                taken.append(f"{base}.{alias.name}")
            if f"{base}.{alias.name}" in MODULES:
                aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and aliases[node.value.id] != module
            and private(node.attr)
        ):
            taken.append(f"{aliases[node.value.id]}.{node.attr}")
    return taken


_PACKAGES = {m for m, p in MODULES.items() if p.name == "__init__.py"}


def test_few_private_names_cross_modules():
    taken = {
        module: _private_imports(module, path.read_text(encoding="utf-8"))
        for module, path in MODULES.items()
    }
    total = sum(len(names) for names in taken.values())
    by_source = Counter(name.rpartition(".")[0] for names in taken.values() for name in names)
    assert total <= MAX_PRIVATE_IMPORTS, (
        f"{total} private names cross torch_tp modules (at most {MAX_PRIVATE_IMPORTS}): "
        f"give the ones a sibling needs a public name; by source: {by_source.most_common(8)}"
    )


def test_the_private_import_count_finds_what_it_counts():
    """The counter above on a module of known imports (a count of nothing passes)."""
    source = (
        "from torch_tp import _names, runtime\n"
        "from torch_tp.style.base import _helper, public\n"
        "from . import _sibling\n"
        "x = _names._flag(runtime._cache, runtime.for_mesh, _names.__name__)\n"
    )
    assert sorted(_private_imports("torch_tp.style.linear", source)) == [
        "torch_tp._names",
        "torch_tp._names._flag",
        "torch_tp.runtime._cache",
        "torch_tp.style._sibling",
        "torch_tp.style.base._helper",
    ]


def _style_type_checks(source: str, styles: set[str]) -> list[str]:
    """The ``isinstance``/``issubclass`` calls and ``type(x) is`` comparisons in ``source``
    that name one of ``styles`` (class names), as ``line: name``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        named = []
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
            "isinstance",
            "issubclass",
        ):
            if len(node.args) == 2:
                kinds = node.args[1]
                named = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Call):
            if getattr(node.left.func, "id", None) == "type":
                named = node.comparators
        for kind in named:
            name = getattr(kind, "id", None) or getattr(kind, "attr", None)
            if name in styles:
                found.append(f"{node.lineno}: {name}")
    return found


BUILT_IN_STYLES = set(torch_tp.style.__all__) - {"ParallelStyle"}


def test_nothing_outside_the_styles_asks_which_style_it_is():
    """Code outside ``torch_tp.style`` reads a style's contract, never its class: a user's
    style with the same contract gets the same service."""
    found = {
        module: _style_type_checks(path.read_text(encoding="utf-8"), BUILT_IN_STYLES)
        for module, path in MODULES.items()
        if module != "torch_tp.style" and not module.startswith("torch_tp.style.")
    }
    assert not {module: checks for module, checks in found.items() if checks}


def test_the_style_type_check_finds_what_it_looks_for():
    source = (
        "isinstance(s, RowwiseParallel)\n"
        "isinstance(s, (nn.Linear, torch_tp.ColwiseParallel))\n"
        "type(s) is SequenceParallel\n"
        "isinstance(m, nn.Linear)\n"
    )
    assert _style_type_checks(source, BUILT_IN_STYLES) == [
        "1: RowwiseParallel",
        "2: ColwiseParallel",
        "3: SequenceParallel",
    ]


@pytest.mark.slow  # a Python process of its own
def test_public_paths_come_with_the_package():
    """``import torch_tp`` alone makes every public module path an attribute (a fresh
    interpreter: here, other tests may have imported them already)."""
    import subprocess
    import sys

    names = ("api", "plan", "style", "contract", "random", "loss", "checkpoint", "report")
    code = f"import torch_tp; [getattr(torch_tp, name) for name in {names!r}]"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
