"""Command line entry point: ``python -m torch_tp COMMAND [options]``.

Each command lives in its own module, which provides ``configure_parser(parser)``: it adds the
command's options and sets ``func``, the handler that takes the parsed arguments and returns
an exit status. A new command is one more line in ``_COMMANDS``; its module is imported only
when that command runs, so ``--help`` and the other commands do not pay for its imports.

A few commands forward to a script of the source checkout instead (``_SCRIPTS``): the script
runs as a child process with the remaining arguments, exactly as ``python SCRIPT ARGS`` would.

Example::

    $ python -m torch_tp demo --steps 10
    $ torchrun --nproc-per-node 2 -m torch_tp demo
    $ python -m torch_tp bench --sizes tiny
    $ python -m torch_tp plan --model llama3-8b --tp 8 --sequence-parallel
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

# name -> (module providing configure_parser, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "torch_tp.cli.demo",
        "train a tiny Llama tensor-parallel and on one device, and compare the losses",
    ),
    "plan": (
        "torch_tp.cli.plan",
        "dry-run a plan on the meta device: memory per rank, collectives per step, problems",
    ),
}

# name -> (script, relative to the repository root, one-line help)
_SCRIPTS: dict[str, tuple[str, str]] = {
    "bench": (
        "benchmarks/bench_tp.py",
        "time tensor-parallel training steps: torch_tp, upstream and a Megatron-style "
        "baseline (options: bench --help)",
    ),
}


def _run_script(name: str, argv: Sequence[str]) -> int:
    """Run the script behind command ``name`` with ``argv``; return its exit status."""
    relative = _SCRIPTS[name][0]
    script = Path(__file__).resolve().parents[1] / relative
    if not script.is_file():
        print(
            f"error: '{name}' runs {relative} of a source checkout of torch_tp, "
            f"not found at {script}",
            file=sys.stderr,
        )
        return 2
    return subprocess.call([sys.executable, str(script), *argv])


def _build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torch_tp",
        description="torch_tp: tensor parallelism for PyTorch, on DTensor.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in _COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        # Only the command being run needs its options (and its module's imports).
        if name == command:
            importlib.import_module(module_name).configure_parser(sub)
    for name, (_, help_text) in _SCRIPTS.items():
        subparsers.add_parser(name, help=help_text, description=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, return its exit status.

    A reader that stops reading early (``python -m torch_tp plan ... | head``) ends the
    command quietly, as Python's documentation recommends for ``SIGPIPE``: no traceback, the
    rest of the output discarded, and the command's own exit status if it had finished (1,
    Python's status for a broken pipe, if it had not).
    """
    status = 1
    try:
        status = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here rather than at interpreter exit
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at devnull so that it cannot fail
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return status


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command in _SCRIPTS:  # the script parses its own options, --help included
        return _run_script(command, argv[argv.index(command) + 1 :])
    args = _build_parser(command).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
