"""Errors raised inside a parallelized module's forward carry the plan's context.

A hand-written plan that ``parallelize_module`` accepts can still be wrong where the model's
own code meets it. The first-forward check refuses most such plans before they run
(test_forward_check.py); what it cannot see, or where it is off, fails in the forward. There
the error keeps its type and aten's message, chains aten's exception, and goes on to name
the module whose forward raised, the user's source line, the style of that module or of the
planned modules inside it with the layouts each takes and hands on, and the likely cause.

Tried on the mistakes of the issue (the attention view with the whole model's head count, an
MLP with its styles swapped or with two column-parallel layers), and on five more written as
public code writes them: multi-query attention (one key/value head) at two ranks, a per-head
parameter the plan leaves whole, a column-parallel ``lm_head`` before transformers' own loss,
a ``use_local_output=False`` output added to a plain residual, and a tied weight read
directly. Each runs on two ranks, and every rank raises alike.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import tiny_hf_llama
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.testing import assert_close

import torch_tp
from torch_tp import ColwiseParallel, LocalParamsParallel, RowwiseParallel
from torch_tp.testing import device_type, run_distributed


class _MLP(nn.Module):
    """An MLP as public codebases write it (nanoGPT's ``c_fc`` / ``c_proj``)."""

    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(32, 64)
        self.c_proj = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(torch.nn.functional.gelu(self.c_fc(x)))


def _first_forward_error(plan: dict, model: nn.Module | None = None, **kw) -> Exception:
    """The exception the first forward of ``model`` (default: the MLP) raises under ``plan``,
    the first-forward check off unless ``check_forward=True`` is passed."""
    mesh = init_device_mesh(device_type(), (2,))
    torch.manual_seed(0)
    model = _MLP() if model is None else model
    # the first-forward check refuses most such plans before they run (test_forward_check);
    # this is what the forward itself says where the check is off or cannot see
    check = kw.pop("check_forward", False)
    inputs = kw.pop("inputs", None)
    model = torch_tp.parallelize_module(model, mesh, plan, check_forward=check)
    with pytest.raises(Exception) as info:
        model(*(inputs if inputs is not None else (torch.randn(2, 8, 32),)), **kw)
    return info.value


def _swapped_styles() -> None:
    err = _first_forward_error({"c_fc": RowwiseParallel(), "c_proj": ColwiseParallel()})
    message = str(err)
    assert "RowwiseParallel" in message and "on 'c_fc' (Linear)" in message, message
    assert "has 32 features" in message and "takes 16 (of 32)" in message, message
    assert "ColwiseParallel" in message and "input_layouts=Replicate()" in message, message
    assert isinstance(err.__cause__, RuntimeError)
    assert "cannot be multiplied" in str(err.__cause__)
    # torch_tp's own error, raised once: no second context after it
    assert "raised in the forward of" not in message and not getattr(err, "__notes__", ())


def _two_column_parallel_layers() -> None:
    err = _first_forward_error({"c_fc": ColwiseParallel(), "c_proj": ColwiseParallel()})
    message = str(err)
    assert "ColwiseParallel" in message and "on 'c_proj' (Linear)" in message, message
    assert "has 32 features" in message and "takes 64 (of 64)" in message, message
    assert "RowwiseParallel" in message and "input_layouts=Shard(-1)" in message, message


def _other_errors_keep_their_message() -> None:
    # the sizes match and the plan chains: aten's own error (here a dtype) comes first, as
    # it is, with the place and the layouts after it and no cause guessed
    err = _first_forward_error(
        {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()},
        inputs=(torch.randn(2, 8, 32, dtype=torch.float64),),
    )
    assert type(err) is RuntimeError and isinstance(err.__cause__, RuntimeError)
    message = str(err)
    assert "dtype" in str(err.__cause__) and message.startswith(str(err.__cause__))
    assert "raised in the forward of 'c_fc' (Linear) at test_forward_errors.py:" in message
    assert "`return self.c_proj(torch.nn.functional.gelu(self.c_fc(x)))`" in message
    assert "Its style: ColwiseParallel: in Replicate(); out Shard(-1)" in message, message
    assert "Likely cause" not in message and "features" not in message, message
    # an exception type whose constructor takes more than a message keeps its object; the
    # context is a note, which tracebacks print after it
    model = torch_tp.parallelize_module(_Raising(), init_device_mesh(device_type(), (2,)), {
        "c_fc": ColwiseParallel()})  # fmt: skip
    with pytest.raises(_CacheMiss) as info:
        model(torch.randn(2, 8, 32))
    assert info.value is model.error and str(info.value) == "layer 3 has no entry 7"
    (note,) = info.value.__notes__
    assert "raised in the forward of the root module (_Raising)" in note, note
    assert "`raise self.error`" in note and "c_fc: ColwiseParallel: in Replicate()" in note


class _CacheMiss(Exception):
    def __init__(self, layer: int, position: int) -> None:
        super().__init__(f"layer {layer} has no entry {position}")


class _Raising(_MLP):
    def __init__(self) -> None:
        super().__init__()
        self.error = _CacheMiss(3, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.c_fc(x)
        raise self.error


class _Attention(nn.Module):
    """Attention as public code writes it: nanoGPT's shapes, Llama's q/k/v/o names, and the
    options the mistakes below need (key/value heads, a learned per-head scale)."""

    def __init__(self, heads: int = 4, kv_heads: int = 4, head_scale: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = heads, kv_heads, 8
        self.q_proj = nn.Linear(32, heads * 8, bias=False)
        self.k_proj = nn.Linear(32, kv_heads * 8, bias=False)
        self.v_proj = nn.Linear(32, kv_heads * 8, bias=False)
        self.o_proj = nn.Linear(heads * 8, 32, bias=False)
        self.head_scale = nn.Parameter(torch.rand(heads, 1, 1) + 0.5) if head_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scores = q @ k.transpose(-2, -1) / self.head_dim**0.5
        if self.head_scale is not None:
            scores = scores * self.head_scale
        y = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def _attention_plan(**o_proj: object) -> dict:
    columns = {name: ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
    return {**columns, "o_proj": RowwiseParallel(**o_proj)}


def _natural_view() -> None:
    # the first case, the check off: q.view(B, T, self.n_heads, self.head_dim)
    from test_forward_check import Attention

    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel()}
    err = _first_forward_error({**plan, "o": RowwiseParallel()}, Attention(), inputs=(
        torch.randn(2, 8, 64),))  # fmt: skip
    message = str(err)
    assert type(err) is RuntimeError and "is invalid for input of size" in str(err.__cause__)
    assert "raised in the forward of the root module (Attention) at test_forward_check.py:" in (
        message
    )
    assert "self.q(x).view(b, t, self.n_heads, self.head_dim)" in message, message
    assert "q: ColwiseParallel: in Replicate(); out Shard(-1) (this rank's part" in message
    assert "o: RowwiseParallel: in Shard(-1); out Partial(sum) -> Replicate()" in message
    assert (
        "Likely cause: the head count is read from n_heads (4), the whole model's: pass -1 in"
        in (message)
    )
    assert (
        "AttentionHeads('n_heads', divide=('n_heads',)) so that each rank's n_heads is its own 2"
        in (message)
    )


def _multi_query_attention() -> None:
    # one key/value head (multi-query attention, Falcon's) and view(..., -1, head_dim): the
    # plan splits k and v, whose 8 features are one head, into halves of a head
    err = _first_forward_error(_attention_plan(), _Attention(kv_heads=1))
    message = str(err)
    assert type(err) is RuntimeError and "is invalid for input of size" in message
    assert "raised in the forward of the root module (_Attention)" in message, message
    assert "`k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)`" in message
    assert "k_proj: ColwiseParallel: in Replicate(); out Shard(-1)" in message, message
    assert "holds 0.5 of the units the view counts" in message, message
    assert "does not divide over 2 ranks" in message, message


def _per_head_parameter_left_whole() -> None:
    # a learned scale per head, [heads, 1, 1]: the projections give each rank 2 of the 4
    # heads, the plan leaves the scale whole
    err = _first_forward_error(_attention_plan(), _Attention(head_scale=True))
    message = str(err)
    assert type(err) is RuntimeError and "must match the size of tensor b" in message, message
    assert "`scores = scores * self.head_scale`" in message, message
    assert "one operand has 2 where the other has 4, 2 times as many" in message, message
    assert "such as 'head_scale' [4, 1, 1]" in message, message
    assert "LocalParamsParallel({'head_scale': Shard(0)})" in message, message
    # the fix it names runs, and computes what one device does
    mesh = init_device_mesh(device_type(), (2,))
    torch.manual_seed(0)
    reference = _Attention(head_scale=True)
    model = torch_tp.parallelize_module(
        copy.deepcopy(reference),
        mesh,
        {**_attention_plan(), "": LocalParamsParallel({"head_scale": Shard(0)})},
    )
    x = torch.randn(2, 8, 32)
    assert_close(model(x), reference(x))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x)


def _lm_head_left_sharded_before_transformers_loss() -> None:
    # transformers' Llama computes its loss itself when given labels, viewing the logits with
    # the config's vocabulary size; a hand plan that makes lm_head column-parallel with its
    # default local output gives it half the vocabulary's logits. The first-forward check
    # refuses the plan; with it off, the forward's own error names the head
    from torch_tp.plans.hf import plan_for

    model = tiny_hf_llama()
    plan = {**plan_for(model), "lm_head": ColwiseParallel()}
    ids = torch.arange(16).view(2, 8) * 4 % 64
    refused = _first_forward_error(
        plan, copy.deepcopy(model), check_forward=True, inputs=(ids,), labels=ids
    )  # fmt: skip
    assert "torch_tp's check of the first forward" in str(refused), refused
    err = _first_forward_error(plan, model, inputs=(ids,), labels=ids)
    message = str(err)
    assert type(err) is ValueError and "target batch_size (16)" in str(err.__cause__), message
    assert "raised in the forward of the root module (LlamaForCausalLM)" in message, message
    assert "loss_utils.py:" in message, message
    # the modules nearest the one that raised come first: the head before the layers'
    listed = message.split("the planned modules inside it:\n", 1)[1]
    assert listed.startswith("  lm_head: ColwiseParallel: in Replicate(); out Shard(-1)"), listed
    assert "Likely cause: 'lm_head' hands on this rank's part of its output" in message, message
    assert "output_layouts=Replicate()" in message and "loss_parallel()" in message, message


class _LM(nn.Module):
    """nanoGPT's language model, its loss computed in its forward from the logits' own
    last dimension."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, 32)
        self.block = _Block()
        self.lm_head = None if tied else nn.Linear(32, 64, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.block(self.wte(ids))
        # a tied head reads the embedding's weight directly
        logits = F.linear(h, self.wte.weight) if self.lm_head is None else self.lm_head(h)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _lm_head_left_sharded_before_the_loss() -> None:
    # here the shapes agree (each rank's 32 logits, its targets): the first-forward check,
    # on, passes it, and the loss's own error is what the user sees
    plan = {"lm_head": ColwiseParallel()}
    plan |= {f"block.attn.{k}": v for k, v in _attention_plan().items()}
    ids = torch.arange(16).view(2, 8) * 4 % 64
    err = _first_forward_error(plan, _LM(), check_forward=True, inputs=(ids, ids))
    message = str(err)
    assert type(err) is IndexError and "is out of bounds" in str(err.__cause__), message
    assert "`return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))`" in (
        message
    )
    assert "Likely cause: 'lm_head' hands on this rank's part of its output" in message, message


def _dtensor_output_into_a_residual() -> None:
    # use_local_output=False on o_proj (to keep it a DTensor), then the block's residual add
    # with the plain input
    plan = {f"attn.{k}": v for k, v in _attention_plan(use_local_output=False).items()}
    err = _first_forward_error(plan, _Block())
    message = str(err)
    assert "mixed torch.Tensor and DTensor" in message, message
    assert "raised in the forward of the root module (_Block)" in message, message
    assert "`return x + self.attn(x)`" in message, message
    assert "attn.o_proj: RowwiseParallel: in Shard(-1); out Partial(sum) -> Replicate() (a " in (
        message
    )
    assert "Likely cause: 'attn.o_proj' hands on a DTensor (use_local_output=False)" in message


def _tied_weight_read_directly() -> None:
    plan = {"wte": RowwiseParallel(input_layouts=Replicate())}
    plan |= {f"block.attn.{k}": v for k, v in _attention_plan().items()}
    err = _first_forward_error(plan, _LM(tied=True), inputs=(torch.arange(16).view(2, 8),))
    message = str(err)
    assert "mixed torch.Tensor and DTensor" in message, message
    assert "`logits = F.linear(h, self.wte.weight) if self.lm_head is None" in message, message
    assert "wte: RowwiseParallel: in Replicate(); out Partial(sum) -> Replicate()" in message
    assert "Likely cause: a planned module's parameters are DTensors" in message, message


def _signature_kept() -> None:
    # transformers' Trainer keeps the dataset columns forward's signature names, and generate
    # checks its keywords against it: the wrapper must not hide it
    mesh = init_device_mesh(device_type(), (2,))
    plan = {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()}
    model = torch_tp.parallelize_module(_MLP(), mesh, plan)
    assert model.forward is not _MLP.forward
    assert inspect.signature(model.forward) == inspect.signature(_MLP().forward)
    # a deep copy wraps its own forward: it runs, and its errors name its own modules
    twin = copy.deepcopy(model)
    x = torch.randn(2, 8, 32)
    assert_close(twin(x), model(x))
    with pytest.raises(RuntimeError, match="raised in the forward of 'c_fc'") as info:
        twin(x.double())
    assert "Its style: ColwiseParallel" in str(info.value)


def test_swapped_mlp_styles_name_the_module_and_the_fix():
    run_distributed(_swapped_styles, 2)


def test_column_after_column_names_the_module_and_the_fix():
    run_distributed(_two_column_parallel_layers, 2)


def _many_compiled_models() -> None:
    # torch.compile caches per code object, 8 entries at most, and the wrapper is the first
    # frame it compiles of each model: one more model than that, each compiled with
    # fullgraph=True, must not hit the limit (a shared code object would)
    mesh = init_device_mesh(device_type(), (2,))
    plan = {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()}
    x = torch.randn(2, 8, 32)
    for seed in range(torch._dynamo.config.recompile_limit + 1):
        torch.manual_seed(seed)
        reference = _MLP()
        model = torch_tp.parallelize_module(copy.deepcopy(reference), mesh, plan)
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        assert_close(compiled(x), reference(x))


@pytest.mark.slow  # nine models compiled on each rank
def test_each_parallelized_model_compiles_with_a_cache_of_its_own():
    run_distributed(_many_compiled_models, 2)


def test_the_forward_keeps_its_signature():
    run_distributed(_signature_kept, 2)


def test_other_errors_keep_their_message_and_gain_the_place():
    run_distributed(_other_errors_keep_their_message, 2)


def test_the_natural_attention_view_names_the_head_count_and_the_fix():
    run_distributed(_natural_view, 2)


def test_multi_query_attention_over_two_ranks_names_the_head_split():
    run_distributed(_multi_query_attention, 2)


def test_a_per_head_parameter_left_whole_names_the_parameter_and_the_fix():
    run_distributed(_per_head_parameter_left_whole, 2)


def test_a_sharded_lm_head_before_transformers_loss_names_the_head():
    run_distributed(_lm_head_left_sharded_before_transformers_loss, 2)


def test_a_sharded_lm_head_before_a_loss_the_check_passes_names_the_head():
    run_distributed(_lm_head_left_sharded_before_the_loss, 2)


def test_a_dtensor_output_added_to_a_plain_residual_names_the_module():
    run_distributed(_dtensor_output_into_a_residual, 2)


def test_a_tied_weight_read_directly_names_dtensor_parameters():
    run_distributed(_tied_weight_read_directly, 2)
