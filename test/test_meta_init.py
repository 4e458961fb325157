"""Meta-device initialisation as a route: build on meta, parallelize, ``torch_tp.materialize``,
load a checkpoint; the logits equal the single-device model's built from the same checkpoint
(exactly). Every loader refuses a model still on meta, naming its tensors; ``materialize``
refuses what it cannot compute again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import CHECKPOINT_CONFIG, checkpoint_llama, parallelize_dp_tp, tp_mesh

import torch_tp
from torch_tp import parallelize_module
from torch_tp.checkpoint import (
    full_state_dict,
    load,
    load_full_state_dict,
    load_pretrained,
    save,
    save_pretrained,
)
from torch_tp.models import Llama, tiny_config
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import run_distributed

transformers = pytest.importorskip("transformers")

from torch_tp.plans.hf import plan_for  # noqa: E402

_IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def _hf_config(family: str):
    common = {"vocab_size": 64, "attn_implementation": "eager"}
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=16, **common)
    heads = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16,
        "tie_word_embeddings": False, **common,
    }  # fmt: skip
    if family == "llama":  # a scaled RoPE: inv_freq is not the plain formula
        return transformers.LlamaConfig(
            **heads,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        )  # fmt: skip
    if family == "qwen3":
        return transformers.Qwen3Config(**heads, head_dim=16, sliding_window=4)
    return transformers.MistralConfig(**heads, sliding_window=4)


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.named_buffers()}


def _hf_route(family: str, path: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """meta -> parallelize -> materialize -> load_pretrained, in float64: the logits (equal,
    bit for bit, to those of the same plan on the model built whole from the checkpoint) and
    the buffers."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            _hf_config(family), dtype=torch.float64
        ).eval()
    parallelize_module(model, tp_mesh(), plan_for(model))
    torch_tp.materialize(model)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    load_pretrained(model, path)
    eager = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float64
    ).eval()
    parallelize_module(eager, tp_mesh(), plan_for(eager))
    with torch.no_grad():
        logits = model(_IDS).logits
        torch.testing.assert_close(logits, eager(_IDS).logits, rtol=0, atol=0)
    return logits, _buffers(model)


@pytest.mark.parametrize(
    "family",
    [
        "llama",  # a scaled RoPE (llama3)
        pytest.param("qwen3", marks=pytest.mark.slow),  # the full suite: three more families
        pytest.param("mistral", marks=pytest.mark.slow),
        pytest.param("gpt2", marks=pytest.mark.slow),
    ],
)
def test_meta_parallelize_materialize_load_pretrained(family, tmp_path):
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_hf_config(family)).save_pretrained(tmp_path)
    # one device, from the same checkpoint
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float64
    ).eval()
    with torch.no_grad():
        expected = reference(_IDS).logits
    for logits, buffers in run_distributed(_hf_route, 2, family, str(tmp_path)):
        assert sorted(buffers) == sorted(_buffers(reference))
        for name, value in _buffers(reference).items():  # rotary inv_freq among them
            torch.testing.assert_close(buffers[name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(logits, expected)  # float64: only the sums' order differs


def _llama_route(path: str, sequence_parallel: bool, dp: int) -> tuple[torch.Tensor, dict]:
    """meta -> parallelize (-> FSDP2) -> materialize -> load: the logits (equal, bit for bit,
    to those of the same layout on the model built whole) and the full state and buffers."""
    with torch.device("meta"):
        model = Llama(tiny_config(**CHECKPOINT_CONFIG)).double()
    model, _ = parallelize_dp_tp(model, dp, 2, sequence_parallel)
    torch_tp.materialize(model)
    load_pretrained(model, path)
    eager = checkpoint_llama(seed=1).double()
    load_full_state_dict(eager, os.path.join(path, "model.safetensors"))
    eager, _ = parallelize_dp_tp(eager, dp, 2, sequence_parallel)
    tokens = torch.randint(0, 1001, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    torch.testing.assert_close(logits, eager(tokens), rtol=0, atol=0)
    return logits.detach(), {**full_state_dict(model), **_buffers(model)}


@pytest.mark.parametrize(
    "sequence_parallel, dp",
    [
        (False, 1),
        pytest.param(True, 1, marks=pytest.mark.slow),
        pytest.param(False, 2, marks=pytest.mark.slow),  # FSDP2 x TP
    ],
)
def test_reference_llama_from_meta_equals_one_device(tmp_path, sequence_parallel, dp):
    from safetensors.torch import save_file

    reference = checkpoint_llama().double()
    save_file(reference.state_dict(), str(tmp_path / "model.safetensors"))
    tokens = torch.randint(0, 1001, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = reference(tokens)
    results = run_distributed(_llama_route, 2 * dp, str(tmp_path), sequence_parallel, dp)
    for logits, state in results:
        for name, value in [*reference.state_dict().items(), ("rope_cache", reference.rope_cache)]:
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(logits, expected)  # float64: only the sums' order differs


def test_materialize_without_a_mesh_is_exact_on_one_device():
    reference = checkpoint_llama()
    with torch.device("meta"):
        model = Llama(tiny_config(**CHECKPOINT_CONFIG))
    with pytest.raises(ValueError, match="no DTensor.*pass device="):
        torch_tp.materialize(model)
    assert torch_tp.materialize(model, device="cpu") is model
    assert model.rope_cache.device.type == "cpu"
    load_full_state_dict(model, reference.state_dict())
    tokens = torch.randint(0, 1001, (2, 16))
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=0)


class _NoConfig(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.arange(4.0), persistent=False)
        self.register_buffer("table", torch.arange(3.0))  # persistent: a checkpoint fills it


def test_materialize_refuses_what_it_cannot_compute_again():
    with torch.device("meta"):
        model = torch.nn.Sequential(_NoConfig())
    with pytest.raises(ValueError, match=r"'0.scale' \(_NoConfig\): neither its module") as info:
        torch_tp.materialize(model, device="cpu")
    assert "'0.table'" not in str(info.value)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])  # nothing changed
    model[0].scale = torch.ones(4)  # given a value: left alone
    torch_tp.materialize(model, device="cpu")
    assert torch.equal(model[0].scale, torch.ones(4)) and not model[0].table.is_meta


def _loaders_refuse(paths: dict[str, str], bad_rank: int | None) -> list[str]:
    """Each loader, given a model still on the meta device (on every rank, or on
    ``bad_rank`` only), raises the same ValueError on every rank, naming its tensors."""
    import torch.distributed as dist

    with torch.device("meta"):
        model = Llama(tiny_config(**CHECKPOINT_CONFIG))
    parallelize_module(model, tp_mesh(), llama_plan())
    if bad_rank is not None and dist.get_rank() != bad_rank:
        torch_tp.materialize(model)
    calls = {
        "load_full_state_dict(path)": lambda: load_full_state_dict(model, paths["file"]),
        "load_full_state_dict(dict)": lambda: load_full_state_dict(
            model, checkpoint_llama().state_dict()
        ),
        "load_full_state_dict(broadcast)": lambda: load_full_state_dict(
            model, paths["file"] if dist.get_rank() == 0 else None, broadcast_from_rank0=True
        ),
        "load_pretrained": lambda: load_pretrained(model, paths["hf"]),
        "load": lambda: load(paths["dcp"], model, rng=False),
        "full_state_dict": lambda: full_state_dict(model),
        "save": lambda: save(paths["out"], model, step=1),
        "save_pretrained": lambda: save_pretrained(model, paths["out_hf"]),
    }
    messages = []
    for what, call in calls.items():
        with pytest.raises(ValueError, match="on the meta device") as info:
            call()
        message = str(info.value)
        assert "'tok_embeddings.weight'" in message and "torch_tp.materialize" in message, what
        assert "22 of the model" in message and "and 18 more" in message, message
        messages.append(message)
    return messages


def test_every_loader_refuses_a_model_on_meta(tmp_path):
    from safetensors.torch import save_file

    reference = checkpoint_llama()
    paths = {k: str(tmp_path / k) for k in ("file", "hf", "dcp", "out", "out_hf")}
    save_file(reference.state_dict(), paths["file"])
    Path(paths["hf"]).mkdir()
    save_file(reference.state_dict(), str(Path(paths["hf"]) / "model.safetensors"))
    save(paths["dcp"], reference, step=1)  # in this process, without a group
    # on rank 1 only: rank 0, whose model is fine, raises the same error (no rank waits)
    first, second = run_distributed(_loaders_refuse, 2, paths, 1)
    assert first == second
    assert not Path(paths["out"]).exists() and not Path(paths["out_hf"]).exists()
