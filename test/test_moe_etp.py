"""Experts over two mesh dimensions (:class:`torch_tp.ExpertTensorParallel`): whole experts
split over ``ep``, each expert's matrices over ``tp``, against one device.

On a ``(ep, tp)`` mesh of four CPU ranks, the reference MoE Llama's dense layers, router and
shared expert are tensor-parallel on ``mesh["tp"]`` (its ready plan, with and without sequence
parallelism) and its experts are ``ExpertTensorParallel()`` on the 2-D mesh. Each ``ep`` rank
trains on its own micro-batch (expert parallelism borrowed from data parallelism, as
torchtitan does): FSDP2 shards the dense parameters over ``mesh["ep"]`` (the data-parallel
dimension here) and averages their gradients; the experts, split by ``ep`` already, are left
to FSDP2's ``ignored_params``, and their gradients, which the all-to-all sums over the ``ep``
ranks' tokens, are divided by the ``ep`` degree as FSDP2 divides the others. The reference is
the single-device model trained on the same micro-batches, their gradients accumulated (the
mean of the micro-batch losses), in float64, for three AdamW steps.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import adamw, check_step
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import torch_tp
from torch_tp import ExpertTensorParallel
from torch_tp.models import MoEConfig, MoELlama
from torch_tp.plans.moe import moe_llama_plan
from torch_tp.testing import device_type, run_distributed

# bench_moe's counter of collectives (imported inside the ranks' functions: the mutation check's
# copy of the repository has no benchmarks/)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

GRAD_TOL = {"rtol": 1e-5, "atol": 1e-8}
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-7}
# transformers' MoE routers: float32 softmax (see _hf_train)
HF_TOL = {"rtol": 1e-4, "atol": 1e-6}
EXPERTS = "layers.*.feed_forward.experts"


def _model(n_experts: int = 4) -> MoELlama:
    torch.manual_seed(0)
    config = MoEConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        n_experts=n_experts,
        expert_hidden_dim=16,
        shared_expert_hidden_dim=16,
        vocab_size=128,
        max_seq_len=32,
    )
    return MoELlama(config).double()


def _loss(model: MoELlama, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()) + model.aux_loss()


def _parallelize(
    model: MoELlama, sequence_parallel: bool, shape: tuple[int, int], one_call: bool = False
) -> torch.distributed.DeviceMesh:
    mesh = init_device_mesh(device_type(), shape, mesh_dim_names=("ep", "tp"))
    plan = moe_llama_plan(experts="tp", shared_expert=True, sequence_parallel=sequence_parallel)
    # the experts go on the 2-D mesh; where the block sums their output with the shared
    # expert's (and reduce-scatters it under sequence parallelism), they leave theirs a
    # partial sum over tp, as the plan's TensorParallelExperts entry says
    tp_experts = plan.pop(EXPERTS)
    experts = ExpertTensorParallel(output_layouts=tp_experts.output_layouts)
    if one_call:  # one plan on the 2-D mesh: the experts on (ep, tp), the others on tp
        torch_tp.parallelize_module(model, mesh, {**plan, EXPERTS: experts})
    else:
        torch_tp.parallelize_module(model, mesh["tp"], plan)
        torch_tp.parallelize_module(model, mesh, {EXPERTS: experts})
    ep = mesh["ep"].size()
    for block in model.layers:
        experts = list(block.feed_forward.experts.parameters())
        for p in experts:  # summed over the ep ranks' tokens; FSDP2 averages the others
            p.register_hook(lambda grad: grad / ep)
        fully_shard(block, mesh=mesh["ep"], ignored_params=set(experts))
    fully_shard(model, mesh=mesh["ep"])
    return mesh


def _train(sequence_parallel: bool, shape: tuple[int, int], one_call: bool = False) -> None:
    reference = _model()
    model = copy.deepcopy(reference)
    mesh = _parallelize(model, sequence_parallel, shape, one_call)
    data_rank, data_ranks = mesh["ep"].get_local_rank(), mesh["ep"].size()
    gate_up = model.layers[0].feed_forward.experts.gate_up_proj
    assert gate_up.device_mesh == mesh and gate_up.placements[0] == Shard(0)
    # of 4 experts of 2 x 16 gate and up rows: this rank's experts, its slice of their rows
    assert gate_up.to_local().shape == (4 // shape[0], 32 // shape[1], 32)
    ref_optim, optim = adamw(reference.parameters()), adamw(model.parameters())
    optim_params = list(model.parameters())
    per_rank = 2
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 128, (data_ranks * per_rank, 16), generator=gen)
        targets = torch.randint(0, 128, (data_ranks * per_rank, 16), generator=gen)
        ref_losses = []
        for r in range(data_ranks):
            mine = slice(r * per_rank, (r + 1) * per_rank)
            ref_loss = _loss(reference, tokens[mine], targets[mine]) / data_ranks
            ref_loss.backward()
            ref_losses.append(ref_loss.detach())
        mine = slice(data_rank * per_rank, (data_rank + 1) * per_rank)
        loss = _loss(model, tokens[mine], targets[mine])
        loss.backward()
        torch.testing.assert_close(loss.detach() / data_ranks, ref_losses[data_rank])
        assert all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in optim_params)
        check_step(model, reference, optim, ref_optim, grad_tol=GRAD_TOL, param_tol=PARAM_TOL)


@pytest.mark.four_ranks
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_experts_over_ep2_and_tp2_match_one_device(sequence_parallel):
    run_distributed(_train, 4, sequence_parallel, (2, 2))


@pytest.mark.parametrize(
    ("shape", "one_call"),
    [((2, 1), False), ((1, 2), False), ((1, 2), True)],
    ids=["ep2-tp1", "ep1-tp2", "ep1-tp2-one-plan"],
)
def test_experts_over_one_of_two_dimensions_match_one_device(shape, one_call):
    """The same on two ranks, one dimension of size 1: all-to-alls over ``ep`` and no
    tensor parallelism, or tensor-parallel experts whose tokens all stay on their rank.
    ``one_call``: the dense plan and the experts' in one plan on the 2-D mesh."""
    run_distributed(_train, 2, False, shape, one_call)


def _refusals() -> list[str]:
    """Plans ExpertTensorParallel cannot take, each refused before anything changes."""
    from torch_tp import ColwiseParallel

    errors = []

    def refused(model, mesh, plan, **kwargs):
        before = {n: p for n, p in model.named_parameters()}
        with pytest.raises((ValueError, NotImplementedError)) as caught:
            torch_tp.parallelize_module(model, mesh, plan, **kwargs)
        after = dict(model.named_parameters())
        assert all(after[n] is p and not isinstance(p, DTensor) for n, p in before.items())
        errors.append(str(caught.value))

    mesh = init_device_mesh(device_type(), (1, 2), mesh_dim_names=("ep", "tp"))
    experts = {EXPERTS: ExpertTensorParallel()}
    refused(_model(), mesh["tp"], experts)  # a 1-D mesh
    # a plan mixing them puts the 1-D styles on the last dimension, which must be "tp"
    other = init_device_mesh(device_type(), (1, 2), mesh_dim_names=("ep", "mp"))
    refused(_model(), other, {**experts, "layers.*.attention.wq": ColwiseParallel()})
    unnamed = init_device_mesh(device_type(), (1, 2))
    refused(_model(), unnamed, experts)
    model = _model()
    model.layers[1].feed_forward.experts.gate_up_proj = torch.nn.Parameter(
        torch.zeros(4, 30, 32, dtype=torch.double)
    )
    model.layers[1].feed_forward.experts.down_proj = torch.nn.Parameter(
        torch.zeros(4, 32, 15, dtype=torch.double)
    )
    refused(model, mesh, experts)  # a hidden size of 15 over tp2
    refused(_model(), mesh, experts, example_inputs=torch.zeros(1, 4, dtype=torch.long))
    ep_mesh = init_device_mesh(device_type(), (2, 1), mesh_dim_names=("ep", "tp"))
    refused(_model(n_experts=3), ep_mesh, experts)  # 3 experts over ep2
    swapped = init_device_mesh(device_type(), (2, 1), mesh_dim_names=("tp", "ep"))
    refused(_model(), swapped, experts)
    # the dense layers tensor-parallel over the ranks ep splits: not orthogonal
    model = _model()
    dense = moe_llama_plan(experts="tp")
    del dense[EXPERTS]
    torch_tp.parallelize_module(model, ep_mesh["ep"], dense)
    with pytest.raises(ValueError) as caught:
        torch_tp.parallelize_module(model, ep_mesh, experts)
    assert not isinstance(model.layers[0].feed_forward.experts.gate_up_proj, DTensor)
    errors.append(str(caught.value))
    return errors


def test_plans_it_cannot_take_are_refused_before_anything_changes():
    errors = run_distributed(_refusals, 2)[0]
    one_d, one_d_style, unnamed, hidden, shapes, experts, swapped, crossed = errors
    assert "takes a 2-D mesh with named dimensions, (ep, tp)" in one_d and "1-D" in one_d
    assert "ColwiseParallel on 'layers.0.attention.wq'" in one_d_style, one_d_style
    assert "must be named 'tp'" in one_d_style and "('ep', 'mp')" in one_d_style
    assert "must name its dimensions" in unnamed
    assert "layers.1.feed_forward.experts" in hidden and "hidden size 15" in hidden
    assert "shape check" in shapes and "2-D" in shapes
    assert "3 experts do not split over the 2 ranks of 'ep'" in experts
    assert "ExpertTensorParallel" in experts and "layers.0.feed_forward.experts" in experts
    assert "dims are ('tp', 'ep')" in swapped and "pass mesh['ep', 'tp']" in swapped
    assert "ep must be orthogonal to the tensor-parallel dimension" in crossed, crossed
    assert "ranks [0, 1]" in crossed and "layers.0.feed_forward.experts" in crossed


def _bad_ids_on_one_rank(shape: tuple[int, int]) -> str:
    """Rank 1's router gives an expert id out of range, rank 0's does not."""
    model = _model()
    mesh = init_device_mesh(device_type(), shape, mesh_dim_names=("ep", "tp"))
    torch_tp.parallelize_module(model, mesh, {EXPERTS: ExpertTensorParallel()})
    experts = model.layers[0].feed_forward.experts
    tokens = torch.randn(6, 32, dtype=torch.double)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    if dist.get_rank() == 1:
        ids[4, 1] = 4
    with pytest.raises(ValueError) as caught:
        experts(tokens, ids, torch.full((6, 2), 0.5, dtype=torch.double))
    return str(caught.value)


@pytest.mark.parametrize(
    "shape",
    [(2, 1), (1, 2), pytest.param((2, 2), marks=pytest.mark.four_ranks)],
    ids=["ep2-tp1", "ep1-tp2", "ep2-tp2"],
)
def test_one_ranks_bad_routing_raises_on_every_rank(shape):
    """At (ep2, tp2) rank 1 is (ep 0, tp 1): its tp peer learns from the agreement over tp,
    the other ep rank of each tp slice from the counts exchanged over ep."""
    for message in run_distributed(_bad_ids_on_one_rank, shape[0] * shape[1], shape):
        assert "layers.0.feed_forward.experts" in message
        assert "expert ids outside [0, 4)" in message


def test_the_shape_check_and_the_report_refuse_it_by_name():
    """Both read 1-D styles only: they say so, naming the module, rather than checking or
    predicting a 2-D layout as if it were 1-D."""
    from torch_tp.report import plan_report
    from torch_tp.shapes import check_shapes

    with torch.device("meta"):
        model = _model()
    plan = {EXPERTS: ExpertTensorParallel()}
    for run in (
        lambda: check_shapes(model, plan, 2),
        lambda: plan_report(model, plan, 2, batch_size=2, seq_len=8, device_type="cpu"),
    ):
        with pytest.raises(NotImplementedError, match="1-D mesh only") as caught:
            run()
        assert "'layers.0.feed_forward.experts' (ExpertTensorParallel, on a 2-D mesh)" in str(
            caught.value
        )


def _hf_train(family: str, sequence_parallel: bool = False) -> None:
    """transformers' ``family`` at (ep2, tp2): its own ``_tp_plan`` on ``mesh["tp"]`` but for
    the experts, which are ``ExpertTensorParallel()`` on the 2-D mesh; each ep rank its own
    micro-batch; two AdamW steps against one device.

    With ``sequence_parallel``: ``plan_for(model, sequence_parallel=True)``, the residual
    stream sharded on the sequence over tp and each MLP one region, whose experts leave their
    output a partial sum over tp (``ExpertTensorParallel(output_layouts=Partial())``, as the
    plan's ``TensorParallelExperts`` entry says), reduce-scattered at the MLP's end."""
    from test_transformers_moe import _model as hf_model
    from test_transformers_moe import _plan as hf_plan

    from torch_tp.plans.hf import plan_for

    reference = hf_model(family)
    model = copy.deepcopy(reference)
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("ep", "tp"))
    experts_key = "model.layers.*.mlp.experts"
    if sequence_parallel:
        plan = plan_for(model, sequence_parallel=True)
        experts = ExpertTensorParallel(output_layouts=plan[experts_key].output_layouts)
        assert experts.output_layouts == Partial()
    else:
        plan, experts = hf_plan(model), "ep_tp_experts"
    plan = {k: v for k, v in plan.items() if ".experts" not in k}
    torch_tp.parallelize_module(model, mesh["tp"], plan)
    torch_tp.parallelize_module(model, mesh, {experts_key: experts})
    if sequence_parallel:  # the stream between blocks really is sharded on the sequence
        assert model.model.layers[0].post_attention_layernorm.weight.placements == (Replicate(),)
    ep, data_rank = mesh["ep"].size(), mesh["ep"].get_local_rank()
    moe = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert moe and all(e.gate_up_proj.device_mesh == mesh for e in moe)
    for layer in model.model.layers:
        experts = set(layer.mlp.experts.parameters()) if hasattr(layer.mlp, "experts") else set()
        for p in experts:
            p.register_hook(lambda grad: grad / ep)
        fully_shard(layer, mesh=mesh["ep"], ignored_params=experts)
    fully_shard(model, mesh=mesh["ep"])
    ref_optim, optim = adamw(reference.parameters()), adamw(model.parameters())
    for step in range(2):
        gen = torch.Generator().manual_seed(200 + step)
        ids = torch.randint(2, 128, (ep * 2, 12), generator=gen)
        labels = torch.randint(2, 128, (ep * 2, 12), generator=gen)
        for r in range(ep):
            mine = slice(2 * r, 2 * r + 2)
            out = reference(input_ids=ids[mine], labels=labels[mine], use_cache=False)
            (out.loss / ep).backward()
            if r == data_rank:
                expected = out.logits.detach()
        mine = slice(2 * data_rank, 2 * data_rank + 2)
        out = model(input_ids=ids[mine], labels=labels[mine], use_cache=False)
        out.loss.backward()  # FSDP2 averages over the ep ranks
        # transformers' routers compute their softmax in float32: after a step, the float32
        # rounding of the routing weights (differently summed) shows through AdamW's update;
        # under sequence parallelism already in the first step's gradients (the routers read
        # the stream reduce-scattered and gathered back: float64 sums in another order, one
        # routing weight a float32 step apart moves an embedding gradient by ~1e-8)
        tol = {} if step == 0 else HF_TOL
        torch.testing.assert_close(out.logits.detach(), expected, **tol)
        grad_tol = HF_TOL if sequence_parallel else tol or GRAD_TOL
        check_step(model, reference, optim, ref_optim, grad_tol=grad_tol, param_tol=HF_TOL)


@pytest.mark.four_ranks
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
def test_transformers_moe_families_over_ep_and_tp_match_one_device(family, sequence_parallel):
    pytest.importorskip("transformers")
    run_distributed(_hf_train, 4, family, sequence_parallel)


def _load_hub_mixtral(path: str, shape: tuple[int, int]) -> tuple[dict, dict[str, int], int]:
    """transformers' Mixtral checkpoint (the Hub's per-expert ``block_sparse_moe.experts.<e>.
    w1/w2/w3`` keys) loaded into ExpertTensorParallel on ``shape``: the full state dict, the
    elements read per key, and the elements this rank's tensors hold."""
    from helpers import safetensors_reads
    from test_hf_checkpoint import _model as hub_model

    from torch_tp.checkpoint import full_state_dict, load_pretrained
    from torch_tp.plans.hf import plan_for

    model = hub_model("mixtral", seed=1)
    mesh = init_device_mesh(device_type(), shape, mesh_dim_names=("ep", "tp"))
    plan = {k: v for k, v in plan_for(model).items() if ".experts" not in k}
    torch_tp.parallelize_module(model, mesh["tp"], plan)
    torch_tp.parallelize_module(model, mesh, {"model.layers.*.mlp.experts": "ep_tp_experts"})
    with safetensors_reads() as reads:
        load_pretrained(model, path)
    mine = sum(
        (v.to_local() if isinstance(v, DTensor) else v).numel() for v in model.state_dict().values()
    )
    return full_state_dict(model), {k: sum(v) for k, v in reads.items()}, mine


@pytest.mark.parametrize(
    "shape",
    [pytest.param((2, 2), marks=pytest.mark.four_ranks), (1, 2), (2, 1)],
    ids=["ep2-tp2", "ep1-tp2", "ep2-tp1"],
)
def test_a_hub_mixtral_checkpoint_loads_into_experts_over_ep_and_tp(tmp_path, shape):
    """Each rank reads its experts' slices only: with 4 experts, expert ``e``'s ``w1`` (gate)
    is read by the ep rank holding it, each tp rank its half of the rows."""
    pytest.importorskip("transformers")
    from test_hf_checkpoint import _saved

    expected = _saved("mixtral", str(tmp_path))
    ep, tp = shape
    results = run_distributed(_load_hub_mixtral, ep * tp, str(tmp_path), shape)
    w1 = "model.layers.0.block_sparse_moe.experts.{}.w1.weight"
    for rank, (state, reads, mine) in enumerate(results):
        assert sorted(state) == sorted(expected)
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
        assert sum(reads.values()) == mine  # exactly this rank's elements
        e = rank // tp  # the ep rank: experts 4 / ep * e onward
        held = range(4 // ep * e, 4 // ep * (e + 1))
        for expert in range(4):
            read = reads.get(w1.format(expert), 0)
            assert read == (64 * 32 // tp if expert in held else 0), (rank, expert, read)


def _shard_of(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's shard of ``full`` laid out as ``like`` (sliced here, nothing sent). Each
    rank compares its own shard, so together they compare every element: ``full_tensor()``
    cannot gather the experts under FSDP2 here (torch 2.13's redistribution of dim 0 split
    by dp's strided shard and by ep's shard fails its unpadding check)."""
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def _train_dp_ep_tp(sequence_parallel: bool) -> None:
    """(dp2, ep2, tp2) on eight ranks: the dense layers tensor-parallel on ``tp`` and sharded
    by FSDP2 over ``dp x ep`` (flattened: four data-parallel ranks), the experts
    ``ExpertTensorParallel`` on ``(ep, tp)`` and sharded by FSDP2 over ``dp``; each of the
    four data-parallel ranks its own micro-batch."""
    reference = _model()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh(device_type(), (2, 2, 2), mesh_dim_names=("dp", "ep", "tp"))
    data = mesh["dp", "ep"]._flatten("dp_ep")  # the data-parallel ranks: dp x ep
    plan = moe_llama_plan(experts="tp", shared_expert=True, sequence_parallel=sequence_parallel)
    tp_experts = plan.pop(EXPERTS)
    torch_tp.parallelize_module(model, mesh["tp"], plan)
    experts = ExpertTensorParallel(output_layouts=tp_experts.output_layouts)
    torch_tp.parallelize_module(model, mesh["ep", "tp"], {EXPERTS: experts})
    data_ranks = data.size()
    for block in model.layers:
        experts = block.feed_forward.experts
        fully_shard(experts, mesh=mesh["dp"])
        # summed over the ep ranks' tokens by the all-to-all, then over dp by FSDP2: the
        # mean over all four data-parallel ranks
        experts.set_gradient_divide_factor(float(data_ranks))
        fully_shard(block, mesh=data)
    fully_shard(model, mesh=data)
    data_rank = data.get_local_rank()
    ref_optim, optim = adamw(reference.parameters()), adamw(model.parameters())
    per_rank = 2
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 128, (data_ranks * per_rank, 16), generator=gen)
        targets = torch.randint(0, 128, (data_ranks * per_rank, 16), generator=gen)
        for r in range(data_ranks):
            mine = slice(r * per_rank, (r + 1) * per_rank)
            (_loss(reference, tokens[mine], targets[mine]) / data_ranks).backward()
        mine = slice(data_rank * per_rank, (data_rank + 1) * per_rank)
        _loss(model, tokens[mine], targets[mine]).backward()
        check_step(
            model, reference, optim, ref_optim, grad_tol=GRAD_TOL, param_tol=PARAM_TOL,
            shard_of=_shard_of,
        )  # fmt: skip


@pytest.mark.slow  # eight ranks
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_experts_over_dp_ep_tp_with_fsdp2_match_one_device(sequence_parallel):
    run_distributed(_train_dp_ep_tp, 8, sequence_parallel)


def _etp_counts(sequence_parallel: bool) -> dict:
    """One forward and backward of the MoE Llama at (ep2, tp2): the collectives inside its
    MoE layers, forward and backward (bench_moe's split: the counts all-to-alls and the agreed
    checks apart), their checks, and the total against CommDebugMode's."""
    import bench_moe
    from torch.distributed.tensor.debug import CommDebugMode

    model = _model()
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("ep", "tp"))
    # the shared expert's output joins the experts' partial sum: still one reduction
    plan = moe_llama_plan(experts="tp", shared_expert=True, sequence_parallel=sequence_parallel)
    tp_experts = plan.pop(EXPERTS)
    torch_tp.parallelize_module(model, mesh["tp"], plan)
    experts = ExpertTensorParallel(output_layouts=tp_experts.output_layouts)
    torch_tp.parallelize_module(model, mesh, {EXPERTS: experts})
    tokens = torch.randint(
        0, 128, (2, 16), generator=torch.Generator().manual_seed(mesh["ep"].get_local_rank())
    )

    def step() -> None:
        _loss(model, tokens, tokens.roll(1, -1)).backward()

    with bench_moe.MoECounter() as counter:
        step()
    with CommDebugMode() as comm:
        step()
    split = bench_moe.split_records(counter.records)
    return {
        "fwd": {k: c for k, (c, _) in split["fwd"].items()},
        "bwd": {k: c for k, (c, _) in split["bwd"].items()},
        "counts": {k: c for k, (c, _) in split["counts"].items()},
        "check_modules": [r.module for r in counter.records if r.kind == "all_reduce(check)"],
        "all": len(counter.records),
        "comm_debug": comm.get_total_counts(),
    }


@pytest.mark.four_ranks
@pytest.mark.fast_runtime  # plain DTensor reduces gradients apart, as they arrive
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_experts_over_ep_and_tp_issue_the_minimal_collectives(sequence_parallel):
    """Per MoE layer (2 layers): the tokens' two all-to-alls over ep each way, and one
    reduction over tp each way (an all-reduce; under sequence parallelism the block's one
    all-gather and one reduce-scatter), the counts all-to-all and the agreed check of expert
    ids (over tp) apart."""
    n = 2
    tp = {"all_gather": n, "reduce_scatter": n} if sequence_parallel else {"all_reduce": n}
    for rank, got in enumerate(run_distributed(_etp_counts, 4, sequence_parallel)):
        assert got["fwd"] == {**tp, "all_to_all": 2 * n}, (rank, got)
        assert got["bwd"] == {**tp, "all_to_all": 2 * n}, (rank, got)
        assert got["counts"] == {"all_to_all(counts)": n}, (rank, got)
        # the agreed checks: the embedding's token ids, and each MoE layer's expert ids (tp)
        experts = [f"layers.{i}.feed_forward.experts" for i in range(n)]
        assert got["check_modules"] == ["tok_embeddings", *experts], (rank, got)
        assert got["all"] == got["comm_debug"], (rank, got)  # the counter misses none
