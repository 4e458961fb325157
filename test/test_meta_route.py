"""The other meta-device route: build on meta, parallelize, ``model.to_empty()`` (PyTorch's
own habit) instead of :func:`torch_tp.materialize`, then load. ``to_empty`` leaves the
non-persistent buffers (rotary ``inv_freq``) uninitialised; every loader computes them again
as ``materialize`` does (warning, naming them), so the logits equal one device's, or refuses
when the model also holds such buffers that cannot be computed again.

Compares a parallelized model (TP=2) against one device."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import tp_mesh
from test_meta_init import _hf_config

from torch_tp import parallelize_module
from torch_tp.checkpoint import load, load_full_state_dict, load_pretrained, save
from torch_tp.testing import run_distributed

transformers = pytest.importorskip("transformers")

from torch_tp.plans.hf import plan_for  # noqa: E402

_IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
_LOADERS = ("load_pretrained", "load_full_state_dict", "load")
_SHAPES = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
    "tie_word_embeddings",
)  # fmt: skip


def _config(family: str):
    """test_meta_init's tiny configs (Llama with a llama3-scaled RoPE, Qwen3), and OLMo-2's
    (its default pad_token_id, 1, under the vocabulary; no eos beyond it)."""
    if family != "olmo2":
        return _hf_config(family)
    llama = _hf_config("llama")
    return transformers.Olmo2Config(
        **{k: getattr(llama, k) for k in _SHAPES},
        attn_implementation="eager",
        pad_token_id=1,
        eos_token_id=None,
    )


def _to_empty(family: str) -> torch.nn.Module:
    """Built on meta, parallelized, given memory by to_empty(); the buffers then hold what
    uninitialised memory may hold (here finite values, drawn, so that no run depends on what
    the allocator happened to reuse)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            _config(family), dtype=torch.float64
        ).eval()
    parallelize_module(model, tp_mesh(), plan_for(model))
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for buffer in model.buffers():
            buffer.copy_(torch.rand(buffer.shape, generator=generator, dtype=torch.float64) + 1)
    return model


def _load(loader: str, model: torch.nn.Module, paths: dict[str, str]) -> None:
    if loader == "load_pretrained":
        load_pretrained(model, paths["hf"])
    elif loader == "load_full_state_dict":
        load_full_state_dict(model, paths["file"])
    else:
        assert load(paths["dcp"], model, rng=False) == 1


def _route(family: str, paths: dict[str, str]) -> dict[str, tuple[torch.Tensor, list[str]]]:
    """Each loader on a fresh to_empty() model: the logits, and what the load warned."""
    out = {}
    for loader in _LOADERS:
        model = _to_empty(family)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _load(loader, model, paths)
        said = [str(w.message) for w in caught if "non-persistent buffers" in str(w.message)]
        with torch.no_grad():
            out[loader] = (model(_IDS).logits, said)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2"])
def test_to_empty_then_each_loader_equals_one_device(family, tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_config(family)).save_pretrained(tmp_path / "hf")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager", dtype=torch.float64
    ).eval()
    paths = {k: str(tmp_path / k) for k in ("hf", "file", "dcp")}
    save_file(reference.state_dict(), paths["file"])
    save(paths["dcp"], reference, step=1)  # in this process, without a group
    with torch.no_grad():
        expected = reference(_IDS).logits
    for results in run_distributed(_route, 2, family, paths):
        for loader, (logits, said) in results.items():
            torch.testing.assert_close(logits, expected, msg=lambda m, k=loader: f"{k}: {m}")
            # said once, naming the buffers computed again and the route to use instead
            assert len(said) == 1 and "'model.rotary_emb.inv_freq'" in said[0], (loader, said)
            assert "'model.rotary_emb.original_inv_freq'" in said[0]
            assert "torch_tp.materialize" in said[0]


class _Scale(torch.nn.Module):
    """A non-persistent buffer no module's config can compute again."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(4), persistent=False)


def _refusals(paths: dict[str, str]) -> list[str]:
    messages = []
    for loader in _LOADERS:
        model = _to_empty("llama")
        model.extra = _Scale().to(torch.float64)
        model.extra.scale.fill_(7.0)  # what to_empty might have left
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
        with pytest.raises(ValueError, match="torch_tp.materialize") as info:
            _load(loader, model, paths)
        message = str(info.value)
        assert "'model.rotary_emb.inv_freq'" in message and "'extra.scale'" in message, message
        for name, value in model.state_dict().items():  # nothing changed
            torch.testing.assert_close(
                value, before[name], rtol=0, atol=0, equal_nan=True, msg=name
            )
        for name, value in model.named_buffers():
            torch.testing.assert_close(
                value, buffers[name], rtol=0, atol=0, equal_nan=True, msg=name
            )
        messages.append(message.replace(loader, "<loader>"))
    # a model built whole: nothing is recomputed, nothing said
    model = transformers.AutoModelForCausalLM.from_config(_config("llama"), dtype=torch.float64)
    parallelize_module(model, tp_mesh(), plan_for(model))
    model.extra = _Scale()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_pretrained(model, paths["hf"])
    return messages


def test_to_empty_with_a_buffer_that_cannot_be_computed_is_refused(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(_config("llama"), dtype=torch.float64)
    reference.save_pretrained(tmp_path / "hf")
    paths = {k: str(tmp_path / k) for k in ("hf", "file", "dcp")}
    save_file(reference.state_dict(), paths["file"])
    save(paths["dcp"], reference, step=1)
    first, second = run_distributed(_refusals, 2, paths)
    assert first == second  # the same error on every rank
