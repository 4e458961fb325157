"""PEFT's LoRA on a torch_tp model is exact: it matches the same PEFT model on one device.

Each test builds a tiny transformers model (float64) on every rank, a single-device PEFT
reference from it, and the same PEFT model parallelized by torch_tp at TP=2 (TP=4 where
marked), then compares logits, loss, every adapter gradient (every base parameter frozen
and without a gradient on both), and every parameter after two AdamW steps. The routes:

* both orders: ``get_peft_model`` then ``parallelize_module(model.base_model.model, ...)``,
  and ``parallelize_module`` then ``get_peft_model`` (the module-registration hook hosts
  the adapters PEFT registers);
* LoRA on the column-parallel projections only (q, v), on the row-parallel ones only
  (o_proj, down_proj), and on all seven;
* ``lora_dropout=0.1`` in train mode (the same seed before each forward on both: the
  masks must be one device's), ``use_rslora=True``, ``lora_bias=True``;
* GPT-2, whose packed ``c_attn`` (a ``Conv1D``, ``fan_in_fan_out=True``) is planned
  ``PackedColwiseParallel(3)`` and ``c_proj`` row-wise;
* the plan of the PEFT model itself: ``plan_for(peft_model)`` and ``auto(peft_model)``,
  applied to the ``PeftModel``; ``load_pretrained`` into the parallelized base, then
  ``get_peft_model``.

The collectives of one step are counted too (TP=2): LoRA on all seven projections adds none
to the forward (6 all-reduces and 1 all-gather either way: a row-parallel adapter's partial
sum rides in its base's all-reduce, 36 features instead of 32), and in the fast runtime's
backward its 10 column-parallel ``lora_A`` gradients (partial sums) are summed in the one
all-reduce at the end of backward, while the frozen base spares layer 0's input-gradient
all-reduce: 5 all-reduces with adapters as without.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from helpers import FAST_RUNTIME, check_step, full_tensor, tp_mesh
from torch import nn
from torch.distributed.tensor import DTensor

import torch_tp
from torch_tp.testing import run_distributed

peft = pytest.importorskip("peft", reason="the adapter tests need peft (pip install -e '.[peft]')")
transformers = pytest.importorskip("transformers", reason="the adapter tests need transformers")

from torch_tp.plans.hf import plan_for  # noqa: E402  (needs transformers)

_ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_COLUMN = ["q_proj", "v_proj"]
_ROW = ["o_proj", "down_proj"]
_IDS_SEED, _ADAPTER_SEED = 3, 1


# --------------------------------------------------------------------------- models


def _llama(kv_heads: int = 2) -> nn.Module:
    """A tiny transformers Llama in float64, the same on every rank (seed 0). ``kv_heads=4``
    gives every one of 4 TP ranks a whole key/value head."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, tie_word_embeddings=False,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def _gpt2() -> nn.Module:
    """A tiny GPT-2 (tied embeddings, packed ``c_attn``) in float64, without its own dropout
    (its attention dropout acts on this rank's heads, whose mask no rank can share)."""
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double()


def _base(family: str, kv_heads: int = 2) -> nn.Module:
    return _llama(kv_heads) if family == "llama" else _gpt2()


def _lora(family: str, targets: list[str] | None, **options: Any) -> Any:
    """The adapter config: rank 4, adapters drawn at random (``init_lora_weights=False``:
    PEFT's default zero ``lora_B`` would hide a wrong ``lora_A``)."""
    if family == "gpt2":
        targets, options = ["c_attn", "c_proj"], {"fan_in_fan_out": True, **options}
    return peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **options
    )


def _peft_model(base: nn.Module, config: Any) -> nn.Module:
    torch.manual_seed(_ADAPTER_SEED)
    return peft.get_peft_model(base, config)


# --------------------------------------------------------------------------- routes


def _plan_of(model: nn.Module, how: str) -> dict:
    if how == "auto":
        from torch_tp.plans.auto import auto

        return auto(model, tp_degree=dist.get_world_size())
    return plan_for(model)


def _parallel_peft(
    route: str, family: str, config: Any, reference: nn.Module, kv_heads: int, path: str | None
) -> nn.Module:
    """The PEFT model of ``reference`` (a PEFT model on one device) parallelized by
    ``route``, holding ``reference``'s values."""
    mesh = tp_mesh()
    base = _base(family, kv_heads)
    if route in ("peft_first", "plan_for_peft", "auto_peft"):
        model = _peft_model(base, config)
        model.load_state_dict(reference.state_dict())
        if route == "peft_first":
            inner = model.base_model.model
            torch_tp.parallelize_module(inner, mesh, plan_for(inner))
        else:  # the plan of the PeftModel itself, applied to it
            how = "auto" if route == "auto_peft" else "plan_for"
            torch_tp.parallelize_module(model, mesh, _plan_of(model, how))
        return model
    if route == "load_pretrained":
        from torch_tp.checkpoint import load_pretrained

        with torch.no_grad():  # another base: the load must bring the reference's values
            for param in base.parameters():
                param.normal_()
        torch_tp.parallelize_module(base, mesh, plan_for(base))
        load_pretrained(base, path)
    else:  # "plan_first"
        torch_tp.parallelize_module(base, mesh, plan_for(base))
    model = _peft_model(base, config)
    # the adapters PEFT drew after the plan: the reference's values, each rank its slices
    adapters = {k: v for k, v in reference.state_dict().items() if "lora_" in k}
    result = model.load_state_dict(adapters, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    return model


def _step(model: nn.Module, ids: torch.Tensor, seed: int) -> Any:
    torch.manual_seed(seed)  # the same dropout masks on both, where the input is replicated
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out


def _parity(
    route: str,
    family: str = "llama",
    targets: list[str] | None = _ALL_SEVEN,
    kv_heads: int = 2,
    path: str | None = None,
    **options: Any,
) -> None:
    """The parallelized PEFT model (``route``) against the same PEFT model on one device."""
    config = _lora(family, targets, **options)
    base = _base(family, kv_heads)
    if route == "load_pretrained" and dist.get_rank() == 0:
        base.save_pretrained(path)
    dist.barrier()
    reference = _peft_model(base, config)
    model = _parallel_peft(route, family, config, reference, kv_heads, path)
    lora = [n for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(model.get_parameter(n).requires_grad for n in lora)
    hosted = [n for n in lora if isinstance(model.get_parameter(n), DTensor)]
    assert hosted == lora, sorted(set(lora) - set(hosted))  # every adapter laid out by torch_tp

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(_IDS_SEED))
    check_lora_training(model, reference, ids)


def check_lora_training(
    model: nn.Module, reference: nn.Module, ids: torch.Tensor, steps: int = 2
) -> None:
    """Train ``model`` (a parallelized PEFT model) and ``reference`` (the same on one
    device) ``steps`` AdamW steps on ``ids`` as a causal LM, in train mode (the same seed
    before each forward of both: the same dropout masks, where the input is replicated):
    logits and loss equal, then every gradient (the frozen base's: None on both) and every
    parameter after each step."""
    reference.train()
    model.train()
    ref_optim = torch.optim.AdamW(
        [p for p in reference.parameters() if p.requires_grad], lr=1e-2, eps=1e-6
    )
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-6)
    for step in range(steps):
        expected, actual = _step(reference, ids, 100 + step), _step(model, ids, 100 + step)
        torch.testing.assert_close(full_tensor(actual.logits), expected.logits)
        torch.testing.assert_close(full_tensor(actual.loss), expected.loss)
        check_step(model, reference, optim, ref_optim, grad_tol={}, param_tol={})


# --------------------------------------------------------------------------- parity tests


@pytest.mark.parametrize("route", ["peft_first", "plan_first"])
def test_both_orders_match_one_device(route: str) -> None:
    run_distributed(_parity, 2, route)


@pytest.mark.four_ranks
@pytest.mark.parametrize("route", ["peft_first", "plan_first"])
def test_both_orders_match_one_device_at_four_ranks(route: str) -> None:
    run_distributed(_parity, 4, route, kv_heads=4)


@pytest.mark.parametrize("route", ["peft_first", "plan_first"])
@pytest.mark.parametrize("targets", [_COLUMN, _ROW], ids=["column_only", "row_only"])
def test_subsets_of_the_projections(route: str, targets: list[str]) -> None:
    run_distributed(_parity, 2, route, targets=targets)


@pytest.mark.parametrize("route", ["peft_first", "plan_first"])
@pytest.mark.parametrize(
    "options",
    [{"lora_dropout": 0.1}, {"use_rslora": True}, {"lora_bias": True}],
    ids=["dropout", "rslora", "lora_bias"],
)
def test_adapter_options(route: str, options: dict[str, Any]) -> None:
    run_distributed(_parity, 2, route, **options)


@pytest.mark.parametrize("route", ["peft_first", "plan_first"])
def test_gpt2_packed_c_attn(route: str) -> None:
    run_distributed(_parity, 2, route, family="gpt2", lora_dropout=0.1)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_plan_for_a_peft_model(family: str) -> None:
    run_distributed(_parity, 2, "plan_for_peft", family=family)


def test_auto_plan_of_a_peft_model() -> None:
    run_distributed(_parity, 2, "auto_peft")


def test_load_pretrained_then_get_peft_model(tmp_path: Path) -> None:
    run_distributed(_parity, 2, "load_pretrained", path=str(tmp_path / "base"))


# --------------------------------------------------------------------------- collectives


@contextlib.contextmanager
def _all_reduce_sizes() -> Iterator[list[int]]:
    """The element count of each ``torch.distributed.all_reduce`` called inside (the fast
    runtime's collectives; CommDebugMode counts them but records no size)."""
    sizes: list[int] = []
    original = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    with mock.patch.object(dist, "all_reduce", counted):
        yield sizes


def _collectives(adapters: bool) -> dict[str, Any]:
    """The collectives of one forward and one backward of the tiny Llama at TP=2 (LoRA on
    all seven projections, or no adapters and every parameter trained): CommDebugMode's
    counts, and each all-reduce's element count."""
    from torch.distributed.tensor.debug import CommDebugMode

    model = _llama()
    if adapters:
        model = _peft_model(model, _lora("llama", _ALL_SEVEN))
    inner = model.base_model.model if adapters else model
    torch_tp.parallelize_module(inner, tp_mesh(), plan_for(inner))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(_IDS_SEED))
    found: dict[str, Any] = {}
    for phase in ("forward", "backward"):
        with CommDebugMode() as comm, _all_reduce_sizes() as sizes:
            if phase == "forward":
                loss = model(input_ids=ids, labels=ids).loss
            else:
                loss.backward()
        counts = comm.get_comm_counts()
        found[phase] = {str(op): n for op, n in counts.items() if n}
        found[phase + " sizes"] = sizes
    return found


def test_adapters_add_no_forward_collective() -> None:
    plain, lora = (run_distributed(_collectives, 2, adapters)[0] for adapters in (False, True))
    # the same collectives, LoRA or not: a row-parallel adapter's partial sum (r = 4
    # features) is concatenated to its base's before the base's one all-reduce
    assert lora["forward"] == plain["forward"], (lora["forward"], plain["forward"])
    if FAST_RUNTIME:
        # the ids' agreed check (2), the vocabulary-parallel embedding (2 x 8 x 32), then
        # o_proj and down_proj of each layer: 2 x 8 x 32, and 2 x 8 x (32 + 4) with LoRA
        assert plain["forward sizes"] == [2, 512, 512, 512, 512, 512], plain
        assert lora["forward sizes"] == [2, 512, 576, 576, 576, 576], lora


@pytest.mark.fast_runtime
def test_adapter_gradients_join_the_one_end_of_backward_reduction() -> None:
    plain, lora = (run_distributed(_collectives, 2, adapters)[0] for adapters in (False, True))
    # Without adapters (every parameter trained): 5 all-reduces of input gradients
    # (2 x 8 x 32), one per column-parallel region: q/k/v and gate/up of each layer (one
    # shared by the layers reading one tensor), and lm_head's.
    assert plain["backward sizes"] == [512] * 5, plain
    # With LoRA (the base frozen): layer 0's attention needs no input gradient (it flows
    # only to the frozen norm and embedding), so 3 of those plus lm_head's, and the one
    # end-of-backward all-reduce (PartialGradientReduction) of the 10 column-parallel
    # lora_A gradients (q, k, v, gate, up of 2 layers; r x 32 = 128 each): partial sums,
    # each rank's covering its own output columns. lora_B's gradients and the row-parallel
    # adapters' need none. 5 all-reduces either way.
    assert lora["backward sizes"] == [512] * 4 + [10 * 128], lora
    assert lora["backward"] == plain["backward"] == {"c10d.allreduce_": 5}, (lora, plain)
