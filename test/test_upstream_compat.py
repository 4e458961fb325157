"""Code written for ``torch.distributed.tensor.parallel``, run on torch_tp.

Patterns taken from upstream code (PyTorch's own test ``Transformer.parallelize`` in
``torch/testing/_internal/distributed/_tensor/common_dtensor.py``, ``loss_parallel`` misuse)
that torch_tp must run, or refuse with a better error than upstream's, and the same code on
upstream for comparison. Upstream is imported here only, to compare against it.
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as upstream
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.testing import assert_close

import torch_tp
from torch_tp.models import Llama, LlamaConfig
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import device_type, run_distributed

VOCAB = 65  # uneven over 2 ranks: the tied weight's shards are 33 and 32 rows


def _mesh():
    return init_device_mesh(device_type(), (dist.get_world_size(),))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


# --------------------------------------------------------------------------- tied weights


def _tied_llama() -> Llama:
    """The reference Llama with its output projection tied to the token embedding."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=32, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=16))
    model.output.weight = model.tok_embeddings.weight
    return model


def _parallelize_separately(lib, model: Llama, mesh, sequence_parallel: bool, **kwargs) -> None:
    """``Transformer.parallelize`` of PyTorch's tests, written with ``lib``'s classes: one
    call for the root's embedding (and norm), one per layer, one for the output projection,
    then the weights re-tied by hand."""
    C, R, S = lib.ColwiseParallel, lib.RowwiseParallel, lib.SequenceParallel
    PI = lib.PrepareModuleInput
    if sequence_parallel:
        root_plan = {
            "tok_embeddings": R(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": S(),
        }
    else:
        root_plan = {"tok_embeddings": R(input_layouts=Replicate(), output_layouts=Replicate())}
    lib.parallelize_module(model, mesh, root_plan, **kwargs)
    for layer in model.layers:
        plan = {
            "attention.wq": C(),
            "attention.wk": C(),
            "attention.wv": C(),
            "attention.wo": R(output_layouts=Shard(1)) if sequence_parallel else R(),
            "feed_forward.w1": C(),
            "feed_forward.w2": R(output_layouts=Shard(1)) if sequence_parallel else R(),
            "feed_forward.w3": C(),
        }
        if sequence_parallel:
            plan["attention_norm"] = S()
            plan["ffn_norm"] = S()
            plan["attention"] = PI(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            )
            plan["feed_forward"] = PI(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
        lib.parallelize_module(layer, mesh, plan, **kwargs)
    output = (
        C(input_layouts=Shard(1), output_layouts=Replicate())
        if sequence_parallel
        else C(output_layouts=Replicate())
    )
    lib.parallelize_module(model.output, mesh, output, **kwargs)
    if lib is torch_tp:
        # the output's style lays the weight out as the embedding's did (Shard(0)): torch_tp
        # shares the embedding's DTensor parameter again by itself
        assert model.output.weight is model.tok_embeddings.weight
    # as upstream's Transformer.parallelize does: share the parameter (and its gradient) again
    model.output.weight = model.tok_embeddings.weight


def _train_step(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, lr: float = 0.5):
    """One SGD step on the cross-entropy of ``model``; the logits, the loss and every gradient
    (full tensors, by parameter name), and the logits after the step."""
    logits = model(tokens)
    loss = F.cross_entropy(_full(logits).flatten(0, 1), labels.flatten())
    loss.backward()
    grads = {name: _full(p.grad) for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None
    return _full(logits).detach(), loss.detach(), grads, _full(model(tokens)).detach()


def _tied_separately_strict_false(sequence_parallel: bool) -> None:
    mesh = _mesh()
    reference = _tied_llama()
    ours, theirs = copy.deepcopy(reference), copy.deepcopy(reference)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))

    with pytest.warns(UserWarning) as record:
        _parallelize_separately(torch_tp, ours, mesh, sequence_parallel, strict=False)
    tied = [str(w.message) for w in record if "tied" in str(w.message)]
    assert len(tied) == 1, [str(w.message) for w in record]
    # names the module, both parameters, and says what happens
    for part in ("'tok_embeddings'", "'weight'", "'output.weight'", "strict=False", "re-tie"):
        assert part in tied[0], (part, tied[0])
    # the second call found the parameter it was tied to, laid out alike: the tie is one
    # DTensor parameter (the re-tie by hand re-registers the same object)
    assert ours.output.weight is ours.tok_embeddings.weight
    assert ours.tok_embeddings.weight.placements == (Shard(0),)
    assert len(list(ours.parameters())) == len(list(reference.parameters()))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # upstream's own deprecation notices, if any
        _parallelize_separately(upstream, theirs, mesh, sequence_parallel)
    assert theirs.output.weight is theirs.tok_embeddings.weight

    expected = _train_step(reference, tokens, labels)
    for name, model in (("torch_tp", ours), ("upstream", theirs)):
        logits, loss, grads, after = _train_step(model, tokens, labels)
        assert_close(logits, expected[0], msg=lambda m, n=name: f"{n}: logits: {m}")
        assert_close(loss, expected[1], msg=lambda m, n=name: f"{n}: loss: {m}")
        assert grads.keys() == expected[2].keys()
        for key, grad in grads.items():
            assert_close(grad, expected[2][key], msg=lambda m, n=name, k=key: f"{n}: {k}: {m}")
        assert_close(after, expected[3], msg=lambda m, n=name: f"{n}: after a step: {m}")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sequence_parallel"])
def test_tied_weights_parallelized_separately_with_strict_false(sequence_parallel):
    run_distributed(_tied_separately_strict_false, 2, sequence_parallel)


def _tied_separately_strict() -> None:
    mesh = _mesh()
    model = _tied_llama()
    with pytest.raises(ValueError, match="tied weights") as info:
        _parallelize_separately(torch_tp, model, mesh, sequence_parallel=False)
    message = str(info.value)
    # both ways out: one plan for both modules, or strict=False and a re-tie afterwards
    assert "in one parallelize_module call" in message, message
    assert "'tok_embeddings'" in message and "'output'" in message, message
    assert "strict=False" in message and "re-tie" in message, message
    assert not any(isinstance(p, DTensor) for p in model.parameters())

    # the first way out, as the message says: one plan, and the tie is kept
    plan = {
        "tok_embeddings": torch_tp.RowwiseParallel(input_layouts=Replicate()),
        "output": torch_tp.ColwiseParallel(output_layouts=Replicate()),
    }
    reference = _tied_llama()
    torch_tp.parallelize_module(model, mesh, plan)
    assert model.output.weight is model.tok_embeddings.weight
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    assert_close(model(tokens), reference(tokens))


def test_tied_weights_parallelized_separately_strict_raises():
    run_distributed(_tied_separately_strict, 2)


# --------------------------------------------------------------------------- loss_parallel


@contextlib.contextmanager
def _upstream_loss_parallel() -> Iterator[None]:
    """Upstream's ``loss_parallel``, undone even when the body raises.

    Upstream's context does not restore DTensor's operators when an exception leaves it:
    its replacements of ``log_softmax`` and ``nll_loss`` stay installed for the whole
    process, which would leak into every later test run by the same worker. Entering and
    leaving it once more removes them.
    """
    try:
        with upstream.loss_parallel():
            yield
    finally:
        with upstream.loss_parallel():
            pass


def _loss_parallel_classes_not_sharded() -> None:
    mesh = _mesh()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 10, generator=gen)
    target = torch.randint(0, 10, (6,), generator=gen)
    logits_3d = torch.randn(2, 3, 10, generator=gen)  # (batch, seq, vocab)
    target_3d = torch.randint(0, 10, (2, 3), generator=gen)
    replicated_target = distribute_tensor(target, mesh, [Replicate()])
    cases = {
        # (logits, their placement, target, weight, what the message names as found)
        "replicated": (logits, Replicate(), target, None, r"\(Replicate\(\),\)"),
        "batch": (logits, Shard(0), target, None, r"\(Shard\(dim=0\),\)"),
        # (batch, seq, vocab) passed as is: the class dimension is 1 (seq), not 2
        "3d": (logits_3d, Shard(2), target_3d, None, r"\(Shard\(dim=2\),\)"),
        "plain_weight": (logits, Replicate(), replicated_target, torch.ones(10), "Replicate"),
    }
    for name, (x, placement, t, weight, found) in cases.items():
        dt = distribute_tensor(x, mesh, [placement]).requires_grad_()
        with pytest.raises(ValueError) as info, torch_tp.loss_parallel():
            F.cross_entropy(dt, t, weight=weight)
        message = str(info.value)
        assert "loss_parallel()" in message, (name, message)
        assert "Shard(1)" in message, (name, message)  # expected: the class dimension, 1
        assert re.search(found, message), (name, message)  # found
        plain = "weight" if weight is not None else "target"
        assert f"plain-tensor {plain}" in message, (name, message)  # what cannot be mixed
        if name == "3d":
            assert "flatten(0, 1)" in message, message  # the way out for (batch, seq, vocab)
        assert torch._C._len_torch_function_stack() == 0

        # upstream raises ValueError too (for any DTensor not sharded on the classes)
        with pytest.raises(ValueError, match="loss_parallel"), _upstream_loss_parallel():
            F.cross_entropy(dt, t, weight=weight)

    # with a DTensor target, such logits are not ours to take: F.cross_entropy runs as it
    # does outside the context (upstream raises here as well)
    dt = distribute_tensor(logits, mesh, [Replicate()]).requires_grad_()
    with torch_tp.loss_parallel():
        loss = F.cross_entropy(dt, replicated_target)
    assert_close(loss.full_tensor(), F.cross_entropy(logits, target))
    with pytest.raises(ValueError, match="loss_parallel"), _upstream_loss_parallel():
        F.cross_entropy(dt, replicated_target)


def test_loss_parallel_refuses_logits_not_sharded_on_the_classes():
    run_distributed(_loss_parallel_classes_not_sharded, 2)


# --------------------------------------------------------------------------- LocalTensorMode
#
# PyTorch's own distributed tests simulate every rank in this one process: a fake process
# group, and ``LocalTensorMode``, under which a tensor holds one value per simulated rank (a
# LocalTensor) and a rank is a SymInt with one value per rank. These tests run there, with no
# worker processes: TP=2, simulated.

LOCAL_WORLD = 2
LOCAL_VOCAB = 64  # even: DTensor cannot take uneven-shard gradients back in LocalTensorMode


@pytest.fixture
def fake_mesh() -> Iterator:
    """A 1-D CPU mesh of two ranks on a fake process group, built outside LocalTensorMode
    (as PyTorch's tests build theirs); the random states and tracker are restored after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=LOCAL_WORLD)
    try:
        with torch.random.fork_rng():
            yield init_device_mesh("cpu", (LOCAL_WORLD,))
    finally:
        torch_tp.random.set_rng_tracker(None)
        dist.destroy_process_group()


def _on_every_rank(mode, value: torch.Tensor) -> torch.Tensor:
    """``value`` (a plain tensor) as a LocalTensor that holds it on every simulated rank."""
    return mode.rank_map(lambda rank: value.clone())


def _by_rank(value: torch.Tensor) -> dict[int, torch.Tensor]:
    """The value of each simulated rank of a LocalTensor (or of a DTensor's full tensor)."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return dict(value._local_tensors)


def _assert_on_every_rank(value: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    by_rank = _by_rank(value)
    assert sorted(by_rank) == list(range(LOCAL_WORLD)), (what, sorted(by_rank))
    for rank, local in by_rank.items():
        assert_close(local, expected, msg=lambda m, r=rank: f"{what}, rank {r}: {m}")


def _local_llama(dropout: float) -> Llama:
    torch.manual_seed(0)
    config = LlamaConfig(
        dim=32, n_layers=2, n_heads=4, vocab_size=LOCAL_VOCAB, max_seq_len=16, dropout=dropout
    )
    return Llama(config)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sequence_parallel"])
def test_llama_plan_in_local_tensor_mode(fake_mesh, sequence_parallel):
    from torch.distributed._local_tensor import LocalTensorMode

    # dropout on: the default stream must be consumed exactly as on one device, in both plans
    reference = _local_llama(dropout=0.25)
    model = copy.deepcopy(reference)
    tokens = torch.randint(0, LOCAL_VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, LOCAL_VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(5)
    expected = reference(tokens)
    F.cross_entropy(expected.flatten(0, 1), labels.flatten()).backward()

    with LocalTensorMode(LOCAL_WORLD) as mode:
        torch_tp.parallelize_module(
            model, fake_mesh, llama_plan(sequence_parallel=sequence_parallel)
        )
        torch.manual_seed(5)
        logits = model(_on_every_rank(mode, tokens))
        target = _on_every_rank(mode, labels)
        F.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
        _assert_on_every_rank(logits, expected, "logits")
        named = dict(model.named_parameters())
        assert named.keys() == dict(reference.named_parameters()).keys()
        for name, param in reference.named_parameters():
            # a DTensor's gradient is gathered; a plain parameter's is a LocalTensor already
            _assert_on_every_rank(named[name].grad, param.grad, f"{name}.grad")


def test_rng_tracker_fork_in_local_tensor_mode(fake_mesh):
    from torch.distributed._local_tensor import LocalTensorMode

    seed, shape = 7, (4, 16)

    def single_device(tp_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # what a real rank draws: two forked dropouts from its own stream, then the default
        # stream, untouched by the forks
        stream = torch.Generator().manual_seed(seed + 2718 + tp_rank)
        with torch.random.fork_rng():
            torch.set_rng_state(stream.get_state())
            first = F.dropout(torch.ones(shape), 0.5)
            second = F.dropout(torch.ones(shape), 0.5)
            torch.manual_seed(seed)
            default = torch.rand(shape)
        return first, second, default

    with LocalTensorMode(LOCAL_WORLD) as mode:
        tracker = torch_tp.random.manual_seed(seed, fake_mesh)
        ones = _on_every_rank(mode, torch.ones(shape))
        with tracker.fork():
            first = F.dropout(ones, 0.5)
        with torch_tp.random.fork():
            second = F.dropout(ones, 0.5)
        default = torch.rand(shape)
    for rank, local in _by_rank(first).items():
        expected = single_device(rank)  # on a 1-D mesh, the TP rank is the rank
        assert_close(local, expected[0], msg=lambda m, r=rank: f"rank {r}, first fork: {m}")
        assert_close(_by_rank(second)[rank], expected[1])
        assert_close(_by_rank(default)[rank], expected[2])
    # the ranks of a TP group draw different masks inside a fork
    assert not torch.equal(_by_rank(first)[0], _by_rank(first)[1])

    # parallelize_module installs one the same way, from the default generator's seed
    torch_tp.random.set_rng_tracker(None)
    torch.manual_seed(seed)
    with LocalTensorMode(LOCAL_WORLD) as mode:
        torch_tp.parallelize_module(nn.Linear(8, 8), fake_mesh, torch_tp.ColwiseParallel())
        with torch_tp.random.fork():
            drawn = F.dropout(_on_every_rank(mode, torch.ones(shape)), 0.5)
    for rank, local in _by_rank(drawn).items():
        assert_close(local, single_device(rank)[0])


def test_loss_parallel_in_local_tensor_mode(fake_mesh):
    from torch.distributed._local_tensor import LocalTensorMode

    reference = _local_llama(dropout=0.0)
    model = copy.deepcopy(reference)
    tokens = torch.randint(0, LOCAL_VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, LOCAL_VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    weight = torch.rand(LOCAL_VOCAB, generator=torch.Generator().manual_seed(3))
    logits = reference(tokens)
    options = {"weight": weight, "label_smoothing": 0.1}
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), **options)
    expected.backward()

    with LocalTensorMode(LOCAL_WORLD) as mode:
        plan = llama_plan(sequence_parallel=True, loss_parallel=True)
        torch_tp.parallelize_module(model, fake_mesh, plan)
        sharded = model(_on_every_rank(mode, tokens))
        assert sharded.placements == (Shard(2),)
        target = distribute_tensor(_on_every_rank(mode, labels), fake_mesh, [Replicate()])
        class_weight = distribute_tensor(_on_every_rank(mode, weight), fake_mesh, [Replicate()])
        with torch_tp.loss_parallel():
            loss = F.cross_entropy(
                sharded.flatten(0, 1), target.flatten(), weight=class_weight, label_smoothing=0.1
            )
            loss.backward()
        _assert_on_every_rank(loss, expected, "loss")
        named = dict(model.named_parameters())
        for name, param in reference.named_parameters():
            _assert_on_every_rank(named[name].grad, param.grad, f"{name}.grad")

        # the function on local shards, with the vocabulary split found by an all-gather
        local = sharded.to_local().flatten(0, 1)
        found = torch_tp.loss.vocab_parallel_cross_entropy(
            local, _on_every_rank(mode, labels.flatten()), fake_mesh
        )
    _assert_on_every_rank(found, F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "loss")


# --------------------------------------------------------------------------- inference_mode
#
# Upstream's ``test_mlp_inference`` (``test/distributed/tensor/parallel/test_tp_examples.py``):
# the mesh is built outside ``torch.inference_mode()``, the model parallelized and run inside
# it; PyTorch runs that test on real ranks and under LocalTensorMode, where the mesh is built
# in the mode.


class _MLP(nn.Module):
    """Upstream's test ``MLPModule``: two Linear layers around a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def _mlp_inference(lib, mesh, model: nn.Module, inp: torch.Tensor) -> torch.Tensor:
    """Inside ``torch.inference_mode()``: a copy of ``model`` parallelized with ``lib`` on
    ``mesh`` (built outside it), run on ``inp``."""
    with torch.inference_mode():
        model_tp = copy.deepcopy(model)
        plan = {"net1": lib.ColwiseParallel(), "net2": lib.RowwiseParallel()}
        model_tp = lib.parallelize_module(model_tp, mesh, plan)
        return model_tp(inp)


def _mlp_inference_on_ranks() -> None:
    mesh = _mesh()
    torch.manual_seed(0)
    model, inp = _MLP(), torch.rand(8, 10)
    out = _mlp_inference(torch_tp, mesh, model, inp)
    assert out.is_inference()
    assert_close(out, model(inp))


def test_mlp_inference():
    run_distributed(_mlp_inference_on_ranks, 2)


def test_mlp_inference_in_local_tensor_mode(fake_mesh):
    from torch.distributed._local_tensor import LocalTensorMode

    torch.manual_seed(0)
    model, inp = _MLP(), torch.rand(8, 10)
    expected = model(inp)
    with LocalTensorMode(LOCAL_WORLD) as mode:
        # as upstream's test builds it: in the mode, outside inference_mode
        mesh = init_device_mesh("cpu", (LOCAL_WORLD,))
        out = _mlp_inference(torch_tp, mesh, model, _on_every_rank(mode, inp))
        theirs = _mlp_inference(upstream, mesh, model, _on_every_rank(mode, inp))
    _assert_on_every_rank(out, expected, "output")
    _assert_on_every_rank(theirs, expected, "upstream's output")
