"""The styles beyond ``torch.distributed.tensor.parallel``'s, at single-device parity.

transformers' ``Conv1D`` (GPT-2's weight-transposed Linear) under the column- and row-wise
styles; fused projections (:class:`PackedColwiseParallel`, :class:`PackedRowwiseParallel`);
:class:`AttentionHeads`; tied weights sharded alike; :class:`ReplicateParallel`; and the one
region entry that column-parallel layers reading the same local tensor share.

``Conv1D`` here is a copy of transformers' (same name, attributes and forward), so that these
tests run without transformers; ``test_transformers.py`` runs the real one.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from helpers import sgd, tp_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing import assert_close

from torch_tp import (
    AttentionHeads,
    ColwiseParallel,
    PackedColwiseParallel,
    PackedRowwiseParallel,
    ReplicateParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch_tp.plan import from_dict, to_dict
from torch_tp.testing import check_parity, run_distributed

WORLD_SIZES = [2, pytest.param(4, marks=pytest.mark.four_ranks)]


class Conv1D(nn.Module):
    """transformers' ``Conv1D``: ``x @ weight + bias`` with ``weight`` of shape (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.nx = nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)
        nn.init.normal_(self.bias, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class FusedAttention(nn.Module):
    """GPT-2's attention: one fused q/k/v projection split by ``split_size``."""

    def __init__(self, dim: int, heads: int, conv1d: bool) -> None:
        super().__init__()
        self.num_heads, self.split_size, self.head_dim = heads, dim, dim // heads
        self.c_attn = Conv1D(3 * dim, dim) if conv1d else nn.Linear(dim, 3 * dim)
        self.c_proj = Conv1D(dim, dim) if conv1d else nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.split_size, dim=2)
        shape = (*x.shape[:-1], self.num_heads, self.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))


def _attention_plan(conv1d_heads_attribute: str = "num_heads") -> dict:
    return {
        "": AttentionHeads(conv1d_heads_attribute, divide=("num_heads", "split_size")),
        "c_attn": PackedColwiseParallel(3),
        "c_proj": RowwiseParallel(),
    }


# --------------------------------------------------------------------------- Conv1D


def _conv1d_mlp(world_size: int) -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(Conv1D(24, 8), nn.GELU(), Conv1D(8, 24))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    tp, _ = check_parity(mlp, tp_mesh(), plan, (torch.randn(2, 5, 8),), optimizer_fn=sgd)
    assert tp[0].weight.placements == (Shard(1),) and tp[0].bias.placements == (Shard(0),)
    assert tp[2].weight.placements == (Shard(0),) and tp[2].bias.placements == (Replicate(),)
    for param in tp.parameters():  # each gradient has the size of its shard
        assert param.grad.placements == param.placements
        assert param.grad.to_local().shape == param.to_local().shape


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_conv1d_column_and_row_parallel(world_size):
    run_distributed(_conv1d_mlp, world_size, world_size)


def _conv1d_layouts() -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    # gathered output; sequence-sharded input
    check_parity(
        Conv1D(12, 8), mesh, ColwiseParallel(output_layouts=Replicate()), (torch.randn(2, 4, 8),)
    )
    x = torch.randn(2, 4, 12)
    local = x.chunk(dist.get_world_size(), dim=-1)[dist.get_rank()]
    check_parity(
        Conv1D(8, 12),
        mesh,
        RowwiseParallel(output_layouts=Shard(1)),
        (x,),
        tp_args=(local,),
        output_placements=Shard(1),
    )


def test_conv1d_layouts():
    run_distributed(_conv1d_layouts, 2)


# --------------------------------------------------------------------------- packed


def _fused_attention(world_size: int, conv1d: bool) -> None:
    torch.manual_seed(0)
    attention = FusedAttention(16, 4, conv1d)
    tp, _ = check_parity(
        attention, tp_mesh(), _attention_plan(), (torch.randn(2, 6, 16),), optimizer_fn=sgd
    )
    weight = tp.c_attn.weight
    dim = 1 if conv1d else 0
    assert weight.placements == (_StridedShard(dim, split_factor=3),)
    # this rank holds its slice of q, of k and of v, in that order
    full = weight.full_tensor()
    expected = torch.cat(
        [part.chunk(world_size, dim)[dist.get_rank()] for part in full.chunk(3, dim)], dim
    )
    assert_close(weight.to_local(), expected, rtol=0, atol=0)
    assert tp.num_heads == 4 // world_size and tp.split_size == 16 // world_size
    assert weight.grad.placements == weight.placements


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("conv1d", [True, False])
def test_packed_colwise_splits_fused_qkv_by_head(world_size, conv1d):
    run_distributed(_fused_attention, world_size, world_size, conv1d)


class GatedMLP(nn.Module):
    """A fused gate/up projection, chunked in two: packed on both sides of the MLP."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=False)
        self.mix = nn.Linear(2 * hidden, 2 * hidden, bias=False)  # unsharded, for the test
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class PackedDown(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden)
        self.down_proj = nn.Linear(2 * hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_up_proj(x)))


def _packed_names() -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    x = torch.randn(2, 3, 8)
    plan = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
    check_parity(GatedMLP(8, 12), mesh, plan, (x,), optimizer_fn=sgd)
    # packed on both sides: the row-parallel input is the packed slices, not a plain shard
    plan = {"gate_up_proj": "packed_colwise", "down_proj": "packed_rowwise"}
    tp, _ = check_parity(PackedDown(8, 12), mesh, plan, (x,), optimizer_fn=sgd)
    assert tp.down_proj.weight.placements == (_StridedShard(1, split_factor=2),)


def test_packed_names():
    run_distributed(_packed_names, 2)


def _packed_pair_collectives() -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = parallelize_module(PackedDown(8, 12), tp_mesh(), _PACKED_PAIR)
    x = torch.randn(2, 3, 8) * 1.0
    forward, backward = Counter(), Counter()
    with _counting_collectives(forward):
        y = model(x.requires_grad_())
    with _counting_collectives(backward):
        y.sum().backward()
    return dict(forward), dict(backward)


_PACKED_PAIR = {"gate_up_proj": "packed_colwise", "down_proj": "packed_rowwise"}


@pytest.mark.fast_runtime
def test_report_follows_packed_layouts():
    """The dry-run report chains a packed column-parallel output into a packed row-parallel
    input (no false error, no extra collective) and predicts what the run issues."""
    from torch_tp.report import plan_report

    forward, backward = run_distributed(_packed_pair_collectives, 2)[0]
    with torch.device("meta"):
        model = PackedDown(8, 12)

    def inputs(batch: int, seq: int) -> torch.Tensor:
        return torch.randn(batch, seq, 8, requires_grad=True)

    report = plan_report(
        model, _PACKED_PAIR, 2, batch_size=2, seq_len=3, device_type="cpu", example_inputs=inputs
    )
    assert not report.errors, report.errors
    assert report.counts("forward") == forward == {"all_reduce": 1}
    assert report.counts("backward") == backward == {"all_reduce": 1}


def _packed_gathered_output() -> None:
    torch.manual_seed(0)
    style = PackedColwiseParallel(3, output_layouts=Replicate())
    check_parity(nn.Linear(8, 12), tp_mesh(), style, (torch.randn(2, 3, 8),))


def test_packed_colwise_gathered_output():
    run_distributed(_packed_gathered_output, 2)


def _packed_refusals() -> None:
    mesh = tp_mesh()
    with pytest.raises(ValueError, match="multiple of 3 x 2 = 6"):
        parallelize_module(nn.Linear(4, 9), mesh, PackedColwiseParallel(3))
    with pytest.raises(NotImplementedError, match="nn.Embedding"):
        parallelize_module(nn.Embedding(8, 4), mesh, PackedColwiseParallel())


def test_packed_refusals():
    run_distributed(_packed_refusals, 2)
    with pytest.raises(ValueError, match="None .* or Replicate"):
        PackedColwiseParallel(3, output_layouts=Shard(0))
    with pytest.raises(ValueError, match="positive int"):
        PackedColwiseParallel(0)


# --------------------------------------------------------------------------- heads


def _heads_refused_before_anything_changes() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"attn": FusedAttention(24, 6, conv1d=True)})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = {f"attn.{k}" if k else "attn": v for k, v in _attention_plan().items()}
    with pytest.raises(ValueError) as info:
        parallelize_module(model, tp_mesh(), plan)
    message = str(info.value)
    assert "'attn'" in message and "AttentionHeads" in message
    assert "6 query heads do not split over 4 ranks" in message and "(1, 2, 3, 6)" in message
    assert model.attn.num_heads == 6 and model.attn.split_size == 24
    for name, param in model.named_parameters():
        assert not isinstance(param, DTensor), name
        assert_close(param, before[name], rtol=0, atol=0)


@pytest.mark.four_ranks
def test_heads_that_do_not_divide_are_refused_before_anything_changes():
    run_distributed(_heads_refused_before_anything_changes, 4)


def test_attention_heads_arguments():
    config = type("Config", (), {"num_attention_heads": 8, "num_key_value_heads": 2})()
    attention = nn.Module()
    attention.config = config
    style = AttentionHeads("config.num_attention_heads", "config.num_key_value_heads")
    assert style._count(attention, style.num_heads) == 8
    assert style._count(attention, style.num_kv_heads) == 2
    with pytest.raises(ValueError, match="module itself"):
        AttentionHeads(8, divide=("config.num_attention_heads",))
    with pytest.raises(TypeError, match="int or an attribute name"):
        AttentionHeads(8.0)


# --------------------------------------------------------------------------- tied weights


class TiedLM(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        return self.lm_head(h + self.mlp(h))


_TIED_PLAN = {
    "wte": RowwiseParallel(input_layouts=Replicate()),
    "mlp.0": ColwiseParallel(),
    "mlp.2": RowwiseParallel(),
    "lm_head": ColwiseParallel(output_layouts=Replicate()),
}


def _tied_weights(world_size: int) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 7))
    tp, _ = check_parity(TiedLM(32, 8), tp_mesh(), _TIED_PLAN, (ids,), optimizer_fn=sgd)
    assert tp.lm_head.weight is tp.wte.weight
    assert tp.wte.weight.placements == (Shard(0),)
    assert len(list(tp.parameters())) == 5  # still one tied weight


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tied_weights_sharded_alike_stay_tied(world_size):
    run_distributed(_tied_weights, world_size, world_size)


def _tied_weights_refused() -> None:
    mesh = tp_mesh()
    model = TiedLM(32, 8)
    for plan, found in [
        ({"wte": RowwiseParallel(input_layouts=Replicate())}, "'lm_head.weight' (not in the plan)"),
        (
            {"wte": ColwiseParallel(), "lm_head": ColwiseParallel()},
            "'lm_head.weight' (Shard(dim=0))",
        ),
    ]:
        with pytest.raises(ValueError, match="tied weights") as info:
            parallelize_module(model, mesh, plan)
        assert found in str(info.value)
        assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_tied_weights_laid_out_differently_are_refused():
    run_distributed(_tied_weights_refused, 2)


# --------------------------------------------------------------------------- replicate


class QKNorm(nn.Module):
    """A per-head norm after a column-parallel projection: it sees this rank's heads only."""

    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(dim, dim)
        self.q_norm = nn.LayerNorm(head_dim)
        self.gate = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.sigmoid(self.gate(x))  # replicated: sees the whole activation
        q = self.q_proj(x * g)
        q = self.q_norm(q.view(*q.shape[:-1], -1, self.head_dim)).flatten(-2)
        return self.o_proj(q)


def _replicate(world_size: int) -> None:
    torch.manual_seed(0)
    plan = {
        "gate": "replicate",
        "q_proj": "colwise",
        "q_norm": "replicated_with_grad_allreduce",
        "o_proj": "rowwise",
    }
    tp, _ = check_parity(
        QKNorm(16, 4), tp_mesh(), plan, (torch.randn(2, 3, 16),), optimizer_fn=sgd, steps=2
    )
    for name in ("gate.weight", "q_norm.weight", "q_norm.bias"):
        param = tp.get_parameter(name)
        assert param.placements == (Replicate(),) and param.grad.placements == (Replicate(),)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_replicate_parallel(world_size):
    run_distributed(_replicate, world_size, world_size)


class NormedEmbedding(nn.Embedding):
    """A lookup followed by a norm of its own (transformers' Inkling's normed embeddings)."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__(vocab, dim)
        self.embed_norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(super().forward(ids))


def _normed_embedding(style: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(NormedEmbedding(16, 8), nn.Linear(8, 8))
    plan = {"0": style, "1": "colwise_rep"}
    tp, _ = check_parity(
        model, tp_mesh(), plan, (torch.randint(0, 16, (2, 5)),), steps=2, optimizer_fn=sgd
    )
    # the norm inside is replicated with the module: a DTensor with its whole gradient
    for name in ("0.embed_norm.weight", "0.embed_norm.bias"):
        param = tp.get_parameter(name)
        assert param.placements == (Replicate(),) and param.grad.placements == (Replicate(),)


@pytest.mark.parametrize("style", ["replicate", "embedding_rowwise", "embedding_colwise"])
def test_a_module_keeps_its_submodules_without_a_style(style):
    # replicated whole, or sharded with its own forward running on DTensors (the norm on a
    # DTensor too)
    run_distributed(_normed_embedding, 2, style)


def _replicate_refuses_styled_submodules() -> None:
    model = nn.Sequential(NormedEmbedding(16, 8))
    plan = {"0": "replicate", "0.embed_norm": "sequence_parallel"}
    with pytest.raises(ValueError, match=r"submodules \['embed_norm'\] have styles of their own"):
        parallelize_module(model, tp_mesh(), plan)
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # nothing changed


def test_replicate_parallel_refuses_submodules_with_styles():
    run_distributed(_replicate_refuses_styled_submodules, 2)


# --------------------------------------------------------------------------- shared entry


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.o(self.q(h) * self.k(h) + self.v(h))


def _shared_entry(sequence_parallel: bool) -> None:
    torch.manual_seed(0)
    mesh = tp_mesh()
    stream = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "q": ColwiseParallel(input_layouts=stream),
        "k": ColwiseParallel(input_layouts=stream),
        "v": ColwiseParallel(input_layouts=stream),
        "o": RowwiseParallel(output_layouts=stream),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel(use_local_output=True)
    x = torch.randn(2, 4, 8, requires_grad=True)
    local = x.detach().chunk(2, dim=1)[dist.get_rank()] if sequence_parallel else x.detach()
    tp, ref = check_parity(
        Block(8),
        mesh,
        plan,
        (x,),
        tp_args=(local.requires_grad_(),),
        output_placements=stream,
        optimizer_fn=sgd,
    )
    local.grad = None
    # counted at c10d, not with CommDebugMode: its module tracker gives every module call
    # its own alias of the input (full backward hooks do), and aliases cannot share
    counts: Counter[str] = Counter()
    with _counting_collectives(counts):
        tp(local).sum().backward()
    if sequence_parallel:
        # one gather of h for q, k and v (and its one reduce-scatter back); the output's
        # reduce-scatter (and its gather back); the norm's gradients: one all-reduce
        assert counts == {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 1}, counts
    else:
        # q, k and v share one input-gradient all-reduce; the output: one all-reduce
        assert counts == {"all_reduce": 2}, counts
    # the input's gradient is correct too (it crosses the shared region twice)
    expected = ref(x).sum()
    x.grad = None
    expected.backward()
    full = local.grad
    if sequence_parallel:
        gathered = [torch.empty_like(local.grad) for _ in range(2)]
        dist.all_gather(gathered, local.grad)
        full = torch.cat(gathered, dim=1)
    assert_close(full, x.grad)


@pytest.mark.fast_runtime
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_layers_reading_one_tensor_share_one_region_entry(sequence_parallel):
    run_distributed(_shared_entry, 2, sequence_parallel)


@contextlib.contextmanager
def _counting_collectives(counts: Counter[str]):
    names = {
        "all_reduce": "all_reduce",
        "all_gather_single": "all_gather",
        "reduce_scatter_single": "reduce_scatter",
    }
    originals = {name: getattr(dist, name) for name in names}

    def counting(name):
        def call(*args, **kwargs):
            counts[names[name]] += 1
            return originals[name](*args, **kwargs)

        return call

    try:
        for name in names:
            setattr(dist, name, counting(name))
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


# --------------------------------------------------------------------------- as data


def test_new_styles_round_trip_as_data():
    plan = {
        "attn": AttentionHeads("num_heads", "config.num_key_value_heads", divide=["num_heads"]),
        "attn.c_attn": PackedColwiseParallel(3),
        "attn.gathered": PackedColwiseParallel(3, output_layouts=Replicate()),
        "mlp.gate_up_proj": "packed_colwise",
        "mlp.down_proj": PackedRowwiseParallel(2, output_layouts=Shard(1)),
        "router": ReplicateParallel(),
        "q_norm": ReplicateParallel(sum_gradients=True),
    }
    data = to_dict(plan)
    assert data["mlp.gate_up_proj"] == "packed_colwise"
    assert data["router"] == "replicate" and data["q_norm"] == "replicated_with_grad_allreduce"
    assert data["attn"] == {
        "style": "AttentionHeads",
        "num_heads": "num_heads",
        "num_kv_heads": "config.num_key_value_heads",
        "divide": ["num_heads"],
    }
    assert data["attn.c_attn"] == {"style": "PackedColwiseParallel", "parts": 3}
    import json

    assert from_dict(json.loads(json.dumps(data))) == from_dict(data)
    rebuilt = from_dict(data)
    for key, style in plan.items():
        expected = from_dict({key: style})[key] if isinstance(style, str) else style
        assert rebuilt[key] == expected, key
