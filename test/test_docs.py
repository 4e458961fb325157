"""The documentation keeps its promises: commands, examples and references still work.

These tests read README.md, CONTRIBUTING.md, .ci/run and docs/ as text. Every fenced python
block of README.md and docs/ runs as pasted, on CPU where there is no GPU (the slow test runs
them all under ``torchrun --nproc-per-node 2``), unless the line above it is
``<!-- fragment -->``; the guide's and CONTRIBUTING's test examples also run as tests (on 2
ranks, through ``torch_tp.testing``), and the README's plan is resolved against the
reference Llama.
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


def test_api_reference_maps_every_module():
    """The API page's "Where the code is" tables name every module of the package whose path
    has no private part: a module added, moved or removed changes the page."""
    import pkgutil

    def walk(package):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            if not any(part.startswith("_") for part in info.name.split(".")[1:]):
                yield info.name
                if info.ispkg:
                    yield from walk(importlib.import_module(info.name))

    modules = set(walk(torch_tp))
    section = API[API.index("## Where the code is") : API.index("## Applying a plan")]
    named = set(re.findall(r"`(torch_tp(?:\.\w+)+)`", section))
    assert "torch_tp.style.linear" in modules and "torch_tp.checkpoint.dcp" in modules
    assert modules - named == set(), f"modules the API page does not map: {modules - named}"
    assert named - modules == set(), f"the API page maps no such modules: {named - modules}"


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


@pytest.mark.slow  # a Python process of its own, importing torch and transformers
@pytest.mark.parametrize("package", ["peft", "transformers"])
def test_import_torch_tp_does_not_import_optional_packages(package):
    """The extras stay optional (setup.py's ``peft``; transformers only for
    ``torch_tp.plans.hf``): a fresh interpreter importing torch_tp, and the modules that host
    PEFT's adapters and plan transformers models, has not imported them."""
    import subprocess

    modules = ("torch_tp", "torch_tp.style.adapters", "torch_tp.plans.hf")
    code = (
        f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] == {package!r}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", f"importing torch_tp imported {proc.stdout.strip()}"


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


# --------------------------------------------------------------------------- every code block

FRAGMENT = "<!-- fragment -->"
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK_RANKS = 2  # the ranks the blocks run on (torchrun --nproc-per-node 2)


def _python_blocks() -> list[tuple[str, str, bool]]:
    """Every fenced python block of README.md and docs/: ``(where, code, is_fragment)``,
    ``where`` as ``docs/guide.md:33`` (the line of the opening fence). A block is a fragment
    when the line right above its fence is ``<!-- fragment -->``."""
    blocks = []
    for page in DOC_PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        start = None
        for number, line in enumerate(lines):
            if start is None and line.strip() == "```python":
                start = number
            elif start is not None and line.strip() == "```":
                where = f"{page.relative_to(ROOT)}:{start + 1}"
                fragment = start > 0 and lines[start - 1].strip() == FRAGMENT
                blocks.append((where, "\n".join(lines[start + 1 : number]) + "\n", fragment))
                start = None
    return blocks


def test_every_python_block_runs_as_pasted_or_is_marked_a_fragment():
    """The cheap half of the promise: a block that claims to run parses, chooses its device by
    what is available rather than naming "cuda", and fragments stay a minority. (The slow
    test below runs them.)"""
    blocks = _python_blocks()
    assert blocks, "no python blocks found"
    problems = []
    for where, code, fragment in blocks:
        if fragment:
            continue
        try:
            ast.parse(code, filename=where)
        except SyntaxError as err:
            problems.append(f"{where}: does not parse ({err.msg}, line {err.lineno})")
            continue
        if re.search(r"[\"']cuda[\"']", code) and "is_available()" not in code:
            problems.append(f'{where}: names "cuda" without checking torch.cuda.is_available()')
    assert not problems, (
        "mark a block that cannot run as pasted with " + FRAGMENT + ":\n" + ("\n".join(problems))
    )
    fragments = [where for where, _, fragment in blocks if fragment]
    assert len(fragments) < len(blocks) / 2, f"most blocks are fragments: {fragments}"


# Runs every non-fragment block, one after the other, as `python block.py` would under
# `torchrun --nproc-per-node 2` (one torchrun for all: starting ranks costs more than the
# blocks do). The process group is made once, with a timeout, so a block that leaves one
# rank waiting fails instead of hanging; destroy_process_group is a no-op until the end.
_BLOCK_DRIVER = """
import datetime, os, runpy, sys, traceback
import torch.distributed as dist

dist.init_process_group(timeout=datetime.timedelta(seconds=120))
destroy = dist.destroy_process_group
dist.destroy_process_group = lambda *args, **kwargs: None
initialized = dist.init_process_group
dist.init_process_group = lambda *a, **k: None if dist.is_initialized() else initialized(*a, **k)
failed = []
for where, path in {blocks!r}:
    try:
        runpy.run_path(path, run_name="__main__")
    except BaseException:
        failed.append(where)
        print(f"BLOCK FAILED {{where}} on rank {{dist.get_rank()}}:", file=sys.stderr)
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    dist.barrier()
print(f"rank {{dist.get_rank()}} failed: {{failed}}", flush=True)
destroy()
os._exit(0)
"""


@pytest.mark.slow  # a torchrun of its own, running some 30 blocks
def test_every_python_block_that_is_not_a_fragment_runs(tmp_path):
    import os
    import subprocess

    runnable = [(where, code) for where, code, fragment in _python_blocks() if not fragment]
    paths = []
    for index, (where, code) in enumerate(runnable):
        path = tmp_path / f"block_{index:02d}.py"
        path.write_text(code, encoding="utf-8")
        paths.append((where, str(path)))
    driver = tmp_path / "driver.py"
    driver.write_text(_BLOCK_DRIVER.format(blocks=paths), encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    work = tmp_path / "cwd"  # what the blocks write (checkpoints, exports) goes here
    work.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={BLOCK_RANKS}", str(driver)]
    proc = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    # the ranks share one pipe: their summary lines may come out run together
    summary = re.findall(r"rank (\d+) failed: (\[[^\]]*\])", proc.stdout)
    assert proc.returncode == 0 and len(summary) == BLOCK_RANKS, output[-8000:]
    assert all(failed == "[]" for _, failed in summary), "\n".join([str(summary), output[-12000:]])


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
