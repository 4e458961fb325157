"""torch_tp.checkpoint with mixture-of-experts parameters.

Expert parallelism (``ExpertParallel``) places every stacked expert parameter as ``Shard(0)``:
each rank holds whole experts. Tensor-parallel experts (``TensorParallelExperts``) place
``gate_up_proj [E, 2I, H]`` as DTensor's strided shard of dim 1 (each rank: its slice of every
expert's gate rows and of its up rows) and ``down_proj [E, H, I]`` as ``Shard(2)``. A
reference MoE Llama is saved on one layout (a DCP checkpoint, and a full state dict written
to a safetensors file) and loaded on the others; every value, the optimizer's included, must
arrive exactly, each rank's shard must be what ``distribute_tensor`` gives it, a safetensors
load must read only the bytes of this rank's slices, and the loaded model's logits must be
the saved model's. The layouts: ``"ep"`` and ``"tp"`` over every rank, ``"fsdp-ep"`` and
``"fsdp-tp"`` the same on the ``tp`` dim of a (dp=2, tp=2) mesh with FSDP2 on ``dp`` (which
splits the experts, dim 0, again), ``"etp"``, ``"etp-ep"`` and ``"etp-tp"``, the experts
``ExpertTensorParallel`` on an (ep, tp) mesh of (2, 2), (2, 1) and (1, 2) (whole experts over
ep, each one's hidden dimension over tp: ``(Shard(0), p)``), ``"fsdp-etp"`` the same on a
(dp=2, ep=2, tp=2) mesh with FSDP2 over dp for the experts and over dp x ep for the rest, and
``"one"``, a single device.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from helpers import perturb_norms, safetensors_reads, tp_mesh
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torch_tp import ExpertTensorParallel, checkpoint, parallelize_module
from torch_tp._torch_compat import StridedShard
from torch_tp.checkpoint._staging import full_tensor
from torch_tp.models import MoEConfig, MoELlama
from torch_tp.plans.moe import moe_llama_plan
from torch_tp.testing import device_type, run_distributed

CONFIG = {
    "dim": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 4,
    "n_experts": 4,
    "expert_hidden_dim": 16,
    "shared_expert_hidden_dim": 16,
    "max_seq_len": 16,
}
EXPERTS = [
    f"layers.{i}.feed_forward.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")
]
# ExpertTensorParallel's layouts: experts over ep and each expert's matrices over tp, (ep, tp)
ETP = {"etp": (2, 2), "etp-ep": (2, 1), "etp-tp": (1, 2)}


def _model(
    seed: int = 0, layout: str = "one", meta: bool = False, vocab_size: int | None = None
) -> MoELlama:
    """The reference MoE Llama in float64 (routing must not flip between layouts), with
    experts far from zero and perturbed norms, laid out as ``layout``."""
    torch.manual_seed(seed)
    config = CONFIG if vocab_size is None else {**CONFIG, "vocab_size": vocab_size}
    with torch.device("meta" if meta else "cpu"):
        model = MoELlama(MoEConfig(**config)).double()
    if not meta:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".experts." in name:
                    param.normal_(std=0.2)
        perturb_norms(model)
    if layout == "fsdp-etp":
        mesh = init_device_mesh(device_type(), (2, 2, 2), mesh_dim_names=("dp", "ep", "tp"))
        data = mesh["dp", "ep"]._flatten("dp_ep")
        plan = moe_llama_plan(experts="tp", shared_expert=True)
        tp_experts = plan.pop("layers.*.feed_forward.experts")
        parallelize_module(model, mesh["tp"], plan)
        etp = ExpertTensorParallel(output_layouts=tp_experts.output_layouts)
        parallelize_module(model, mesh["ep", "tp"], {"layers.*.feed_forward.experts": etp})
        for block in model.layers:
            fully_shard(block.feed_forward.experts, mesh=mesh["dp"])
            # summed over the ep ranks' tokens, then averaged over dp: the mean over dp x ep
            block.feed_forward.experts.set_gradient_divide_factor(float(data.size()))
            fully_shard(block, mesh=data)
        fully_shard(model, mesh=data)
    elif layout in ETP:
        mesh = init_device_mesh(device_type(), ETP[layout], mesh_dim_names=("ep", "tp"))
        plan = moe_llama_plan(experts="tp", shared_expert=True)
        # the block sums the experts' output with the shared expert's: as the plan's
        # tensor-parallel experts, they leave theirs partial
        tp_experts = plan.pop("layers.*.feed_forward.experts")
        parallelize_module(model, mesh["tp"], plan)
        etp = ExpertTensorParallel(output_layouts=tp_experts.output_layouts)
        parallelize_module(model, mesh, {"layers.*.feed_forward.experts": etp})
    elif layout != "one":
        experts = layout.removeprefix("fsdp-")
        plan = moe_llama_plan(experts=experts, shared_expert=True)
        if layout == experts:
            parallelize_module(model, tp_mesh(), plan)
        else:
            mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh["tp"], plan)
            for block in model.layers:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
    if meta:
        model.to_empty(device=device_type())
        model.rope_cache = model._rope_table(torch.device(device_type()))
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 1001, (2, 8), generator=torch.Generator().manual_seed(0))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    logits = model(_tokens())
    F.cross_entropy(logits.flatten(0, 1), _tokens().roll(1, -1).flatten()).backward()
    _average_over_ep(model)
    optim.step()
    optim.zero_grad()


def _average_over_ep(model: nn.Module) -> None:
    """Under ExpertTensorParallel the ep ranks are data-parallel replicas (here with the same
    tokens): average their gradients, as FSDP2 or DDP over ep would. The other parameters'
    differ between them by rounding only (each ep rank's rows sit elsewhere in its experts'
    batches), but replicas must agree to be saved; the experts' is a sum over the ep ranks'
    tokens."""
    grid = [p.device_mesh for p in model.parameters() if getattr(p, "device_mesh", None)]
    grid = next((mesh for mesh in grid if mesh.mesh_dim_names == ("ep", "tp")), None)
    if grid is None:
        return
    ep = grid["ep"]
    for param in model.parameters():
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        if isinstance(param, DTensor) and param.device_mesh == grid:  # an expert
            grad.div_(ep.size())
        else:
            dist.all_reduce(grad, group=ep.get_group())
            grad.div_(ep.size())


def _snapshot(model: nn.Module, optim: torch.optim.Optimizer | None = None) -> dict:
    """The single-device values of the model (and optimizer) and the model's logits."""
    with torch.no_grad():
        logits = model(_tokens())
    out = {"model": checkpoint.full_state_dict(model), "logits": logits}
    if optim is not None:
        _, state = get_state_dict(model, optim)
        out["optim"] = {  # gathered as full_state_dict gathers (torch's fails on fsdp-etp)
            f"{fqn}.{key}": full_tensor(value) if isinstance(value, DTensor) else value
            for fqn, entry in state["state"].items()
            for key, value in entry.items()
        }
    return out


def _assert_same(actual: dict, expected: dict) -> None:
    for part in ("model", "optim"):
        if part not in expected:
            continue
        assert list(actual[part]) == list(expected[part]), part
        for name, value in expected[part].items():
            torch.testing.assert_close(actual[part][name], value, rtol=0, atol=0, msg=name)
    # the same weights, another summation order (EP and TP split the experts' sums
    # differently); float64 makes the difference tiny
    torch.testing.assert_close(actual["logits"], expected["logits"], rtol=1e-10, atol=1e-12)


def _assert_shards(model: nn.Module, layout: str, expected: dict[str, torch.Tensor]) -> None:
    """Each rank holds what ``distribute_tensor`` of the full tensor gives it (under FSDP2:
    its chunk of that), and the expert parameters have the placements under test."""
    state = model.state_dict()
    for name in EXPERTS:
        if layout in ETP or layout == "fsdp-etp":  # whole experts, each one's hidden dim
            split = StridedShard(1, split_factor=2) if name.endswith("gate_up_proj") else Shard(2)
            want = (Shard(0), split)
        elif layout.endswith("ep"):
            want = (Shard(0),)
        elif name.endswith("gate_up_proj"):
            want = (StridedShard(1, split_factor=2),)
        else:
            want = (Shard(2),)
        if layout == "fsdp-etp":  # FSDP2 over dp splits dim 0 of each ep shard
            want = (StridedShard(0, split_factor=2),) + want
        elif layout.startswith("fsdp-"):  # FSDP2 splits dim 0 of each tensor-parallel shard
            want = ((StridedShard(0, split_factor=2),) if want[0].dim == 0 else (Shard(0),)) + want
        assert state[name].placements == want, (name, state[name].placements)
    for name, value in state.items():
        if not isinstance(value, DTensor):
            continue
        mesh, placements = value.device_mesh, value.placements
        if layout == "fsdp-etp":  # torch's own split, as FSDP2 holds it (dims even here)
            want = distribute_tensor(expected[name], mesh, placements, src_data_rank=None)
            want = want.to_local()
        elif mesh.mesh_dim_names == ("dp",):  # FSDP2 alone (a parameter TP leaves alone)
            want = expected[name].chunk(mesh.size(), dim=0)[mesh.get_local_rank()]
        elif layout.startswith("fsdp-"):
            # the tensor-parallel shard, then FSDP2's chunk of its dim 0
            tp = distribute_tensor(expected[name], mesh["tp"], placements[1:]).to_local()
            want = tp.chunk(mesh["dp"].size(), dim=0)[mesh["dp"].get_local_rank()]
        else:
            want = distribute_tensor(expected[name], mesh, placements).to_local()
        torch.testing.assert_close(value.to_local(), want, rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------- distributed checkpoints


def _dcp_save(ckpt_dir: str, layout: str, vocab_size: int | None = None) -> dict:
    """Train one step on ``layout`` and save step 1."""
    model = _model(layout=layout, vocab_size=vocab_size)
    optim = _adamw(model)
    _train_step(model, optim)
    checkpoint.save(ckpt_dir, model, optim, step=1)
    return _snapshot(model, optim)


def _dcp_load(ckpt_dir: str, layout: str, vocab_size: int | None = None) -> dict:
    """Load step 1 into another init on ``layout``, with optimizer state to overwrite."""
    model = _model(seed=1, layout=layout, vocab_size=vocab_size)
    optim = _adamw(model)
    _train_step(model, optim)
    assert checkpoint.load(ckpt_dir, model, optim, rng=False) == 1
    out = _snapshot(model, optim)
    if layout != "one":
        _assert_shards(model, layout, out["model"])
    return out


# where each saved checkpoint is loaded (beside a single device)
DCP_TARGETS = {
    ("ep", 2): [("ep", 4), ("tp", 2), ("tp", 4), ("fsdp-ep", 4), ("fsdp-tp", 4), ("etp", 4)],
    ("tp", 2): [("ep", 2), ("ep", 4)],
    ("fsdp-tp", 4): [("ep", 2), ("tp", 4)],
    ("etp", 4): [("ep", 2), ("tp", 4), ("etp-ep", 2), ("etp-tp", 2)],
}


@pytest.mark.parametrize(
    "saved_on",
    # each saves once and loads in several layouts at 2 and 4 ranks: seconds each; the
    # quick run (-m "not slow") keeps the full-state-dict and safetensors tests
    [pytest.param(s, marks=pytest.mark.slow) for s in DCP_TARGETS],
    ids=lambda s: f"{s[0]}{s[1]}",
)
def test_dcp_between_expert_layouts(tmp_path, saved_on):
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_dcp_save, saved_on[1], ckpt, saved_on[0])[0]
    assert list(saved["model"]) == list(_model().state_dict())
    targets = DCP_TARGETS[saved_on]
    for layout, world_size in targets:
        for loaded in run_distributed(_dcp_load, world_size, ckpt, layout):
            _assert_same(loaded, saved)
    _assert_same(_dcp_load(ckpt, "one"), saved)  # this process, without a process group


def _uneven_fsdp_etp(ckpt_dir: str) -> tuple[dict, str]:
    """The full state dict of fsdp-etp with the 1001-row vocabulary, and the error saving it
    to DCP raises: torch would place rank 6's FSDP2 chunk of the embedding's tensor-parallel
    shard (rows 378-500: 123 of them) at another offset and size."""
    model = _model(layout="fsdp-etp")
    full = checkpoint.full_state_dict(model)
    with pytest.raises(NotImplementedError) as caught:
        checkpoint.save(ckpt_dir, model, step=1)
    return full, str(caught.value)


def _load_then_uneven(ckpt_dir: str, vocab_size: int, uneven_dir: str) -> tuple:
    return (_dcp_load(ckpt_dir, "fsdp-etp", vocab_size), *_uneven_fsdp_etp(uneven_dir))


@pytest.mark.slow  # eight ranks
def test_dcp_and_full_state_dicts_of_experts_over_dp_ep_tp(tmp_path):
    """(dp2, ep2, tp2), FSDP2 on top: the experts' dim 0 split by ep and then by FSDP2's
    strided shard over dp, their packed dim 1 over tp. DCP saves and loads it exactly, to
    and from (ep, tp) and one device, and full state dicts gather it; with a vocabulary
    FSDP2 splits unevenly, DCP (which would misplace the rows) is refused on every rank
    before anything is written, naming the tensor, and the full state dict still gathers."""
    even = 1024  # the rows split evenly by tp x dp x ep
    ckpt = str(tmp_path / "from-fsdp-etp")
    saved = run_distributed(_dcp_save, 8, ckpt, "fsdp-etp", even)[0]
    for loaded in run_distributed(_dcp_load, 4, ckpt, "etp", even):
        _assert_same(loaded, saved)
    _assert_same(_dcp_load(ckpt, "one", even), saved)
    ckpt = str(tmp_path / "to-fsdp-etp")
    saved = run_distributed(_dcp_save, 4, ckpt, "etp", even)[0]
    expected = _gather("one")["model"]
    # one launch of eight ranks: the load into fsdp-etp, then the uneven vocabulary
    runs = run_distributed(_load_then_uneven, 8, ckpt, even, str(tmp_path / "uneven"))
    for loaded, _, _ in runs:
        _assert_same(loaded, saved)
    for _, full, error in runs:
        assert list(full) == list(expected)
        for name, value in expected.items():
            torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=name)
        # ranks 6 and 7 hold FSDP2's short chunks (123 and 125 rows): each raises its own
        # error, the others rank 6's
        assert re.search(r"tok_embeddings\.weight: rank [67] holds indices", error), error
    assert not (tmp_path / "uneven" / "step-1").exists()


# ------------------------------------------------------------------------ full state dicts


def _gather(layout: str) -> dict:
    """The full state dict and the logits of the reference model laid out as ``layout``."""
    return _snapshot(_model(layout=layout))


def _load_file(path: str, layout: str, expected: dict) -> dict[str, int]:
    """Load the safetensors file into an empty (meta-built) model on ``layout``: only this
    rank's slices are read. Returns the bytes read, per expert parameter and in all."""
    model = _model(layout=layout, meta=True)
    with safetensors_reads() as reads:
        result = checkpoint.load_full_state_dict(model, path)
    assert result.missing_keys == [] and result.unexpected_keys == []
    if layout != "one":
        _assert_shards(model, layout, expected["model"])
    _assert_same(_snapshot(model), expected)
    # nothing beyond this rank's slices: one read per expert block (EP: its experts), one
    # per part of the strided gate_up_proj (TP: its slice of every expert's gate rows, and
    # of their up rows)
    for name, value in model.state_dict().items():
        local = value.to_local() if isinstance(value, DTensor) else value
        assert sum(reads[name]) == local.numel(), (name, reads[name], local.shape)
        if name in EXPERTS:
            parts = 2 if layout.endswith("tp") and name.endswith("gate_up_proj") else 1
            assert len(reads[name]) == parts, (name, reads[name])
    itemsize = torch.float64.itemsize
    bytes_read = {name: sum(reads[name]) * itemsize for name in EXPERTS}
    bytes_read["total"] = sum(sum(sizes) for sizes in reads.values()) * itemsize
    return bytes_read


def _load_full(path: str, layout: str, expected: dict) -> dict[str, int]:
    """Load the full state dict from the file, from a dict on every rank and from rank 0
    only; returns what :func:`_load_file` does."""
    bytes_read = _load_file(path, layout, expected)
    model = _model(seed=1, layout=layout)
    checkpoint.load_full_state_dict(model, expected["model"])
    _assert_shards(model, layout, expected["model"])
    _assert_same(_snapshot(model), expected)
    model = _model(seed=1, layout=layout)
    source = expected["model"] if dist.get_rank() == 0 else None
    checkpoint.load_full_state_dict(model, source, broadcast_from_rank0=True)
    _assert_shards(model, layout, expected["model"])
    _assert_same(_snapshot(model), expected)
    return bytes_read


LAYOUTS = [
    ("ep", 2),
    ("ep", 4),
    ("tp", 2),
    ("tp", 4),
    ("fsdp-ep", 4),
    ("fsdp-tp", 4),
    ("etp", 4),
    ("etp-tp", 2),
]


@pytest.mark.parametrize(
    ("layout", "world_size"),
    # at 4 ranks in the full run only: the quick run stays under 2 minutes
    [(lay, n) if n == 2 else pytest.param(lay, n, marks=pytest.mark.slow) for lay, n in LAYOUTS],
)
def test_full_state_dict_of_expert_layouts(layout, world_size):
    expected = _model().state_dict()
    for gathered in run_distributed(_gather, world_size, layout):
        assert list(gathered["model"]) == list(expected)
        for name, value in expected.items():
            torch.testing.assert_close(gathered["model"][name], value, rtol=0, atol=0)


@pytest.fixture(scope="module")
def ep2_file(tmp_path_factory) -> tuple[str, dict]:
    """The safetensors file of an EP=2 job's full state dict, and that job's values and
    logits. (Every layout gathers the same state dict, bit for bit, so a file written from
    tensor-parallel experts is this file.)"""
    saved = run_distributed(_gather, 2, "ep")[0]
    path = tmp_path_factory.mktemp("moe") / "moe.safetensors"
    save_file(saved["model"], str(path))
    return str(path), saved


@pytest.mark.parametrize(
    ("layout", "world_size"),
    [c if c[1] == 2 else pytest.param(*c, marks=pytest.mark.slow) for c in LAYOUTS],
)
def test_safetensors_shard_on_load(ep2_file, layout, world_size):
    path, saved = ep2_file
    per_rank = run_distributed(_load_full, world_size, path, layout, saved)
    whole = {name: value.numel() * value.itemsize for name, value in saved["model"].items()}
    for rank, bytes_read in enumerate(per_rank):
        print(f"{layout}={world_size} rank {rank}: {bytes_read}")
        for name in EXPERTS:  # 1/world_size of each expert parameter, no more
            assert bytes_read[name] * world_size == whole[name], (rank, name, bytes_read)
        assert bytes_read["total"] < sum(whole.values())


def test_safetensors_on_one_device(ep2_file):
    path, saved = ep2_file
    bytes_read = _load_file(path, "one", saved)  # this process, without a process group
    assert bytes_read["total"] == sum(v.numel() * v.itemsize for v in saved["model"].values())
