"""Pipeline stages from one model (``torch_tp.pipeline``) with tensor parallelism inside,
trained by ``torch.distributed.pipelining``'s own schedules, against one device.

Four CPU ranks as a (pp=2, tp=2) mesh train the reference Llama for three AdamW steps on
micro-batches of the global batch: the loss of every step and every parameter after it
equal the single-device model trained on the whole batch (the schedules average the
micro-batches' gradients, ``scale_grads=True``).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import adamw, full_tensor
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from torch_tp import clip_grad_norm_
from torch_tp.models import Llama, LlamaConfig
from torch_tp.pipeline import build_schedule, pipeline_stages, split_model
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import device_type, run_distributed

CONFIG = LlamaConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=16)
BATCH, SEQ, MICROBATCHES = 8, 8, 4


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _hf_llama() -> nn.Module:
    """A tiny transformers Llama (untied: the embedding and the head are on different
    stages), float64, eager attention."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=CONFIG.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config).double()


def _train(
    schedule_name: str,
    stages_per_rank: int,
    tp: bool,
    sp: bool = False,
    ac: bool = False,
    hf: bool = False,
    dropout: bool = False,
) -> None:
    """Three AdamW steps through the pipeline against one device. ``hf``: transformers'
    Llama with its ready plan, and a padding mask that the stages hand on. ``dropout``:
    dropout 0.25 on every residual branch, with ``exact_dropout``."""
    from torch_tp.plans.hf import plan_for

    torch.manual_seed(0)
    config = dataclasses.replace(CONFIG, dropout=0.25 if dropout else 0.0)
    reference = _hf_llama() if hf else Llama(config).double()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("pp", "tp"))
    plan = (plan_for(model) if hf else llama_plan(sequence_parallel=sp)) if tp else None
    stages = pipeline_stages(
        model,
        mesh["pp"],
        stages_per_rank=stages_per_rank,
        tp_mesh=mesh["tp"] if tp else None,
        plan=plan,
        sequence_parallel=sp,
        exact_dropout=dropout,
    )
    if ac:  # activation checkpointing of every block, inside the stages
        from torch.distributed._composable import checkpoint

        import torch_tp

        for stage in stages:
            for block in stage.submod.layers.values():
                checkpoint(block, context_fn=torch_tp.random.checkpoint_contexts)
    calls: list[int] = []  # attention forwards of one block: recomputation runs them again
    blocks = stages[0].submod.model.layers if hf else stages[0].submod.layers.values()
    attention = next(iter(blocks)).self_attn if hf else next(iter(blocks)).attention
    attention.register_forward_hook(lambda *_: calls.append(1))
    schedule = build_schedule(
        stages, schedule_name, n_microbatches=MICROBATCHES, batch_size=BATCH, loss_fn=_loss
    )
    params = [p for stage in stages for p in stage.submod.parameters()]
    assert not tp or any(isinstance(p, DTensor) for p in params)
    optim, ref_optim = adamw(params), adamw(reference.parameters())
    names = {id(p): n for stage in stages for n, p in stage.submod.named_parameters()}
    last = any(stage.is_last for stage in stages)
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=gen)
        targets = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=gen)
        inputs: dict[str, torch.Tensor] = {}
        if hf:  # right padding: each sequence keeps its first 5 to 8 tokens
            lengths = torch.randint(5, SEQ + 1, (BATCH, 1), generator=gen)
            inputs["attention_mask"] = (torch.arange(SEQ) < lengths).long()
            ref_loss = _loss(reference(tokens, **inputs).logits, targets)
        else:
            before = torch.get_rng_state()  # the pipeline starts the step from the same state
            ref_loss = _loss(reference(tokens), targets)
            after = torch.get_rng_state()
            torch.set_rng_state(before)
        ref_loss.backward()
        losses: list[torch.Tensor] = []
        # the same call on every rank: each hands the schedule what its stages take
        schedule.step(tokens, **inputs, target=targets, losses=losses)
        if not hf:  # and leaves the generator where one device does
            assert torch.equal(torch.get_rng_state(), after)
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
@pytest.mark.parametrize(
    ("schedule", "stages_per_rank"), [("ScheduleGPipe", 1), ("ScheduleInterleaved1F1B", 2)]
)
def test_pp2_tp2_with_dropout_matches_one_device(schedule, stages_per_rank):
    run_distributed(_train, 4, schedule, stages_per_rank, True, False, False, False, True)


@pytest.mark.slow
def test_transformers_llama_pp2_tp2_matches_one_device():
    run_distributed(_train, 4, "Schedule1F1B", 1, True, False, False, True)


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


def _tiny_hf(model_type: str, **fields):
    import transformers

    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
        **fields,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def test_transformers_stages_chained_equal_the_model():
    """Three stages of a Qwen2 with sliding-window and full-attention layers, run one after
    the other, give the whole model's logits: without a mask, with a padding mask, and with
    position ids (the first stage hands them on)."""
    torch.manual_seed(0)
    layer_types = ["sliding_attention", "full_attention"] * 2
    model = _tiny_hf(
        "qwen2",
        tie_word_embeddings=False,
        layer_types=layer_types,
        use_sliding_window=True,
        sliding_window=4,
    ).double()
    stages = split_model(model, 3)
    assert [list(s.model.layers._modules) for s in stages] == [["0", "1"], ["2"], ["3"]]
    assert sorted(k for s in stages for k in s.state_dict()) == sorted(model.state_dict())
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 6:] = 0  # (every query keeps a key in its window: no all-masked rows)
    positions = torch.arange(8).expand(2, 8) + 3
    for inputs in (
        {},
        {"attention_mask": mask},
        {"attention_mask": mask, "position_ids": positions},
    ):
        out = stages[0](ids, *inputs.values())
        for stage in stages[1:]:
            out = stage(*out) if isinstance(out, tuple) else stage(out)
        torch.testing.assert_close(out, model(ids, **inputs).logits, rtol=0, atol=0)


def test_transformers_models_that_cannot_be_pipelined_are_refused():
    with pytest.raises(NotImplementedError, match="tie_word_embeddings"):
        split_model(_tiny_hf("llama", tie_word_embeddings=True), 2)
    assert len(split_model(_tiny_hf("llama", tie_word_embeddings=True), 1)) == 1
    olmoe = _tiny_hf("olmoe", num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    with pytest.raises(NotImplementedError, match="OlmoeForCausalLM declares none"):
        split_model(olmoe, 2)


def _bad_pipeline_inputs() -> None:
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("pp", "tp"))
    model = Llama(CONFIG)
    with pytest.raises(ValueError, match=r"pp_mesh must be a 1-D mesh \(e.g. mesh\['pp'\]\)"):
        pipeline_stages(model, mesh)
    with pytest.raises(ValueError, match="must be two different dimensions of one mesh"):
        pipeline_stages(model, mesh["pp"], tp_mesh=mesh["pp"], plan=llama_plan())
    typo = {**llama_plan(), "layers.*.atention": "colwise"}
    with pytest.raises(ValueError, match=r"plan keys \['layers.\*.atention'\] name no module"):
        pipeline_stages(model, mesh["pp"], tp_mesh=mesh["tp"], plan=typo)
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # nothing applied
    stages = pipeline_stages(model, mesh["pp"], tp_mesh=mesh["tp"], plan=llama_plan())
    with pytest.raises(ValueError, match="batch_size 6 is not a multiple of n_microbatches 4"):
        build_schedule(stages, "Schedule1F1B", n_microbatches=4, batch_size=6, loss_fn=_loss)
    with pytest.raises(ValueError, match="at least as many micro-batches as stages"):
        build_schedule(stages, "ScheduleGPipe", n_microbatches=1, batch_size=4, loss_fn=_loss)
    with pytest.raises(ValueError, match="unknown schedule 'OneFOneB'"):
        build_schedule(stages, "OneFOneB", n_microbatches=2, batch_size=4, loss_fn=_loss)
    with pytest.raises(ValueError, match=r"step_group must hold every rank of the stages' pipe"):
        build_schedule(
            stages,
            "Schedule1F1B",
            n_microbatches=2,
            batch_size=4,
            step_group=mesh["tp"].get_group(),
        )
    schedule = build_schedule(stages, "Schedule1F1B", n_microbatches=2, batch_size=4, loss_fn=_loss)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, SEQ))
    # the first stage's rank gets a batch of 6: every rank raises, none starts the schedule
    wrong = torch.randint(0, CONFIG.vocab_size, (6, SEQ))
    first = stages[0].is_first
    with pytest.raises(ValueError, match=r"rank \d: the first stage's input has shape \(6, 8\)"):
        schedule.step(wrong if first else tokens, target=tokens)
    # global rank 0 alone: its tensor-parallel peer and the other stage's ranks raise too
    with pytest.raises(ValueError, match=r"of the step started it: rank 0: [^;]* \(6, 8\)[^;]*$"):
        schedule.step(wrong if dist.get_rank() == 0 else tokens, target=tokens)
    with pytest.raises(ValueError, match="the last stage's rank got no target"):
        schedule.step(tokens)
    schedule.step(tokens, target=tokens)  # the pipeline still works after both
    # exact dropout cannot follow the backward's recomputation of checkpointed blocks
    with pytest.raises(NotImplementedError, match="exact_dropout with sequence_parallel"):
        pipeline_stages(
            Llama(CONFIG),
            mesh["pp"],
            tp_mesh=mesh["tp"],
            plan=llama_plan(sequence_parallel=True),
            sequence_parallel=True,
            exact_dropout=True,
        )
    from torch.distributed._composable import checkpoint

    dropout_model = Llama(dataclasses.replace(CONFIG, dropout=0.1))
    stages = pipeline_stages(dropout_model, mesh["pp"], exact_dropout=True)
    checkpoint(next(iter(stages[0].submod.layers.values())))
    schedule = build_schedule(stages, "Schedule1F1B", n_microbatches=2, batch_size=4, loss_fn=_loss)
    with pytest.raises(ValueError, match=r"exact_dropout cannot redraw the masks of 'layers.\d'"):
        schedule.step(tokens, target=tokens)
    dist.barrier()


@pytest.mark.four_ranks
def test_bad_pipeline_inputs_raise_on_every_rank():
    run_distributed(_bad_pipeline_inputs, 4)


def _one_bad_rank(dims: tuple[int, ...]) -> None:
    """Global rank 0 alone gets a batch one sample short: every rank of the pp x (dp x) tp
    world raises the same ValueError naming rank 0, its tensor- and data-parallel peers too
    (they would otherwise start the schedule and wait for rank 0); no gradient is touched.
    The next, good step gives the single-device gradients."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    reference = Llama(CONFIG).double()
    model = copy.deepcopy(reference)
    names = ("pp", "dp", "tp") if len(dims) == 3 else ("pp", "tp")
    mesh = init_device_mesh(device_type(), dims, mesh_dim_names=names)
    stages = pipeline_stages(model, mesh["pp"], tp_mesh=mesh["tp"], plan=llama_plan())
    dp, dp_rank = (dims[1], mesh["dp"].get_local_rank()) if "dp" in names else (1, 0)
    for stage in stages if dp > 1 else ():
        for block in stage.submod.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(stage.submod, mesh=mesh["dp"])
    batch = BATCH // dp
    schedule = build_schedule(
        stages, "Schedule1F1B", n_microbatches=2, batch_size=batch, loss_fn=_loss
    )
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=gen)
    mine = slice(dp_rank * batch, (dp_rank + 1) * batch)
    bad = tokens[mine][1:] if dist.get_rank() == 0 else tokens[mine]
    with pytest.raises(ValueError) as raised:
        schedule.step(bad, target=targets[mine])
    message = str(raised.value)
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    assert messages == [message] * len(messages)  # the same error on every rank
    assert f"rank 0: the first stage's input has shape ({batch - 1}, {SEQ})" in message
    assert f"none of the {dist.get_world_size()} ranks of the step started it" in message
    params = [p for stage in stages for p in stage.submod.parameters()]
    assert all(p.grad is None for p in params)  # no rank started the schedule
    schedule.step(tokens[mine], target=targets[mine])
    _loss(reference(tokens), targets).backward()
    names_of = {id(p): n for stage in stages for n, p in stage.submod.named_parameters()}
    for p in params:
        ref = reference.get_parameter(names_of[id(p)])
        torch.testing.assert_close(full_tensor(p.grad), ref.grad, msg=names_of[id(p)])


@pytest.mark.slow
@pytest.mark.parametrize("dims", [(2, 2), (2, 2, 2)], ids=["pp2_tp2", "pp2_dp2_tp2"])
def test_one_rank_bad_batch_raises_on_every_rank_then_a_good_step_matches(dims):
    run_distributed(_one_bad_rank, 2 ** len(dims), dims)


def _train_3d(schedule_name: str, stages_per_rank: int = 1) -> None:
    """pp=2 x dp=2 x tp=2: each data-parallel rank trains its half of the batch, in two
    micro-batches, through the pipeline; FSDP2 shards each stage over mesh["dp"]."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    reference = Llama(CONFIG).double()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh(device_type(), (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    stages = pipeline_stages(
        model,
        mesh["pp"],
        stages_per_rank=stages_per_rank,
        tp_mesh=mesh["tp"],
        plan=llama_plan(),
    )
    for stage in stages:
        for block in stage.submod.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(stage.submod, mesh=mesh["dp"])
    schedule = build_schedule(
        stages, schedule_name, n_microbatches=2, batch_size=BATCH // 2, loss_fn=_loss
    )
    params = [p for stage in stages for p in stage.submod.parameters()]
    names = {id(p): n for stage in stages for n, p in stage.submod.named_parameters()}
    optim, ref_optim = adamw(params), adamw(reference.parameters())
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=gen)
        targets = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=gen)
        _loss(reference(tokens), targets).backward()
        mine = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
        schedule.step(tokens[mine], target=targets[mine])
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
@pytest.mark.parametrize(
    ("schedule", "stages_per_rank"),
    # the interleaved schedule only: two stages per rank, FSDP2 on both; the other schedules
    # are checked at pp2 x tp2, and 1F1B at 3-D by the example's test (its default)
    [("ScheduleInterleaved1F1B", 2)],
)
def test_pp2_dp2_tp2_matches_one_device(schedule, stages_per_rank):
    run_distributed(_train_3d, 8, schedule, stages_per_rank)


# --------------------------------------------------------------------------- checkpoints


def _stages_3d(mesh, tp: bool, dp: bool) -> list:
    """This rank's stages of the reference Llama on ``mesh`` (named dims), tensor-parallel
    over ``mesh["tp"]`` when ``tp``, FSDP2 over ``mesh["dp"]`` when ``dp``."""
    from torch.distributed.fsdp import fully_shard

    model = Llama(CONFIG).double()
    stages = pipeline_stages(
        model,
        mesh["pp"],
        tp_mesh=mesh["tp"] if tp else None,
        plan=llama_plan() if tp else None,
    )
    for stage in stages if dp else ():
        for block in stage.submod.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(stage.submod, mesh=mesh["dp"])
    return stages


def _gathered(module: nn.Module, group) -> dict[str, torch.Tensor]:
    """The full state dict of every pipeline rank's stage, merged (the union)."""
    from torch_tp.checkpoint import full_state_dict

    parts: list[dict] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(parts, full_state_dict(module), group=group)
    return {k: v for part in parts for k, v in part.items()}


def _save_3d(path: str) -> dict[str, torch.Tensor]:
    """Train one step at pp=2 x dp=2 x tp=2 (FSDP2 over dp), save a DCP checkpoint of every
    rank's stage, and return the full state dict gathered from the 3-D model."""
    from torch_tp.checkpoint import save

    torch.manual_seed(0)
    mesh = init_device_mesh(device_type(), (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    stages = _stages_3d(mesh, tp=True, dp=True)
    schedule = build_schedule(stages, "Schedule1F1B", n_microbatches=2, batch_size=4, loss_fn=_loss)
    dp_rank = mesh["dp"].get_local_rank()
    tokens = torch.randint(
        0, CONFIG.vocab_size, (8, SEQ), generator=torch.Generator().manual_seed(1)
    )
    mine = tokens[dp_rank * 4 : (dp_rank + 1) * 4]
    schedule.step(mine, target=mine)
    optim = adamw(stages[0].submod.parameters())
    optim.step()
    save(path, stages[0].submod, step=1)
    return _gathered(stages[0].submod, mesh["pp"].get_group())


def _load_on(path: str, pp: int, tp: int) -> dict[str, torch.Tensor]:
    """Load the checkpoint at pp x tp (other weights first: the load must replace them all)
    and return the full state dict. pp=1 is the model without a pipeline."""
    from torch_tp import parallelize_module
    from torch_tp.checkpoint import full_state_dict, load

    torch.manual_seed(5)
    if pp == 1:
        model = Llama(CONFIG).double()
        parallelize_module(model, init_device_mesh(device_type(), (tp,)), llama_plan())
        load(path, model, step=1, rng=False)
        return full_state_dict(model)
    assert tp == 1
    mesh = init_device_mesh(device_type(), (pp,), mesh_dim_names=("pp",))
    stages = _stages_3d(mesh, tp=False, dp=False)
    load(path, stages[0].submod, step=1, rng=False)
    return _gathered(stages[0].submod, mesh.get_group())


@pytest.mark.slow
def test_a_3d_checkpoint_loads_on_other_layouts(tmp_path):
    """Saved at (pp=2, dp=2, tp=2); loaded exactly on one device, at (pp=1, tp=2) and at
    (pp=2, tp=1); the full state dict gathered from the 3-D model has the model's names and
    equals every load."""
    from torch_tp.checkpoint import load

    saved = run_distributed(_save_3d, 8, str(tmp_path))
    for state in saved[1:]:  # every rank gathered the same whole model
        assert state.keys() == saved[0].keys()
        for name, value in state.items():
            torch.testing.assert_close(value, saved[0][name], rtol=0, atol=0, msg=name)
    saved = saved[0]
    torch.manual_seed(5)
    expected = Llama(CONFIG).double()
    assert sorted(saved) == sorted(expected.state_dict())
    load(str(tmp_path), expected, step=1, rng=False)  # on one device
    loaded = [expected.state_dict()]
    loaded += run_distributed(_load_on, 2, str(tmp_path), 1, 2)  # pp=1 x tp=2
    loaded += run_distributed(_load_on, 2, str(tmp_path), 2, 1)  # pp=2 x tp=1
    for state in loaded:
        assert sorted(state) == sorted(saved)
        for name, value in state.items():
            torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)
    # the step trained: the checkpoint is not the initial model
    torch.manual_seed(0)
    initial = Llama(CONFIG).double().state_dict()
    assert not torch.equal(
        initial["layers.0.attention.wq.weight"], saved["layers.0.attention.wq.weight"]
    )


@pytest.mark.slow
def test_every_transformers_decoder_splits_into_stages_that_give_its_logits(monkeypatch):
    """Every causal LM of the installed transformers that declares a ``base_model_pp_plan``
    (the zoo of test_zoo.py, tiny, untied embeddings): split into two stages and run one
    after the other on one device, it gives the whole model's logits, or split_model refuses
    it with NotImplementedError. Nothing in between: no architecture is split wrongly."""
    import test_zoo

    untied = test_zoo.tiny_config

    def tiny_config(model_type: str):
        config = untied(model_type)
        config.tie_word_embeddings = False
        return config

    monkeypatch.setattr(test_zoo, "tiny_config", tiny_config)
    passed, refused = [], []
    for model_type in sorted(test_zoo.zoo()):
        config = tiny_config(model_type)
        if not getattr(type(config), "base_model_pp_plan", None):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = test_zoo.build(model_type)
                ids = torch.randint(2, test_zoo.VOCAB, (2, test_zoo.SEQ))
                expected = model(input_ids=ids, use_cache=False).logits
        except Exception:  # noqa: BLE001 - the zoo test records what does not build
            continue
        try:
            stages = split_model(model, 2)
        except NotImplementedError:
            refused.append(model_type)
            continue
        with torch.no_grad():
            logits = stages[1](stages[0](ids))
        torch.testing.assert_close(logits, expected, **test_zoo.TOLERANCE, msg=model_type)
        passed.append(model_type)
    print(f"{len(passed)} split and match, {len(refused)} refused: {refused}")
    assert len(passed) >= 78, passed
