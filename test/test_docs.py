"""The documentation keeps its promises: commands, examples and references still work.

These tests read README.md, CONTRIBUTING.md, .ci/run and docs/ as text. The examples that
can run on CPU are run (on 2 ranks, through ``torch_tp.testing``); the plan in the README,
written for a GPU job, is at least resolved against the reference Llama.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

import torch_tp
from torch_tp.models import Llama, tiny_config
from torch_tp.plan import resolve_plan
from torch_tp.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CONTRIBUTING = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
GUIDE = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
API = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def _code_blocks(markdown: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", markdown, flags=re.M | re.S)


def _section(markdown: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    match = re.search(rf"^(#+) {re.escape(heading)}$", markdown, flags=re.M)
    assert match, f"no heading {heading!r}"
    level = len(match.group(1))
    rest = markdown[match.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, flags=re.M)
    return rest[: end.start()] if end else rest


# --------------------------------------------------------------------------- quick start


def _quick_start_commands() -> list[str]:
    return [block.strip() for block in _code_blocks(_section(README, "Quick start"), "sh")]


def test_quick_start_is_two_single_line_commands():
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    for command in commands:
        assert "\n" not in command, command
        # torch first (the CPU build), then the package, inside a venv (no root needed)
        assert command.startswith("python3 -m venv .venv && . .venv/bin/activate && ")
        assert command.index("pip install torch==2.13.0") < command.index("pip install -e")
    assert commands[0].endswith("python -m torch_tp demo")
    assert commands[1].endswith("python -m pytest")
    assert "'.[test]'" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = _quick_start_commands()[1]
    ci_lines = [line.strip() for line in CI.splitlines()]
    assert any(line.startswith(test_command) for line in ci_lines), (
        ".ci/run must run the README's quick-start test command character for character"
    )
    assert "set -euo pipefail" in CI
    for check in ("ruff check .", "ruff format --check .", "mkdocs build --strict"):
        assert check in ci_lines, check


# --------------------------------------------------------------------------- references


def test_version_matches_setup_py():
    setup_py = (ROOT / "setup.py").read_text(encoding="utf-8")
    assert f'version="{torch_tp.__version__}"' in setup_py


def _resolve(dotted: str) -> object:
    """Import the longest module prefix of ``dotted``, then walk the attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("name", re.findall(r"^::: ([\w.]+)", API, flags=re.M))
def test_api_reference_objects_exist(name):
    obj = _resolve(name)
    assert obj.__doc__, f"{name} has no docstring for the API reference"


def test_api_reference_covers_the_public_api():
    documented = set(re.findall(r"^::: torch_tp\.(\w+)$", API, flags=re.M))
    exported = {name for name in torch_tp.__all__ if not _is_module(getattr(torch_tp, name))}
    assert exported <= documented, f"undocumented: {sorted(exported - documented)}"


def _is_module(obj: object) -> bool:
    return type(obj).__name__ == "module"


def test_nav_pages_exist():
    mkdocs_yml = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = re.findall(r"^\s+- [^:\n]+: ([\w/.-]+\.md)$", mkdocs_yml, flags=re.M)
    assert pages, "mkdocs.yml has no nav"
    for page in pages:
        assert (ROOT / "docs" / page).is_file(), page


def test_readme_plan_resolves_on_the_reference_llama():
    """The README's plan is for a GPU job; its keys must still name real Llama modules."""
    (example,) = [b for b in _code_blocks(README, "python") if "parallelize_module" in b]
    tree = ast.parse(example)
    plans = [node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)]
    plans = [node for node in plans if isinstance(node, ast.Dict)]
    assert len(plans) == 1, "expected one `plan = {...}` in the README example"
    namespace = {name: getattr(torch_tp, name) for name in torch_tp.__all__}
    plan = eval(compile(ast.Expression(plans[0]), "README.md", "eval"), namespace)
    entries = resolve_plan(Llama(tiny_config(n_layers=2)), plan, strict=True)
    assert len(entries) == 2 * len(plan)


# --------------------------------------------------------------------------- rules


def test_nothing_in_torch_tp_imports_upstream_tensor_parallel():
    upstream = "torch.distributed.tensor.parallel"
    offenders = []
    for path in sorted((ROOT / "torch_tp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            if any(n == upstream or n.startswith(upstream + ".") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"torch_tp must not import {upstream}: {offenders}"


# --------------------------------------------------------------------------- runnable examples


def _load_example(markdown: str, marker: str, tmp_path: Path, monkeypatch):
    """Write the python block of ``markdown`` containing ``marker`` to a module, import it.

    The module stays importable for the test (the harness pickles its functions by
    reference, and its workers get the caller's ``sys.path``); its name is unique.
    """
    (code,) = [b for b in _code_blocks(markdown, "python") if marker in b]
    name = f"_doc_example_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(code), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


def test_guide_testing_example_passes(tmp_path, monkeypatch):
    module = _load_example(GUIDE, "def test_llama_parity", tmp_path, monkeypatch)
    for sequence_parallel in (False, True):
        run_distributed(module._llama_parity, 2, sequence_parallel)


def test_contributing_harness_example_passes(tmp_path, monkeypatch):
    module = _load_example(CONTRIBUTING, "def test_mlp_parity", tmp_path, monkeypatch)
    module.test_mlp_parity()


# --------------------------------------------------------------------------- docs tooling


def test_pytorch_docstrings_become_google_style():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        from griffe_pytorch import pytorch_to_google
    finally:
        sys.path.remove(str(ROOT / "docs"))
    docstring = textwrap.dedent(
        """\
        Shard a :class:`~torch.nn.Linear`.

        Args:
            module (:class:`nn.Module`): the module.
            plan (Union[:class:`ParallelStyle`, Dict[str, :class:`~a.P`]],
                optional): see :func:`parallelize_module`.

        Example::
            >>> # xdoctest: +SKIP("distributed")
            >>> parallelize_module(m, mesh, plan)

        .. note:: Read `the paper <https://arxiv.org/abs/2205.05198>`__ first.
            It is short.
        """
    )
    assert pytorch_to_google(docstring) == textwrap.dedent(
        """\
        Shard a `Linear`.

        Args:
            module (nn.Module): the module.
            plan (Union[ParallelStyle, Dict[str, P]], optional): see `parallelize_module`.

        Examples:
            >>> parallelize_module(m, mesh, plan)

        Note:
            Read [the paper](https://arxiv.org/abs/2205.05198) first.
            It is short.
        """
    )
