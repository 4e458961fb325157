"""ContextParallel: the reference Llama with its sequence split over a ``cp`` mesh.

Each rank holds its part of every sequence (``shard_sequence``, load-balanced: a head chunk
and a tail chunk) and the tokens' true positions (``sequence_positions``); the attention of
each block is a ring of key/value blocks over the ``cp`` ranks. FSDP2 over ``cp`` sums the
parameters' gradients (each rank's is its tokens' part). Everything is compared with one
device on the whole sequence, float64: the logits gathered back in sequence order, the loss,
every gradient and every parameter after AdamW steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import adamw, check_step, perturb_norms
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import torch_tp
from torch_tp import ContextParallel, sequence_positions, shard_sequence, unshard_sequence
from torch_tp.models import Llama, tiny_config
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import device_type, run_distributed

TOL = {"rtol": 1e-7, "atol": 1e-9}
SEQ = 16


def _model() -> Llama:
    torch.manual_seed(0)
    model = Llama(tiny_config(n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)).double()
    perturb_norms(model)
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 1001, (2, SEQ), generator=gen)
    return tokens, torch.randint(0, 1001, (2, SEQ), generator=gen)


def _train(
    cp: int, tp: int, rotation: str, load_balance: bool, target: str, one_call: bool = False
) -> None:
    reference = _model()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh(device_type(), (cp, tp), mesh_dim_names=("cp", "tp"))
    style = ContextParallel(rotation=rotation, load_balance=load_balance)
    if one_call:  # one plan on the 2-D mesh: ContextParallel on cp, the others on tp
        torch_tp.parallelize_module(model, mesh, {**llama_plan(), target: style})
    else:
        if tp > 1:
            torch_tp.parallelize_module(model, mesh["tp"], llama_plan())
        torch_tp.parallelize_module(model, mesh["cp"], {target: style})
    for layer in model.layers:  # the gradients summed (averaged) over cp
        fully_shard(layer, mesh=mesh["cp"])
    fully_shard(model, mesh=mesh["cp"])
    ref_optim, optim = adamw(reference.parameters()), adamw(model.parameters())
    positions = sequence_positions(SEQ, mesh["cp"], load_balance=load_balance)
    for step in range(2):
        tokens, targets = _batch(step)
        ref_logits = reference(tokens)
        F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten()).backward()
        mine = shard_sequence(tokens, mesh["cp"], load_balance=load_balance)
        logits = model(mine, positions=positions)
        whole = unshard_sequence(logits.detach(), mesh["cp"], load_balance=load_balance)
        torch.testing.assert_close(whole, ref_logits.detach(), **TOL)
        local_targets = shard_sequence(targets, mesh["cp"], load_balance=load_balance)
        # each rank's mean over its tokens; FSDP2 averages over cp: the mean over all of them
        F.cross_entropy(logits.flatten(0, 1), local_targets.flatten()).backward()
        check_step(model, reference, optim, ref_optim, grad_tol=TOL, param_tol=TOL)


@pytest.mark.parametrize(
    ("rotation", "load_balance", "target"),
    [
        ("p2p", True, "layers.*.attention"),
        ("allgather", False, "layers.*"),
    ],
    ids=["p2p-balanced-attention", "allgather-contiguous-block"],
)
def test_cp2_matches_one_device(rotation, load_balance, target):
    run_distributed(_train, 2, 2, 1, rotation, load_balance, target)


@pytest.mark.four_ranks
@pytest.mark.parametrize("rotation", ["p2p", "allgather"])
def test_cp4_matches_one_device(rotation):
    run_distributed(_train, 4, 4, 1, rotation, True, "layers.*.attention")


@pytest.mark.four_ranks
@pytest.mark.parametrize(
    ("rotation", "one_call"), [("p2p", False), ("allgather", False), ("p2p", True)]
)
def test_cp2_tp2_matches_one_device(rotation, one_call):
    """Tensor-parallel attention (its heads over tp) on a split sequence: each rank's ring
    carries its local heads. The attention module has a tensor-parallel style: the context-
    parallel one goes on the block around it. ``one_call``: one plan on the (cp, tp) mesh."""
    run_distributed(_train, 4, 2, 2, rotation, True, "layers.*", one_call)


def test_one_plan_on_a_cp_tp_mesh_matches_one_device():
    """(cp2, tp1) on two ranks, one parallelize_module call: each style on its dimension."""
    run_distributed(_train, 2, 2, 1, "p2p", True, "layers.*", True)


def _train_dp_cp_tp() -> None:
    """(dp2, cp2, tp2) on eight ranks: each dp rank its own sequences, split over cp; the
    attention's heads over tp; FSDP2 over dp x cp (flattened) averages the gradients."""
    reference = _model()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh(device_type(), (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    data = mesh["dp", "cp"]._flatten("dp_cp")
    torch_tp.parallelize_module(model, mesh["tp"], llama_plan())
    torch_tp.parallelize_module(model, mesh["cp"], {"layers.*": ContextParallel()})
    for layer in model.layers:
        fully_shard(layer, mesh=data)
    fully_shard(model, mesh=data)
    ref_optim, optim = adamw(reference.parameters()), adamw(model.parameters())
    cp, dp = mesh["cp"], mesh["dp"].get_local_rank()
    positions = sequence_positions(SEQ, cp)
    for step in range(2):
        tokens, targets = _batch(step)  # two sequences: one per dp rank
        ref_logits = reference(tokens)
        F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten()).backward()
        mine = slice(dp, dp + 1)
        logits = model(shard_sequence(tokens[mine], cp), positions=positions)
        whole = unshard_sequence(logits.detach(), cp)
        torch.testing.assert_close(whole, ref_logits[mine].detach(), **TOL)
        local_targets = shard_sequence(targets[mine], cp)
        F.cross_entropy(logits.flatten(0, 1), local_targets.flatten()).backward()
        check_step(model, reference, optim, ref_optim, grad_tol=TOL, param_tol=TOL)


@pytest.mark.slow  # eight ranks
def test_dp2_cp2_tp2_with_fsdp2_matches_one_device():
    run_distributed(_train_dp_cp_tp, 8)


def _train_cp_ep(sequence_parallel: bool) -> None:
    """The reference MoE Llama at (cp2, ep2): experts over ep (the plan's tensor-parallel
    attention over the same ranks), each sequence split over cp. The load-balancing loss is
    each rank's tokens' (as under data parallelism): left out, the rest compared."""
    from torch_tp.models import MoEConfig, MoELlama
    from torch_tp.plans.moe import moe_llama_plan

    torch.manual_seed(0)
    config = MoEConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        n_experts=4,
        expert_hidden_dim=16,
        vocab_size=128,
        max_seq_len=SEQ,
        router_aux_loss_coef=0.0,
    )
    reference = MoELlama(config).double()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("cp", "ep"))
    plan = moe_llama_plan(experts="ep", sequence_parallel=sequence_parallel)
    torch_tp.parallelize_module(model, mesh["ep"], plan)
    torch_tp.parallelize_module(model, mesh["cp"], {"layers.*": ContextParallel()})
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["cp"])
    fully_shard(model, mesh=mesh["cp"])
    ref_optim, optim = adamw(reference.parameters()), adamw(model.parameters())
    cp = mesh["cp"]
    positions = sequence_positions(SEQ, cp)
    for step in range(2):
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 128, (2, SEQ), generator=gen)
        targets = torch.randint(0, 128, (2, SEQ), generator=gen)
        ref_logits = reference(tokens)
        F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten()).backward()
        logits = model(shard_sequence(tokens, cp), positions=positions)
        whole = unshard_sequence(logits.detach(), cp)
        torch.testing.assert_close(whole, ref_logits.detach(), **TOL)
        F.cross_entropy(logits.flatten(0, 1), shard_sequence(targets, cp).flatten()).backward()
        check_step(model, reference, optim, ref_optim, grad_tol=TOL, param_tol=TOL)


@pytest.mark.four_ranks
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["ep", "ep+sp"])
def test_cp2_ep2_moe_matches_one_device(sequence_parallel):
    run_distributed(_train_cp_ep, 4, sequence_parallel)


def _train_pp_cp(schedule_name: str, stages_per_rank: int) -> None:
    """(pp2, cp2): pipeline stages of the reference Llama, each rank's stages on its part of
    every sequence (cp_mesh), the gradients averaged over cp by hand."""
    from torch_tp.pipeline import build_schedule, pipeline_stages

    reference = Llama(tiny_config(n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)).double()
    perturb_norms(reference)
    model = copy.deepcopy(reference)
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("pp", "cp"))
    cp = mesh["cp"]
    stages = pipeline_stages(model, mesh["pp"], stages_per_rank=stages_per_rank, cp_mesh=cp)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    batch = 4
    schedule = build_schedule(
        stages, schedule_name, n_microbatches=2, batch_size=batch, loss_fn=loss_fn
    )
    params = [p for stage in stages for p in stage.submod.parameters()]
    names = {id(p): n for stage in stages for n, p in stage.submod.named_parameters()}
    optim, ref_optim = adamw(params), adamw(reference.parameters())
    last = any(stage.is_last for stage in stages)
    for step in range(2):
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 1001, (batch, SEQ), generator=gen)
        targets = torch.randint(0, 1001, (batch, SEQ), generator=gen)
        ref_loss = loss_fn(reference(tokens), targets)
        ref_loss.backward()
        losses: list[torch.Tensor] = []
        schedule.step(shard_sequence(tokens, cp), target=shard_sequence(targets, cp), losses=losses)
        if last:  # each cp rank's mean over its tokens; their mean is the batch's
            loss = torch.stack(losses).mean()
            torch.distributed.all_reduce(loss, group=cp.get_group())
            torch.testing.assert_close(loss / cp.size(), ref_loss.detach(), **TOL)
        for p in params:  # averaged over cp, as data parallelism would
            torch.distributed.all_reduce(p.grad, group=cp.get_group())
            p.grad /= cp.size()
            ref = reference.get_parameter(names[id(p)])
            torch.testing.assert_close(p.grad, ref.grad, **TOL, msg=names[id(p)])
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        for p in params:
            ref = reference.get_parameter(names[id(p)])
            torch.testing.assert_close(p.detach(), ref.detach(), **TOL, msg=names[id(p)])


@pytest.mark.four_ranks
@pytest.mark.parametrize(
    ("schedule", "stages_per_rank"), [("Schedule1F1B", 1), ("ScheduleInterleaved1F1B", 2)]
)
def test_pp2_cp2_matches_one_device(schedule, stages_per_rank):
    run_distributed(_train_pp_cp, 4, schedule, stages_per_rank)


def _checkpoint_cp_tp(path: str) -> dict:
    """Train one step at (cp2, tp2) with FSDP2 over cp, save (DCP); return the trained
    values, gathered."""
    model = _model()
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("cp", "tp"))
    torch_tp.parallelize_module(model, mesh["tp"], llama_plan())
    torch_tp.parallelize_module(model, mesh["cp"], {"layers.*": ContextParallel()})
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["cp"])
    fully_shard(model, mesh=mesh["cp"])
    optim = adamw(model.parameters())
    tokens, targets = _batch(0)
    cp = mesh["cp"]
    logits = model(shard_sequence(tokens, cp), positions=sequence_positions(SEQ, cp))
    F.cross_entropy(logits.flatten(0, 1), shard_sequence(targets, cp).flatten()).backward()
    optim.step()
    torch_tp.checkpoint.save(path, model, optim, step=1)
    return torch_tp.checkpoint.full_state_dict(model)


@pytest.mark.four_ranks
def test_a_cp2_tp2_checkpoint_loads_on_one_device(tmp_path):
    """Context parallelism shards no parameter: a DCP checkpoint of (cp2, tp2) with FSDP2
    over cp loads on one device, equal to the same step trained there."""
    saved = run_distributed(_checkpoint_cp_tp, 4, str(tmp_path))[0]
    reference = _model()
    optim = adamw(reference.parameters())
    tokens, targets = _batch(0)
    F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten()).backward()
    optim.step()
    model = _model()
    model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
    loaded = torch_tp.checkpoint.load(str(tmp_path), model, adamw(model.parameters()), rng=False)
    assert loaded == 1
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, **TOL, msg=name)
        torch.testing.assert_close(saved[name], value, **TOL, msg=name)


def test_cp_degree_of_the_ready_plans():
    """auto(cp_degree=): ContextParallel on the blocks over 1, nothing at 1, a bad degree or
    blocks the plan already styles refused."""
    import warnings

    from torch_tp.plans._context import with_context_parallel
    from torch_tp.plans.auto import auto

    with torch.device("meta"):
        model = Llama(tiny_config())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = auto(model, cp_degree=2)
        assert plan["layers.*"] == ContextParallel()
        assert not any(isinstance(v, ContextParallel) for v in auto(model, cp_degree=1).values())
        for bad in (0, 2.0, True):
            with pytest.raises(ValueError, match="cp_degree must be a positive int"):
                auto(model, cp_degree=bad)
    with pytest.raises(ValueError, match=r"already gives them a style \(\['layers.1'\]\)"):
        with_context_parallel(model, {"layers.1": "sequence_parallel"}, 2)


def _odd_length() -> str:
    model = _model()
    mesh = init_device_mesh(device_type(), (2,), mesh_dim_names=("cp",))
    torch_tp.parallelize_module(model, mesh, {"layers.*.attention": ContextParallel()})
    tokens = torch.randint(0, 1001, (2, 3))  # 3 tokens a rank: 6 do not split in 4 chunks
    with pytest.raises(ValueError) as caught:
        model(tokens, positions=torch.arange(3))
    return str(caught.value)


def test_a_length_the_layout_cannot_split_is_refused_naming_the_module():
    for message in run_distributed(_odd_length, 2):
        assert "'layers.0.attention'" in message, message
        assert "a sequence of 6 tokens cannot be split over cp=2" in message, message
