"""ContextParallel on transformers' Llama and Qwen2, eager and sdpa attention.

The sequence is split over ``cp`` (load-balanced); each rank runs the model on its tokens with
their true ``position_ids``; ``ContextParallel`` on the decoder layers turns their attention
into a ring (an eager attention module computes the same attention by
``F.scaled_dot_product_attention``; the causal masks transformers builds for this rank's
tokens give way to the ring's causal mask of the true positions). FSDP2 over ``cp`` sums the
gradients. Against one device on the whole sequence, float64: the logits, the loss, every
gradient and every parameter after AdamW steps, at cp2 and cp2 x tp2 (the model's own plan
on ``tp``). Then what the ring cannot follow, refused on every rank: padding, positions that
are not the tokens' own, sliding windows (the other windows: test_context_parallel_windows).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import adamw, check_step
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import torch_tp
from torch_tp import ContextParallel, sequence_positions, shard_sequence, unshard_sequence
from torch_tp.testing import device_type, run_distributed

transformers = pytest.importorskip("transformers")

TOL = {"rtol": 1e-7, "atol": 1e-9}
# transformers' eager attention takes its softmax in float32 (the ring: float64)
EAGER_TOL = {"rtol": 1e-4, "atol": 1e-6}
SEQ, BATCH, VOCAB = 16, 2, 128
LAYERS = "model.layers.*"


def _model(family: str, attention: str, heads: tuple[int, int]) -> torch.nn.Module:
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    config = config_class(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation=attention,
    )
    torch.manual_seed(0)
    return model_class(config).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    # the next token of the whole sequence, shifted before the sequence is split
    labels = torch.cat([tokens[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    return tokens, labels


def _loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def _parallelize(model, cp: int, tp: int, plan: str = "two calls"):
    """``plan``: ``"two calls"``, the model's plan on mesh["tp"] and ContextParallel on
    mesh["cp"]; ``"plan_for"`` or ``"auto"``, that function's plan with ``cp_degree=cp``, in
    one call on the (cp, tp) mesh."""
    from torch_tp.plans.auto import auto
    from torch_tp.plans.hf import plan_for

    mesh = init_device_mesh(device_type(), (cp, tp), mesh_dim_names=("cp", "tp"))
    if plan == "two calls":
        if tp > 1:
            torch_tp.parallelize_module(model, mesh["tp"], plan_for(model))
        torch_tp.parallelize_module(model, mesh["cp"], {LAYERS: ContextParallel()})
    else:
        make = plan_for if plan == "plan_for" else auto
        full = make(model, cp_degree=cp)
        assert full[LAYERS] == ContextParallel()
        torch_tp.parallelize_module(model, mesh, full)
    for layer in model.model.layers:  # the gradients averaged over cp
        fully_shard(layer, mesh=mesh["cp"])
    fully_shard(model, mesh=mesh["cp"])
    return mesh


def _train(
    family: str,
    attention: str,
    heads: tuple[int, int],
    cp: int,
    tp: int,
    plan: str = "two calls",
) -> None:
    reference = _model(family, attention, heads)
    model = copy.deepcopy(reference)
    tol = EAGER_TOL if attention == "eager" else TOL
    mesh = _parallelize(model, cp, tp, plan)
    cp_mesh = mesh["cp"]
    for attn in (layer.self_attn for layer in model.model.layers):
        assert attn.config._attn_implementation == "sdpa"  # eager: this module's copy
    assert model.config._attn_implementation == attention  # the model's own is untouched
    ref_optim, optim = adamw(reference.parameters()), adamw(model.parameters())
    positions = sequence_positions(SEQ, cp_mesh)[None].expand(BATCH, -1)
    for step in range(2):
        tokens, labels = _batch(step)
        count = int((labels != -100).sum())
        ref_logits = reference(input_ids=tokens).logits
        ref_loss = _loss_sum(ref_logits, labels) / count
        ref_loss.backward()
        logits = model(input_ids=shard_sequence(tokens, cp_mesh), position_ids=positions).logits
        whole = unshard_sequence(logits.detach(), cp_mesh)
        torch.testing.assert_close(whole, ref_logits.detach(), **tol)
        loss = _loss_sum(logits, shard_sequence(labels, cp_mesh)) / count
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=cp_mesh.get_group())
        torch.testing.assert_close(total, ref_loss.detach(), **tol)
        # FSDP2 averages over cp: each rank's part of the sum, times cp
        (loss * cp).backward()
        check_step(model, reference, optim, ref_optim, grad_tol=tol, param_tol=tol)


CASES = [
    ("llama", "eager", (4, 2)),
    ("qwen2", "sdpa", (4, 2)),
    ("llama", "sdpa", (4, 4)),
    ("qwen2", "eager", (4, 4)),
]


@pytest.mark.parametrize(
    ("family", "attention", "heads"),
    # two in the quick run, the others in the full one
    [
        case if i < 2 else pytest.param(*case, marks=pytest.mark.slow)
        for i, case in enumerate(CASES)
    ],
    ids=lambda v: str(v),
)
def test_cp2_matches_one_device(family, attention, heads):
    run_distributed(_train, 2, family, attention, heads, 2, 1)


@pytest.mark.four_ranks
@pytest.mark.parametrize(("family", "attention", "heads"), CASES, ids=lambda v: str(v))
def test_cp2_tp2_matches_one_device(family, attention, heads):
    run_distributed(_train, 4, family, attention, heads, 2, 2)


@pytest.mark.parametrize(
    ("plan", "tp"),
    [
        ("plan_for", 1),
        pytest.param("plan_for", 2, marks=pytest.mark.four_ranks),
        pytest.param("auto", 2, marks=pytest.mark.four_ranks),
    ],
)
def test_plans_with_cp_degree_apply_in_one_call(plan, tp):
    """plan_for(model, cp_degree=2) and auto(model, cp_degree=2): the model's tensor-parallel
    plan and ContextParallel on the decoder layers, applied in one call on the (cp, tp)
    mesh, each style on its dimension."""
    run_distributed(_train, 2 * tp, "qwen2", "sdpa", (4, 2), 2, tp, plan)


# --------------------------------------------------------------------------- refused


def _refused_inputs() -> list[str]:
    """Inputs the ring cannot follow, one rank's only: every rank raises, none hangs."""
    model = _model("llama", "sdpa", (4, 2))
    mesh = _parallelize(model, 2, 1)
    cp_mesh = mesh["cp"]
    rank = cp_mesh.get_local_rank()
    tokens = shard_sequence(_batch(0)[0], cp_mesh)
    positions = sequence_positions(SEQ, cp_mesh)[None]
    errors = []
    mask = torch.ones_like(tokens)
    if rank == 1:
        mask[0, 0] = 0  # padding on one rank's part only
    cases = [
        {"attention_mask": mask, "position_ids": positions},
        {"position_ids": positions if rank == 0 else torch.arange(SEQ // 2)[None]},
        {},  # no positions: each rank would count from 0
    ]
    for kwargs in cases:
        with pytest.raises(ValueError) as caught:
            model(input_ids=tokens, **kwargs)
        errors.append(str(caught.value))
    # a mask of all ones is no padding
    model(input_ids=tokens, attention_mask=torch.ones_like(tokens), position_ids=positions)
    return errors


def test_inputs_the_ring_cannot_follow_are_refused_on_every_rank():
    for errors in run_distributed(_refused_inputs, 2):
        assert "attention_mask that masks tokens (padding)" in errors[0]
        assert "position_ids must be the positions" in errors[1]
        assert "position_ids must be the positions" in errors[2]


def _sliding_window_refused() -> str:
    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=0,
        attn_implementation="sdpa",
    )
    model = transformers.Qwen2ForCausalLM(config).double()
    before = copy.deepcopy(model.state_dict())
    mesh = init_device_mesh(device_type(), (2,), mesh_dim_names=("cp",))
    with pytest.raises(ValueError) as caught:
        torch_tp.parallelize_module(model, mesh, {LAYERS: ContextParallel()})
    assert model.model.layers[0].self_attn.config is model.config  # nothing changed
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
    return str(caught.value)


def test_sliding_windows_are_refused_before_anything_changes():
    message = run_distributed(_sliding_window_refused, 2)[0]
    assert "model.layers.0" in message and "sliding window of 4 tokens" in message, message
    # (more windows, wherever transformers keeps them: test_context_parallel_windows.py)


def _refused_layouts() -> list[str]:
    """Refused before anything changes: dropout inside attention, and a cp mesh that is the
    tensor-parallel one."""
    from torch_tp.plans.hf import plan_for

    errors = []
    model = _model("llama", "sdpa", (4, 2))
    model.model.layers[1].self_attn.attention_dropout = 0.1
    mesh = init_device_mesh(device_type(), (2,), mesh_dim_names=("cp",))
    with pytest.raises(NotImplementedError) as caught:
        torch_tp.parallelize_module(model, mesh, {LAYERS: ContextParallel()})
    errors.append(str(caught.value))
    assert model.model.layers[0].self_attn.config is model.config  # nothing changed

    model = _model("llama", "sdpa", (4, 2))
    torch_tp.parallelize_module(model, mesh, plan_for(model))  # "tp" over the same ranks
    with pytest.raises(ValueError) as caught:
        torch_tp.parallelize_module(model, mesh, {LAYERS: ContextParallel()})
    errors.append(str(caught.value))

    model = _model("llama", "sdpa", (4, 2))  # a plan over (cp, tp) on a 1-D mesh
    with pytest.raises(ValueError) as caught:
        torch_tp.parallelize_module(model, mesh, plan_for(model, cp_degree=2))
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    errors.append(str(caught.value))
    return errors


def test_dropout_and_a_cp_mesh_shared_with_tp_are_refused():
    dropout, shared, one_d = run_distributed(_refused_layouts, 2)[0]
    assert "ContextParallel on 'model.layers.0'" in one_d and "not a 1-D mesh" in one_d, one_d
    assert "model.layers.1" in dropout and "attention_dropout=0.1" in dropout, dropout
    assert "context parallelism needs a mesh dimension of its own" in shared, shared


def _custom_mask_refused() -> str:
    """A model whose attention gets a mask of its own making (here, on one rank only: full
    attention, as a bidirectional span would): every rank raises, none hangs."""
    model = _model("llama", "eager", (4, 2))
    mesh = _parallelize(model, 2, 1)
    cp_mesh = mesh["cp"]

    def bidirectional(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None and cp_mesh.get_local_rank() == 1:
            kwargs["attention_mask"] = torch.zeros_like(mask)
        return args, kwargs

    model.model.layers[0].self_attn.register_forward_pre_hook(bidirectional, with_kwargs=True)
    tokens = shard_sequence(_batch(0)[0], cp_mesh)
    positions = sequence_positions(SEQ, cp_mesh)[None]
    with pytest.raises(NotImplementedError) as caught:
        model(input_ids=tokens, position_ids=positions)
    model.model.layers[0].self_attn._forward_pre_hooks.clear()
    model(input_ids=tokens, position_ids=positions)  # the model's own mask: causal
    return str(caught.value)


def test_a_mask_of_the_models_own_is_refused_on_every_rank():
    for message in run_distributed(_custom_mask_refused, 2):
        assert "model.layers.0.self_attn" in message or "model.layers.0" in message, message
        assert "an attention mask other than the causal one" in message, message
