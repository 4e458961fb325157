"""PEFT LoRA under tensor parallelism composed with the rest of a training step.

The model is the tiny transformers Llama in float64 with LoRA (rank 4, non-zero ``lora_B``)
on every projection (q, k, v, o, gate, up, down), its base frozen. Every test trains it for 2
AdamW steps and compares with the same PEFT model on one device: the loss, the logits, every
adapter gradient (each base parameter receiving none), and every parameter after each step
(float64 ``assert_close`` defaults):

* FSDP2 on a ``(dp=2, tp=2)`` mesh: TP on ``mesh["tp"]`` with ``plan_for``, then
  ``fully_shard`` per decoder layer and at the root (the ``PeftModel``) on ``mesh["dp"]``, as
  a PEFT user (or accelerate) writes it; each dp rank trains on its half of the batch, the
  single device on the whole batch. Both orders: ``get_peft_model`` before
  ``parallelize_module``, or between it and ``fully_shard``; and everything at once
  (sequence parallelism, torch's checkpoint, FSDP2, clipping).
* sequence parallelism (``plan_for(..., sequence_parallel=True)``), TP=2, both orders, with
  dropout too (the MLP's ``down_proj`` hands its output on as a partial sum there).
* ``torch_tp.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_`` on one device, with
  a ``max_norm`` that clips every step (the norm, then the clipped gradients).
* activation checkpointing: transformers' ``gradient_checkpointing_enable`` (reentrant and
  not) and torch's ``checkpoint`` on each decoder layer, with ``lora_dropout`` 0 and 0.1
  (the recomputation draws the forward's masks again); the reference does not checkpoint.

The meshes are named ``("dp", "tp")`` even at dp=1, as users name them: PEFT sizes the
factors of a layer whose weight is a DTensor on a mesh so named to its local shard.

Dropout is only tested where every rank holds the whole batch: a dp rank draws the masks of
its half of the batch, which are not the single device's masks for that half.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import full_tensor, tiny_hf_llama
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import torch_tp
from torch_tp.testing import device_type, run_distributed

peft = pytest.importorskip("peft", reason="the adapter tests need peft (pip install -e '.[peft]')")
pytest.importorskip("transformers", reason="the adapter tests need transformers")

from torch_tp.plans.hf import plan_for  # noqa: E402  (needs transformers)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 2


def _lora_config(dropout: float):
    # init_lora_weights=False: lora_B is not zero, so lora_A's gradient is not either
    return peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS, init_lora_weights=False
    )


def _peft_llama(dropout: float, base: nn.Module | None = None) -> nn.Module:
    """The PEFT model (adapters drawn after ``torch.manual_seed(1)``) of the tiny float64
    Llama, or of ``base``."""
    if base is None:
        base = tiny_hf_llama().double()
    torch.manual_seed(1)
    return peft.get_peft_model(base, _lora_config(dropout))


def _build(order: str, mesh, sequence_parallel: bool, dropout: float, reference: nn.Module):
    """The PEFT model parallelized on ``mesh`` (1-D, TP), its state the reference's.

    ``peft_first``: ``get_peft_model``, then ``parallelize_module`` of the wrapped model.
    ``plan_first``: ``parallelize_module`` of the plain model, then ``get_peft_model``."""
    state = reference.state_dict()
    if order == "peft_first":
        model = _peft_llama(dropout)
        model.load_state_dict(state)
        inner = model.base_model.model
        torch_tp.parallelize_module(
            inner, mesh, plan_for(inner, sequence_parallel=sequence_parallel)
        )
    elif order == "plan_first":
        base = tiny_hf_llama().double()
        torch_tp.parallelize_module(base, mesh, plan_for(base, sequence_parallel=sequence_parallel))
        model = _peft_llama(dropout, base)
        # the base is the reference's (same seed); the adapters are loaded as full tensors
        missing, unexpected = model.load_state_dict(
            {k: v for k, v in state.items() if "lora_" in k}, strict=False
        )
        assert not unexpected and not [k for k in missing if "lora_" in k]
    else:
        raise ValueError(order)
    return model


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.base_model.model.model.layers


def _checkpoint(model: nn.Module, how: str | None) -> None:
    if how == "hf":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif how == "hf_reentrant":
        # the reentrant checkpoint only backpropagates into inputs that require grad: this
        # enables them on the embeddings' output (transformers does, as PEFT asks)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    elif how == "torch":
        # transformers turns its KV cache off under its own checkpointing only; with torch's,
        # the recomputation would append to the cache a second time
        model.config.use_cache = False
        for layer in _decoder_layers(model):
            checkpoint(layer, context_fn=torch_tp.random.checkpoint_contexts)
    elif how is not None:
        raise ValueError(how)


def _train(
    order: str,
    dp: int,
    sequence_parallel: bool = False,
    dropout: float = 0.0,
    max_norm: float | None = None,
    checkpointing: str | None = None,
) -> list[float]:
    """Train the reference and the parallel PEFT model ``STEPS`` AdamW steps, comparing every
    step; return the reference's gradient norms (with ``max_norm``)."""
    tp = dist.get_world_size() // dp
    mesh = init_device_mesh(device_type(), (dp, tp), mesh_dim_names=("dp", "tp"))
    reference = _peft_llama(dropout)
    model = _build(order, mesh["tp"], sequence_parallel, dropout, reference)
    _checkpoint(model, checkpointing)
    if dp > 1:
        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    calls = []  # attention forwards: a recomputation runs them again in backward
    _decoder_layers(model)[0].self_attn.register_forward_hook(lambda *_: calls.append(1))

    named = dict(model.named_parameters())
    ref_named = dict(reference.named_parameters())
    assert list(named) == list(ref_named)
    trained = [n for n, p in ref_named.items() if p.requires_grad]
    assert len(trained) == 2 * 2 * len(TARGETS) and all("lora_" in n for n in trained)
    assert trained == [n for n, p in named.items() if p.requires_grad]
    assert all(isinstance(named[n], DTensor) for n in trained)  # hosted (and sharded by FSDP)
    ref_optim = torch.optim.AdamW([ref_named[n] for n in trained], lr=1e-2)
    optim = torch.optim.AdamW([named[n] for n in trained], lr=1e-2)
    reference.train()
    model.train()

    rank = mesh["dp"].get_local_rank()
    batch = 2 * dp
    mine = slice(rank * 2, rank * 2 + 2)  # each dp rank its half of the batch
    norms = []
    for step in range(STEPS):
        ids = torch.randint(0, 64, (batch, 8), generator=torch.Generator().manual_seed(10 + step))
        # the same generator state on every rank and for the reference: the same masks
        torch.manual_seed(100 + step)
        ref_out = reference(input_ids=ids, labels=ids)
        torch.manual_seed(100 + step)
        out = model(input_ids=ids[mine], labels=ids[mine])
        ref_out.loss.backward()
        out.loss.backward()

        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        torch.testing.assert_close(loss / dp, ref_out.loss.detach())
        torch.testing.assert_close(full_tensor(out.logits.detach()), ref_out.logits[mine].detach())
        if max_norm is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
            norm = torch_tp.clip_grad_norm_(model.parameters(), max_norm)
            assert not isinstance(norm, DTensor)
            torch.testing.assert_close(norm, ref_norm)
            norms.append(ref_norm.item())
        for name, p in named.items():
            if name in trained:
                torch.testing.assert_close(
                    full_tensor(p.grad),
                    ref_named[name].grad,
                    msg=lambda m, n=name: f"grad {n}: {m}",
                )
            else:
                assert p.grad is None and ref_named[name].grad is None, name

        ref_optim.step()
        optim.step()
        ref_optim.zero_grad()
        optim.zero_grad()
        for name, p in named.items():
            torch.testing.assert_close(
                full_tensor(p.detach()), ref_named[name].detach(), msg=lambda m, n=name: f"{n}: {m}"
            )
    assert len(calls) == STEPS * (2 if checkpointing else 1)
    return norms


@pytest.mark.four_ranks
@pytest.mark.parametrize("order", ["peft_first", "plan_first"])
def test_fsdp2_tp_lora_matches_single_device(order):
    run_distributed(_train, 4, order, 2)


@pytest.mark.four_ranks
def test_fsdp2_tp_lora_sequence_parallel_checkpointed_clipped():
    # everything at once, in torchtitan's order: TP, activation checkpointing, FSDP2
    norms = run_distributed(_train, 4, "plan_first", 2, True, 0.0, 0.05, "torch")[0]
    assert min(norms) > 0.05, norms  # every step was clipped


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("order", ["peft_first", "plan_first"])
def test_sequence_parallel_lora_matches_single_device(order, dropout):
    run_distributed(_train, 2, order, 1, True, dropout)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_clip_grad_norm_lora_matches_torch(sequence_parallel):
    norms = run_distributed(_train, 2, "peft_first", 1, sequence_parallel, 0.0, 0.05)[0]
    assert min(norms) > 0.05, norms  # every step was clipped


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("how", ["hf", "hf_reentrant", "torch"])
def test_activation_checkpointing_lora_matches_single_device(how, dropout):
    run_distributed(_train, 2, "peft_first", 1, False, dropout, None, how)
