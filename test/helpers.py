"""Helpers shared by the test files: ``from helpers import tp_mesh, full_tensor``.

pytest puts ``test/`` on ``sys.path`` (its default "prepend" import mode; ``test/`` has no
``__init__.py``), and the worker processes of :func:`torch_tp.testing.run_distributed` start
with the parent's ``sys.path``, so test files and the rank functions they run import this
module by its plain name. A helper that is itself passed to ``run_distributed`` is found
here by its qualified name, as a rank function must be.

Only code that several test files share lives here, each piece once; a helper used by one
file stays in that file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import torch_tp
from torch_tp.models import Llama, tiny_config
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import device_type

__all__ = [
    "CHECKPOINT_CONFIG",
    "FAST_RUNTIME",
    "adamw",
    "checkpoint_llama",
    "full_tensor",
    "meta_llama",
    "parallelize_dp_tp",
    "perturb_norms",
    "reference_llama",
    "safetensors_reads",
    "sgd",
    "tiny_hf_llama",
    "tp_mesh",
    "train_llama",
]


# whether this run tests the fast runtime (the default) or plain DTensor (TORCH_TP_RUNTIME=dtensor)
FAST_RUNTIME = os.environ.get("TORCH_TP_RUNTIME", "fast") == "fast"


# --------------------------------------------------------------------------- meshes, tensors


def tp_mesh() -> DeviceMesh:
    """A 1-D mesh over every rank of the default process group."""
    return init_device_mesh(device_type(), (dist.get_world_size(),))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (gathered on every rank); a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW for multi-step parity with a single device. AdamW divides each gradient by its
    running RMS, which turns a float-rounding difference in a near-zero gradient into a
    parameter difference of order ``lr``; ``eps=1e-6`` (instead of 1e-8) caps that at
    ``lr * rounding / eps`` (see ``test_fsdp.py``)."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.1)


def check_step(
    model: nn.Module,
    reference: nn.Module,
    optim: torch.optim.Optimizer,
    ref_optim: torch.optim.Optimizer,
    *,
    grad_tol: dict,
    param_tol: dict,
    shard_of: Callable[[torch.Tensor, DTensor], torch.Tensor] | None = None,
) -> None:
    """After a backward of both: every gradient of ``model`` equals ``reference``'s (same
    parameter names), both optimizers step, and every parameter equals the reference's.
    DTensors are gathered to full tensors, or, with ``shard_of(full, dtensor)``, each rank's
    shard is compared with its shard of the reference's tensor (together the ranks compare
    every element)."""

    def compare(actual: torch.Tensor, expected: torch.Tensor, tol: dict, what: str) -> None:
        if shard_of is not None and isinstance(actual, DTensor):
            actual, expected = actual.to_local(), shard_of(expected, actual)
        else:
            actual = full_tensor(actual)
        torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")

    named = list(model.named_parameters())
    assert [n for n, _ in named] == [n for n, _ in reference.named_parameters()]
    for name, param in named:
        compare(param.grad, reference.get_parameter(name).grad, grad_tol, f"grad {name}")
    optim.step()
    ref_optim.step()
    optim.zero_grad()
    ref_optim.zero_grad()
    for name, param in named:
        compare(param.detach(), reference.get_parameter(name).detach(), param_tol, name)


# --------------------------------------------------------------------------- the reference Llama


def perturb_norms(model: nn.Module) -> None:
    """Draw every norm weight from U(0.5, 1.5): weights of one would hide a norm weight that
    is sharded, broadcast or gathered wrongly."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)


def reference_llama(seed: int = 0, **config) -> Llama:
    """``Llama(tiny_config(**config))`` after ``torch.manual_seed(seed)``, with perturbed norm
    weights: the same model on every rank."""
    torch.manual_seed(seed)
    model = Llama(tiny_config(**config))
    perturb_norms(model)
    return model


# --------------------------------------------------------------------------- checkpoints

# n_kv_heads=4: whole kv heads on each of up to 4 TP ranks
CHECKPOINT_CONFIG = {"max_seq_len": 32, "n_kv_heads": 4}


def checkpoint_llama(seed: int = 0, **config) -> Llama:
    """The reference Llama of the checkpoint tests (``CHECKPOINT_CONFIG``, then ``config``)."""
    return reference_llama(seed, **{**CHECKPOINT_CONFIG, **config})


def tiny_hf_llama(seed: int = 0) -> nn.Module:
    """A tiny transformers Llama (2 layers, hidden size 32, untied embeddings, eager
    attention) drawn after ``torch.manual_seed(seed)``: the checkpoint tests' Hugging Face
    model."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def parallelize_dp_tp(
    model: Llama, dp: int, tp: int, sequence_parallel: bool = False
) -> tuple[Llama, DeviceMesh | None]:
    """TP on mesh["tp"], then FSDP2 per block and at the root on mesh["dp"] (if dp > 1).
    Returns the model and the (dp, tp) mesh, or ``None`` for a single device."""
    if dp * tp == 1:
        return model, None
    mesh = init_device_mesh(device_type(), (dp, tp), mesh_dim_names=("dp", "tp"))
    torch_tp.parallelize_module(model, mesh["tp"], llama_plan(sequence_parallel=sequence_parallel))
    if dp > 1:
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def meta_llama(dp: int, tp: int, sequence_parallel: bool = False, **config) -> Llama:
    """A parallelized model built on the meta device, materialized empty (no full copy)."""
    with torch.device("meta"):
        model = Llama(tiny_config(**{**CHECKPOINT_CONFIG, **config}))
    model, _ = parallelize_dp_tp(model, dp, tp, sequence_parallel)
    model.to_empty(device=device_type())
    model.rope_cache = model._rope_table(torch.device(device_type()))
    return model


def train_llama(
    model: nn.Module, mesh: DeviceMesh | None, optim: torch.optim.Optimizer, steps: range
) -> list[float]:
    """Global-batch losses; each dp rank trains on its slice of the batch."""
    dp = 1 if mesh is None else mesh["dp"].size()
    dp_rank = 0 if mesh is None else mesh["dp"].get_local_rank()
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 1001, (4, 16), generator=gen)
        targets = torch.randint(0, 1001, (4, 16), generator=gen)
        mine = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)
        loss = F.cross_entropy(model(tokens[mine]).flatten(0, 1), targets[mine].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        loss = loss.detach()
        if dp > 1:
            dist.all_reduce(loss, group=mesh["dp"].get_group())
        losses.append(loss.item() / dp)
    return losses


def saved_then_trained_on(
    ckpt_dir: str,
) -> tuple[nn.Module, DeviceMesh, torch.optim.Optimizer, dict]:
    """A (dp=2, tp=2) Llama trained one step and saved as step 1 in ``ckpt_dir``, then trained
    one more step; with the full state dict that was saved."""
    model, mesh = parallelize_dp_tp(checkpoint_llama(), 2, 2)
    optim = adamw(model.parameters())
    train_llama(model, mesh, optim, range(1))
    torch_tp.checkpoint.save(ckpt_dir, model, optim, step=1)
    saved = torch_tp.checkpoint.full_state_dict(model)
    train_llama(model, mesh, optim, range(1, 2))
    return model, mesh, optim, saved


class _SliceSpy:
    """Wraps safe_open: records the elements of every read, per tensor name."""

    reads: dict[str, list[int]] = {}

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __enter__(self):
        self._real.__enter__()
        return self

    def __exit__(self, *exc):
        return self._real.__exit__(*exc)

    def get_tensor(self, name):
        out = self._real.get_tensor(name)
        _SliceSpy.reads.setdefault(name, []).append(out.numel())
        return out

    def get_slice(self, name):
        real = self._real.get_slice(name)

        class Slice:
            def get_shape(self):
                return real.get_shape()

            def get_dtype(self):
                return real.get_dtype()

            def __getitem__(self, index):
                out = real[index]
                _SliceSpy.reads.setdefault(name, []).append(out.numel())
                return out

        return Slice()


@contextlib.contextmanager
def safetensors_reads() -> Iterator[dict[str, list[int]]]:
    """The elements of every safetensors read inside the block, per tensor name."""
    import safetensors

    real_open = safetensors.safe_open
    _SliceSpy.reads = {}
    with mock.patch.object(safetensors, "safe_open", lambda *a, **k: _SliceSpy(real_open(*a, **k))):
        yield _SliceSpy.reads
