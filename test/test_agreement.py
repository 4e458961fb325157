"""Agree before you communicate: one rank's bad input is the same error on every rank.

A check that guards a collective is made by each rank on its own data. Each case here gives
bad input to ONE rank only and checks that every rank raises the same exception (type and
message, naming the rank), rather than the good rank waiting in a collective for the one
that raised, and that a good call afterwards still runs and gives the single-device result.
(The pipeline's step is tested in ``test_pipeline.py``, the expert ids in ``test_moe.py``.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import tp_mesh
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing import assert_close

from torch_tp import RowwiseParallel, loss_parallel, parallelize_module
from torch_tp.loss import vocab_parallel_cross_entropy
from torch_tp.testing import device_type, run_distributed

VOCAB = 10


def _raised_alike(call, kind: type[Exception], where: str) -> None:
    """``call()`` raises ``kind`` on this rank, with the same message as on every other
    rank, naming ``where`` (the rank that had the bad input)."""
    with pytest.raises(kind) as raised:
        call()
    message = str(raised.value)
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, (type(raised.value), message))
    assert messages == [(type(raised.value), message)] * len(messages), messages
    assert where in message, message


def _one_bad_rank() -> None:
    mesh = tp_mesh()
    rank = dist.get_rank()
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (6,))
    expected = F.cross_entropy(logits, target)
    bad_target = target.clone()
    bad_target[2] = VOCAB if rank == 1 else bad_target[2]

    # loss_parallel: rank 1's target holds a class outside the vocabulary
    dt = distribute_tensor(logits, mesh, [Shard(1)])
    with loss_parallel():
        _raised_alike(
            lambda: F.cross_entropy(dt, bad_target), IndexError, f"Target {VOCAB} is out of bounds"
        )
        assert_close(F.cross_entropy(dt, target).full_tensor(), expected)

    # vocab_parallel_cross_entropy: rank 0's target has the wrong shape; then a vocabulary
    # size that only rank 0's shard contradicts (11 classes split 6 + 5, the shards hold 5)
    local = dt.to_local()
    wrong = target[:5] if rank == 0 else target
    _raised_alike(
        lambda: vocab_parallel_cross_entropy(local, wrong, mesh),
        ValueError,
        "found (5,) (on rank 0)",
    )
    _raised_alike(
        lambda: vocab_parallel_cross_entropy(local, target, mesh, vocab_size=VOCAB + 1),
        ValueError,
        "rank 0 should hold 6 classes",
    )
    assert_close(vocab_parallel_cross_entropy(local, target, mesh, vocab_size=VOCAB), expected)

    # a vocabulary-parallel embedding: rank 1's replicated ids hold one outside the vocabulary
    model = nn.Sequential()
    model.add_module("tok_embeddings", nn.Embedding(VOCAB, 4))
    reference = nn.Embedding(VOCAB, 4)
    reference.load_state_dict(model.tok_embeddings.state_dict())
    parallelize_module(model, mesh, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate())})
    ids = torch.tensor([[1, 2, 3, 4]])
    bad_ids = torch.tensor([[1, VOCAB + 5, 3, 4]]) if rank == 1 else ids
    _raised_alike(lambda: model(bad_ids), IndexError, f"found {VOCAB + 5} (1 of 4 ids")
    _raised_alike(lambda: model(bad_ids), IndexError, "(on rank 1)")
    assert_close(model(ids), reference(ids))

    # torch_tp.random.manual_seed: rank 0's seed is out of range, then rank 1's is no int;
    # the other rank is in the seeds' all-gather meanwhile. Then a good seed installs.
    from torch_tp import random as tp_random

    previous = tp_random.get_rng_tracker()
    try:
        bad_seed = 2**64 if rank == 0 else 7
        _raised_alike(lambda: tp_random.manual_seed(bad_seed, mesh), ValueError, "(on rank 0)")
        not_int = "7" if rank == 1 else 7
        _raised_alike(lambda: tp_random.manual_seed(not_int, mesh), TypeError, "(on rank 1)")
        assert tp_random.manual_seed(7, mesh).seed == 7
    finally:
        tp_random.set_rng_tracker(previous)


def test_one_bad_rank_raises_the_same_error_on_every_rank():
    run_distributed(_one_bad_rank, 2)


def _one_bad_rank_2d() -> None:
    """loss_parallel on a (dp, tp) mesh, the tokens split over dp: rank 3's shard of the
    target holds a class outside the vocabulary. Its tensor-parallel peer learns it in the
    first all-reduce, the other data-parallel pair in one more (over dp): all four raise."""
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    logits = torch.randn(8, VOCAB, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (8,))
    expected = F.cross_entropy(logits, target)
    dt = distribute_tensor(logits, mesh, [Shard(0), Shard(1)])
    dt_target = distribute_tensor(target, mesh, [Shard(0), Replicate()])
    local = dt_target.to_local().clone()
    if dist.get_rank() == 3:
        local[0] = -3
    bad = type(dt_target).from_local(local, mesh, [Shard(0), Replicate()], run_check=False)
    with loss_parallel():
        _raised_alike(lambda: F.cross_entropy(dt, bad), IndexError, "-3 is out of bounds")
        assert_close(F.cross_entropy(dt, dt_target).full_tensor(), expected)


@pytest.mark.slow
def test_one_bad_rank_on_a_2d_mesh_raises_on_every_rank():
    run_distributed(_one_bad_rank_2d, 4)
