"""Packaging for torch_tp.

All project metadata lives here; ``pyproject.toml`` only declares the build system and the
tool configuration (ruff, pytest).

``torch`` is a range, never a bare name: CI and the README install ``torch==2.13.0`` (the CPU
build on the project's machine) first, and a requirement that this version already satisfies
keeps pip from replacing it with another (possibly multi-GB CUDA) build. It stays the first
requirement. The range is the tested one: CI runs the whole suite on 2.13.0 and again, in a
second virtualenv, on 2.15.0, the newest release; the private torch APIs torch_tp relies on
are all in ``torch_tp/_torch_compat.py`` (whose ``SUPPORTED`` states the same range).

The other two requirements are small and depend on nothing (in particular not on torch, so
they never pull a torch build of their own): ``numpy``, without which torch warns at import,
cannot send Python objects between ranks (``gather_object``, which DCP saves use) and
cannot import its DTensor debug tools (:mod:`torch_tp.testing` uses them); and
``safetensors``, which :mod:`torch_tp.checkpoint` reads and writes. The ``checkpoint`` extra,
which once installed ``safetensors``, is kept so that ``pip install 'torch_tp[checkpoint]'``
still works.
"""

from pathlib import Path

from setuptools import find_packages, setup

README = Path(__file__).parent / "README.md"

setup(
    name="torch_tp",
    version="0.1.0",
    description=(
        "PyTorch-native tensor parallelism on DTensor: a drop-in for "
        "torch.distributed.tensor.parallel with strict plans and atomic application"
    ),
    long_description=README.read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torch_tp", "torch_tp.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.13,<2.16", "numpy>=1.26,<3", "safetensors>=0.4"],
    extras_require={
        "test": [
            "pytest>=8",
            # two test processes (pyproject.toml's addopts)
            "pytest-xdist==3.8.0",
            "expecttest>=0.2",
            "ruff==0.17.6",
            # test/test_transformers.py checks the plans of torch_tp.plans.hf against the real
            # models; its requirements do not include torch (only its "torch" extra does)
            "transformers==5.23.0",
            # benchmarks/bench_moe.py compares with transformers' own TP/EP, which needs it
            "accelerate==1.15.0",
            # the tests of PEFT's LoRA under TP, docs/adapters.md, examples/lora_finetune.py
            # and benchmarks/bench_lora.py (the "peft" extra below)
            "peft==0.21.2",
        ],
        # PEFT's LoRA adapters on a torch_tp model (docs/adapters.md); `import torch_tp` never
        # imports peft. Its own "torch>=1.13" is met by the torch installed first
        "peft": ["peft==0.21.2"],
        # transformers models: plan_for, auto() on them, load_pretrained/save_pretrained
        # (docs/transformers.md); `import torch_tp` never imports transformers
        "hf": ["transformers==5.23.0", "accelerate==1.15.0"],
        # an alias kept for old install lines: safetensors is a plain requirement now
        "checkpoint": ["safetensors>=0.4"],
        "docs": [
            "mkdocs==1.6.1",
            "mkdocstrings[python]==1.0.8",
            # the handler decides how docstrings render and what warns (--strict fails on it)
            "mkdocstrings-python==2.0.11",
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Operating System :: POSIX :: Linux",
    ],
)
