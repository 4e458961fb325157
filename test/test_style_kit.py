"""The style kit is what the built-in styles compute with, and a user style gets it whole.

The guide's "Writing your own style" example, :class:`GatherColumns`, is written with the
public kit only (``torch_tp.runtime`` and ``torch_tp.style.base``). Here it runs as the
guide's block defines it: at parity with one device, issuing the collectives of the built-in
``ColwiseParallel(output_layouts=Replicate())``, and through the same runtime path: under the
fast runtime its output comes from the same region Function as the built-in's, and under the
plain-DTensor runtime from DTensor, as the built-in's does.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
from pathlib import Path

import torch
from helpers import tp_mesh
from torch import nn
from torch.distributed.tensor import Replicate

import torch_tp
from torch_tp import ColwiseParallel, parallelize_module, runtime
from torch_tp.style import base
from torch_tp.testing import run_distributed

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"
MODULE = "_guide_style_kit_example"


def _example_path(tmp_path: Path) -> str:
    """The guide's block that defines ``GatherColumns``, written to a file."""
    blocks = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(encoding="utf-8"), re.M | re.S)
    (code,) = [block for block in blocks if "class GatherColumns" in block]
    path = tmp_path / f"{MODULE}.py"
    path.write_text(code, encoding="utf-8")
    return str(path)


def _load(path: str):
    """The example as a module, loaded once per process (its class registers a plan name)."""
    if MODULE not in sys.modules:
        spec = importlib.util.spec_from_file_location(MODULE, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[MODULE] = module
        spec.loader.exec_module(module)
    return sys.modules[MODULE]


@contextlib.contextmanager
def _runtime_mode(mode: str):
    previous = os.environ.get(runtime.RUNTIME_ENV)
    os.environ[runtime.RUNTIME_ENV] = mode
    try:
        yield
    finally:
        if previous is None:
            del os.environ[runtime.RUNTIME_ENV]
        else:
            os.environ[runtime.RUNTIME_ENV] = previous


def _output_function(style, mesh) -> str:
    """The autograd node that made the output of a Linear parallelized with ``style``."""
    torch.manual_seed(0)
    with torch.device(mesh.device_type):
        layer = parallelize_module(nn.Linear(16, 32), mesh, style)
        x = torch.randn(4, 16, requires_grad=True)
    return type(layer(x).grad_fn).__name__


def _guide_example(path: str) -> None:
    example = _load(path)
    mesh = tp_mesh()
    example.main()  # parity with one device, and the built-in's collectives
    made_by = {}
    for mode in ("fast", "dtensor"):
        with _runtime_mode(mode):
            mine = _output_function(example.GatherColumns(), mesh)
            builtin = _output_function(ColwiseParallel(output_layouts=Replicate()), mesh)
            counts = example.collectives(example.GatherColumns(), mesh)
        assert mine == builtin, (mode, mine, builtin)
        assert sum(counts.values()) == 2, counts  # the gather forward, the all-reduce back
        made_by[mode] = mine
    # the fast runtime's gather is a region Function of its own, not DTensor's
    assert made_by["fast"] != made_by["dtensor"], made_by


def test_the_guides_own_style_runs_on_the_kits_fast_path(tmp_path):
    run_distributed(_guide_example, 2, _example_path(tmp_path))


def test_the_kit_is_public_and_the_built_ins_use_it():
    """Every name the guide's kit section presents is public, and the built-in families read
    no private name of the runtime or of the regions beneath it."""
    kit = GUIDE.read_text(encoding="utf-8").split("#### The style kit", 1)[1].split("\n#", 1)[0]
    for dotted in re.findall(r"`(torch_tp\.[\w.]+)\(", kit):
        module, name = dotted.rsplit(".", 1)
        assert name in importlib.import_module(module).__all__, dotted
    assert {"for_mesh", "normalize", "shard_range"} <= set(runtime.__all__)
    assert {"distribute_parameters", "run_on_local_parameters"} <= set(base.__all__)
    assert torch_tp.runtime is runtime
    styles = Path(base.__file__).parent
    for path in styles.glob("*.py"):
        source = path.read_text(encoding="utf-8")
        private = re.findall(r"\b(?:runtime|boundaries)\._\w+", source)
        assert not private, (path.name, private)
        # the kit is all of the runtime a style reads: nothing beneath it
        assert "runtime.boundaries" not in source and "_regions" not in source, path.name
