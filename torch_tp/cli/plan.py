"""``python -m torch_tp plan``: the dry-run report of a plan, printed as tables.

The model is built on the meta device (no memory for weights, no process group), its forward
is traced once, and :func:`torch_tp.report.plan_report` says what the plan shards, what each
rank holds, which collectives a training step issues, and what is wrong with the plan. The
exit status is 1 when the report finds an error, so the command can guard a plan in CI.

Models: ``llama-tiny`` (:func:`torch_tp.models.tiny_config`), ``llama3-8b`` (the shapes of
Llama 3 8B), ``module:factory`` for your own (``factory()`` is called under
``torch.device("meta")``), or a transformers model: the path of its ``config.json`` or of a
checkpoint directory holding one (read locally, never downloaded; weights are not read), built
with ``AutoModelForCausalLM.from_config`` (``AutoModel`` for a family without a causal-LM
head) on the meta device. Plans: ``llama`` (:func:`torch_tp.plans.llama.llama_plan`, the
default for the built-in models, shaped by ``--sequence-parallel`` and ``--loss-parallel``),
``auto`` (:func:`torch_tp.plans.auto`, inferred from the model's structure), ``hf``
(:func:`torch_tp.plans.hf.plan_for`, the default for a transformers model, shaped by
``--sequence-parallel`` as ``plan_for(model, sequence_parallel=True)`` and by
``--loss-parallel``: ``lm_head``'s logits left sharded on the vocabulary), ``module:attribute``
(a plan dict, or a function returning one), or a JSON file written by
:func:`torch_tp.plan.to_dict` (a transformers ``tp_plan`` dict works too). The two flags are
refused with any other plan, which they would not change.

The report's Problems also list the warnings planning raised (``auto()``'s
:class:`~torch_tp.plans.auto.ReplicatedModulesWarning`) and a ``--seq-len`` above the
model's positions (a transformers config's ``max_position_embeddings``, the ``max_seq_len``
of :class:`torch_tp.models.Llama`, Llama 3 8B's 8192).

Example::

    $ python -m torch_tp plan --model llama3-8b --tp 8 --seq-len 8192 --dtype bfloat16 \\
          --sequence-parallel
    $ python -m torch_tp plan --model mypackage.model:build --plan mypackage.model:PLAN --tp 4
    $ python -m torch_tp plan --model llama-tiny --plan my_plan.json --tp 2 --seq-len 64
    $ python -m torch_tp plan --model mypackage.model:build --plan auto --tp 8
    $ python -m torch_tp plan --model path/to/checkpoint_dir --tp 4 --seq-len 512
    $ python -m torch_tp plan --model path/to/config.json --plan auto --tp 4
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["BUILT_IN_MODELS", "configure_parser", "llama3_8b_config", "main"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def llama3_8b_config(max_seq_len: int = 8192):
    """The shapes of Llama 3 8B as a :class:`torch_tp.models.LlamaConfig`.

    32 layers of width 4096, 32 query heads and 8 key/value heads of 128, a SwiGLU hidden
    width of 14336 and a vocabulary of 128256.
    """
    from torch_tp.models import LlamaConfig

    return LlamaConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        norm_eps=1e-5,
        rope_theta=500000.0,
        max_seq_len=max_seq_len,
    )


def _llama_tiny(seq_len: int) -> nn.Module:
    from torch_tp.models import Llama, tiny_config

    return Llama(tiny_config(max_seq_len=max(seq_len, 64)))


def _llama3_8b(seq_len: int) -> nn.Module:
    from torch_tp.models import Llama

    return Llama(llama3_8b_config(max_seq_len=max(seq_len, 8192)))


# name -> function of the sequence length building the model (called on the meta device)
BUILT_IN_MODELS: dict[str, Callable[[int], nn.Module]] = {
    "llama-tiny": _llama_tiny,
    "llama3-8b": _llama3_8b,
}

# the positions a built-in model stands for, which it is built beyond to trace a longer
# --seq-len (llama-tiny, a toy, stands for none: it is built as long as asked)
_BUILT_IN_POSITIONS: dict[str, tuple[int, str]] = {
    "llama3-8b": (8192, "Llama 3 8B's max_seq_len"),
}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` options to ``parser`` and make :func:`main` its handler."""
    parser.add_argument(
        "--model",
        default="llama-tiny",
        help=f"{', '.join(BUILT_IN_MODELS)}, module:factory, or a transformers config.json or "
        "checkpoint directory (built on meta, never downloaded) (default: %(default)s)",
    )
    parser.add_argument(
        "--plan",
        default=None,
        help="'llama', 'auto' (inferred from the model's structure), 'hf' (the ready plan of a "
        "transformers model), module:attribute (a dict or a function returning one), or a JSON "
        "file (default: 'llama' for the built-in models, 'hf' for a transformers model)",
    )
    parser.add_argument("--tp", type=int, required=True, help="the TP degree")
    parser.add_argument(
        "--batch-size", type=int, default=1, help="sequences per step (default: %(default)s)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=2048, help="tokens per sequence (default: %(default)s)"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default=None,
        help="cast the parameters to this dtype (default: as the model builds them)",
    )
    parser.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="for --plan llama and --plan hf: shard norms and the residual stream on the sequence",
    )
    parser.add_argument(
        "--loss-parallel",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="for --plan llama and --plan hf: leave the logits sharded on the vocabulary",
    )
    parser.add_argument(
        "--device-type",
        default="cuda",
        help="the device the plan will run on; on cpu (gloo) a shard moved to another "
        "dimension is all-gathered (default: %(default)s)",
    )
    parser.add_argument(
        "--inputs",
        default=None,
        help="module:function taking (batch_size, seq_len) and returning the forward's "
        "inputs (default: token ids of shape (batch_size, seq_len))",
    )
    parser.set_defaults(func=main)


def _load(spec: str) -> Any:
    """The object ``module:attribute`` names (``attribute`` may be dotted)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"expected module:attribute, found {spec!r}")
    obj = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


def _transformers_config(spec: str) -> Path | None:
    """The ``config.json`` that ``--model spec`` names (the file, or a directory holding one),
    or ``None`` if ``spec`` is not a path; ``ValueError`` for a directory without one."""
    if spec in BUILT_IN_MODELS:
        return None
    path = Path(spec)
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ValueError(
                f"{path} has no config.json: --model takes a transformers checkpoint directory "
                "(save_pretrained's), its config.json, a built-in model or module:factory"
            )
        return config
    if path.is_file():
        return path
    if spec.endswith(".json"):
        raise FileNotFoundError(f"no such file: {spec} (--model's transformers config.json)")
    return None


def _transformers_model(config_path: Path) -> nn.Module:
    """The transformers model of ``config_path`` built on the meta device, without weights."""
    try:
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    except ImportError as err:
        raise ImportError(f"--model {config_path} needs transformers: {err}") from None

    # read locally: a checkpoint directory's config.json, never the Hub
    config = AutoConfig.from_pretrained(config_path, local_files_only=True)
    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:  # a family without a causal-LM head (an encoder, a vision model)
            return AutoModel.from_config(config)


def _build_model(spec: str, seq_len: int) -> nn.Module:
    config = _transformers_config(spec)
    if config is not None:
        return _transformers_model(config)
    with torch.device("meta"):
        if spec in BUILT_IN_MODELS:
            return BUILT_IN_MODELS[spec](seq_len)
        if ":" not in spec:
            raise ValueError(
                f"unknown model {spec!r}: expected {', '.join(BUILT_IN_MODELS)}, module:factory, "
                "or a transformers config.json or checkpoint directory (not found)"
            )
        return _load(spec)()


def _plan(args: argparse.Namespace, model: nn.Module) -> Any:
    from torch_tp.plan import from_dict

    spec = args.plan
    if spec is None and args.model in BUILT_IN_MODELS:
        spec = "llama"
    elif spec is None and _transformers_config(args.model) is not None:
        spec = "hf"
    if spec is None:
        raise ValueError(
            "--plan is required for a model given as module:factory: pass --plan auto to "
            "infer one from the model's structure, or name one (llama, hf, module:attribute, "
            "a JSON file)"
        )
    if spec not in ("llama", "hf"):
        for flag in ("sequence_parallel", "loss_parallel"):
            if getattr(args, flag):
                raise ValueError(
                    f"--{flag.replace('_', '-')} shapes --plan llama and --plan hf only, and "
                    f"would not change --plan {spec}: drop the flag, or write the plan with it"
                )
    if spec == "llama":
        from torch_tp.plans.llama import llama_plan

        return llama_plan(
            sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel
        )
    if spec == "auto":
        from torch_tp.plans import auto

        return auto(model, tp_degree=args.tp)
    if spec == "hf":
        from torch_tp.plans.hf import plan_for

        plan = plan_for(model, sequence_parallel=args.sequence_parallel)
        return _vocabulary_parallel_logits(model, plan) if args.loss_parallel else plan
    if spec.endswith(".json") or Path(spec).is_file():
        return from_dict(_read_json(Path(spec)))
    plan = _load(spec)
    return plan() if callable(plan) else plan


def _vocabulary_parallel_logits(model: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` (a transformers model's) with ``lm_head`` returning its logits as a DTensor
    sharded on the vocabulary (``Shard(-1)``), for a vocabulary-parallel loss
    (:func:`torch_tp.loss_parallel`), as ``llama_plan(loss_parallel=True)`` has its output.

    Raises:
        ValueError: the plan has no column-parallel ``lm_head`` (a base model, or a plan
            laying it out otherwise): the message names what it found.
    """
    import inspect

    from torch.distributed.tensor import Shard

    from torch_tp.registry import STYLE_REGISTRY

    keys = [key for key in plan if key.rpartition(".")[2] == "lm_head"]
    if not keys:
        raise ValueError(
            f"--loss-parallel: the plan of {type(model).__qualname__} has no lm_head entry "
            "(a base model returns no logits): expected a column-parallel lm_head"
        )
    modules = dict(model.named_modules())
    out = dict(plan)
    for key in keys:
        value = plan[key]
        style = STYLE_REGISTRY.style(value) if isinstance(value, str) else value
        # by its contract: computed on this rank's part of the vocabulary, the output layout
        # an argument (a column-parallel lm_head)
        contract = getattr(style, "contract", None)
        try:
            outputs = contract.outputs(style, modules.get(key)) if contract is not None else None
        except Exception:  # noqa: BLE001 - a contract that cannot describe this module
            outputs = None
        takes = inspect.signature(type(style)).parameters
        if not (
            outputs is not None
            and outputs.args
            and outputs.args[0] is not None
            and type(outputs.args[0].given) is Shard
            and {"output_layouts", "use_local_output"} <= set(takes)
        ):
            raise ValueError(
                f"--loss-parallel: expected a column-parallel {key!r} in the plan of "
                f"{type(model).__qualname__}, found {value!r}"
            )
        arguments = contract.arguments(style)
        out[key] = type(style)(
            **{**arguments, "output_layouts": Shard(-1), "use_local_output": False}
        )
    return out


def _positions_exceeded(args: argparse.Namespace, model: nn.Module) -> str | None:
    """Why ``--seq-len`` is more than the model's positions, or ``None`` if it is not (or
    the model says nothing of its positions)."""
    found = _BUILT_IN_POSITIONS.get(args.model)
    if found is None and args.model not in BUILT_IN_MODELS:
        config = getattr(model, "config", None)
        for name in ("max_position_embeddings", "max_seq_len"):
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found = value, f"config.{name}"
                break
    if found is None or args.seq_len <= found[0]:
        return None
    positions, source = found
    built = " (built with more to trace it)" if args.model in BUILT_IN_MODELS else ""
    return (
        f"{args.seq_len} tokens per sequence is more than the {positions} positions of the "
        f"model ({source}){built}: the report is for sequences it was not made for; pass "
        f"--seq-len {positions} or less"
    )


def _listed_warnings(caught: list[warnings.WarningMessage]) -> list[Any]:
    """The warnings planning raised, as problems of the report (once each); warnings that
    are not ``UserWarning`` (deprecations) are issued again, as they would have been."""
    from torch_tp.report import Problem

    problems: dict[tuple[str, str], Any] = {}
    for w in caught:
        if issubclass(w.category, UserWarning):
            key = (w.category.__name__, str(w.message))
            problems.setdefault(key, Problem("warning", *key))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return list(problems.values())


def _with_problems(report: Any, problems: list[Any]) -> None:
    """Add ``problems`` to ``report``'s, keeping them ordered errors, warnings, notes."""
    if not problems:
        return
    order = {"error": 0, "warning": 1, "note": 2}
    report.problems = sorted([*report.problems, *problems], key=lambda p: order[p.severity])


def _read_json(path: Path) -> Any:
    """The data in a JSON plan file; ``ValueError`` naming the file if it cannot be read."""
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    except RecursionError:
        raise ValueError(f"{path} nests too deeply to be a plan") from None


# the most of one error message printed: the messages of the checks are bounded, but an
# error from a user's model factory or inputs function may be anything
_MAX_ERROR_CHARS = 2000


def _print_error(err: BaseException) -> None:
    text = f"error: {type(err).__name__}: {err}"
    if len(text) > _MAX_ERROR_CHARS:
        text = f"{text[:_MAX_ERROR_CHARS]}... ({len(text)} chars)"
    print(text, file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    """Print the report; return 1 if it finds an error, 2 if the arguments are wrong.

    Wrong arguments, an unreadable or invalid plan, and a forward that fails on the meta
    device print one error line on stderr, with no traceback. A reader that closes the pipe
    early (``| head``) ends the command quietly, with the report's exit status.
    """
    from torch_tp.report import Problem, plan_report

    too_long = None
    try:
        model = _build_model(args.model, args.seq_len)
        too_long = _positions_exceeded(args, model)
        # warnings planning raises (auto()'s ReplicatedModulesWarning) go into the report
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = _plan(args, model)
            inputs = _load(args.inputs) if args.inputs else None
            report = plan_report(
                model,
                plan,
                args.tp,
                batch_size=args.batch_size,
                seq_len=args.seq_len,
                dtype=_DTYPES[args.dtype] if args.dtype else None,
                example_inputs=inputs,
                device_type=args.device_type,
            )
    except (
        ImportError,
        AttributeError,
        OSError,
        ValueError,
        TypeError,
        NotImplementedError,
        AssertionError,  # layouts of different lengths, as the style objects raise
        RuntimeError,  # the forward failed on the meta device (the report says why)
    ) as err:
        _print_error(err)
        if too_long is not None:
            print(f"note: --seq-len: {too_long}", file=sys.stderr)
        return 2
    problems = _listed_warnings(caught)
    if too_long is not None:
        problems.insert(0, Problem("warning", "--seq-len", too_long))
    _with_problems(report, problems)
    status = 1 if report.errors else 0
    try:
        print(report, flush=True)
    except BrokenPipeError:  # `plan ... | head`: the reader has what it wanted
        _discard_stdout()
    return status


def _discard_stdout() -> None:
    """Point stdout at devnull after a broken pipe, so that the flush at exit cannot fail
    (Python's documented recipe for ``SIGPIPE``)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
