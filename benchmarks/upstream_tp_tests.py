"""Run PyTorch's own tensor-parallel tests against upstream and against torch_tp.

PyTorch's tests of ``torch.distributed.tensor.parallel`` (``test/distributed/tensor/parallel/``
in the PyTorch repository) are not shipped with the wheel and are not part of this
repository: pass a directory holding them. The script copies each ``test_*.py`` twice into a
scratch directory:

- **upstream**: the file as it is, but for the adaptations to the installed torch listed by
  :func:`adapt_to_installed_torch` (none changes what a test checks);
- **torch_tp**: the same, with every import of a public name of
  ``torch.distributed.tensor.parallel`` (and of its ``style`` and ``api`` submodules) that
  torch_tp also exports rewritten to ``from torch_tp import ...`` (:func:`rewrite_for_torch_tp`).
  Names torch_tp does not export (``input_reshard``, private helpers) keep their upstream
  import; so does the test harness (``common_dtensor.Transformer.parallelize`` uses upstream's
  styles, and only GPU-only tests call it).

Each copy runs in one pytest process per file (one at a time, with a wall-clock limit per
file), on CPU: the ``DTensorTestBase`` classes spawn their ranks (4 by default) over gloo;
the ``...WithLocalTensor`` classes PyTorch derives from them run every rank in one process
under ``torch.distributed._local_tensor.LocalTensorMode`` on a fake process group. The script
prints one table per mode: each test, its result on upstream and on torch_tp, and for a
failure the first line of its error, then the counts.

Example::

    python benchmarks/upstream_tp_tests.py /path/to/pytorch/test/distributed/tensor/parallel
    python benchmarks/upstream_tp_tests.py DIR --files test_tp_style.py --markdown
    python benchmarks/upstream_tp_tests.py DIR --json results.json

Results are never asserted by the test suite; the counts and the deviations they show are in
``docs/differences_from_upstream.md``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# The modules whose public names torch_tp replaces (torch_tp is a drop-in for the package).
_UPSTREAM_MODULES = (
    "torch.distributed.tensor.parallel",
    "torch.distributed.tensor.parallel.style",
    "torch.distributed.tensor.parallel.api",
    "torch.distributed.tensor.parallel.loss",
)
# The files of test/distributed/tensor/parallel/ that test what torch_tp replaces (the others
# test FSDP/DDP compositions, micro-pipeline TP on GPUs, or upstream's private helpers).
DEFAULT_FILES = (
    "test_tp_style.py",
    "test_parallelize_api.py",
    "test_tp_examples.py",
    "test_tp_random_state.py",
    "test_tp_examples_compile.py",
)
_LOCAL_SUFFIX = "WithLocalTensor"
_ERROR_LINE = re.compile(r"^\s*((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit)\b.*)$")


@dataclass
class Result:
    """One test's outcome in one copy."""

    outcome: str  # "passed", "failed", "error", "skipped" (and in reports "missing", "not run")
    message: str = ""
    seconds: float = 0.0


def torch_tp_names() -> set[str]:
    """The public names torch_tp exports (what an import may be rewritten to)."""
    sys.path.insert(0, str(REPO_ROOT))
    import torch_tp

    return set(torch_tp.__all__)


def adapt_to_installed_torch(source: str) -> tuple[str, list[str]]:
    """Adapt a test file from a newer PyTorch to the installed torch's test harness.

    PyTorch's test files follow their repository's ``torch.testing._internal``, which the wheel
    ships as it was when the wheel was built. Two changes in newer test files are undone here,
    only where the installed torch lacks them:

    - ``HardwareClassification`` (a CI label, ``hw_classification = ...`` on each class) is
      removed when ``torch.testing._internal.common_utils`` has no such name;
    - ``instantiate_device_type_tests(Cls, globals(), except_for=["cpu"], ...)`` deletes the
      generic class, so on a machine without an accelerator nothing of ``Cls`` runs over gloo
      (only its LocalTensor copy). Before that change the generic class ran on CPU over gloo;
      it is kept, expanded with ``instantiate_parametrized_tests`` before its LocalTensor copy
      is made, as those files did.

    Returns:
        The adapted source and a list of what was changed (empty if nothing).
    """
    import torch.testing._internal.common_utils as common_utils

    changes: list[str] = []
    if not hasattr(common_utils, "HardwareClassification") and "HardwareClassification" in source:
        source, n_attr = re.subn(
            r"(?m)^[ \t]*hw_classification = HardwareClassification\.\w+\n(\s*\n)?", "", source
        )
        source = re.sub(r"\bHardwareClassification,\s*", "", source)
        source = re.sub(r",\s*HardwareClassification\b", "", source)
        changes.append(f"dropped HardwareClassification ({n_attr} class label(s))")

    pattern = re.compile(
        r"instantiate_device_type_tests\(\s*(\w+)\s*,\s*globals\(\)\s*,"
        r"(?P<rest>[^)]*except_for=\[\s*\"cpu\"\s*\][^)]*)\)"
    )
    kept = pattern.findall(source)
    if kept:
        source = pattern.sub("", source)
        for cls, _ in kept:
            # expanded before its LocalTensor copy is made, as the files did then: expanding it
            # after the copy breaks the copy's parametrized tests (they share the functions)
            # (and so not expanded again: it holds the expanded tests)
            copy = re.compile(rf"(?m)^(\w+) = create_local_tensor_test_class\(\s*{cls}\b")
            found = copy.search(source)
            at = found.start() if found else len(source)
            source = f"{source[:at]}instantiate_parametrized_tests({cls})\n{source[at:]}"
            if found:
                again = rf"(?m)^instantiate_parametrized_tests\({found.group(1)}\)\n"
                source = re.sub(again, "", source)
        imported = r"(?m)^from torch\.testing\._internal\.common_utils import .*\b"
        if not re.search(imported + "instantiate_parametrized_tests", source) and not re.search(
            r"\binstantiate_parametrized_tests,", source
        ):
            source = (
                "from torch.testing._internal.common_utils import instantiate_parametrized_tests\n"
                + source
            )
        names = ", ".join(cls for cls, _ in kept)
        changes.append(
            f"kept the generic class(es) {names} on CPU"
            " (instantiate_device_type_tests(except_for=['cpu']))"
        )
    return source, changes


def rewrite_for_torch_tp(source: str, exported: set[str]) -> tuple[str, list[str]]:
    """Rewrite the imports of upstream's public TP names to torch_tp's.

    Every ``from torch.distributed.tensor.parallel[.style|.api|.loss] import A, B`` becomes
    ``from torch_tp import A, B`` for the names torch_tp exports; the others stay imported from
    upstream. Any other mention of the package (``import torch.distributed.tensor.parallel``,
    an attribute path in code) is reported, not rewritten.

    Returns:
        The rewritten source and the names moved, as ``module.name`` strings.
    """
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []
    moved: list[str] = []
    for node in ast.walk(tree):
        if (
            not isinstance(node, ast.ImportFrom)
            or node.module not in _UPSTREAM_MODULES
            or node.level
        ):
            continue
        ours = [a for a in node.names if a.name in exported]
        theirs = [a for a in node.names if a.name not in exported]
        if not ours:
            continue

        def _names(aliases: list[ast.alias]) -> str:
            return ", ".join(
                a.name if a.asname is None else f"{a.name} as {a.asname}" for a in aliases
            )

        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
        text = f"{indent}from torch_tp import {_names(ours)}\n"
        if theirs:
            text += f"{indent}from {node.module} import {_names(theirs)}\n"
        edits.append((node.lineno - 1, node.end_lineno, text))
        moved += [f"{node.module}.{a.name}" for a in ours]
    for start, end, text in sorted(edits, reverse=True):
        lines[start:end] = [text]
    rewritten = "".join(lines)
    for left in sorted(set(re.findall(r"torch\.distributed\.tensor\.parallel[\w.]*", rewritten))):
        if not any(f"from {left} import" in line for line in rewritten.splitlines()):
            moved.append(f"NOT rewritten: {left}")
    return rewritten, moved


def _first_error_line(text: str, test_file: str) -> str:
    """What failed, in one line: the exception (with the first line of its details, e.g.
    "Expected 1 but got 0.") and the test's own source line that raised it.

    A rank's traceback arrives inside the parent's ("Process 0 exited with error code 10 and
    exception: ..."): the rank's exception is the one reported."""
    lines = text.splitlines()
    # pytest marks the error's own lines "E   "; the rest is the source it prints around them
    if any(line.startswith("E ") for line in lines):
        lines = [line[1:].lstrip() if line.startswith("E ") else "" for line in lines]
    error, where = "", ""
    for index, line in enumerate(lines):
        match = _ERROR_LINE.match(line)
        if not match or re.match(r"(RuntimeError|Exception): Process \d+ ", match.group(1)):
            continue
        error = match.group(1).strip()
        detail = next((ln.strip() for ln in lines[index + 1 : index + 4] if ln.strip()), "")
        if error.endswith("!") and detail and not detail.startswith("To execute"):
            error = f"{error} {detail}"
        break
    frame = re.compile(rf'File ".*{re.escape(test_file)}", line (\d+), in (\w+)')
    for index, line in enumerate(lines):
        if (match := frame.search(line)) and index + 1 < len(lines):
            where = f"{lines[index + 1].strip()}` (line {match.group(1)})"
    if not where:
        marked = [ln[1:].strip() for ln in text.splitlines() if ln.startswith(">")]
        where = f"{marked[-1]}`" if marked else ""
    if not error:
        error = next((ln.strip() for ln in lines if ln.strip()), "")
    return (f"{error} at `{where}" if where else error)[:240]


def _parse_junit(path: Path, test_file: str) -> dict[str, Result]:
    results: dict[str, Result] = {}
    if not path.exists():
        return results
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        seconds = float(case.get("time") or 0.0)
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                body = (element.text or "") + "\n" + (element.get("message") or "")
                message = (
                    (element.get("message") or "").splitlines()[0]
                    if kind == "skipped" and element.get("message")
                    else _first_error_line(body, test_file)
                )
                break
        results[test_id] = Result(outcome, message, seconds)
    return results


def run_file(
    path: Path, mode: str, timeout: float, log_dir: Path, test_ids: list[str] | None = None
) -> tuple[dict[str, Result], float]:
    """Run one test file's tests of one mode (``"gloo"`` or ``"local"``) with pytest, in a
    process of its own: all of them, or only ``test_ids`` (``Class::test``). Returns results by
    test id and the wall time. A run past ``timeout`` is killed; its tests without a result
    are missing from the results."""
    junit = log_dir / f"{path.parent.name}-{mode}-{path.stem}.xml"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        f"--rootdir={path.parent}",
        f"--junitxml={junit}",
        *(
            [f"{path}::{test_id}" for test_id in test_ids]
            if test_ids
            else [str(path), "-k", _LOCAL_SUFFIX if mode == "local" else f"not {_LOCAL_SUFFIX}"]
        ),
    ]
    start = time.monotonic()
    log = log_dir / f"{path.parent.name}-{mode}-{path.stem}.log"
    with open(log, "w") as out:
        try:
            subprocess.run(
                command,
                cwd=path.parent,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            out.write(f"\n[upstream_tp_tests] killed after {timeout:.0f} s\n")
    return _parse_junit(junit, path.name), time.monotonic() - start


def _mode(test_id: str) -> str:
    return "LocalTensorMode" if test_id.split("::")[0].endswith(_LOCAL_SUFFIX) else "gloo"


def _table(rows: list[list[str]], header: list[str], markdown: bool) -> str:
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
        return "\n".join(out)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    widths[-1] = 0
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join(
        [fmt(header), fmt(["-" * w for w in widths[:-1]] + ["-----"]), *map(fmt, rows)]
    )


def report(upstream: dict[str, Result], ours: dict[str, Result], markdown: bool) -> str:
    """The tables and the counts, by mode. A test absent from ``upstream`` was not run there
    (``--upstream failures`` runs upstream's copy only where torch_tp does not pass)."""
    not_run = Result("not run")
    sections = []
    for mode in ("gloo", "LocalTensorMode"):
        ids = sorted(t for t in set(upstream) | set(ours) if _mode(t) == mode)
        if not ids:
            continue
        rows = []
        for test_id in ids:
            up = upstream.get(test_id, not_run)
            tp = ours.get(test_id, Result("missing"))
            note = ""
            if tp.outcome in ("failed", "error", "missing"):
                note = tp.message or "(no result: the file timed out or did not collect)"
                if up.outcome not in ("passed", "not run"):
                    note = f"[fails upstream too] {note}"
            elif up.outcome in ("failed", "error"):
                note = f"upstream only: {up.message}"
            rows.append([test_id.replace(_LOCAL_SUFFIX, ""), up.outcome, tp.outcome, note])
        outcomes = [ours.get(t, Result("missing")).outcome for t in ids]
        failing = [
            t for t in ids if ours.get(t, Result("missing")).outcome not in ("passed", "skipped")
        ]
        only_tp = sum(upstream.get(t, not_run).outcome == "passed" for t in failing)
        both = sum(
            upstream.get(t, not_run).outcome in ("failed", "error", "missing") for t in failing
        )
        ran_up = [upstream[t].outcome for t in ids if t in upstream]
        title = f"### {mode}" if markdown else f"== {mode} =="
        summary = (
            f"{mode}: torch_tp passes {outcomes.count('passed')} of {len(ids)}"
            f" ({outcomes.count('skipped')} skipped on this machine, {len(failing)} not passing:"
            f" {only_tp} pass upstream, {both} fail upstream too,"
            f" {len(failing) - only_tp - both} not run upstream)"
        )
        if len(ran_up) == len(ids):
            summary += f"; upstream passes {ran_up.count('passed')} of {len(ids)}"
        sections.append(
            f"{title}\n\n"
            + _table(
                rows, ["test", "upstream", "torch_tp", "torch_tp error (first line)"], markdown
            )
            + f"\n\n{summary}\n"
        )
    return "\n".join(sections)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "tests_dir", type=Path, help="directory of PyTorch's test/distributed/tensor/parallel files"
    )
    parser.add_argument(
        "--files",
        default=",".join(DEFAULT_FILES),
        help="comma-separated test files to run (those present; default: %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="wall-clock seconds per pytest run: one file, one mode, one copy (default 900)",
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="scratch directory (default: a new temporary one, kept)",
    )
    parser.add_argument(
        "--upstream",
        choices=("failures", "all", "none"),
        default="failures",
        help="which tests to run on upstream's copy: those torch_tp does not pass (default;"
        " a gloo test spawns 4 ranks, ~15-45 s each on 2 cores), all, or none",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    args = parser.parse_args(argv)

    files = [args.tests_dir / f for f in args.files.split(",") if (args.tests_dir / f).is_file()]
    if not files:
        parser.error(f"none of {args.files} is in {args.tests_dir}")
    work = args.work or Path(tempfile.mkdtemp(prefix="upstream_tp_tests_"))
    exported = torch_tp_names()
    copies = {"upstream": work / "upstream", "torch_tp": work / "torch_tp"}
    for directory in copies.values():
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    for path in files:
        adapted, changes = adapt_to_installed_torch(path.read_text())
        rewritten, moved = rewrite_for_torch_tp(adapted, exported)
        (copies["upstream"] / path.name).write_text(adapted)
        (copies["torch_tp"] / path.name).write_text(rewritten)
        print(
            f"{path.name}: {'; '.join(changes) or 'as it is'};"
            f" to torch_tp: {', '.join(moved) or 'nothing'}"
        )

    import torch

    print(
        f"\ntorch {torch.__version__} (git {torch.version.git_version[:12]});"
        f" scratch and logs: {work}\n",
        flush=True,
    )
    results: dict[str, dict[str, Result]] = {"upstream": {}, "torch_tp": {}}
    # LocalTensorMode first: one process per file, seconds per test; then gloo, whose tests
    # spawn their ranks each (the slow part on a small machine)
    for mode in ("local", "gloo"):
        for path in files:
            found, seconds = run_file(copies["torch_tp"] / path.name, mode, args.timeout, work)
            results["torch_tp"].update(found)
            print(
                f"  {mode:5} torch_tp {path.name}: {len(found)} tests, {seconds:.0f} s", flush=True
            )
            if args.upstream == "none":
                continue
            rerun = None
            if args.upstream == "failures":
                rerun = [t for t, r in found.items() if r.outcome not in ("passed", "skipped")]
                if not rerun:
                    continue
            found, seconds = run_file(
                copies["upstream"] / path.name, mode, args.timeout, work, rerun
            )
            results["upstream"].update(found)
            print(
                f"  {mode:5} upstream {path.name}: {len(found)} tests, {seconds:.0f} s", flush=True
            )
        if args.json:  # after each mode, so that a run stopped during gloo keeps LocalTensorMode's
            args.json.write_text(
                json.dumps(
                    {name: {t: asdict(r) for t, r in got.items()} for name, got in results.items()},
                    indent=1,
                )
            )
    print()
    print(report(results["upstream"], results["torch_tp"], args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
