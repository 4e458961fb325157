"""The dry-run report (``torch_tp.report``) and ``python -m torch_tp plan``.

The collectives the report predicts from a meta-device trace are checked against what
``CommDebugMode`` (counts) and the functional collectives' arguments (bytes) show in a real
TP=2 step of the reference Llama, for several plans, and of a small net under plans that use
every built-in style and a user-defined one.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
from collections import Counter
from pathlib import Path

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

from torch_tp import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    ReplicateParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch_tp.__main__ import main as cli
from torch_tp._torch_compat import StridedShard
from torch_tp.contract import Boundary, Layout, StyleContract
from torch_tp.models import Llama, LlamaConfig, MoEConfig, MoELlama, tiny_config
from torch_tp.plan import to_dict
from torch_tp.plans.llama import llama_plan
from torch_tp.plans.moe import moe_llama_plan
from torch_tp.registry import STYLE_REGISTRY
from torch_tp.report import PlanReport, plan_report
from torch_tp.testing import (
    RankError,
    check_parity,
    collective_counts,
    device_type,
    run_distributed,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = LlamaConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=1001, max_seq_len=32)
MOE_CONFIG = MoEConfig(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=1001,
    max_seq_len=32,
    n_experts=4,
    expert_hidden_dim=16,
    shared_expert_hidden_dim=16,
)
BATCH, SEQ = 2, 16

# a plan of style names only: no PrepareModuleInput, so q, k and v (and w1, w3) each reduce
# their input gradient separately
NAMES_PLAN = {
    "tok_embeddings": "embedding_rowwise",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "output": "colwise_gather_output",
}
PLANS = {
    "llama": lambda: llama_plan(),
    "llama_sequence_parallel": lambda: llama_plan(sequence_parallel=True),
    "llama_loss_parallel": lambda: llama_plan(sequence_parallel=True, loss_parallel=True),
    "names": lambda: NAMES_PLAN,
}
# the MoE Llama's plans: each data-dependent transfer (the tokens dispatched to their experts
# and their gradients) is predicted for balanced routing, which the mean over the ranks of
# a measured run equals whatever the routing (every routing slot is sent, and received,
# exactly once)
MOE_PLANS = {
    f"moe_{experts}{'_sequence_parallel' if sp else ''}": functools.partial(
        moe_llama_plan, experts=experts, shared_expert=True, sequence_parallel=sp
    )
    for experts in ("tp", "ep")
    for sp in (False, True)
}


def _meta(config: LlamaConfig = CONFIG) -> Llama:
    with torch.device("meta"):
        return Llama(config)


# --------------------------------------------------------------------------- measured


class _CollectiveBytes(TorchDispatchMode):
    """Count and bytes per kind of collective (functional or c10d): the whole tensor reduced
    or gathered.

    Unlike ``CommDebugMode``, it installs no module hooks: ``CommDebugMode``'s module tracker
    gives every module call its own alias of its input, so column-parallel layers reading one
    tensor cannot share their region entry under it (see
    ``runtime.boundaries._shared_entry``), and a per-layer plan would measure more collectives
    than it issues in a normal run.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()

    def _add(self, kind: str, nbytes: int) -> None:
        self.counts[kind] += 1
        self.bytes[kind] += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ops, c10d = torch.ops._c10d_functional, torch.ops.c10d
        if func in (ops.all_reduce.default, ops.reduce_scatter_tensor.default):
            self._add(func.overloadpacket.__name__, args[0].numel() * args[0].element_size())
        elif func is ops.all_gather_into_tensor.default:  # (input, group_size, group)
            size = args[0].numel() * args[0].element_size() * args[1]
            self._add(func.overloadpacket.__name__, size)
        elif func is c10d.allreduce_.default:  # ([tensors], group, op, ...)
            self._add("all_reduce", sum(t.numel() * t.element_size() for t in args[0]))
        elif func is c10d._allgather_base_.default:  # (output, input, group, ...)
            self._add("all_gather_into_tensor", args[0].numel() * args[0].element_size())
        elif func is c10d._reduce_scatter_base_.default:  # (output, input, group, ...)
            self._add("reduce_scatter_tensor", args[1].numel() * args[1].element_size())
        elif func is c10d.alltoall_base_.default:  # (output, input, splits, splits, group, ...)
            self._add("all_to_all", args[1].numel() * args[1].element_size())
        return func(*args, **(kwargs or {}))


def _counts(mode: CommDebugMode) -> dict[str, int]:
    # collective_counts folds c10d and functional ops into kinds; the report names two of
    # them after the functional ops
    return {_REPORT_KIND.get(kind, kind): n for kind, n in collective_counts(mode).items()}


_REPORT_KIND = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = _MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class _Net(nn.Module):
    """Biased layers and LayerNorms, fed features rather than token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class GatheredColwise(ParallelStyle):
    """A user-defined style, written with plain DTensor: a column-parallel ``nn.Linear`` that
    takes its input as a replicated DTensor and returns its output gathered, as a local
    tensor. Its contract is all the report knows of it."""

    contract = StyleContract(
        names={"test_gathered_colwise": {}},
        modules=(nn.Linear,),
        parameters=lambda s, m: {"weight": Shard(0), "bias": Shard(0)},
        # the module gets a DTensor; F.linear's backward gives each rank a partial sum
        inputs=lambda s, m: Boundary(
            (Layout(Replicate(), Replicate(), local=False, grad=Partial()),)
        ),
        # DTensor's linear makes the output sharded on its features; gathered, handed on local
        outputs=lambda s, m: Boundary((Layout(Shard(-1), Replicate()),)),
        local_forward=lambda s, m: True,
    )

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), device_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded))

        def enter(module, args):
            return (DTensor.from_local(args[0], device_mesh, [Replicate()]), *args[1:])

        def leave(module, args, output):
            return output.redistribute(device_mesh, [Replicate()]).to_local()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
        return module


_SEQUENCE_SHARDED_INPUT = PrepareModuleInput(
    input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True
)
NET_PLANS = {
    # local tensors into the MLP: its column-parallel layer reduces the input gradient itself;
    # the biased row-parallel layer has a sequence-sharded output, so its bias gradient is
    # partial, like the LayerNorms'
    "net_local_inputs": {
        "": _SEQUENCE_SHARDED_INPUT,
        "blocks.*.norm": SequenceParallel(),
        "blocks.*.mlp": PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True
        ),
        "blocks.*.mlp.up": ColwiseParallel(),
        "blocks.*.mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    },
    # the MLP's output moved by PrepareModuleInputOutput; a DTensor output of the model
    "net_input_output": {
        "": _SEQUENCE_SHARDED_INPUT,
        "blocks.*.norm": "sequence_parallel",
        "blocks.*.mlp": PrepareModuleInputOutput(
            input_layouts=Shard(1),
            desired_input_layouts=Replicate(),
            output_layouts=Replicate(),
            desired_output_layouts=Shard(1),
        ),
        "blocks.*.mlp.up": "colwise",
        "blocks.*.mlp.down": "rowwise",
        "head": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(1), use_local_output=False
        ),
    },
    # a user-defined style known to the report by its contract alone, by its plan name
    "net_user_style": {
        "blocks.*.mlp.up": "test_gathered_colwise",
        "blocks.*.mlp.down": "rowwise_split_input",
        "head": GatheredColwise(),
    },
}


def _case(name: str) -> tuple[nn.Module, dict, tuple[torch.Tensor, ...]]:
    """The model (built on the current default device), plan and inputs of a case."""
    torch.manual_seed(0)
    if name in PLANS:
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), device="cpu")
        return Llama(CONFIG), PLANS[name](), (tokens,)
    if name in MOE_PLANS:
        tokens = torch.randint(0, MOE_CONFIG.vocab_size, (BATCH, SEQ), device="cpu")
        return MoELlama(MOE_CONFIG), MOE_PLANS[name](), (tokens,)
    return _Net(), NET_PLANS[name], (torch.randn(BATCH, SEQ, 16, device="cpu"),)


def _measure(name: str) -> dict[str, dict[str, int]]:
    mesh = init_device_mesh(device_type(), (2,))
    model, plan, inputs = _case(name)
    model = parallelize_module(model, mesh, plan)
    measured = {}
    for debug_mode in (False, True):
        # once with the plain counter, once with CommDebugMode: the plans that hand a block's
        # input to its projections as a DTensor measure the same under both
        with _CollectiveBytes() as forward:
            with CommDebugMode() if debug_mode else contextlib.nullcontext() as forward_debug:
                out = model(*inputs)
        # a loss on the output as it is: replicated, or (loss_parallel) vocabulary shards
        loss = (out.to_local() if isinstance(out, DTensor) else out).sum()
        with _CollectiveBytes() as backward:
            with CommDebugMode() if debug_mode else contextlib.nullcontext() as backward_debug:
                loss.backward()
        model.zero_grad(set_to_none=True)
        if debug_mode:
            measured["forward (CommDebugMode)"] = _counts(forward_debug)
            measured["backward (CommDebugMode)"] = _counts(backward_debug)
        else:
            measured.update(
                {
                    "forward": dict(forward.counts),
                    "backward": dict(backward.counts),
                    "forward bytes": dict(forward.bytes),
                    "backward bytes": dict(backward.bytes),
                }
            )
    return measured


def _mean_bytes(per_rank: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Rank 0's counts, and each kind's bytes averaged over the ranks (the data-dependent
    transfers of expert parallelism differ per rank; their mean is the balanced one)."""
    for other in per_rank[1:]:
        assert {k: v for k, v in other.items() if "bytes" not in k} == {
            k: v for k, v in per_rank[0].items() if "bytes" not in k
        }
    mean = dict(per_rank[0])
    for key in ("forward bytes", "backward bytes"):
        total: Counter[str] = Counter()
        for measured in per_rank:
            total.update(measured[key])
        assert all(v % len(per_rank) == 0 for v in total.values()), total
        mean[key] = {kind: v // len(per_rank) for kind, v in total.items()}
    return mean


@pytest.mark.fast_runtime  # the report predicts the default runtime's collectives
@pytest.mark.parametrize("name", [*PLANS, *NET_PLANS, *MOE_PLANS])
def test_predicted_collectives_equal_measured(name):
    measured = _mean_bytes(run_distributed(_measure, 2, name))
    with torch.device("meta"):
        model, plan, inputs = _case(name)
    meta_inputs = tuple(torch.empty_like(t, device="meta") for t in inputs)
    report = plan_report(
        model,
        plan,
        2,
        batch_size=BATCH,
        seq_len=SEQ,
        example_inputs=meta_inputs,
        device_type=device_type(),
    )
    predicted = {
        "forward": report.counts("forward"),
        "backward": report.counts("backward"),
        "forward bytes": report.bytes("forward"),
        "backward bytes": report.bytes("backward"),
    }
    if name != "names":
        # the per-layer plan shares region entries by tensor identity, which CommDebugMode's
        # module hooks defeat (each projection then reduces its own input gradient)
        predicted["forward (CommDebugMode)"] = predicted["forward"]
        predicted["backward (CommDebugMode)"] = predicted["backward"]
    else:
        del measured["forward (CommDebugMode)"], measured["backward (CommDebugMode)"]
    assert predicted == measured
    assert not report.errors


# --------------------------------------------------------------------------- every plan name
# A style states its layouts twice: in its contract, which the report reads, and in its
# forward, which runs. Each plan name of a style that takes a bare Linear or Embedding (the
# registry's, so a new name is a new case), alone on such a module: the collectives the report
# predicts from the contract are those the forward issues.


_BARE_MODULES = {
    "linear": lambda: nn.Linear(12, 24),
    "embedding": lambda: nn.Embedding(36, 12),
}


class _FakeMesh:
    """What a style's ``_validate`` reads of a 1-D mesh: its size (and that it has no
    dimension names)."""

    ndim = 1
    mesh_dim_names = None

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self, dim: int | None = None) -> int:
        return self._size


def _takes_alone(style: ParallelStyle, module: nn.Module) -> bool:
    """Whether ``style`` takes ``module`` alone, called with one input, on a 1-D mesh."""
    contract = style.contract
    if contract.mesh_ndim != 1 or contract.mesh_dims is not None or not contract.accepts(module):
        return False
    try:
        style._validate(module, _FakeMesh(2))
    except (NotImplementedError, ValueError, TypeError):
        return False
    inputs = style.contract.inputs(style, module)
    return inputs is None or len(inputs.args) <= 1  # not the experts (tokens and routing)


def _bare_cases() -> list[str]:
    """``name-kind`` for each plan name of a built-in style and each bare module it takes
    (sizes every style divides: packed parts of two or three, over two ranks)."""
    cases = []
    for name in STYLE_REGISTRY.names():
        style = STYLE_REGISTRY.style(name)
        if not type(style).__module__.startswith("torch_tp."):
            continue  # a style a test module defines (the workers may not have imported it)
        for kind, make in _BARE_MODULES.items():
            with torch.device("meta"):
                if _takes_alone(style, make()):
                    cases.append(f"{name}-{kind}")
    return cases


def _bare_case(case: str) -> tuple[nn.Module, ParallelStyle, torch.Tensor]:
    """The module, the style and the whole input of one case."""
    name, _, kind = case.rpartition("-")
    torch.manual_seed(0)
    module = _BARE_MODULES[kind]()
    if isinstance(module, nn.Embedding):
        x = torch.randint(0, module.num_embeddings, (BATCH, 4), device="cpu")
    else:
        x = torch.randn(BATCH, 4, module.in_features, device="cpu")
    return module, STYLE_REGISTRY.style(name), x


def _local_input(style: ParallelStyle, module: nn.Module, x: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's part of the whole input ``x``, as the style's contract says it arrives."""
    inputs = style.contract.inputs(style, module)
    given = inputs.args[0].given if inputs is not None and inputs.args[0] is not None else None
    if not isinstance(given, (Shard, StridedShard)):
        return x
    dim, n, rank = given.dim % x.ndim, mesh.size(), mesh.get_local_rank()
    # a strided shard (a packed row-parallel layer): this rank's part of each block
    blocks = x.chunk(getattr(given, "split_factor", 1), dim)
    return torch.cat([block.chunk(n, dim)[rank] for block in blocks], dim).contiguous()


def _measure_bare(case: str) -> dict[str, dict[str, int]]:
    mesh = init_device_mesh(device_type(), (2,))
    module, style, x = _bare_case(case)
    x = _local_input(style, module, x, mesh)
    module = parallelize_module(module, mesh, style)
    if x.is_floating_point():
        x.requires_grad_()
    with _CollectiveBytes() as forward:
        out = module(x)
    with _CollectiveBytes() as backward:
        (out.to_local() if isinstance(out, DTensor) else out).sum().backward()
    return {"forward": dict(forward.counts), "backward": dict(backward.counts)}


def test_the_bare_cases_hold_every_linear_and_embedding_style():
    """The cases come from the registry, filtered by each style's own validation: one that
    started refusing a bare module would drop out silently, so the usual ones are named."""
    cases = set(_bare_cases())
    for name in ("colwise", "rowwise", "colwise_rep", "rowwise_split_input", "packed_colwise"):
        assert f"{name}-linear" in cases, name
    for name in ("embedding_rowwise", "embedding_colwise"):
        assert f"{name}-embedding" in cases, name
    assert "replicate-linear" in cases and len(cases) >= 25, sorted(cases)


@pytest.mark.fast_runtime  # the report predicts the default runtime's collectives
@pytest.mark.parametrize("case", _bare_cases())
def test_each_plan_names_contract_agrees_with_its_forward(case):
    measured = run_distributed(_measure_bare, 2, case)[0]
    with torch.device("meta"):
        module, style, x = _bare_case(case)
    report = plan_report(
        module,
        style,
        2,
        batch_size=BATCH,
        seq_len=4,
        # a float input requires grad, as in the measured run
        example_inputs=(torch.empty_like(x, device="meta").requires_grad_(x.is_floating_point()),),
        device_type=device_type(),
    )
    predicted = {"forward": report.counts("forward"), "backward": report.counts("backward")}
    assert predicted == measured, (case, style)


def test_reference_counts():
    """The counts the issue measured on this model, for the record."""
    report = plan_report(_meta(), llama_plan(), 2, batch_size=BATCH, seq_len=SEQ)
    # (and one all-reduce of two numbers: the embedding's ids agreed in range on every rank)
    assert report.counts() == {"all_reduce": 18 + 1, "all_gather_into_tensor": 1}
    report = plan_report(
        _meta(), llama_plan(sequence_parallel=True), 2, batch_size=BATCH, seq_len=SEQ
    )
    assert report.counts() == {
        "reduce_scatter_tensor": 18,
        "all_gather_into_tensor": 19,
        "all_reduce": 1 + 1,
    }
    # the projections reading one tensor share one input-gradient reduction, as with
    # PrepareModuleInput: one per attention, one per MLP, one for the output projection
    report = plan_report(_meta(), NAMES_PLAN, 2, batch_size=BATCH, seq_len=SEQ)
    assert report.counts("backward") == {"all_reduce": 1 + 4 * 2}


# --------------------------------------------------------------------------- the table


class ReportTableTest(expecttest.TestCase):
    def test_sequence_parallel_llama(self):
        config = tiny_config(n_layers=1, max_seq_len=16)
        report = plan_report(_meta(config), llama_plan(sequence_parallel=True), 2, **_SIZE)
        self.assertExpectedInline(
            str(report),
            """\
Plan report: Llama, 174.40K parameters, TP degree 2, batch 2 x 16 tokens, float32

Plan
  key                         modules  style
  ""                                1  AttentionHeads(num_heads=config.n_heads, num_kv_heads=config.kv_heads)
  tok_embeddings                    1  RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
  layers.*.attention                1  PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
  layers.*.attention.wq             1  "colwise"
  layers.*.attention.wk             1  "colwise"
  layers.*.attention.wv             1  "colwise"
  layers.*.attention.wo             1  RowwiseParallel(output_layouts=Shard(1))
  layers.*.feed_forward             1  PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
  layers.*.feed_forward.w1          1  "colwise"
  layers.*.feed_forward.w2          1  RowwiseParallel(output_layouts=Shard(1))
  layers.*.feed_forward.w3          1  "colwise"
  output                            1  ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
  layers.*.attention_norm           1  "sequence_parallel"
  layers.*.attention_dropout        1  "sequence_parallel"
  layers.*.ffn_norm                 1  "sequence_parallel"
  layers.*.ffn_dropout              1  "sequence_parallel"
  norm                              1  "sequence_parallel"

Parameters (per rank: the largest shard, torch.chunk convention)
  parameter                            count  placement    global     per rank  bytes/rank  unsharded
  tok_embeddings.weight                    1  Shard(0)     1001 x 64  501 x 64   125.2 KiB  250.2 KiB
  layers.*.attention_norm.weight           1  Replicate()  64         64             256 B      256 B
  layers.*.attention.wq.weight             1  Shard(0)     64 x 64    32 x 64      8.0 KiB   16.0 KiB
  layers.*.attention.wk.weight             1  Shard(0)     32 x 64    16 x 64      4.0 KiB    8.0 KiB
  layers.*.attention.wv.weight             1  Shard(0)     32 x 64    16 x 64      4.0 KiB    8.0 KiB
  layers.*.attention.wo.weight             1  Shard(1)     64 x 64    64 x 32      8.0 KiB   16.0 KiB
  layers.*.ffn_norm.weight                 1  Replicate()  64         64             256 B      256 B
  layers.*.feed_forward.w1.weight          1  Shard(0)     176 x 64   88 x 64     22.0 KiB   44.0 KiB
  layers.*.feed_forward.w2.weight          1  Shard(1)     64 x 176   64 x 88     22.0 KiB   44.0 KiB
  layers.*.feed_forward.w3.weight          1  Shard(0)     176 x 64   88 x 64     22.0 KiB   44.0 KiB
  norm.weight                              1  Replicate()  64         64             256 B      256 B
  output.weight                            1  Shard(0)     1001 x 64  501 x 64   125.2 KiB  250.2 KiB
  total per rank (50.1% of unsharded)     12                                     341.2 KiB  681.2 KiB

Plan quality (sharded: of the parameters matrix products read, and of their FLOPs in one forward; a block: all its layers)
  block                 linear parameters  matmul FLOPs
  layers.*              100% of 46.08K     100% of 3.08 MFLOP
  (outside the blocks)  100% of 64.06K     100% of 4.10 MFLOP

Collectives per step (model forward and backward, batch 2 x 16; the loss is not included)
  pass      collective              count  bytes each  bytes total  from
  forward   reduce_scatter_tensor       1     8.0 KiB      8.0 KiB  tok_embeddings
  forward   all_reduce                  1        16 B         16 B  tok_embeddings
  forward   all_gather_into_tensor      1     8.0 KiB      8.0 KiB  layers.*.attention
  forward   reduce_scatter_tensor       1     8.0 KiB      8.0 KiB  layers.*.attention.wo
  forward   all_gather_into_tensor      1     8.0 KiB      8.0 KiB  layers.*.feed_forward
  forward   reduce_scatter_tensor       1     8.0 KiB      8.0 KiB  layers.*.feed_forward.w2
  forward   all_gather_into_tensor      1     8.0 KiB      8.0 KiB  output
  forward   all_gather_into_tensor      1   125.2 KiB    125.2 KiB  output
  forward   total                       8                173.3 KiB
  backward  reduce_scatter_tensor       1     8.0 KiB      8.0 KiB  output
  backward  all_gather_into_tensor      1     8.0 KiB      8.0 KiB  layers.*.feed_forward.w2
  backward  reduce_scatter_tensor       1     8.0 KiB      8.0 KiB  layers.*.feed_forward
  backward  all_gather_into_tensor      1     8.0 KiB      8.0 KiB  layers.*.attention.wo
  backward  reduce_scatter_tensor       1     8.0 KiB      8.0 KiB  layers.*.attention
  backward  all_gather_into_tensor      1     8.0 KiB      8.0 KiB  tok_embeddings
  backward  all_reduce                  1       768 B        768 B  (replicated parameters)
  backward  total                       7                 48.8 KiB

Problems
  warning  tok_embeddings.weight: the vocabulary (1001) does not divide by the TP degree 2: shards of 501 and fewer (torch.chunk); the largest is reported. Pad it to 1002 for even shards
  warning  output.weight: the vocabulary (1001) does not divide by the TP degree 2: shards of 501 and fewer (torch.chunk); the largest is reported. Pad it to 1002 for even shards""",  # noqa: E501
        )
        assert report.per_rank_bytes < report.unsharded_bytes
        assert not report.errors

    def test_problems_of_a_broken_plan(self):
        plan = {
            **llama_plan(),
            "layers.*.atention.wq": "colwise",  # a typo
            # the heads arrive sharded: declaring them replicated does not chain
            "layers.*.attention.wo": RowwiseParallel(input_layouts=Replicate()),
            "output": "colwise",  # logits left as vocabulary shards: fine, not a problem
        }
        del plan["layers.*.feed_forward.w3"]  # forgotten: it gets the MLP's input DTensor
        report = plan_report(_meta(tiny_config(n_layers=2)), plan, 4, **_SIZE)
        self.assertExpectedInline(
            "\n".join(f"{p.severity} {p.where}: {p.message}" for p in report.problems),
            """\
error layers.*.atention.wq: parallelize_plan key 'layers.*.atention.wq' matches no submodule: segment 'atention' matches no child of 'layers.0' (children: attention_norm, attention, attention_dropout, ffn_norm, feed_forward, ffn_dropout)
error : cannot apply AttentionHeads(num_heads=config.n_heads, num_kv_heads=config.kv_heads) on '' (Llama): 2 key/value heads do not split over 4 ranks: each rank must hold whole heads. Use a TP degree that divides 2 (1, 2)
error layers.*.attention.wo: the input arrives as a local tensor laid out Shard(2) (from layers.*.attention.wq), but "rowwise_split_input" takes it as Replicate(): the layouts do not chain; change this style's input layout or the producer's output layout
error layers.*.feed_forward.w3: linear gets a DTensor (from layers.*.feed_forward) and a plain tensor of shape (176, 64), which DTensor refuses: give this module a style, or hand it local tensors (use_local_output=True)
error layers.*.attention.wk: its output is viewed as 2 heads of 16, and 2 heads do not divide by the TP degree 4: a rank would hold part of a head. Use a TP degree that divides 2, such as 2
error layers.*.attention.wv: its output is viewed as 2 heads of 16, and 2 heads do not divide by the TP degree 4: a rank would hold part of a head. Use a TP degree that divides 2, such as 2
warning tok_embeddings.weight: the vocabulary (1001) does not divide by the TP degree 4: shards of 251 and fewer (torch.chunk); the largest is reported. Pad it to 1004 for even shards
warning output.weight: the vocabulary (1001) does not divide by the TP degree 4: shards of 251 and fewer (torch.chunk); the largest is reported. Pad it to 1004 for even shards
note layers.*.feed_forward.w3: Linear 176 x 64 is not sharded: every rank holds all of it (2 x 44.0 KiB)""",  # noqa: E501
        )


_SIZE = {"batch_size": 2, "seq_len": 16}


# --------------------------------------------------------------------------- problems


def _messages(report: PlanReport, severity: str = "error") -> str:
    return "\n".join(f"{p.where}: {p.message}" for p in report.problems if p.severity == severity)


def test_colwise_gathered_then_rowwise_does_not_chain():
    with torch.device("meta"):
        mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    plan = {"0": ColwiseParallel(output_layouts=Replicate()), "2": RowwiseParallel()}
    report = plan_report(mlp, plan, 2, batch_size=4, seq_len=1, example_inputs=_features)
    assert _messages(report) == (
        "2: the input arrives as a local tensor laid out Replicate() (from 0), but "
        '"rowwise" takes it as Shard(1): the layouts do not chain; change this style\'s '
        "input layout or the producer's output layout"
    )
    # and a pair that chains costs one all-reduce forward, none backward (input needs none)
    report = plan_report(mlp, {"0": "colwise", "2": "rowwise"}, 2, batch_size=4, seq_len=1,
                         example_inputs=_features)  # fmt: skip
    assert not report.problems
    assert report.counts("forward") == {"all_reduce": 1} and report.counts("backward") == {}


def _features(batch_size: int, seq_len: int) -> torch.Tensor:
    return torch.empty(batch_size, 16)


def test_residual_stream_layouts_must_agree():
    plan = {
        **llama_plan(),
        # the embedding leaves the stream sequence-sharded, the blocks expect it replicated
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    }
    errors = _messages(plan_report(_meta(tiny_config()), plan, 2, **_SIZE))
    assert errors == (
        # the unplanned norm computes on the sequence shard: its gradient would be partial
        "layers.*.attention_norm.weight: the parameter layers.*.attention_norm.weight, which "
        "no plan entry lays out, computes (mul) with a local tensor laid out Shard(1) (from "
        "tok_embeddings): each rank's gradient of it would cover that shard only and nothing "
        "would sum them (a silently wrong gradient). Give its module ReplicateParallel("
        "sum_gradients=True) if it acts on every feature alike, or a style that shards it with "
        "the features\n"
        "layers.*.attention: input 0 arrives as a local tensor laid out Shard(1) (from "
        "tok_embeddings), but PrepareModuleInput(input_layouts=(Replicate(), None), "
        "desired_input_layouts=(Replicate(), None)) takes it as Replicate(): the layouts do not "
        "chain; change this style's input layout or the producer's output layout\n"
        "layers.*: add combines local tensors laid out Shard(1) (from tok_embeddings) and "
        "Replicate() (from layers.*.attention.wo): the layouts do not chain"
    )


class _LearnedActivation(nn.Module):
    """An activation with a learned parameter (apertus' xIELU has two): between a column-
    and a row-parallel layer it sees each rank's features only."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha * F.relu(x)


def _learned_activation_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), _LearnedActivation(), nn.Linear(32, 16))


def test_an_unplanned_parameter_on_sharded_activations_is_an_error():
    with torch.device("meta"):
        mlp = _learned_activation_mlp()
    plan = {"0": "colwise", "2": "rowwise"}
    report = plan_report(mlp, plan, 2, batch_size=4, seq_len=1, example_inputs=_features)
    assert _messages(report).startswith(
        # (per-layer indices read "*": one row for every layer)
        "*.alpha: the parameter *.alpha, which no plan entry lays out, computes (mul) with a "
        "local tensor laid out Shard(1) (from 0)"
    ), _messages(report)
    # replicated with its gradient summed, it is right: no error
    plan["1"] = "replicated_with_grad_allreduce"
    assert not plan_report(mlp, plan, 2, batch_size=4, seq_len=1, example_inputs=_features).errors


def _learned_activation_parity(sum_gradients: bool) -> None:
    torch.manual_seed(0)
    plan = {"0": "colwise", "1": ReplicateParallel(sum_gradients=sum_gradients), "2": "rowwise"}
    check_parity(_learned_activation_mlp(), init_device_mesh(device_type(), (2,)), plan,
                 (torch.randn(4, 16),))  # fmt: skip


def test_the_reported_fix_matches_one_device_and_the_error_was_real():
    run_distributed(_learned_activation_parity, 2, True)
    with pytest.raises(RankError, match="gradient of '1.alpha' differs"):
        run_distributed(_learned_activation_parity, 2, False)


def test_uneven_features_are_a_warning_when_they_chain():
    with torch.device("meta"):
        mlp = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 16))
    plan = {"0": "colwise", "2": "rowwise"}
    report = plan_report(mlp, plan, 2, batch_size=4, seq_len=1, example_inputs=_features)
    assert not report.errors
    assert [(p.severity, p.where) for p in report.problems] == [
        ("warning", "0.weight"),
        ("warning", "0.bias"),
        ("warning", "2.weight"),
    ]
    assert report.problems[2].message == (
        "dim 1 (33) does not divide by the TP degree 2: shards of 17 and fewer (torch.chunk); "
        "the largest is reported. Pad it to 34 for even shards"
    )
    weight = next(g for g in report.parameters if g.name == "2.weight")
    assert (weight.global_shape, weight.local_shape) == ((16, 33), (16, 17))


def test_tied_weights_cannot_be_sharded():
    model = _meta(tiny_config())
    model.output.weight = model.tok_embeddings.weight
    plan = {"tok_embeddings": "embedding_rowwise"}
    assert _messages(plan_report(model, plan, 2, **_SIZE)) == (
        "tok_embeddings: its parameter 'weight' (Shard(dim=0) here) is shared with "
        "'output.weight' (not in the plan) (tied weights); sharding it differently, or in one "
        "place only, would untie them: give every module holding it a style that lays it out "
        "alike"
    )


def test_sequence_length_must_divide_under_sequence_parallelism():
    plan = llama_plan(sequence_parallel=True)
    report = plan_report(_meta(tiny_config()), plan, 2, batch_size=2, seq_len=15)
    assert "tok_embeddings: the output is a local tensor sharded on dim 1 of size 15" in (
        _messages(report)
    )
    assert "make it a multiple of 2 (e.g. 16" in _messages(report)


def test_unsupported_module_type_is_an_error():
    plan = {"layers.0.attention": ColwiseParallel()}
    report = plan_report(_meta(tiny_config()), plan, 2, **_SIZE)
    assert "cannot apply \"colwise\" on 'layers.0.attention' (Attention)" in _messages(report)


def test_unsharded_layers_are_noted_with_their_size():
    report = plan_report(_meta(tiny_config()), {"layers.*.attention.wq": "colwise"}, 2, **_SIZE)
    # and q alone split into local heads meets whole k and v in the attention
    assert _messages(report) == (
        "layers.*.attention: scaled_dot_product_attention combines local tensors laid out "
        "Shard(2) (from layers.*.attention.wq) and Replicate() (from the model input): the "
        "layouts do not chain"
    )
    notes = _messages(report, "note")
    assert "output: Linear 1001 x 64 is not sharded: every rank holds all of it (250.2 KiB)" in (
        notes
    )
    assert "tok_embeddings: Embedding 1001 x 64 is not sharded" in notes
    assert "layers.*.feed_forward.w1: Linear 176 x 64 is not sharded" in notes


def test_llama3_8b_at_tp16_cannot_split_kv_heads():
    from torch_tp.cli.plan import llama3_8b_config

    report = plan_report(_meta(llama3_8b_config()), llama_plan(), 16, batch_size=1, seq_len=64)
    assert "8 heads do not divide by the TP degree 16" in _messages(report)
    assert "32 heads" not in _messages(report)


def test_model_must_be_on_meta_and_is_left_unchanged():
    with pytest.raises(ValueError, match="meta device"):
        plan_report(Llama(tiny_config()), llama_plan(), 2, **_SIZE)
    with pytest.raises(ValueError, match="tp_degree"):
        plan_report(_meta(tiny_config()), llama_plan(), 0, **_SIZE)
    model = _meta(tiny_config())
    before = {name: (p.dtype, p.shape) for name, p in model.named_parameters()}
    plan_report(model, llama_plan(sequence_parallel=True), 2, dtype=torch.bfloat16, **_SIZE)
    assert {name: (p.dtype, p.shape) for name, p in model.named_parameters()} == before
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert not isinstance(module.weight if hasattr(module, "weight") else None, DTensor)


# --------------------------------------------------------------------------- command line


def _run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli(["plan", *argv])
    return status, out.getvalue()


def test_cli_built_in_model():
    status, out = _run_cli("--model", "llama-tiny", "--tp", "2", "--seq-len", "16")
    assert status == 0
    assert out.startswith("Plan report: Llama, 220.61K parameters, TP degree 2, batch 1 x 16")
    status, out = _run_cli("--tp", "4", "--seq-len", "16")  # 2 kv heads over 4 ranks
    assert status == 1 and "2 heads do not divide by the TP degree 4" in out


def test_cli_user_model_and_json_plan(tmp_path):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(to_dict(llama_plan(sequence_parallel=True))))
    status, by_json = _run_cli(
        "--model", "torch_tp.models:Llama", "--plan", str(plan_file), "--tp", "2", "--seq-len", "64"
    )
    assert status == 0
    status, by_flag = _run_cli("--model", "torch_tp.models:Llama", "--plan", "llama",
                               "--sequence-parallel", "--tp", "2", "--seq-len", "64")  # fmt: skip
    assert status == 0 and by_json == by_flag
    status, by_module = _run_cli(
        "--model", "torch_tp.models:Llama", "--plan", "torch_tp.plans.llama:llama_plan",
        "--tp", "2", "--seq-len", "64",
    )  # fmt: skip
    assert status == 0 and by_module != by_flag


def test_cli_automatic_plan():
    """``--plan auto`` reports the inferred plan; on the reference model it shards every
    parameter as the ready plan does, so the memory table is the same."""
    status, by_auto = _run_cli("--model", "llama-tiny", "--plan", "auto", "--tp", "2",
                               "--seq-len", "16")  # fmt: skip
    assert status == 0
    status, by_ready = _run_cli("--model", "llama-tiny", "--tp", "2", "--seq-len", "16")
    assert status == 0

    def parameters(out: str) -> str:
        return out[out.index("\nParameters") : out.index("\nCollectives")]

    assert parameters(by_auto) == parameters(by_ready)


def test_cli_automatic_plan_refusal(capsys):
    """``--plan auto`` refuses, with the reason, a degree that does not divide the heads."""
    argv = ["plan", "--model", "llama-tiny", "--plan", "auto", "--tp", "4", "--seq-len", "16"]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert "error: ValueError" in err and "layers.*.attention" in err, err


def test_cli_errors(capsys):
    assert cli(["plan", "--model", "nope", "--tp", "2"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert cli(["plan", "--model", "torch_tp.models:Llama", "--tp", "2"]) == 2
    assert "--plan is required" in capsys.readouterr().err


@pytest.mark.slow  # the quick run stays under 2 minutes
def test_docs_example_is_the_cli_output():
    """docs/plans.md shows the report of Llama-3-8B at TP=8; it must be what the CLI prints."""
    docs = (ROOT / "docs" / "plans.md").read_text(encoding="utf-8")
    match = re.search(r"```sh\n\$ python -m torch_tp plan ([^\n]*)\n```\n+```text\n(.*?)```", docs,
                      flags=re.S)  # fmt: skip
    assert match, "docs/plans.md has no example of `python -m torch_tp plan`"
    argv = match.group(1).split()
    status, out = _run_cli(*argv)
    assert status == 0
    assert out == match.group(2)
    # and the problems the same command shows at TP=16
    problems = re.search(r"At TP=16 .*?```text\n(.*?)```", docs, flags=re.S)
    assert problems, "docs/plans.md shows no problems at TP=16"
    status, out = _run_cli(*argv[: argv.index("--tp") + 1], "16", *argv[argv.index("--tp") + 2 :])
    assert status == 1
    assert out.endswith(problems.group(1))
