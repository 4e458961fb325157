"""Private torch APIs go through ``torch_tp/_torch_compat.py`` and nowhere else.

A private torch name is anything reached through a ``_``-prefixed module or attribute of
torch: ``torch._C._current_graph_task_id``, ``torch.utils._pytree``, ``_StridedShard``, a
DTensor's ``_local_tensor``, a module's ``_parameters``. The static scan below finds them in
every file of ``torch_tp/`` but the compat module, so that a torch release that moves one
breaks one file, which says which versions it was checked on.
"""

from __future__ import annotations

import ast
import collections
import re
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

import torch_tp
from torch_tp import _torch_compat

PACKAGE = Path(torch_tp.__file__).resolve().parent
COMPAT = PACKAGE / "_torch_compat.py"

# a dotted path into torch, as importlib.import_module or a string annotation names it
_TORCH_PATH = re.compile(r"torch(\.\w+)+")

# torch's private attributes that torch_tp may name for its own: ParallelStyle's contract
# method (torch's nn.Module has an ``_apply`` too; a style is not a module)
_OWN_ON_PURPOSE = {"_apply"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_private_attributes() -> set[str]:
    """The ``_``-prefixed attributes torch's own classes define (and instances carry)."""
    owners: list[object] = [
        torch.Tensor,
        DTensor,
        nn.Module,
        nn.Parameter,
        nn.Linear(1, 1),
        nn.Embedding(1, 1),
        DeviceMesh,
        _torch_compat.DTensorSpec,
        _torch_compat.TensorMeta,
        Placement,
        Shard,
        _torch_compat.StridedShard(0, split_factor=2),
        Replicate,
        Partial,
        dist.ProcessGroup,
        torch.Generator,
        torch.autograd.Function,
        torch.autograd.Variable,
        torch.cuda,
    ]
    names = {name for owner in owners for name in dir(owner) if _is_private(name)}
    names |= {name for name in vars(nn.Linear(1, 1)) if _is_private(name)}
    # what torch.compile wraps a module in (``_orig_mod``)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names |= {name for name in dir(torch.compile(nn.Linear(1, 1))) if _is_private(name)}
    # LocalTensorMode (one process simulating every rank) and its per-rank integers
    from torch.distributed import _local_tensor

    mode = _local_tensor.LocalTensorMode(2)
    for owner in (mode, _local_tensor.LocalIntNode({0: 1, 1: 2})):
        names |= {name for name in dir(owner) if _is_private(name)}
    # Python's, not torch's: a namedtuple's public API (``_fields``, ``_replace``, ...)
    return names - set(dir(collections.namedtuple("Plain", "a")))


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
    something of torch and goes through a ``_``-prefixed attribute, any use of an attribute
    in ``attributes`` (the private attributes of torch's classes), and a string that is one of
    those attributes or a dotted torch path with a ``_``-prefixed component (for
    ``getattr``, ``__dict__[...]``, ``importlib.import_module``).
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
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if text in attributes:
                found.append((node.lineno, repr(text)))
            elif _TORCH_PATH.fullmatch(text) and any(map(_is_private, text.split("."))):
                found.append((node.lineno, repr(text)))
        # getattr(torch.x, "_name"), torch.x.__dict__["_name"]: a private name of any object
        # of torch, whether or not a class above defines it
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
        if isinstance(name, str) and _is_private(name) and name not in attributes:
            while isinstance(target, ast.Attribute):
                target = target.value
            if isinstance(target, ast.Name) and target.id in torch_names:
                found.append((node.lineno, repr(name)))
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


def test_own_names_hide_no_private_torch_attribute():
    # the scan lets torch_tp's own private names pass (``style._apply``); one that is also a
    # private attribute of torch's would hide every use of torch's under that name
    shadowed = _torch_private_attributes() & _own_private_names()
    assert shadowed <= _OWN_ON_PURPOSE, (
        f"torch_tp names its own {sorted(shadowed - _OWN_ON_PURPOSE)}, which torch's classes "
        "use privately: rename it, so that the scan still sees torch's"
    )


@pytest.mark.parametrize(
    "source",
    [
        # modules
        "import torch._C",
        "import torch.utils._pytree as pytree",
        "from torch.utils._pytree import tree_leaves",
        "import torch.distributed._functional_collectives as funcol",
        "from torch.distributed import _functional_collectives",
        "import torch.distributed as dist\ndist._functional_collectives.all_reduce(t, 'sum', g)",
        "from torch.distributed.tensor._utils import compute_local_shape_and_global_offset",
        "from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta",
        "import torch.distributed.tensor._dtensor_spec",
        "from torch.nn import _reduction\n_reduction.legacy_get_string(None, None)",
        "import torch.nn.functional as F\nF._Reduction.legacy_get_string(None, None)",
        "from torch.distributed._local_tensor import enabled_local_tensor_mode",
        "importlib.import_module('torch.distributed._local_tensor')",
        # names
        "from torch.distributed.tensor.placement_types import _StridedShard",
        "from torch.distributed.tensor import _StridedShard",
        "from torch.distributed.device_mesh import _mesh_resources",
        "from torch.nn.modules.module import _IncompatibleKeys",
        "import torch\ntorch._C._log_api_usage_once('x')",
        "import torch\ntorch._C._current_graph_task_id()",
        "import torch\ntorch._foreach_mul_(grads, scale)",
        "import torch\ntorch.cuda._lazy_init()",
        "import torch\ntorch.ops.c10d._allgather_base_",
        "from torch import nn\nnn.modules.module._IncompatibleKeys",
        "from torch.autograd import Variable\nVariable._execution_engine.queue_callback(f)",
        "import torch\nnew = torch.Tensor._dtensor__new__",
        "import torch\nnew = getattr(torch.Tensor, '_dtensor__new__', None)",
        "import torch.distributed.checkpoint as dcp\ndcp._whatever",
        # private attributes of torch's objects, on values of any name
        "local = value._local_tensor",
        "spec = value._spec",
        "chunks, _ = placement._split_tensor(t, 2, with_padding=False)",
        "version = t._version",
        "params = module._parameters",
        "children = module._modules",
        "buffers = module._buffers",
        "hooks = module._forward_pre_hooks",
        "module.__dict__['_parameters'] = params",
        "init = getattr(device_module, '_lazy_init', None)",
        "group._get_backend(device)",
        "states = mode._per_rank_rng_states",
        "ints = getattr(node, '_local_ints', None)",
        "inner = compiled._orig_mod",
        "PARTS = ('_orig_mod',)",
    ],
)
def test_the_scan_finds_each_kind(source, attributes):
    assert scan(textwrap.dedent(source), attributes), source


def test_the_scan_passes_public_and_own_names(attributes):
    source = """
        import torch
        import torch.distributed as dist
        from torch_tp.style.base import style_arguments
        x = torch.nn.functional.linear(a, b)
        style._apply(module, mesh)
        value.__dict__.get("x")
        obj.__dict__["_torch_tp_path"] = path
        getattr(style, "_validate", None)
        _torch_compat.local_tensor(value)
        dist.get_rank()
        name = "torch.distributed.tensor"
        doc = "see torch.distributed._local_tensor.LocalTensorMode, private"
    """
    assert scan(textwrap.dedent(source), attributes) == []


def test_the_compat_module_resolves_every_name_on_this_torch():
    for name in _torch_compat.__all__:
        assert getattr(_torch_compat, name) is not None, name
    assert _torch_compat.SUPPORTED[0] <= _torch_compat.TORCH_VERSION < _torch_compat.SUPPORTED[1]


def test_the_supported_range_is_the_one_setup_py_states():
    first, past_last = _torch_compat.SUPPORTED
    setup = (PACKAGE.parent / "setup.py").read_text(encoding="utf-8")
    assert f'"torch>={first[0]}.{first[1]},<{past_last[0]}.{past_last[1]}"' in setup


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.14.1", "2.15.0+cu132"])
def test_a_supported_torch_imports_quietly(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _torch_compat.check_version(version)


@pytest.mark.parametrize("version", ["2.12.1", "2.16.0", "2.16.0.dev20270101", "3.0.0", "main"])
def test_an_unsupported_torch_warns_and_goes_on(version):
    with pytest.warns(UserWarning, match=f"found {re.escape(version)}"):
        assert not _torch_compat.check_version(version)


def test_the_compiled_module_name_is_torch_compiles():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(nn.Linear(1, 1))
    names = [name for name, _ in compiled.named_parameters()]
    assert names == [f"{_torch_compat.COMPILED_MODULE_NAME}.{n}" for n in ("weight", "bias")]


def test_queue_callback_runs_at_the_end_of_backward():
    ran: list[int] = []
    weight = torch.ones(2, requires_grad=True)
    weight.register_hook(lambda grad: _torch_compat.queue_callback(lambda: ran.append(1)))
    (weight * 2).sum().backward()
    assert ran == [1]
    public = getattr(torch.autograd.graph, "queue_callback", None)
    assert public is None or _torch_compat.queue_callback is public


def test_direct_parameters_keep_empty_slots():
    linear = nn.Linear(2, 2, bias=False)
    assert _torch_compat.direct_parameters(linear) == {"weight": linear.weight, "bias": None}
    local = {"weight": torch.zeros(2, 2), "bias": None}
    params = _torch_compat.swap_direct_parameters(linear, local)
    try:
        assert torch.equal(linear(torch.ones(1, 2)), torch.zeros(1, 2))
    finally:
        _torch_compat.swap_direct_parameters(linear, params)
    assert linear.weight is params["weight"]


def test_lazy_init_calls_the_public_init_else_the_private_one_else_nothing():
    import types

    calls: list[str] = []
    public = types.SimpleNamespace(
        init=lambda: calls.append("init"), _lazy_init=lambda: calls.append("_lazy_init")
    )
    private = types.SimpleNamespace(_lazy_init=lambda: calls.append("_lazy_init"))
    _torch_compat.lazy_init(public)
    assert calls == ["init"]
    _torch_compat.lazy_init(private)
    assert calls == ["init", "_lazy_init"]
    _torch_compat.lazy_init(types.SimpleNamespace())  # nothing to initialize: nothing runs
    assert calls == ["init", "_lazy_init"]


def test_lazy_init_is_a_no_op_where_there_is_nothing_to_initialize():
    # torch.cpu has neither init() nor _lazy_init(): its random state and the default
    # generator are what they were
    state = torch.get_rng_state()
    generator = torch.default_generator
    _torch_compat.lazy_init(torch.cpu)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.default_generator is generator
