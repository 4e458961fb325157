"""PyTorch's own ``model.load_state_dict`` on a model parallelized by torch_tp.

``parallelize_module`` gives every module holding a tensor of its own a load pre-hook
(``torch_tp._state_dict``): a full, single-device tensor becomes this rank's slice of it (no
communication). So the
single-device state dict of another model (seed 1) loads into a parallelized model (seed 0),
strictly, and the result is that model: its logits, its gradients after a backward and its
gathered state dict equal the single-device model's, at TP=2 and 4, with and without
sequence parallelism, for the reference Llama and a transformers Llama, and (four_ranks)
under FSDP2 on a 2 x 2 mesh. Also: ``strict=False`` with a key left out, a wrong shape
(torch's one "size mismatch" error on every rank, the other tensors loaded), and
``state_dict()`` still returning DTensors. A DTensor state dict of another model on the same
mesh and plan, as it is or replicated, loaded before the hooks too (DTensor's ``copy_``
redistributes): those tests keep it so.
"""

from __future__ import annotations

import pytest
import torch
from helpers import full_tensor, parallelize_dp_tp, reference_llama, tiny_hf_llama, tp_mesh
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

import torch_tp
from torch_tp.checkpoint import full_state_dict
from torch_tp.plans.hf import plan_for
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import run_distributed

EXACT = {"rtol": 0, "atol": 0}
CONFIG = {"max_seq_len": 32, "n_kv_heads": 4}  # whole kv heads on each of up to 4 ranks


def _llama(seed: int) -> nn.Module:
    return reference_llama(seed, **CONFIG).double()


def _tokens() -> torch.Tensor:
    return torch.randint(0, 1001, (2, 16), generator=torch.Generator().manual_seed(7))


def _tp_llama(seed: int, sequence_parallel: bool = False) -> nn.Module:
    model = _llama(seed)
    torch_tp.parallelize_module(model, tp_mesh(), llama_plan(sequence_parallel=sequence_parallel))
    return model


def _assert_state_equal(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert not isinstance(actual[key], DTensor), key
        torch.testing.assert_close(actual[key], value, **EXACT, msg=lambda m, k=key: f"{k}: {m}")


def _assert_dtensor_state(model: nn.Module) -> None:
    """``state_dict()`` still returns the parallelized parameters' DTensors, as upstream."""
    state, sharded = model.state_dict(), 0
    for name, param in model.named_parameters():
        assert isinstance(state[name], DTensor) == isinstance(param, DTensor), name
        sharded += isinstance(param, DTensor)
    assert sharded


def _assert_matches(model: nn.Module, reference: nn.Module, forward) -> None:
    """Logits, every gradient after a backward, and the gathered state dict."""
    logits, expected = forward(model), forward(reference)
    torch.testing.assert_close(full_tensor(logits), expected)
    full_tensor(logits).square().mean().backward()
    expected.square().mean().backward()
    named = list(model.named_parameters())
    assert [n for n, _ in named] == [n for n, _ in reference.named_parameters()]
    for name, param in named:
        expected_grad = reference.get_parameter(name).grad
        torch.testing.assert_close(full_tensor(param.grad), expected_grad, msg=f"grad {name}")
    _assert_state_equal(full_state_dict(model), reference.state_dict())


def _llama_forward(model: nn.Module) -> torch.Tensor:
    return model(_tokens())


def _load_full_llama(sequence_parallel: bool) -> None:
    model, reference = _tp_llama(0, sequence_parallel), _llama(1)
    full = reference.state_dict()
    before = {k: v.clone() for k, v in full.items()}
    result = model.load_state_dict(full)  # strict
    assert not result.missing_keys and not result.unexpected_keys
    _assert_state_equal(full, before)  # the caller's dict is not changed
    _assert_dtensor_state(model)
    _assert_matches(model, reference, _llama_forward)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_full_state_dict_loads(sequence_parallel):
    run_distributed(_load_full_llama, 2, sequence_parallel)


@pytest.mark.four_ranks
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_full_state_dict_loads_tp4(sequence_parallel):
    run_distributed(_load_full_llama, 4, sequence_parallel)


def _hf_forward(model: nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    return model(input_ids=ids).logits


def _load_full_hf() -> None:
    model, reference = tiny_hf_llama(0).double(), tiny_hf_llama(1).double()
    torch_tp.parallelize_module(model, tp_mesh(), plan_for(model))
    result = model.load_state_dict(reference.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    _assert_dtensor_state(model)
    _assert_matches(model, reference, _hf_forward)


def test_transformers_llama():
    pytest.importorskip("transformers")
    run_distributed(_load_full_hf, 2)


def _non_strict() -> None:
    model, reference = _tp_llama(0), _llama(1)
    left_out = "layers.0.attention.wq.weight"
    kept = model.get_parameter(left_out).full_tensor()
    full = reference.state_dict()
    del full[left_out]
    result = model.load_state_dict(full, strict=False)
    assert result.missing_keys == [left_out] and not result.unexpected_keys
    gathered = full_state_dict(model)
    torch.testing.assert_close(gathered.pop(left_out), kept, **EXACT)
    _assert_state_equal(gathered, full)


def test_non_strict_missing_key():
    run_distributed(_non_strict, 2)


def _dtensor_state_dict(replicated: bool) -> None:
    """Another parallelized model's DTensors: as they are (same placements), or all
    replicated (redistributed by the hook to each parameter's placements)."""
    model, other = _tp_llama(0), _tp_llama(1)
    state = other.state_dict()
    if replicated:
        state = {
            k: v.redistribute(v.device_mesh, [Replicate()]) if isinstance(v, DTensor) else v
            for k, v in state.items()
        }
    result = model.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            assert param.placements == other.get_parameter(name).placements, name
    _assert_state_equal(full_state_dict(model), full_state_dict(other))
    torch.testing.assert_close(
        full_tensor(_llama_forward(model)), full_tensor(_llama_forward(other)), **EXACT
    )


@pytest.mark.parametrize("replicated", [False, True])
def test_dtensor_state_dict(replicated):
    run_distributed(_dtensor_state_dict, 2, replicated)


def _wrong_shape() -> str:
    model, reference = _tp_llama(0), _llama(1)
    full = reference.state_dict()
    key = "layers.1.feed_forward.w1.weight"
    full[key] = full[key][:, :-1].clone()
    with pytest.raises(RuntimeError, match=f"size mismatch for {key}") as info:
        model.load_state_dict(full)
    # torch's one error, for that key alone: every other full tensor was taken (and loaded,
    # as torch loads the rest before it raises)
    assert "While copying" not in str(info.value)
    assert str(info.value).count("size mismatch") == 1
    gathered = full_state_dict(model)
    del gathered[key], full[key]
    _assert_state_equal(gathered, full)
    return str(info.value)


def test_wrong_shape_raises_on_every_rank():
    messages = run_distributed(_wrong_shape, 2)
    assert len(messages) == 2 and all("size mismatch" in m for m in messages)


def _load_full_2d() -> None:
    reference = _llama(1)
    model, _ = parallelize_dp_tp(_llama(0), 2, 2)
    result = model.load_state_dict(reference.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    _assert_matches(model, reference, _llama_forward)  # the same batch on both dp ranks


@pytest.mark.four_ranks
def test_fsdp2_tp_full_state_dict_loads():
    run_distributed(_load_full_2d, 4)
