"""Command line entry point: ``python -m torch_tp COMMAND [options]``.

Each command lives in its own module, which provides ``configure_parser(parser)``: it adds the
command's options and sets ``func``, the handler that takes the parsed arguments and returns
an exit status. A new command is one more line in ``_COMMANDS``; its module is imported only
when that command runs, so ``--help`` and the other commands do not pay for its imports.

Example::

    $ python -m torch_tp demo --steps 10
    $ torchrun --nproc-per-node 2 -m torch_tp demo
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

# name -> (module providing configure_parser, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "torch_tp._demo",
        "train a tiny Llama tensor-parallel and on one device, and compare the losses",
    ),
}


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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = _build_parser(command).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
