"""Pipeline stages from one model (``torch_tp.pipeline``) with tensor parallelism inside,
trained by ``torch.distributed.pipelining``'s own schedules, against one device.

Four CPU ranks as a (pp=2, tp=2) mesh train the reference Llama for three AdamW steps on
micro-batches of the global batch: the loss of every step and every parameter after it
equal the single-device model trained on the whole batch (the schedules average the
micro-batches' gradients, ``scale_grads=True``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import adamw, full_tensor
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from torch_tp import clip_grad_norm_
from torch_tp.models import Llama, LlamaConfig
from torch_tp.pipeline import pipeline_stages, split_model
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import device_type, run_distributed

CONFIG = LlamaConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=16)
BATCH, SEQ, MICROBATCHES = 8, 8, 4


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train(
    schedule_name: str, stages_per_rank: int, tp: bool, sp: bool = False, ac: bool = False
) -> None:
    from torch.distributed import pipelining

    torch.manual_seed(0)
    reference = Llama(CONFIG).double()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("pp", "tp"))
    stages = pipeline_stages(
        model,
        mesh["pp"],
        stages_per_rank=stages_per_rank,
        tp_mesh=mesh["tp"] if tp else None,
        plan=llama_plan(sequence_parallel=sp) if tp else None,
        sequence_parallel=sp,
    )
    if ac:  # activation checkpointing of every block, inside the stages
        from torch.distributed._composable import checkpoint

        import torch_tp

        for stage in stages:
            for block in stage.submod.layers.values():
                checkpoint(block, context_fn=torch_tp.random.checkpoint_contexts)
    calls: list[int] = []  # attention forwards of one block: recomputation runs them again
    next(iter(stages[0].submod.layers.values())).attention.register_forward_hook(
        lambda *_: calls.append(1)
    )
    schedule_class = getattr(pipelining, schedule_name)
    stage_arg = stages if stages_per_rank > 1 else stages[0]
    schedule = schedule_class(stage_arg, n_microbatches=MICROBATCHES, loss_fn=_loss)
    params = [p for stage in stages for p in stage.submod.parameters()]
    optim, ref_optim = adamw(params), adamw(reference.parameters())
    names = {id(p): n for stage in stages for n, p in stage.submod.named_parameters()}
    first = any(stage.is_first for stage in stages)
    last = any(stage.is_last for stage in stages)
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=gen)
        targets = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=gen)
        ref_loss = _loss(reference(tokens), targets)
        ref_loss.backward()
        losses: list[torch.Tensor] = []
        kwargs = {"target": targets, "losses": losses} if last else {}
        if first:
            schedule.step(tokens, **kwargs)
        else:
            schedule.step(**kwargs)
        if last:  # the mean of the micro-batches' losses is the batch's
            torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach())
        for p in params:
            ref = reference.get_parameter(names[id(p)])
            torch.testing.assert_close(full_tensor(p.grad), ref.grad, msg=names[id(p)])
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        for p in params:
            ref = reference.get_parameter(names[id(p)])
            torch.testing.assert_close(full_tensor(p.detach()), ref.detach(), msg=names[id(p)])
        if step == 0:
            after_first = len(calls)
    # (the first step also runs shape inference)
    assert len(calls) - after_first == 2 * MICROBATCHES * (2 if ac else 1)
    # every parameter of the model is on exactly one stage of the pipeline (per tp rank)
    counts = torch.tensor([len(params)])
    dist.all_reduce(counts, group=mesh["pp"].get_group())
    assert counts.item() == len(list(reference.parameters()))


@pytest.mark.parametrize(
    ("schedule", "stages_per_rank"),
    [
        pytest.param("ScheduleGPipe", 1, marks=pytest.mark.slow),
        pytest.param("Schedule1F1B", 1, marks=pytest.mark.slow),
        pytest.param("ScheduleInterleaved1F1B", 2, marks=pytest.mark.slow),
    ],
)
def test_pp2_tp2_matches_one_device(schedule, stages_per_rank):
    run_distributed(_train, 4, schedule, stages_per_rank, True)


@pytest.mark.slow
def test_pp2_tp2_with_sequence_parallelism_matches_one_device():
    run_distributed(_train, 4, "Schedule1F1B", 1, True, True)


@pytest.mark.slow
def test_pp2_tp2_with_activation_checkpointing_matches_one_device():
    run_distributed(_train, 4, "Schedule1F1B", 1, True, True, True)


def test_split_is_balanced_and_keeps_the_model_names():
    model = Llama(CONFIG)
    stages = split_model(model, 2)
    assert [list(s.layers) for s in stages] == [["0", "1"], ["2", "3"]]
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert [list(s.layers) for s in split_model(model, 2, split=[1])] == [["0"], ["1", "2", "3"]]


@pytest.mark.parametrize(
    ("num_stages", "split", "match"),
    [
        (5, None, "need at least one block each"),
        (2, [0], "leaving every stage a block"),
        (3, [2, 2], "leaving every stage a block"),
        (2, [1, 2], "leaving every stage a block"),
        (0, None, "positive int"),
    ],
)
def test_bad_splits_are_refused(num_stages, split, match):
    with pytest.raises(ValueError, match=match):
        split_model(Llama(CONFIG), num_stages, split=split)


def test_a_model_without_blocks_is_refused():
    with pytest.raises(NotImplementedError, match="supports torch_tp.models.Llama"):
        split_model(nn.Sequential(nn.Linear(2, 2)), 2)


def _train_3d(schedule_name: str) -> None:
    """pp=2 x dp=2 x tp=2: each data-parallel rank trains its half of the batch, in two
    micro-batches, through the pipeline; FSDP2 shards each stage over mesh["dp"]."""
    from torch.distributed import pipelining
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    reference = Llama(CONFIG).double()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh(device_type(), (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    stages = pipeline_stages(model, mesh["pp"], tp_mesh=mesh["tp"], plan=llama_plan())
    for stage in stages:
        for block in stage.submod.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(stage.submod, mesh=mesh["dp"])
    schedule = getattr(pipelining, schedule_name)(stages[0], n_microbatches=2, loss_fn=_loss)
    params = list(stages[0].submod.parameters())
    names = {id(p): n for n, p in stages[0].submod.named_parameters()}
    optim, ref_optim = adamw(params), adamw(reference.parameters())
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=gen)
        targets = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=gen)
        _loss(reference(tokens), targets).backward()
        mine = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
        stage = stages[0]
        if stage.is_first:
            schedule.step(tokens[mine])
        else:
            schedule.step(target=targets[mine])
        for p in params:
            ref = reference.get_parameter(names[id(p)])
            torch.testing.assert_close(full_tensor(p.grad), ref.grad, msg=names[id(p)])
        # clipped over the three dimensions: every stage, every shard
        norm = clip_grad_norm_(params, 0.5, pp_mesh=mesh["pp"])
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        torch.testing.assert_close(norm, ref_norm)
        assert ref_norm > 0.5  # it did clip
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        for p in params:
            ref = reference.get_parameter(names[id(p)])
            torch.testing.assert_close(full_tensor(p.detach()), ref.detach(), msg=names[id(p)])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B"])
def test_pp2_dp2_tp2_matches_one_device(schedule):
    run_distributed(_train_3d, 8, schedule)


# --------------------------------------------------------------------------- checkpoints


def _save_pipelined(path: str) -> dict[str, torch.Tensor]:
    """Train one step at pp=2 x tp=2, save a DCP checkpoint of every rank's stage, and return
    the full state dict gathered from the stages (the union over the pipeline ranks)."""
    from torch.distributed.pipelining import Schedule1F1B

    from torch_tp.checkpoint import full_state_dict, save

    torch.manual_seed(0)
    model = Llama(CONFIG).double()
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("pp", "tp"))
    stages = pipeline_stages(model, mesh["pp"], tp_mesh=mesh["tp"], plan=llama_plan())
    schedule = Schedule1F1B(stages[0], n_microbatches=2, loss_fn=_loss)
    tokens = torch.randint(
        0, CONFIG.vocab_size, (4, SEQ), generator=torch.Generator().manual_seed(1)
    )
    if stages[0].is_first:
        schedule.step(tokens)
    else:
        schedule.step(target=tokens)
    optim = adamw(stages[0].submod.parameters())
    optim.step()
    save(path, stages[0].submod, step=1)
    state = full_state_dict(stages[0].submod)
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, state)
    return {k: v for part in gathered for k, v in part.items()}


def _load_tp(path: str) -> dict[str, torch.Tensor]:
    from torch_tp import parallelize_module
    from torch_tp.checkpoint import full_state_dict, load

    torch.manual_seed(5)  # other weights: the load must replace them all
    model = Llama(CONFIG).double()
    parallelize_module(model, init_device_mesh(device_type(), (2,)), llama_plan())
    load(path, model, step=1, rng=False)
    return full_state_dict(model)


@pytest.mark.slow
def test_a_pipelined_checkpoint_loads_on_other_layouts(tmp_path):
    from torch_tp.checkpoint import load

    saved = run_distributed(_save_pipelined, 4, str(tmp_path))[0]
    torch.manual_seed(5)
    expected = Llama(CONFIG).double()
    assert sorted(saved) == sorted(expected.state_dict())
    # on one device
    load(str(tmp_path), expected, step=1, rng=False)
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)
    # at pp=1 x tp=2
    for state in run_distributed(_load_tp, 2, str(tmp_path)):
        for name, value in state.items():
            torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)
