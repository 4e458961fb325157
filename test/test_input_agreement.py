"""The ranks of a tensor-parallel group agree on the shape of the ids they are given.

A vocabulary-parallel embedding (``RowwiseParallel`` on an ``nn.Embedding``) sums every
rank's lookups of the same ids. Ranks given batches of different shapes with as many ids
((2, 8) on one, (4, 4) on the other) would sum rows of different tokens, in a reduction of
as many numbers, and every rank would compute wrong logits with no error. The embedding
already agrees on its ids once per forward (whether any is out of the vocabulary, one
all-reduce); that all-reduce carries the ids' shape too (no other collective), so different
shapes are one ``ValueError`` on every rank naming the embedding and each rank's shape.

Cases: transformers' Llama under ``plan_for`` with and without sequence parallelism, the
reference Llama under ``llama_plan`` with and without it, a bare embedding given ids of
different ndims and of more than four dims; after the error, the same model still matches
one device (float64) on a batch of one shape. On a (dp, tp) mesh the data-parallel ranks'
batches may differ: the check is over the tensor-parallel group only (4 ranks).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import full_tensor, reference_llama, tp_mesh
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.testing import assert_close

from torch_tp import RowwiseParallel, parallelize_module
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import device_type, run_distributed

VOCAB = 256  # test_transformers' vocabulary; the reference Llama's is larger


def _ids(shape: tuple[int, ...], vocab: int = VOCAB) -> torch.Tensor:
    """16 ids, the same on every rank, in ``shape``."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (16,), generator=gen).view(shape).to(device_type())


def _raises_on_every_rank(call, *parts: str) -> None:
    """``call()`` raises ``ValueError`` on this rank with the same message as on every other
    rank, a message holding each of ``parts``."""
    with pytest.raises(ValueError) as raised:
        call()
    message = str(raised.value)
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    assert messages == [message] * len(messages), messages
    for part in parts:
        assert part in message, (part, message)


def _hf_llama() -> nn.Module:
    from test_transformers import _model

    return _model("llama", 2).double()


def _reference_llama() -> nn.Module:
    return reference_llama(max_seq_len=16).double()


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return full_tensor(out if isinstance(out, torch.Tensor) else out.logits)


def _refused_then_matches(build: str, sequence_parallel: bool) -> None:
    """Rank 0 is given (2, 8) ids, rank 1 the same 16 ids as (4, 4): one error on both,
    naming the embedding and each rank's shape; then a batch of one shape on both matches
    one device."""
    if build == "transformers":
        from torch_tp.plans.hf import plan_for

        model = _hf_llama()
        plan = plan_for(model, sequence_parallel=sequence_parallel)
        embedding, vocab = "'model.embed_tokens' (Embedding)", VOCAB
    else:
        model = _reference_llama()
        plan = llama_plan(sequence_parallel=sequence_parallel)
        embedding, vocab = "'tok_embeddings' (Embedding)", model.config.vocab_size
    reference = copy.deepcopy(model)
    parallelize_module(model, tp_mesh(), plan)
    shape = (2, 8) if dist.get_rank() == 0 else (4, 4)
    for _ in range(2):  # and again: no rank was left behind in a collective
        _raises_on_every_rank(
            lambda: model(_ids(shape, vocab)),
            embedding,
            "RowwiseParallel",
            "different shapes: (2, 8) on rank 0; (4, 4) on rank 1",
        )
    ids = _ids((2, 8), vocab)
    with torch.no_grad():
        assert_close(_logits(model, ids), _logits(reference, ids))


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("build", ["transformers", "reference"])
def test_ids_of_different_shapes_are_refused_on_every_rank(build: str, sequence_parallel: bool):
    run_distributed(_refused_then_matches, 2, build, sequence_parallel)


def _bare_embedding() -> None:
    """A vocabulary-parallel embedding alone: ids of different ndims, ids of five dims
    differing past the fourth, ids out of the vocabulary on one rank (still the one-device
    error), and equal shapes of five dims (still one device's rows)."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("embed", nn.Embedding(VOCAB, 8, dtype=torch.float64))
    reference = copy.deepcopy(model)
    parallelize_module(model, tp_mesh(), {"embed": RowwiseParallel(input_layouts=Replicate())})
    first = dist.get_rank() == 0
    _raises_on_every_rank(
        lambda: model(_ids((16,) if first else (2, 8))),
        "'embed' (Embedding)",
        "(16,) on rank 0; (2, 8) on rank 1",
    )
    _raises_on_every_rank(
        lambda: model(_ids((1, 1, 1, 2, 8) if first else (1, 1, 1, 8, 2))),
        "(1, 1, 1, 2, 8) on rank 0; (1, 1, 1, 8, 2) on rank 1",
    )
    bad = _ids((2, 8)).clone()
    bad[0, 0] = VOCAB if not first else bad[0, 0]
    with pytest.raises(IndexError, match=r"index out of range.*\(on rank 1\)"):
        model(bad)
    ids = _ids((1, 2, 1, 2, 4))
    assert_close(model(ids), reference(ids))


def test_bare_embedding_agrees_on_every_shape():
    run_distributed(_bare_embedding, 2)


def _data_parallel_batches_differ() -> None:
    """(dp=2, tp=2): the tp pair of dp rank 0 is given (2, 8) ids, that of dp rank 1 the same
    16 ids as (4, 4). Not refused (each tp group agrees within itself), and each pair's
    logits are one device's on its own batch."""
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    model = _reference_llama()
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], llama_plan())
    shape = (2, 8) if mesh["dp"].get_local_rank() == 0 else (4, 4)
    ids = _ids(shape, model.config.vocab_size)
    with torch.no_grad():
        assert_close(_logits(model, ids), _logits(reference, ids))


@pytest.mark.four_ranks
def test_data_parallel_ranks_may_have_different_shapes():
    run_distributed(_data_parallel_batches_differ, 4)
