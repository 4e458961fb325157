"""The reference Llama under its ready plan, at single-device parity through training steps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import perturb_norms, tp_mesh
from torch.distributed.tensor import DTensor

from torch_tp import parallelize_module
from torch_tp.models import Llama, LlamaConfig, tiny_config
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import check_parity, run_distributed


def _llama_parity(
    sequence_parallel: bool, loss_parallel: bool, n_kv_heads: int, norm: str, steps: int
) -> None:
    world_size = dist.get_world_size()
    mesh = tp_mesh()
    torch.manual_seed(0)
    config = LlamaConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        vocab_size=1001,
        max_seq_len=32,
        norm=norm,
    )
    model = Llama(config)
    perturb_norms(model)  # they must be broadcast, not assumed
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    targets = torch.randint(0, config.vocab_size, (2, 16))

    def loss_fn(logits):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    tp, _ = check_parity(
        model,
        mesh,
        llama_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel),
        (tokens,),
        loss_fn=loss_fn,
        # SGD, not Adam: Adam's update is about lr * sign(grad) for tiny gradients, which
        # turns float rounding in a 1e-9 gradient into a 1e-3 relative parameter difference
        optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
        steps=steps,
        rtol=1e-5,
        atol=1e-5,
    )
    # the heads really are split: each rank holds n_heads / world_size of them
    wq = tp.layers[0].attention.wq.weight
    assert isinstance(wq, DTensor) and wq.to_local().shape[0] == 64 // world_size
    for name, param in tp.named_parameters():
        if isinstance(param, DTensor):
            assert param.grad.placements == param.placements, name


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.four_ranks)])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_llama_parity(world_size, sequence_parallel):
    run_distributed(_llama_parity, world_size, sequence_parallel, False, 4, "rmsnorm", 2)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_llama_gqa_torch_rmsnorm(sequence_parallel):
    run_distributed(_llama_parity, 2, sequence_parallel, False, 2, "torch_rmsnorm", 1)


def test_llama_vocab_sharded_logits():
    run_distributed(_llama_parity, 2, True, True, 4, "rmsnorm", 1)


# ---- head counts the TP degree does not divide: refused before anything changes -------------


def _unsplittable_heads(config_overrides: dict[str, int]) -> tuple[str, str, bool]:
    """Parallelize a reference Llama whose heads do not split over the ranks; return the
    error's type and message, and whether the model is still exactly as it was."""
    mesh = tp_mesh()
    torch.manual_seed(0)
    model = Llama(tiny_config(**config_overrides))
    before = {name: value.clone() for name, value in model.state_dict().items()}
    tokens = torch.randint(0, model.config.vocab_size, (2, 8))
    expected = model(tokens)
    try:
        parallelize_module(model, mesh, llama_plan(sequence_parallel=True))
    except Exception as err:  # noqa: BLE001 - the caller checks the type
        kind, message = type(err).__name__, str(err)
    else:
        return "no error", "", False
    after = model.state_dict()
    untouched = (
        after.keys() == before.keys()
        and not any(isinstance(p, DTensor) for p in model.parameters())
        and all(torch.equal(after[name], value) for name, value in before.items())
        and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
        and torch.equal(model(tokens), expected)
    )
    return kind, message, untouched


@pytest.mark.parametrize(
    ("world_size", "overrides", "count", "what"),
    [
        # grouped-query attention: 4 query heads split over 4 ranks, 2 key/value heads do not
        pytest.param(
            4, {"n_heads": 4, "n_kv_heads": 2}, 2, "key/value heads", marks=pytest.mark.four_ranks
        ),
        # multi-query attention: one key/value head cannot be split at all
        (2, {"n_heads": 4, "n_kv_heads": 1}, 1, "key/value heads"),
        # 3 query heads (dim 48, head_dim 16) over 2 ranks
        (2, {"dim": 48, "n_heads": 3, "n_kv_heads": 3}, 3, "query heads"),
    ],
)
def test_llama_plan_refuses_unsplittable_heads(world_size, overrides, count, what):
    for kind, message, untouched in run_distributed(_unsplittable_heads, world_size, overrides):
        assert kind == "ValueError", message
        assert "AttentionHeads(" in message  # the style
        assert f"{count} {what} do not split over {world_size} ranks" in message
        assert "root module ('') (Llama)" in message  # the module it checks: path and type
        assert "config.kv_heads" in message  # where the counts come from
        assert untouched
