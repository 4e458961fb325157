"""The dry-run report on a mesh of two dimensions: experts over ``(ep, tp)``
(:class:`torch_tp.ExpertTensorParallel`), the dense layers over ``tp``.

:func:`torch_tp.report.plan_report` given the mesh's shape (``{"ep": 2, "tp": 2}``) places
each style by its contract's ``mesh_ndim`` (the 1-D styles on ``tp``, the experts on both),
and reports each collective with the mesh dimension it runs over. Its predictions are
compared with measured runs (at (ep2, tp2) on four ranks, with and without sequence
parallelism; at (ep2, tp1) and (ep1, tp2) on two): the collectives per kind and mesh
dimension, forward and backward, their bytes (each rank's all-to-alls follow its routing:
their mean over the ranks is the balanced prediction), and the parameter bytes per rank.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import torch_tp
from torch_tp import ExpertTensorParallel
from torch_tp.models import MoEConfig, MoELlama
from torch_tp.plans.moe import moe_llama_plan
from torch_tp.report import Collective, plan_report
from torch_tp.testing import device_type, run_distributed

EXPERTS = "layers.*.feed_forward.experts"
CONFIG = MoEConfig(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=4,
    n_experts=4,
    expert_hidden_dim=16,
    shared_expert_hidden_dim=16,
    vocab_size=128,
    max_seq_len=32,
)
BATCH, SEQ = 2, 16  # per ep rank (each brings its own batch)
SHAPE = {"ep": 2, "tp": 2}


def _plans(sequence_parallel: bool) -> tuple[dict, dict]:
    """The dense plan (on ``mesh["tp"]``) and the experts' (on the 2-D mesh)."""
    dense = moe_llama_plan(experts="tp", shared_expert=True, sequence_parallel=sequence_parallel)
    # where the block sums the experts' output with the shared expert's (and reduce-scatters
    # it under sequence parallelism), the experts leave theirs a partial sum over tp
    tp_experts = dense.pop(EXPERTS)
    experts = ExpertTensorParallel(output_layouts=tp_experts.output_layouts)
    return dense, {EXPERTS: experts}


def _meta_report(sequence_parallel: bool = False, shape=SHAPE, **kwargs):
    with torch.device("meta"):
        model = MoELlama(CONFIG).double()
    dense, experts = _plans(sequence_parallel)
    return plan_report(
        model,
        {**dense, **experts},
        shape,
        batch_size=BATCH,
        seq_len=SEQ,
        device_type=kwargs.pop("device_type", "cpu"),
        **kwargs,
    )


# --------------------------------------------------------------------------- on meta


def test_experts_over_ep_and_tp_rows():
    """Per MoE layer: the id check agreed over tp, the counts' all-to-all and the tokens' two
    all-to-alls over ep each way; the experts' output, a partial sum over tp, joins the
    shared expert's, and the block all-reduces it once each way (the output; its input's
    gradient); experts 1/(ep*tp) of them per rank, dense layers 1/tp."""
    report = _meta_report()
    experts = [c for c in report.collectives if c.where == EXPERTS]
    tokens = BATCH * SEQ * 2 * CONFIG.dim * 8  # top-2 routing slots of float64 tokens
    counts = 2 * (4 // 2 + 1) * 8  # per ep rank: its local experts' counts and the bad ids
    hidden = BATCH * SEQ * CONFIG.dim * 8
    assert experts == [
        Collective("forward", "all_reduce", EXPERTS, 2, 8, "tp"),
        Collective("forward", "all_to_all", EXPERTS, 2, counts, "ep"),
        Collective("forward", "all_to_all", EXPERTS, 4, tokens, "ep"),
        Collective("backward", "all_to_all", EXPERTS, 4, tokens, "ep"),
    ]
    block = [c for c in report.collectives if c.where == "layers.*.feed_forward"]
    assert block == [
        Collective("forward", "all_reduce", "layers.*.feed_forward", 2, hidden, "tp"),
        Collective("backward", "all_reduce", "layers.*.feed_forward", 2, hidden, "tp"),
    ]
    # nothing but the experts runs over ep
    assert {c.where for c in report.collectives if c.mesh_dim == "ep"} == {EXPERTS}
    assert report.counts("forward", "ep") == {"all_to_all": 6}
    assert report.counts("backward", "ep") == {"all_to_all": 4}
    groups = {g.name: g for g in report.parameters}
    gate_up = groups[f"{EXPERTS}.gate_up_proj"]
    assert gate_up.placement == "(Shard(0), StridedShard(1, split_factor=2))"
    assert (gate_up.global_shape, gate_up.local_shape) == ((4, 32, 32), (2, 16, 32))
    down = groups[f"{EXPERTS}.down_proj"]
    assert (down.placement, down.local_shape) == ("(Shard(0), Shard(2))", (2, 32, 8))
    wq = groups["layers.*.attention.wq.weight"]
    assert (wq.placement, wq.local_shape) == ("Shard(0)", (16, 32))
    assert report.mesh_shape == SHAPE and report.tp_degree == 2
    assert not report.errors
    text = str(report)
    assert "mesh ep 2 x tp 2 (4 ranks)" in text
    assert "  pass      collective              over  count" in text


def test_experts_over_ep_and_tp_under_sequence_parallelism_leave_tp_to_the_block():
    """With ``output_layouts=Partial()`` the experts issue nothing over tp but their id check:
    the block's all-gather before them and reduce-scatter after them, each way, carry the
    tokens."""
    report = _meta_report(sequence_parallel=True)
    experts = [c for c in report.collectives if c.where == EXPERTS and c.mesh_dim == "tp"]
    assert experts == [Collective("forward", "all_reduce", EXPERTS, 2, 8, "tp")]
    block = {
        (c.phase, c.kind)
        for c in report.collectives
        if c.where == "layers.*.feed_forward" and c.mesh_dim == "tp"
    }
    assert block == {
        (phase, kind)
        for phase in ("forward", "backward")
        for kind in ("all_gather_into_tensor", "reduce_scatter_tensor")
    }
    assert not report.errors


def test_a_shape_of_tp_alone_is_the_one_dimensional_report():
    """``{"tp": 2}`` reports what ``2`` does, each collective over ``tp``."""
    with torch.device("meta"):
        model = MoELlama(CONFIG).double()
    plan = moe_llama_plan(experts="tp", shared_expert=True)
    kwargs = {"batch_size": BATCH, "seq_len": SEQ, "device_type": "cpu"}
    one = plan_report(model, plan, 2, **kwargs)
    shaped = plan_report(model, plan, {"tp": 2}, **kwargs)
    assert {c.mesh_dim for c in one.collectives} == {None}
    assert [dataclasses.replace(c, mesh_dim=None) for c in shaped.collectives] == one.collectives
    assert {c.mesh_dim for c in shaped.collectives} == {"tp"}
    assert one.parameters == shaped.parameters and one.problems == shaped.problems


def test_a_shape_that_does_not_fit_the_plan_is_refused():
    # a dimension the experts need is missing
    with pytest.raises(ValueError, match=r"has 1 dimension\(s\), but the plan puts") as caught:
        _meta_report(shape={"tp": 4})
    message = str(caught.value)
    assert "'layers.0.feed_forward.experts' (ExpertTensorParallel, on a 2-D mesh)" in message
    assert "{'ep': 2, 'tp': 4}" in message
    # a dimension no style runs on
    with pytest.raises(ValueError, match=r"no style of the plan runs on the dimension\(s\) \['dp'"):
        _meta_report(shape={"dp": 2, "ep": 2, "tp": 2})
    with torch.device("meta"):
        model = MoELlama(CONFIG).double()
    dense, _ = _plans(False)
    with pytest.raises(ValueError, match=r"dimension\(s\) \['ep'\].*leave them out: \{'tp': 2\}"):
        plan_report(model, dense, SHAPE, batch_size=BATCH, seq_len=SEQ)
    # tp must be last: the 1-D styles' dimension
    with pytest.raises(ValueError, match="must end with the dimension 'tp'"):
        _meta_report(shape={"tp": 2, "ep": 2})
    for bad in ({"ep": 0, "tp": 2}, {}, True):
        with pytest.raises(ValueError, match="tp_degree"):
            _meta_report(shape=bad)
    # an int degree: refused by name, pointing at the shape
    with pytest.raises(NotImplementedError, match="1-D mesh only.*give plan_report the mesh's"):
        _meta_report(shape=2)


def test_experts_that_do_not_split_over_ep_are_an_error():
    report = _meta_report(shape={"ep": 8, "tp": 2})
    refused = [p for p in report.errors if p.where == EXPERTS]
    assert len(refused) == 2  # one per layer
    assert "4 experts do not split over the 8 ranks of 'ep'" in refused[0].message
    # what follows from the refused experts' output (their sum with the shared expert's
    # partial one does not chain) is reported after them
    assert report.errors[: len(refused)] == refused


# --------------------------------------------------------------------------- measured


class _PerDimension(TorchDispatchMode):
    """Count and bytes per (kind, mesh dimension) of every collective, functional or c10d
    (the bytes as the report counts them: the whole tensor reduced or gathered, the bytes an
    all-to-all sends)."""

    def __init__(self, dims: dict[frozenset[int], str]) -> None:
        super().__init__()
        self.dims = dims  # a process group's global ranks -> mesh dimension
        self.counts: Counter[tuple[str, str]] = Counter()
        self.bytes: Counter[tuple[str, str]] = Counter()

    def _add(self, kind: str, group, nbytes: int) -> None:
        if isinstance(group, str):
            group = _resolve_process_group(group)
        else:
            group = dist.ProcessGroup.unbox(group)
        key = (kind, self.dims[frozenset(dist.get_process_group_ranks(group))])
        self.counts[key] += 1
        self.bytes[key] += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ops, c10d = torch.ops._c10d_functional, torch.ops.c10d

        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        if func is ops.all_reduce.default:  # (input, op, group)
            self._add("all_reduce", args[2], size(args[0]))
        elif func is ops.reduce_scatter_tensor.default:  # (input, op, group_size, group)
            self._add("reduce_scatter_tensor", args[3], size(args[0]))
        elif func is ops.all_gather_into_tensor.default:  # (input, group_size, group)
            self._add("all_gather_into_tensor", args[2], size(args[0]) * args[1])
        elif func is ops.all_to_all_single.default:  # (input, out splits, in splits, group)
            self._add("all_to_all", args[3], size(args[0]))
        elif func is c10d.allreduce_.default:  # ([tensors], group, op, ...)
            self._add("all_reduce", args[1], sum(size(t) for t in args[0]))
        elif func is c10d._allgather_base_.default:  # (output, input, group, ...)
            self._add("all_gather_into_tensor", args[2], size(args[0]))
        elif func is c10d._reduce_scatter_base_.default:  # (output, input, group, ...)
            self._add("reduce_scatter_tensor", args[2], size(args[1]))
        elif func is c10d.alltoall_base_.default:  # (output, input, group, ...)
            self._add("all_to_all", args[2], size(args[1]))
        return func(*args, **(kwargs or {}))


def _measure(sequence_parallel: bool, shape: dict[str, int]) -> dict:
    torch.manual_seed(0)
    model = MoELlama(CONFIG).double()
    mesh = init_device_mesh(device_type(), tuple(shape.values()), mesh_dim_names=tuple(shape))
    dense, experts = _plans(sequence_parallel)
    torch_tp.parallelize_module(model, mesh["tp"], dense)
    torch_tp.parallelize_module(model, mesh, experts)
    # each dimension's group by its ranks, not its name: in a process that built an equal
    # mesh before (the pooled workers), torch may resolve a slice's group to that mesh's
    dims = {frozenset(dist.get_process_group_ranks(mesh.get_group(d))): d for d in shape}
    gen = torch.Generator().manual_seed(mesh["ep"].get_local_rank())  # each ep rank its own
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=gen)
    with _PerDimension(dims) as forward:
        out = model(tokens)
    with _PerDimension(dims) as backward:
        out.sum().backward()
    parameter_bytes = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for p in model.parameters()
    )
    return {
        "counts": {"forward": dict(forward.counts), "backward": dict(backward.counts)},
        "bytes": {"forward": dict(forward.bytes), "backward": dict(backward.bytes)},
        "parameter bytes": parameter_bytes,
    }


def _predicted(report, what: str, phase: str) -> dict[tuple[str, str], int]:
    read = report.counts if what == "counts" else report.bytes
    return {(kind, dim): n for dim in report.mesh_shape for kind, n in read(phase, dim).items()}


@pytest.mark.fast_runtime  # the report predicts the default runtime's collectives
@pytest.mark.parametrize(
    ("ep", "tp", "sequence_parallel"),
    [
        pytest.param(2, 2, False, marks=pytest.mark.four_ranks, id="ep2-tp2"),
        pytest.param(2, 2, True, marks=pytest.mark.four_ranks, id="ep2-tp2-sp"),
        pytest.param(2, 1, False, id="ep2-tp1"),
        pytest.param(1, 2, True, marks=pytest.mark.slow, id="ep1-tp2-sp"),
    ],
)
def test_predicted_collectives_and_memory_equal_measured(ep, tp, sequence_parallel):
    shape = {"ep": ep, "tp": tp}
    per_rank = run_distributed(_measure, ep * tp, sequence_parallel, shape)
    report = _meta_report(sequence_parallel, shape=shape, device_type=device_type())
    assert not report.errors
    for phase in ("forward", "backward"):
        predicted = _predicted(report, "counts", phase)
        for rank, measured in enumerate(per_rank):
            assert measured["counts"][phase] == predicted, (rank, phase)
        # each rank's all-to-alls follow its routing; their mean is the balanced one
        total: Counter[tuple[str, str]] = Counter()
        for measured in per_rank:
            total.update(measured["bytes"][phase])
        assert all(v % len(per_rank) == 0 for v in total.values()), total
        mean = {key: v // len(per_rank) for key, v in total.items()}
        assert mean == _predicted(report, "bytes", phase), phase
    assert [m["parameter bytes"] for m in per_rank] == [report.per_rank_bytes] * (ep * tp)
