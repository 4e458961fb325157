"""The command line: ``python -m torch_tp plan`` (:mod:`torch_tp.cli.plan`) and ``python -m torch_tp
demo`` (:mod:`torch_tp.cli.demo`); the entry point is ``torch_tp/__main__.py``."""
