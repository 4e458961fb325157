"""PEFT LoRA adapters on a torch_tp model, saved as PEFT saves them and through
torch_tp.checkpoint.

The same PEFT LoRA model (a tiny transformers Llama in float64, LoRA on every projection)
is trained on one device and, parallelized by torch_tp at TP=2, on every rank. Compared
with one device: the files PEFT's ``save_pretrained`` writes (and that only rank 0 writes
them), ``PeftModel.from_pretrained`` into a parallelized and into a single-device base,
``merge_and_unload`` in both orders (the merged weights, and the model still parallelized
as planned). The round trips of a model with hosted adapters through
``load_state_dict(state_dict())``, full state dicts, DCP and Hugging Face directories are
exact, at TP=2 and (four_ranks) under FSDP2 on a 2 x 2 mesh; a DCP save one rank refuses is
refused on every rank before any rank gathers an adapter.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from helpers import full_tensor, tiny_hf_llama, tp_mesh
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import torch_tp
from torch_tp import checkpoint
from torch_tp.plans.hf import plan_for
from torch_tp.testing import device_type, run_distributed

peft = pytest.importorskip("peft")

_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_FILES = ["README.md", "adapter_config.json", "adapter_model.safetensors"]
EXACT = {"rtol": 0, "atol": 0}


def _config() -> peft.LoraConfig:
    # random lora_B too (PEFT's default zeros it): every factor's values are checked
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=_TARGETS, init_lora_weights=False)


def _base(seed: int = 0) -> nn.Module:
    return tiny_hf_llama(seed).double()


def _peft(seed: int = 1, base_seed: int = 0) -> peft.PeftModel:
    """The PEFT model, its adapters drawn after ``torch.manual_seed(seed)``."""
    base = _base(base_seed)
    torch.manual_seed(seed)
    return peft.get_peft_model(base, _config())


def _parallelize(model: nn.Module) -> nn.Module:
    """The plan of the transformers model (inside a PEFT model: order 1, PEFT first)."""
    inner = model.base_model.model if isinstance(model, peft.PeftModel) else model
    torch_tp.parallelize_module(inner, tp_mesh(), plan_for(inner))
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))


def _train(model: nn.Module, steps: int = 2) -> torch.optim.Optimizer:
    """``steps`` AdamW steps on the adapters (the base is frozen)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(steps):
        model(input_ids=_ids(), labels=_ids()).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return optimizer


def _trained() -> tuple[peft.PeftModel, peft.PeftModel, torch.optim.Optimizer]:
    """The single-device PEFT model and the torch_tp one, each trained 2 AdamW steps."""
    reference = _peft()
    _train(reference)
    model = _parallelize(_peft())
    return reference, model, _train(model)


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return full_tensor(model(input_ids=_ids()).logits)


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full_tensor(v).clone() for k, v in model.state_dict().items()}


def _assert_state(model: nn.Module, expected: dict[str, torch.Tensor], **tolerance) -> None:
    actual = model.state_dict()
    assert list(actual) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(full_tensor(actual[name]), value, msg=name, **tolerance)


def _assert_hosted(model: peft.PeftModel) -> None:
    """Each rank holds its slices of the adapters, laid out as the base layer (placements
    and local shapes checked), and the base layers are still sharded."""
    attention = model.base_model.model.model.layers[0].self_attn
    q, o = attention.q_proj, attention.o_proj
    assert q.base_layer.weight.placements == (Shard(0),)
    assert q.lora_A["default"].weight.placements == (Replicate(),)
    assert q.lora_B["default"].weight.placements == (Shard(0),)
    assert q.lora_B["default"].weight.to_local().shape == (32 // dist.get_world_size(), 4)
    assert o.base_layer.weight.placements == (Shard(1),)
    assert o.lora_A["default"].weight.placements == (Shard(1),)
    assert o.lora_A["default"].weight.to_local().shape == (4, 32 // dist.get_world_size())
    assert o.lora_B["default"].weight.placements == (Replicate(),)


def _assert_loaded(model: peft.PeftModel, expected: dict[str, torch.Tensor]) -> None:
    """``model`` holds exactly ``expected``, its adapters still each rank's slices (loaded
    into them, not by replacing the DTensors)."""
    _assert_state(model, expected, **EXACT)
    _assert_hosted(model)


@contextlib.contextmanager
def _writes(directory: str) -> Iterator[list[str]]:
    """The names of the files this process writes under ``directory`` (PEFT writes the
    config and the model card with ``open``, the tensors with safetensors' ``save_file``)."""
    written: list[str] = []
    real_open, real_save = builtins.open, peft.peft_model.safe_save_file

    def opening(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and str(file).startswith(directory):
            written.append(os.path.basename(file))
        return real_open(file, mode, *args, **kwargs)

    def saving(tensors, filename, *args, **kwargs):
        written.append(os.path.basename(filename))
        return real_save(tensors, filename, *args, **kwargs)

    with (
        mock.patch("builtins.open", opening),
        mock.patch.object(peft.peft_model, "safe_save_file", saving),
    ):
        yield written


# ------------------------------------------------------------------ PEFT's save_pretrained


def _save_pretrained(tmp: str) -> None:
    from safetensors.torch import load_file

    rank = dist.get_rank()
    reference, model, _ = _trained()
    one_device, tp, default = (f"{tmp}/{name}" for name in ("one_device", "tp", "default"))
    if rank == 0:
        reference.save_pretrained(one_device)
    with _writes(tmp) as written:
        model.save_pretrained(tp, is_main_process=rank == 0)  # every rank, rank 0 writing
    assert sorted(written) == (_FILES if rank == 0 else []), written
    # the default (is_main_process=True on every rank): every rank writes the same files
    with _writes(tmp) as written:
        model.save_pretrained(default)
    assert sorted(written) == _FILES, written
    dist.barrier()

    assert sorted(os.listdir(tp)) == sorted(os.listdir(one_device)) == _FILES
    expected = load_file(f"{one_device}/adapter_model.safetensors")
    actual = load_file(f"{tp}/adapter_model.safetensors")
    assert len(expected) == 4 * len(_TARGETS) and sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert not isinstance(actual[key], DTensor) and actual[key].shape == value.shape, key
        torch.testing.assert_close(actual[key], value, msg=key)  # after training: float64
    config = Path(tp, "adapter_config.json").read_text()
    assert json.loads(config) == json.loads(Path(one_device, "adapter_config.json").read_text())
    # every rank holds the whole adapter, so every rank's file had the same bytes
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert Path(default, name).read_bytes() == Path(tp, name).read_bytes(), name


def test_save_pretrained_writes_once_what_one_device_writes(tmp_path: Path) -> None:
    run_distributed(_save_pretrained, 2, str(tmp_path))


# ------------------------------------------------------------ PeftModel.from_pretrained


def _from_pretrained(tmp: str) -> None:
    reference, model, _ = _trained()
    model.save_pretrained(tmp, is_main_process=dist.get_rank() == 0)
    dist.barrier()
    expected = _logits(reference)

    base = _parallelize(_base())  # each rank holds its slices of the base
    loaded = peft.PeftModel.from_pretrained(base, tmp)
    _assert_hosted(loaded)
    torch.testing.assert_close(_logits(loaded), expected)

    single = peft.PeftModel.from_pretrained(_base(), tmp)
    torch.testing.assert_close(_logits(single), expected)


def test_from_pretrained_into_parallelized_and_single_device_base(tmp_path: Path) -> None:
    run_distributed(_from_pretrained, 2, str(tmp_path))


# ------------------------------------------------------------------- merge_and_unload


def _merge(peft_first: bool) -> None:
    reference = _peft()
    adapters = {k: v.clone() for k, v in reference.state_dict().items() if "lora_" in k}
    _train(reference)
    if peft_first:
        model = _parallelize(_peft())
    else:  # the plan first: PEFT wraps parallelized layers
        base = _parallelize(_base())
        model = peft.get_peft_model(base, _config())
        model.load_state_dict(adapters, strict=False)
    _train(model)

    merged_reference = reference.merge_and_unload()
    merged = model.merge_and_unload()
    expected = merged_reference.state_dict()
    assert not any("lora_" in k or "base_layer" in k for k in expected)
    _assert_state(merged, expected)
    # still parallelized as planned: plain layers again, their weights sharded as before
    assert not any(peft.tuners.tuners_utils.BaseTunerLayer in type(m).__mro__
                   for m in merged.modules())  # fmt: skip
    for layer in merged.model.layers:
        for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj", "mlp.gate_proj"):
            linear = layer.get_submodule(name)
            assert type(linear) is nn.Linear and linear.weight.placements == (Shard(0),), name
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            linear = layer.get_submodule(name)
            assert type(linear) is nn.Linear and linear.weight.placements == (Shard(1),), name
    torch.testing.assert_close(_logits(merged), _logits(merged_reference))


@pytest.mark.parametrize("peft_first", [True, False], ids=["peft_first", "plan_first"])
def test_merge_and_unload_gives_single_device_merged_model(peft_first: bool) -> None:
    run_distributed(_merge, 2, peft_first)


# ------------------------------------------------------- torch_tp.checkpoint round trips


def _fresh() -> peft.PeftModel:
    """Another parallelized PEFT model: other base weights, other adapters."""
    return _parallelize(_peft(seed=2, base_seed=7))


def _load_state_dict() -> None:
    _, model, _ = _trained()
    expected = _gathered(model)
    other = _fresh()
    other.load_state_dict(model.state_dict())
    _assert_loaded(other, expected)
    model.load_state_dict(model.state_dict())
    _assert_state(model, expected, **EXACT)
    torch.testing.assert_close(_logits(other), _logits(model), **EXACT)


def test_load_state_dict_of_state_dict_with_adapters() -> None:
    run_distributed(_load_state_dict, 2)


def _full_state_dict(tmp: str) -> None:
    from safetensors.torch import save_file

    reference, model, _ = _trained()
    expected = _gathered(model)
    state = checkpoint.full_state_dict(model)
    assert list(state) == list(reference.state_dict())  # the single-device names
    for name, value in reference.state_dict().items():
        assert not isinstance(state[name], DTensor), name
        torch.testing.assert_close(state[name], value, msg=name)
        torch.testing.assert_close(state[name], expected[name], msg=name, **EXACT)

    other = _fresh()
    checkpoint.load_full_state_dict(other, state)
    _assert_loaded(other, expected)

    rank0 = dist.get_rank() == 0
    path = f"{tmp}/model.safetensors"  # each rank reads its slices of the file
    if rank0:
        save_file(state, path)
    dist.barrier()
    other = _fresh()
    checkpoint.load_full_state_dict(other, path)
    _assert_loaded(other, expected)

    # rank 0 alone gathers into, and broadcasts from, a full state dict
    alone = checkpoint.full_state_dict(model, rank0_only=True)
    assert (list(alone) == list(state)) if rank0 else alone == {}
    other = _fresh()
    checkpoint.load_full_state_dict(other, alone if rank0 else None, broadcast_from_rank0=True)
    _assert_loaded(other, expected)


def test_full_state_dict_round_trip_with_adapters(tmp_path: Path) -> None:
    run_distributed(_full_state_dict, 2, str(tmp_path))


def _dcp(tmp: str) -> None:
    _, model, optimizer = _trained()
    expected = _gathered(model)
    checkpoint.save(tmp, model, optimizer, step=2)

    other = _fresh()
    other_optimizer = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad])
    assert checkpoint.load(tmp, other, other_optimizer, rng=False) == 2
    _assert_loaded(other, expected)
    # the optimizer's state came back too: one more step each, the same parameters
    for m, opt in ((model, optimizer), (other, other_optimizer)):
        m(input_ids=_ids(), labels=_ids()).loss.backward()
        opt.step()
    _assert_state(other, _gathered(model), **EXACT)

    single = _peft(seed=2, base_seed=7)  # another layout: one device
    checkpoint.load(tmp, single, rng=False)
    _assert_state(single, expected, **EXACT)


def test_dcp_round_trip_with_adapters(tmp_path: Path) -> None:
    run_distributed(_dcp, 2, str(tmp_path))


def _hf(tmp: str) -> None:
    _, model, _ = _trained()
    expected = _gathered(model)
    # the transformers model inside the PEFT model, LoRA layers and all
    checkpoint.save_pretrained(model.base_model.model, tmp)
    other = _fresh()
    checkpoint.load_pretrained(other.base_model.model, tmp)
    _assert_loaded(other, expected)


def test_hf_directory_round_trip_with_adapters(tmp_path: Path) -> None:
    run_distributed(_hf, 2, str(tmp_path))


def _bad_step_on_one_rank(tmp: str) -> None:
    _, model, optimizer = _trained()
    # rank 0's bad step is agreed on before any rank gathers a hosted adapter (the checks
    # read the model's own tensors): the same error everywhere, no rank left in a gather
    step = -1 if dist.get_rank() == 0 else 2
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        checkpoint.save(tmp, model, optimizer, step=step)
    assert os.listdir(tmp) == []


def test_dcp_save_refused_on_every_rank_before_gathering_adapters(tmp_path: Path) -> None:
    run_distributed(_bad_step_on_one_rank, 2, str(tmp_path), timeout=60)


# ------------------------------------------------------------------------- under FSDP2


def _fsdp_tp(seed: int = 1, base_seed: int = 0) -> peft.PeftModel:
    """The PEFT model, tensor-parallel on ``tp`` and sharded by FSDP2 on ``dp`` (2 x 2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    model = _peft(seed, base_seed)
    inner = model.base_model.model
    torch_tp.parallelize_module(inner, mesh["tp"], plan_for(inner))
    for layer in inner.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _fsdp(tmp: str) -> None:
    from safetensors.torch import load_file

    reference = _peft()
    _train(reference)
    model = _fsdp_tp()
    optimizer = _train(model)  # every dp rank the same batch: one device's steps
    expected = _gathered(model)

    model.save_pretrained(f"{tmp}/peft", is_main_process=dist.get_rank() == 0)
    dist.barrier()
    saved = load_file(f"{tmp}/peft/adapter_model.safetensors")
    ours = {k.replace(".default", ""): v for k, v in reference.state_dict().items()}
    assert len(saved) == 4 * len(_TARGETS)
    for key, value in saved.items():
        torch.testing.assert_close(value, ours[key], msg=key)

    other = _fsdp_tp(seed=2, base_seed=7)
    other.load_state_dict(model.state_dict())
    _assert_state(other, expected, **EXACT)
    other = _fsdp_tp(seed=2, base_seed=7)
    checkpoint.load_full_state_dict(other, checkpoint.full_state_dict(model))
    _assert_state(other, expected, **EXACT)
    checkpoint.save(f"{tmp}/dcp", model, optimizer, step=2)
    other = _fsdp_tp(seed=2, base_seed=7)
    checkpoint.load(f"{tmp}/dcp", other, rng=False)
    _assert_state(other, expected, **EXACT)


@pytest.mark.four_ranks
def test_round_trips_under_fsdp2_and_tp(tmp_path: Path) -> None:
    run_distributed(_fsdp, 4, str(tmp_path))
