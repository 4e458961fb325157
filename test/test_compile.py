"""torch.compile of a tensor-parallel model runs on CPU and trains like one device.

Every path of the styles is compiled here: plain column/row-parallel MLPs and attention
(each column-parallel layer reading a replicated input), a partial-sum region
(``PrepareModuleInputOutput(partial_input_gradients=True, output_layouts=Partial())`` with a
nested region and column-parallel layers reading views of its input), the reference Llama
with and without sequence parallelism, and a transformers model under ``plan_for``. The
reference is the eager single-device model, copied before parallelizing: the compiled TP
model must match it (output, loss, every gradient, every parameter after an optimizer step),
so a collective whose backward is wrong fails here even though the compiled and the eager TP
model would agree with each other.

The quick tests compile with ``aot_eager`` (dynamo and AOTAutograd, the part that must trace
what the styles read at run time; seconds on two CPU cores); the sequence-parallel reference
Llama with inductor too (a minute of compiling). ``fullgraph=True`` everywhere, as
upstream's compile tests use it: a graph break in a style fails the test.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import full_tensor, reference_llama, tp_mesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.testing import assert_close

from torch_tp import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    parallelize_module,
)
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import gather_full, run_distributed

# float64: inductor may reorder a reduction, which moves float64 results by ~1e-15
TOLERANCE = {"rtol": 1e-10, "atol": 1e-12}
STEPS = 2
DIM, HIDDEN, HEADS = 16, 32, 4


def _compiled_matches_one_device(
    build: Callable[[], nn.Module],
    plan,
    make_input: Callable[[torch.Generator], torch.Tensor],
    backend: str,
    *,
    input_layout: Placement | None = None,
    output_layout: Placement | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None,
    output_of: Callable[[object], torch.Tensor] = lambda out: out,
) -> None:
    """``build()`` in float64, parallelized by ``plan`` and compiled (``fullgraph=True``),
    trained ``STEPS`` SGD steps beside its eager single-device copy: the output, the loss,
    every gradient and every parameter after each step agree. The TP model takes its input
    as this rank's piece of ``input_layout`` (``None``: whole) and returns its output laid
    out ``output_layout`` (``None``: whole, or a DTensor)."""
    mesh = tp_mesh()
    torch.manual_seed(0)
    reference = build().double()
    model = copy.deepcopy(reference)  # the reference: built before parallelizing
    parallelize_module(model, mesh, plan)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    tp_optim = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = make_input(gen)
        if input_layout is None:
            tp_x = x
        else:  # this rank's piece, as the plan declares it
            tp_x = x.chunk(mesh.size(), dim=input_layout.dim)[mesh.get_local_rank()]
        if x.is_floating_point():
            x, tp_x = x.double().requires_grad_(), tp_x.double().requires_grad_()
        losses, outputs = [], []
        for net, inp in ((reference, x), (compiled, tp_x)):
            out = output_of(net(inp))
            if net is compiled and output_layout is not None:
                out = gather_full(out, mesh, output_layout)
            out = full_tensor(out)
            weights = torch.Generator().manual_seed(100 + step)  # the same for both models
            loss = loss_fn(out, weights) if loss_fn else (out * _weights(out, weights)).sum()
            loss.backward()
            outputs.append(out.detach())
            losses.append(loss.detach())
        assert_close(outputs[1], outputs[0], **TOLERANCE, msg=f"step {step}: output")
        assert_close(losses[1], losses[0], **TOLERANCE, msg=f"step {step}: loss")
        if x.is_floating_point():
            grad = tp_x.grad
            if input_layout is not None:
                grad = gather_full(grad, mesh, input_layout)
            assert_close(grad, x.grad, **TOLERANCE, msg=f"step {step}: input gradient")
        pairs = list(zip(reference.named_parameters(), model.parameters(), strict=True))
        for (name, ref), tp in pairs:
            assert_close(
                full_tensor(tp.grad), ref.grad, **TOLERANCE, msg=f"step {step}: grad of {name}"
            )
        for optim in (ref_optim, tp_optim):
            optim.step()
            optim.zero_grad()
        for (name, ref), tp in pairs:
            assert_close(
                full_tensor(tp.detach()),
                ref.detach(),
                **TOLERANCE,
                msg=f"step {step}: {name} after the optimizer step",
            )


def _weights(out: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A fixed random tensor of ``out``'s shape: a loss whose gradient differs by element."""
    return torch.randn(out.shape, generator=gen, dtype=out.dtype)


# --------------------------------------------------------------------------- plain modules


class MLP(nn.Module):
    """Upstream's ``MLPModule``: two Linears around a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(DIM, HIDDEN)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class Attention(nn.Module):
    """Causal self-attention whose head count comes from the tensors (each rank: its heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM)
        self.wk = nn.Linear(DIM, DIM)
        self.wv = nn.Linear(DIM, DIM)
        self.wo = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        head = DIM // HEADS

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, -1, head).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


MLP_PLAN = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
ATTENTION_PLAN = {
    "wq": ColwiseParallel(),
    "wk": ColwiseParallel(),
    "wv": ColwiseParallel(),
    "wo": RowwiseParallel(),
}


def _tokens(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(2, 8, DIM, generator=gen)


def _plain(kind: str, backend: str) -> None:
    build, plan = {"mlp": (MLP, MLP_PLAN), "attention": (Attention, ATTENTION_PLAN)}[kind]
    _compiled_matches_one_device(build, plan, _tokens, backend)


# the MLP in the quick run, the attention (its q, k and v sharing one entry) in the full one:
# each compiles its own graphs, seconds each
@pytest.mark.parametrize("kind", ["mlp", pytest.param("attention", marks=pytest.mark.slow)])
def test_compiled_colwise_rowwise_matches_one_device(kind):
    # the column-parallel layers read a replicated input (the path that asks whether it is
    # the input of a partial-sum region), the row-parallel ones all-reduce
    run_distributed(_plain, 2, kind, "aot_eager")


# --------------------------------------------------------------------------- partial-sum region


class _FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class Region(nn.Module):
    """A block whose output is a partial sum: two feed-forwards on the flattened tokens (a
    view of the block's input, as a mixture-of-experts block reads them), the second a
    nested region (a shared expert's place)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = _FeedForward()
        self.shared = _FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        return (self.mlp(tokens) + self.shared(tokens)).view_as(x)


def _region_plan(between: Placement) -> dict:
    return {
        "": PrepareModuleInputOutput(
            input_layouts=between,
            desired_input_layouts=Replicate(),
            use_local_input=True,
            partial_input_gradients=True,
            output_layouts=Partial(),
            desired_output_layouts=between,
        ),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Partial()),
        "shared": PrepareModuleInput(
            input_layouts=Replicate(),
            desired_input_layouts=Replicate(),
            partial_input_gradients=True,
        ),
        "shared.up": ColwiseParallel(),
        "shared.down": RowwiseParallel(output_layouts=Partial()),
    }


def _region(sequence_parallel: bool, backend: str) -> None:
    # under sequence parallelism the region gathers the sequence and reduce-scatters its
    # output; without, its input gradient and its output are all-reduced
    between = Shard(1) if sequence_parallel else Replicate()
    layout = between if sequence_parallel else None
    _compiled_matches_one_device(
        Region,
        _region_plan(between),
        _tokens,
        backend,
        input_layout=layout,
        output_layout=layout,
    )


@pytest.mark.parametrize(
    "sequence_parallel",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # compiling, seconds each
    ids=["replicated", "sequence"],
)
def test_compiled_partial_sum_region_matches_one_device(sequence_parallel):
    run_distributed(_region, 2, sequence_parallel, "aot_eager")


# --------------------------------------------------------------------------- whole models


def _llama(sequence_parallel: bool, backend: str) -> None:
    config = {"dim": 32, "n_layers": 1, "n_heads": 4, "vocab_size": 101, "max_seq_len": 16}

    def loss(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        targets = torch.randint(0, config["vocab_size"], logits.shape[:-1], generator=gen)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    _compiled_matches_one_device(
        lambda: reference_llama(0, **config),
        llama_plan(sequence_parallel=sequence_parallel),
        lambda gen: torch.randint(0, config["vocab_size"], (2, 8), generator=gen),
        backend,
        loss_fn=loss,
    )


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_compiled_llama_matches_one_device(sequence_parallel):
    # with sequence parallelism, inductor: all-gathers, reduce-scatters and all-reduces in
    # the compiled graph (about a minute of compiling on two cores); without, aot_eager (the
    # quick tests compile the same column/row-parallel paths; inductor twice cost minutes)
    backend = "inductor" if sequence_parallel else "aot_eager"
    run_distributed(_llama, 2, sequence_parallel, backend, timeout=600)


def _transformers_llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        initializer_range=0.1,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # unit norm weights would hide one broadcast wrongly
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def _transformers(sequence_parallel: bool, backend: str) -> None:
    from torch_tp.plans.hf import plan_for

    torch.manual_seed(0)
    plan = plan_for(_transformers_llama(), sequence_parallel=sequence_parallel)
    _compiled_matches_one_device(
        _transformers_llama,
        plan,
        lambda gen: torch.randint(0, 64, (2, 8), generator=gen),
        backend,
        output_of=lambda out: out.logits,
    )


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_compiled_transformers_llama_matches_one_device(sequence_parallel):
    # transformers' own Llama under plan_for: its attention and rotary code, and (with
    # sequence parallelism) the plan's partial-sum region around each MLP
    run_distributed(_transformers, 2, sequence_parallel, "aot_eager", timeout=600)
