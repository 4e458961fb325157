"""The dry-run report of a context-parallel plan: :class:`torch_tp.ContextParallel` on the
mesh's ``cp`` dimension (its contract's ``mesh_dims``), alone or beside tensor parallelism.

:func:`torch_tp.report.plan_report` given the mesh's shape (``{"cp": 2, "tp": 2}``) traces the
model on ``seq_len / cp`` tokens per rank (the dense collectives over ``tp`` are those of a
rank's tokens), and reports, for each ``F.scaled_dot_product_attention`` call inside a
context-parallel module, the ring's transfers over ``cp`` (``send_recv`` per point-to-point
send, or the all-gathers and the reduce-scatter), sized by :func:`torch_tp._ring.ring_volume`
for the call's local heads. The predictions are compared with a measured run at cp=2: the
sends and collectives per kind over ``cp``, forward and backward, and their bytes.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import torch_tp
from torch_tp import ContextParallel, sequence_positions, shard_sequence
from torch_tp.models import Llama, tiny_config
from torch_tp.plans.llama import llama_plan
from torch_tp.report import Collective, plan_report
from torch_tp.testing import device_type, run_distributed

BATCH, SEQ = 2, 16
CONFIG = tiny_config(n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
ATTENTION, BLOCK = "layers.*.attention", "layers.*"
HEAD_DIM = CONFIG.dim // CONFIG.n_heads


def _meta_model() -> Llama:
    with torch.device("meta"):
        return Llama(CONFIG).double()


def _report(shape, rotation="p2p", tp=False, **kwargs):
    if tp:  # on the blocks: llama_plan has its own style on the attention modules
        plan = {**llama_plan(), BLOCK: ContextParallel(rotation=rotation)}
    else:
        plan = {ATTENTION: ContextParallel(rotation=rotation)}
    kwargs = {"batch_size": BATCH, "seq_len": SEQ, "device_type": "cpu", **kwargs}
    return plan_report(_meta_model(), plan, shape, **kwargs)


def _ring_rows(rotation: str, cp: int, heads: int, where: str = ATTENTION) -> list[Collective]:
    """The ring's rows for the reference Llama (grouped-query attention: ``heads`` key/value
    heads reach the ring), float64: each rank's packed k and v block, and its
    gradient (float64 too); forward, with its rank's verdict (one element more)."""
    kv = BATCH * heads * (SEQ // cp) * 2 * HEAD_DIM * 8
    layers, at = CONFIG.n_layers, where
    if rotation == "p2p":  # cp - 1 sends forward; cp - 1 of kv and cp of gradients backward
        return [
            Collective("forward", "send_recv", at, layers * (cp - 1), kv + 8, "cp"),
            Collective("backward", "send_recv", at, layers * (2 * cp - 1), kv, "cp"),
        ]
    return [
        Collective("forward", "all_gather_into_tensor", at, layers, cp * (kv + 8), "cp"),
        Collective("backward", "reduce_scatter_tensor", at, layers, cp * kv, "cp"),
        Collective("backward", "all_gather_into_tensor", at, layers, cp * kv, "cp"),
    ]


# --------------------------------------------------------------------------- on meta


@pytest.mark.parametrize("rotation", ["p2p", "allgather"])
def test_cp2_rows(rotation):
    """cp alone: only the ring moves anything, over cp; the model traced on 8 of 16 tokens;
    parameters whole on every rank; the attention's saved activations half one device's."""
    report = _report({"cp": 2}, rotation)
    assert report.collectives == _ring_rows(rotation, 2, CONFIG.n_kv_heads)
    assert report.tokens_per_rank == SEQ // 2 and report.tp_degree == 1
    assert report.per_rank_bytes == report.unsharded_bytes
    # per layer, per rank: q and output (B x H x S/cp x D each), k and v (B x Hkv x S/cp x
    # D) and the log-sum-exp
    local = BATCH * CONFIG.n_heads * (SEQ // 2)
    local_kv = BATCH * CONFIG.n_kv_heads * (SEQ // 2)
    saved = CONFIG.n_layers * ((2 * local + 2 * local_kv) * HEAD_DIM + local) * 8
    assert report.attention_activations == (saved, 2 * saved)
    assert not report.errors
    assert any("Parameters are not sharded over cp" in p.message for p in report.problems)
    text = str(report)
    assert "mesh cp 2 (2 ranks), batch 2 x 16 tokens, 8 per rank, float64" in text
    assert "Attention activations saved for backward: " in text


@pytest.mark.parametrize("rotation", ["p2p", "allgather"])
def test_cp2_tp2_rows(rotation):
    """cp x tp: the ring of each rank's heads (half of them) over cp; over tp, exactly the
    collectives of the tensor-parallel plan on a rank's 8 tokens."""
    report = _report({"cp": 2, "tp": 2}, rotation, tp=True)
    assert [c for c in report.collectives if c.mesh_dim == "cp"] == _ring_rows(
        rotation, 2, CONFIG.n_kv_heads // 2, BLOCK
    )
    tp_only = plan_report(
        _meta_model(), llama_plan(), {"tp": 2}, batch_size=BATCH, seq_len=SEQ // 2,
        device_type="cpu",
    )  # fmt: skip
    assert [c for c in report.collectives if c.mesh_dim == "tp"] == tp_only.collectives
    assert report.parameters == tp_only.parameters
    assert not report.errors


def test_cp_plans_refused_clearly():
    with pytest.raises(ValueError, match=r"'layers.0.attention' splits the sequence over the 4 "):
        _report({"cp": 4}, seq_len=12)  # 12 % 8
    with pytest.raises(
        ValueError, match=r"'layers.0' splits the sequence over the 2 ranks of 'cp' in 4"
    ):
        _report({"cp": 2, "tp": 2}, tp=True, seq_len=10)
    # an int degree: the cp dimension is not given
    with pytest.raises(NotImplementedError, match="give plan_report the mesh's shape"):
        _report(2, tp=True)
    with pytest.raises(ValueError, match=r"has no dimension 'cp'.*\{'cp': 2, 'tp': 2\}"):
        _report({"tp": 2}, tp=True)
    with pytest.raises(ValueError, match="must end with the dimension 'tp'"):
        _report({"cp": 2}, tp=True)


# --------------------------------------------------------------------------- measured


class _Sent(TorchDispatchMode):
    """Count and bytes per (kind, mesh dimension) of every send and collective, as the report
    counts them (a send's bytes; the whole tensor gathered or reduced)."""

    def __init__(self, dims: dict[str, str]) -> None:
        super().__init__()
        self.dims = dims  # process group name -> mesh dimension
        self.counts: Counter[tuple[str, str]] = Counter()
        self.bytes: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c10d = torch.ops.c10d

        def add(kind: str, group, nbytes: int) -> None:
            key = (kind, self.dims[dist.ProcessGroup.unbox(group).group_name])
            self.counts[key] += 1
            self.bytes[key] += nbytes

        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        if func is c10d.send.default:  # ([tensors], group, dst, tag)
            add("send_recv", args[1], sum(size(t) for t in args[0]))
        elif func is c10d._allgather_base_.default:  # (output, input, group, ...)
            add("all_gather_into_tensor", args[2], size(args[0]))
        elif func is c10d._reduce_scatter_base_.default:  # (output, input, group, ...)
            add("reduce_scatter_tensor", args[2], size(args[1]))
        elif func is c10d.allreduce_.default:  # ([tensors], group, op, ...)
            add("all_reduce", args[1], sum(size(t) for t in args[0]))
        return func(*args, **(kwargs or {}))


def _measure() -> dict:
    mesh = init_device_mesh(device_type(), (2,), mesh_dim_names=("cp",))
    dims = {mesh.get_group().group_name: "cp"}
    found = {}
    for rotation in ("p2p", "allgather"):
        torch.manual_seed(0)
        model = Llama(CONFIG).double()
        torch_tp.parallelize_module(model, mesh, {ATTENTION: ContextParallel(rotation=rotation)})
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
        with _Sent(dims) as forward:
            out = model(shard_sequence(tokens, mesh), positions=sequence_positions(SEQ, mesh))
        with _Sent(dims) as backward:
            out.sum().backward()
        found[rotation] = {
            phase: (dict(mode.counts), dict(mode.bytes))
            for phase, mode in (("forward", forward), ("backward", backward))
        }
    return found


def test_predicted_ring_equals_measured():
    """At cp=2 on two ranks, both rotations: every send and collective over cp, forward and
    backward, as many and as large as the report predicts."""
    per_rank = run_distributed(_measure, 2)
    for rotation in ("p2p", "allgather"):
        report = _report({"cp": 2}, rotation, device_type=device_type())
        for phase in ("forward", "backward"):
            predicted = (
                {(kind, "cp"): n for kind, n in report.counts(phase, "cp").items()},
                {(kind, "cp"): n for kind, n in report.bytes(phase, "cp").items()},
            )
            for rank, measured in enumerate(per_rank):
                assert measured[rotation][phase] == predicted, (rotation, phase, rank)
