"""Private torch APIs go through ``torch_tp/_torch_compat.py`` and nowhere else.

A private torch name is anything reached through a ``_``-prefixed module or attribute of
torch: ``torch._C._current_graph_task_id``, ``torch.utils._pytree``, ``_StridedShard``, a
DTensor's ``_local_tensor``, a module's ``_parameters``. The static scan below finds them in
every file of ``torch_tp/`` but the compat module, so that a torch release that moves one
breaks one file, which says which versions it was checked on.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import torch_tp
from torch_tp import _torch_compat

PACKAGE = Path(torch_tp.__file__).resolve().parent
COMPAT = PACKAGE / "_torch_compat.py"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_private_attributes() -> set[str]:
    """The ``_``-prefixed attributes torch's own classes define (and instances carry)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    owners: list[object] = [
        torch.Tensor,
        DTensor,
        nn.Module,
        nn.Parameter,
        nn.Linear(1, 1),
        DeviceMesh,
        DTensorSpec,
        Shard,
        Replicate,
        Partial,
        torch.Generator,
        torch.autograd.Function,
        torch.autograd.Variable,
    ]
    names = {name for owner in owners for name in dir(owner) if _is_private(name)}
    names |= {name for name in vars(nn.Linear(1, 1)) if _is_private(name)}
    names |= {name for name in dir(torch.cuda) if _is_private(name)}
    # LocalTensorMode (one process simulating every rank) and its per-rank integers
    from torch.distributed import _local_tensor

    mode = _local_tensor.LocalTensorMode(2)
    for owner in (mode, _local_tensor.LocalIntNode({0: 1, 1: 2})):
        names |= {name for name in dir(owner) if _is_private(name)}
    return names


def _own_private_names() -> set[str]:
    """``_``-prefixed names torch_tp defines itself (functions, methods, attributes): a call
    like ``style._apply(...)`` is torch_tp's, even though ``nn.Module`` has an ``_apply`` too."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {name for name in names if _is_private(name)}


def scan(source: str, attributes: set[str]) -> list[tuple[int, str]]:
    """``(line, what)`` for every private torch name ``source`` uses.

    Flagged: importing a torch module with a ``_``-prefixed component, importing a
    ``_``-prefixed name from torch, an attribute chain that starts at a name bound to
    something of torch and goes through a ``_``-prefixed attribute, and any use of an
    attribute in ``attributes`` (the private attributes of torch's classes).
    """
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    torch_names: set[str] = set()  # names bound to torch modules or objects
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "torch":
                    continue
                torch_names.add(alias.asname or "torch")
                if any(_is_private(part) for part in alias.name.split(".")):
                    found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "torch":
                continue
            private_module = any(_is_private(part) for part in node.module.split("."))
            for alias in node.names:
                torch_names.add(alias.asname or alias.name)
                if private_module or _is_private(alias.name):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
    for node in ast.walk(tree):
        # getattr(x, "_name"), hasattr(...), setattr(...), x.__dict__["_name"]
        name = None
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            name, target = node.args[1].value, node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            value = node.value
            if isinstance(value, ast.Attribute) and value.attr == "__dict__":
                name, target = node.slice.value, value.value
        if isinstance(name, str) and _is_private(name):
            while isinstance(target, ast.Attribute):
                target = target.value
            on_torch = isinstance(target, ast.Name) and target.id in torch_names
            if name in attributes or on_torch:
                found.append((node.lineno, f"{name!r}"))
        if not isinstance(node, ast.Attribute):
            continue
        chain, root = [node.attr], node.value
        while isinstance(root, ast.Attribute):
            chain.append(root.attr)
            root = root.value
        if node.attr in attributes:
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(root, ast.Name) and root.id in torch_names:
            if _is_private(node.attr):
                found.append((node.lineno, ".".join([root.id, *reversed(chain)])))
    return sorted(set(found))


@pytest.fixture(scope="module")
def attributes() -> set[str]:
    return _torch_private_attributes() - _own_private_names()


@pytest.mark.parametrize(
    "path",
    sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p != COMPAT),
)
def test_no_private_torch_name_outside_the_compat_module(path, attributes):
    found = scan((PACKAGE / path).read_text(encoding="utf-8"), attributes)
    assert not found, "\n".join(
        f"torch_tp/{path}:{line}: {what} (go through torch_tp._torch_compat)"
        for line, what in found
    )


@pytest.mark.parametrize(
    "source",
    [
        "import torch._C",
        "import torch.utils._pytree as pytree",
        "from torch.utils._pytree import tree_leaves",
        "from torch.distributed.tensor.placement_types import _StridedShard",
        "import torch\ntorch._C._log_api_usage_once('x')",
        "from torch.autograd import Variable\nVariable._execution_engine.queue_callback(f)",
        "import torch\nnew = torch.Tensor._dtensor__new__",
        "local = value._local_tensor",
        "spec = value._spec",
        "params = module._parameters",
        "from torch.distributed.device_mesh import _mesh_resources",
        "from torch.nn.modules.module import _IncompatibleKeys",
        "version = t._version",
        "import torch\nnew = getattr(torch.Tensor, '_dtensor__new__', None)",
        "module.__dict__['_parameters'] = params",
        "states = mode._per_rank_rng_states",
        "ints = getattr(node, '_local_ints', None)",
        "import torch\ntorch._foreach_mul_(grads, scale)",
    ],
)
def test_the_scan_finds_each_kind(source, attributes):
    assert scan(textwrap.dedent(source), attributes), source


def test_the_scan_passes_public_and_own_names(attributes):
    source = """
        import torch
        from torch_tp.core.style import _arguments
        x = torch.nn.functional.linear(a, b)
        style._apply(module, mesh)
        value.__dict__.get("x")
        _torch_compat.local_tensor(value)
    """
    assert scan(textwrap.dedent(source), attributes) == []


def test_the_compat_module_resolves_every_name_on_this_torch():
    for name in _torch_compat.__all__:
        assert getattr(_torch_compat, name) is not None, name
    assert _torch_compat.SUPPORTED[0] <= _torch_compat.TORCH_VERSION < _torch_compat.SUPPORTED[1]
