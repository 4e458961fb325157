"""Vocabulary-parallel cross-entropy: ``loss_parallel()`` and ``vocab_parallel_cross_entropy``.

Every case compares the loss and the gradient of the logits with ``F.cross_entropy`` on the
full (gathered) logits, on uneven vocabulary shards (1001 classes). Each ``_case`` function runs
on every rank via :func:`torch_tp.testing.run_distributed`.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import full_tensor, tp_mesh
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from torch_tp import parallelize_module
from torch_tp.loss import loss_parallel, vocab_parallel_cross_entropy
from torch_tp.models import Llama, LlamaConfig
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import device_type, gather_full, run_distributed

VOCAB = 1001  # uneven over 2 ranks (501 + 500) and over 4 (251 * 3 + 248)

funcol = torch.ops.c10d_functional


def _data(batch_shape, vocab, ignore: bool, seed: int = 0):
    """Logits, targets (some ignored), class weights and per-token gradient weights."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(*batch_shape, vocab, generator=gen)
    target = torch.randint(0, vocab, batch_shape, generator=gen)
    if ignore:
        target.view(-1)[::3] = -100
    class_weight = torch.rand(vocab, generator=gen) + 0.5
    # weights of the per-token losses of reduction="none": every token's gradient differs
    token_weight = torch.randn(batch_shape, generator=gen)
    return logits, target, class_weight, token_weight


def _scalar(loss, token_weight):
    """What to backpropagate from a loss: itself, or a weighted sum for reduction="none"."""
    if loss.ndim == 0 and token_weight.ndim > 0:
        return loss
    return (loss * token_weight.flatten()[: loss.numel()].reshape(loss.shape)).sum()


# The ways a (batch, seq, vocab) DTensor sharded on the vocabulary reaches F.cross_entropy,
# each with the same call on the full tensor as the reference.
FORMS = {
    # (N, C) logits, (N,) targets
    "2d": lambda logits, target: (logits.flatten(0, 1), target.flatten()),
    # what users write for language models
    "flatten": lambda logits, target: (logits.flatten(0, 1), target.flatten()),
    # (N, C, d1) logits, (N, d1) targets: the class dimension is 1
    "transpose": lambda logits, target: (logits.transpose(1, 2), target),
    # (C,) logits, () target
    "1d": lambda logits, target: (logits[0, 0], target[0, 0]),
}


def _check_loss_parallel(mesh, form, logits, target, token_weight, **options) -> None:
    """loss_parallel() on the DTensor form of ``logits`` against F.cross_entropy on them."""
    full = logits.clone().requires_grad_()
    ref_in, ref_target = FORMS[form](full, target)
    ref = F.cross_entropy(ref_in, ref_target, **options)
    _scalar(ref, token_weight).backward()

    if form == "2d":  # a (N, C) DTensor sharded on dim 1 from the start
        dt = distribute_tensor(logits.flatten(0, 1), mesh, [Shard(1)]).requires_grad_()
        dt_in, dt_target, leaf_grad = dt, target.flatten(), lambda: dt.grad.full_tensor()
    else:
        dt = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
        dt_in, dt_target = FORMS[form](dt, target)
        leaf_grad = lambda: dt.grad.full_tensor()  # noqa: E731
    with loss_parallel():
        loss = F.cross_entropy(dt_in, dt_target, **options)
        assert isinstance(loss, DTensor) and loss.placements == (Replicate(),)
        assert loss.shape == ref.shape and loss.dtype == ref.dtype
        _scalar(loss.full_tensor(), token_weight).backward()
    assert_close(loss.full_tensor(), ref, msg=lambda m: f"{form} {options}: loss: {m}")
    grad = leaf_grad().reshape(full.shape)
    assert_close(grad, full.grad, msg=lambda m: f"{form} {options}: gradient: {m}")


def _check_upstream(mesh, logits, target, token_weight, **options) -> None:
    """Where upstream's loss_parallel is defined (no label smoothing), ours agrees with it."""
    from torch.distributed.tensor.parallel import loss_parallel as upstream_loss_parallel

    results = []
    for context in (loss_parallel, upstream_loss_parallel):
        dt = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
        with context():  # upstream needs the backward inside the context
            loss = F.cross_entropy(dt.flatten(0, 1), target.flatten(), **options)
            _scalar(loss.full_tensor(), token_weight).backward()
        assert loss.placements == (Replicate(),)
        results.append((loss.full_tensor(), dt.grad.full_tensor()))
    assert_close(*results, msg=lambda m: f"against upstream, {options}: {m}")


def _check_functional(mesh, logits, target, token_weight, vocab_size, **options) -> None:
    """vocab_parallel_cross_entropy on local shards against F.cross_entropy on the full."""
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.flatten(0, -2), target.flatten(), **options)
    if ref.ndim:
        ref = ref.reshape(target.shape)
    _scalar(ref, token_weight).backward()

    local = distribute_tensor(logits, mesh, [Shard(-1)]).to_local().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, mesh, vocab_size=vocab_size, **options)
    assert not isinstance(loss, DTensor) and loss.shape == ref.shape
    _scalar(loss, token_weight).backward()
    what = f"functional vocab_size={vocab_size} {options}"
    assert_close(loss, ref, msg=lambda m: f"{what}: loss: {m}")
    grad = gather_full(local.grad, mesh, Shard(-1))
    assert_close(grad, full.grad, msg=lambda m: f"{what}: gradient: {m}")


def _case_options(reduction: str, label_smoothing: float, ignore: bool, vocab: int) -> None:
    mesh = tp_mesh()
    logits, target, class_weight, token_weight = _data((2, 6), vocab, ignore)
    for weight in (None, class_weight):
        options = {
            "reduction": reduction,
            "label_smoothing": label_smoothing,
            "ignore_index": -100,
            "weight": weight,
        }
        for form in FORMS:
            if form == "1d" and ignore:
                continue  # the one target of the 1-D form is ignored: nothing to check
            _check_loss_parallel(mesh, form, logits, target, token_weight, **options)
        # (upstream's backward crashes on class weights with ignored tokens: it indexes the
        # weights with ignore_index)
        if label_smoothing == 0.0 and not (ignore and weight is not None):
            _check_upstream(mesh, logits, target, token_weight, **options)
        for vocab_size in (None, vocab):
            _check_functional(mesh, logits, target, token_weight, vocab_size, **options)


@pytest.mark.parametrize("ignore", [False, True], ids=["all_tokens", "ignore_index"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_options(reduction, label_smoothing, ignore):
    run_distributed(_case_options, 2, reduction, label_smoothing, ignore, VOCAB)


def _case_world_size_4() -> None:
    mesh = tp_mesh()
    for vocab in (VOCAB, 3):  # 251 * 3 + 248; and 1 + 1 + 1 + 0: one rank holds no class
        logits, target, class_weight, token_weight = _data((2, 5), vocab, ignore=True)
        for reduction in ("mean", "none"):
            options = {"reduction": reduction, "label_smoothing": 0.1, "weight": class_weight}
            for form in ("flatten", "transpose"):
                _check_loss_parallel(mesh, form, logits, target, token_weight, **options)
            _check_functional(mesh, logits, target, token_weight, None, **options)
            _check_functional(mesh, logits, target, token_weight, vocab, **options)


@pytest.mark.four_ranks
def test_world_size_4():
    run_distributed(_case_world_size_4, 4)


def _case_2d_mesh() -> None:
    """(dp, tp) mesh: the tokens split on dp, the vocabulary on tp (upstream's N-D layout)."""
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    logits, target, _, token_weight = _data((4, 3), VOCAB, ignore=True)
    # rank pairs on dp see different ignored counts: the mean must use the global count
    target[0, :] = -100
    for reduction in ("mean", "sum", "none"):
        full = logits.clone().requires_grad_()
        ref = F.cross_entropy(full.transpose(1, 2), target, reduction=reduction)
        _scalar(ref, token_weight).backward()

        dt = distribute_tensor(logits, mesh, [Shard(0), Shard(2)]).requires_grad_()
        dt_target = distribute_tensor(target, mesh, [Shard(0), Replicate()])
        with loss_parallel():
            loss = F.cross_entropy(dt.transpose(1, 2), dt_target, reduction=reduction)
        expected = [Shard(0), Replicate()] if reduction == "none" else [Partial(), Replicate()]
        assert list(loss.placements) == expected, (reduction, loss.placements)
        if reduction == "none":
            tw = distribute_tensor(token_weight, mesh, [Shard(0), Replicate()])
            (loss * tw).sum().full_tensor().backward()
        else:
            loss.full_tensor().backward()
        assert_close(loss.full_tensor(), ref)
        assert_close(dt.grad.full_tensor(), full.grad)

    # the functional form wants the vocabulary's own (1-D) mesh
    with pytest.raises(ValueError, match=r'mesh\["tp"\]'):
        vocab_parallel_cross_entropy(logits, target, mesh)
    dt = distribute_tensor(logits, mesh, [Shard(0), Shard(2)])
    with loss_parallel():
        with pytest.raises(ValueError, match="must be a DTensor"):
            F.cross_entropy(dt.transpose(1, 2), target)
        with pytest.raises(RuntimeError, match="expected the target with placements"):
            F.cross_entropy(
                dt.transpose(1, 2), distribute_tensor(target, mesh, [Shard(0), Shard(0)])
            )
        twice = distribute_tensor(logits, mesh, [Shard(2), Shard(2)])
        with pytest.raises(ValueError, match="exactly one mesh dimension"):
            F.cross_entropy(twice.transpose(1, 2), target)


@pytest.mark.four_ranks
def test_2d_mesh():
    run_distributed(_case_2d_mesh, 4)


# --------------------------------------------------------------------------- the reference Llama


def _case_llama(sequence_parallel: bool, label_smoothing: float) -> None:
    mesh = tp_mesh()
    torch.manual_seed(0)
    config = LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=32)
    model = Llama(config).double()
    reference = copy.deepcopy(model)  # one device: copied before parallelizing
    tokens = torch.randint(0, VOCAB, (2, 16))
    labels = torch.randint(0, VOCAB, (2, 16))
    labels[:, :3] = -100  # e.g. a prompt that is not trained on

    plan = llama_plan(sequence_parallel=sequence_parallel, loss_parallel=True)
    model = parallelize_module(model, mesh, plan)

    ref_loss = F.cross_entropy(
        reference(tokens).flatten(0, 1), labels.flatten(), label_smoothing=label_smoothing
    )
    ref_loss.backward()
    logits = model(tokens)
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
    with CommDebugMode() as comm, loss_parallel():
        loss = F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), label_smoothing=label_smoothing
        )
    assert comm.get_comm_counts() == {funcol.all_reduce: 2}, comm.get_comm_counts()
    with loss_parallel():
        loss.backward()

    assert_close(loss.full_tensor(), ref_loss, rtol=1e-12, atol=1e-12)
    for (name, param), ref_param in zip(
        model.named_parameters(), reference.parameters(), strict=True
    ):
        assert_close(
            full_tensor(param.grad),
            ref_param.grad,
            rtol=1e-10,
            atol=1e-12,
            msg=lambda m, n=name: f"{n}: {m}",
        )


@pytest.mark.parametrize(
    "sequence_parallel,label_smoothing", [(False, 0.0), (True, 0.1)], ids=["tp", "tp_sp_smooth"]
)
def test_llama(sequence_parallel, label_smoothing):
    run_distributed(_case_llama, 2, sequence_parallel, label_smoothing)


# --------------------------------------------------------------------------- no side effects


def _leaf(x: torch.Tensor, mesh, placement):
    """``x`` as a leaf that requires grad: a plain tensor, or a DTensor with ``placement``."""
    if placement is None:
        return x.clone().requires_grad_()
    return distribute_tensor(x, mesh, [placement]).requires_grad_()


def _case_no_side_effects() -> None:
    mesh = tp_mesh()
    logits, target, _, _ = _data((4, 7), 33, ignore=False)
    r = torch.randn(4, 7, 33, generator=torch.Generator().manual_seed(1))  # same on all ranks
    # plain tensors, DTensors not sharded on the softmax/class dimension, and sharded on it
    placements = {
        "tensor": None,
        "replicate": Replicate(),
        "shard_batch": Shard(0),
        "shard_classes": Shard(-1),
    }

    def log_softmax(placement):
        x = _leaf(logits, mesh, placement)
        y = F.log_softmax(x, dim=-1)
        (full_tensor(y) * r).sum().backward()
        return full_tensor(y).detach(), full_tensor(x.grad)

    expected = log_softmax(None)
    for name, placement in placements.items():
        assert_close(log_softmax(placement), expected)
        with loss_parallel():
            inside = log_softmax(placement)
        assert_close(inside, expected, msg=lambda m, n=name: f"log_softmax on {n}: {m}")

    # cross_entropy that is not ours to take (plain tensors, and DTensors whose class
    # dimension is not sharded) runs as it does outside the context
    def cross_entropy(placement, target_placement):
        x = _leaf(logits.flatten(0, 1), mesh, placement)
        t = target.flatten()
        if target_placement is not None:
            t = distribute_tensor(t, mesh, [target_placement])
        loss = F.cross_entropy(x, t)
        loss.backward()
        return full_tensor(loss).detach(), full_tensor(x.grad)

    expected = cross_entropy(None, None)
    for name, placement in list(placements.items())[:3]:
        target_placement = (
            None if placement is None else Shard(0) if placement.is_shard() else placement
        )
        with loss_parallel():
            inside = cross_entropy(placement, target_placement)
        assert_close(inside, expected, msg=lambda m, n=name: f"cross_entropy on {n}: {m}")

    # the composite nll_loss(log_softmax(...)) on sharded logits: right, if not parallel
    dt = _leaf(logits.flatten(0, 1), mesh, Shard(1))
    with loss_parallel():
        dt_target = distribute_tensor(target.flatten(), mesh, [Replicate()])
        loss = F.nll_loss(F.log_softmax(dt, -1), dt_target)
        loss.backward()
    assert_close((loss.full_tensor(), dt.grad.full_tensor()), expected)

    # nn.CrossEntropyLoss goes through F.cross_entropy; backward may run after the context
    x = logits.clone().requires_grad_()
    ref = F.cross_entropy(x.flatten(0, 1), target.flatten(), label_smoothing=0.2)
    ref.backward()
    dt = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
    with CommDebugMode() as comm, loss_parallel():
        loss = torch.nn.CrossEntropyLoss(label_smoothing=0.2)(dt.flatten(0, 1), target.flatten())
    assert comm.get_comm_counts() == {funcol.all_reduce: 2}, comm.get_comm_counts()
    loss.backward()
    assert_close(loss.full_tensor(), ref)
    assert_close(dt.grad.full_tensor(), x.grad)

    # the context leaves nothing behind
    assert torch._C._len_torch_function_stack() == 0


def test_no_side_effects():
    run_distributed(_case_no_side_effects, 2)


# --------------------------------------------------------------------------- communication


_FUNCTIONAL_COLLECTIVES = {
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "all_to_all_single",
    "broadcast",
}


class _CollectiveSizes(TorchDispatchMode):
    """Records the number of elements each collective sends (functional or c10d ones: the
    ones CommDebugMode counts, which records no size for plain tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor turn itself into local ops first
        name = func._overloadpacket.__name__
        if func.namespace == "c10d" or (
            func.namespace in ("_c10d_functional", "c10d_functional")
            and name in _FUNCTIONAL_COLLECTIVES
        ):
            self.sizes.append((name, args[0].numel()))
        return func(*args, **(kwargs or {}))


def _case_communication() -> None:
    mesh = tp_mesh()
    tokens = 2 * 6
    sizes = {}
    for vocab in (VOCAB, 4 * VOCAB):
        logits, target, _, _ = _data((2, 6), vocab, ignore=True)
        for label_smoothing in (0.0, 0.1):
            # three numbers per token with label smoothing (sum of exp, target, sum), else two
            per_token = 3 if label_smoothing else 2
            dt = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
            with loss_parallel():
                with CommDebugMode() as forward, _CollectiveSizes() as recorded:
                    loss = F.cross_entropy(
                        dt.flatten(0, 1), target.flatten(), label_smoothing=label_smoothing
                    )
                with CommDebugMode() as backward:
                    loss.backward()
            assert forward.get_comm_counts() == {funcol.all_reduce: 2}
            assert backward.get_total_counts() == 0
            # the max of each token's logits, and whether any rank's inputs failed a check
            assert recorded.sizes == [
                ("all_reduce", tokens + 1),
                ("all_reduce", tokens * per_token),
            ], recorded.sizes
            sizes[vocab, "loss_parallel", label_smoothing] = recorded.sizes

            local = dt.to_local().detach().requires_grad_()
            for vocab_size in (vocab, None):
                with CommDebugMode() as forward, _CollectiveSizes() as recorded:
                    loss = vocab_parallel_cross_entropy(
                        local, target, mesh, vocab_size=vocab_size, label_smoothing=label_smoothing
                    )
                with CommDebugMode() as backward:
                    loss.backward()
                # without vocab_size the local sizes are all-gathered: one number per rank
                expected = {funcol.all_reduce: 2}
                if vocab_size is None:
                    expected[funcol.all_gather_into_tensor] = 1
                assert forward.get_comm_counts() == expected, forward.get_comm_counts()
                assert backward.get_total_counts() == 0
                sizes[vocab, vocab_size is None, label_smoothing] = recorded.sizes
    # no collective grows with the vocabulary: four times the vocabulary, the same sizes
    for (vocab, *rest), recorded in sizes.items():
        if vocab != VOCAB:
            assert recorded == sizes[(VOCAB, *rest)], (vocab, rest, recorded)


def test_communication():
    run_distributed(_case_communication, 2)


# --------------------------------------------------------------------------- dtypes and errors


def _case_low_precision() -> None:
    mesh = tp_mesh()
    logits, target, _, _ = _data((2, 6), VOCAB, ignore=True)
    full = logits.to(torch.bfloat16).requires_grad_()
    ref = F.cross_entropy(full.float().flatten(0, 1), target.flatten(), label_smoothing=0.1)
    ref.backward()
    dt = distribute_tensor(full.detach(), mesh, [Shard(-1)]).requires_grad_()
    with loss_parallel():
        loss = F.cross_entropy(dt.flatten(0, 1), target.flatten(), label_smoothing=0.1)
        loss.backward()
    # computed in float32 (like log_softmax on a GPU); only the result is rounded to bfloat16
    assert loss.dtype == torch.bfloat16 and dt.grad.dtype == torch.bfloat16
    assert_close(loss.full_tensor().float(), ref, rtol=1e-2, atol=0.0)
    assert_close(dt.grad.full_tensor().float(), full.grad.float(), rtol=1e-2, atol=1e-4)


def test_low_precision():
    run_distributed(_case_low_precision, 2)


def _case_errors() -> None:
    mesh = tp_mesh()
    logits, target, class_weight, _ = _data((6,), VOCAB, ignore=False)
    dt = distribute_tensor(logits, mesh, [Shard(1)])
    local = dt.to_local()
    with loss_parallel():
        with pytest.raises(NotImplementedError, match="class probabilities"):
            F.cross_entropy(dt, logits.softmax(-1))
        with pytest.raises(ValueError, match="not a valid value for reduction"):
            F.cross_entropy(dt, target, reduction="avg")
        with pytest.raises(RuntimeError, match="label_smoothing must be between"):
            F.cross_entropy(dt, target, label_smoothing=1.5)
        with pytest.raises(ValueError, match=r"expected a target of \(local\) shape \(6,\)"):
            F.cross_entropy(dt, target[:5])
        with pytest.raises(IndexError, match=f"Target {VOCAB} is out of bounds"):
            F.cross_entropy(dt, torch.full((6,), VOCAB))
        with pytest.raises(RuntimeError, match="for all 1001 classes"):
            F.cross_entropy(dt, target, weight=class_weight[:10])
        with pytest.raises(NotImplementedError, match="weight.detach()"):
            F.cross_entropy(dt, target, weight=class_weight.clone().requires_grad_())
        with pytest.raises(RuntimeError, match="expected the target with placements"):
            F.cross_entropy(dt, distribute_tensor(target, mesh, [Shard(0)]))
    with pytest.raises(TypeError, match="found a DTensor"):
        vocab_parallel_cross_entropy(dt, target, mesh)
    with pytest.raises(ValueError, match="should hold 50[12] classes"):
        vocab_parallel_cross_entropy(local, target, mesh, vocab_size=VOCAB + 2)
    with pytest.raises(ValueError, match=r"local_logits.shape\[:-1\] = \(6,\), found \(2, 3\)"):
        vocab_parallel_cross_entropy(local, target.view(2, 3), mesh)


def test_errors():
    run_distributed(_case_errors, 2)
