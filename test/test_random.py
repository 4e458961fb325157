"""The TP RNG tracker and sequence-parallel dropout: which masks agree, which differ, and
that dropout under tensor and sequence parallelism trains exactly like one device."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.checkpoint import checkpoint

import torch_tp.random as tp_random
from torch_tp import ColwiseParallel, RowwiseParallel, parallelize_module
from torch_tp.models import Llama, LlamaConfig
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import check_parity, run_distributed


@contextlib.contextmanager
def _clean_tracker() -> Iterator[None]:
    """Start and end without a tracker: the worker processes are shared between tests."""
    tp_random.set_rng_tracker(None)
    try:
        yield
    finally:
        tp_random.set_rng_tracker(None)


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _mask(n: int = 256) -> torch.Tensor:
    return F.dropout(torch.ones(n), 0.5, training=True)


# --------------------------------------------------------------------------- (a), (b): who agrees


def _replicated_and_forked_masks() -> None:
    with _clean_tracker():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tracker = tp_random.manual_seed(7, mesh)
        tp_rank = mesh.get_local_rank("tp")
        assert tracker.tp_rank == tp_rank and tp_random.get_rng_tracker() is tracker

        replicated = _mask()
        default_state = torch.get_rng_state()
        with tracker.fork():
            forked = _mask()
        assert torch.equal(torch.get_rng_state(), default_state), "fork consumed the default"

        # the documented seeds: the default stream with 7, the TP stream with 7 + 2718 + tp_rank
        torch.manual_seed(7)
        assert torch.equal(replicated, _mask())
        torch.manual_seed(7 + 2718 + tp_rank)
        assert torch.equal(forked, _mask())

        replicated_all, forked_all = _gather(replicated), _gather(forked)
        coordinates = mesh.mesh  # rank at (dp, tp)
        for i in range(dist.get_world_size()):
            assert torch.equal(replicated_all[i], replicated_all[0]), "replicated masks differ"
            for j in range(dist.get_world_size()):
                (ci,) = (coordinates == i).nonzero().tolist()
                (cj,) = (coordinates == j).nonzero().tolist()
                same_tp = ci[1] == cj[1]
                assert torch.equal(forked_all[i], forked_all[j]) == same_tp, (i, j)


@pytest.mark.four_ranks
def test_replicated_region_agrees_fork_region_differs_by_tp_rank():
    run_distributed(_replicated_and_forked_masks, 4)


# --------------------------------------------------------------------------- (c): reproducible


def _draw(tracker: tp_random.TensorParallelRNGTracker) -> list[torch.Tensor]:
    with tracker.fork():
        first = _mask()
    default = _mask()
    with tracker.fork():
        second = _mask()
    return [first, default, second]


def _reproducible() -> None:
    with _clean_tracker():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        tracker = tp_random.manual_seed(3, mesh)
        run = _draw(tracker)
        assert not torch.equal(run[0], run[2]), "the TP stream restarted at the second fork"
        tracker = tp_random.manual_seed(3, mesh)
        for a, b in zip(run, _draw(tracker), strict=True):
            assert torch.equal(a, b), "the same seed drew different masks"

        # a checkpoint of both streams, through torch.save, replays them
        buffer = io.BytesIO()
        torch.save(tracker.state_dict(), buffer)
        saved = _draw(tracker)
        _draw(tracker)  # move on
        buffer.seek(0)
        tracker.load_state_dict(torch.load(buffer))
        for a, b in zip(saved, _draw(tracker), strict=True):
            assert torch.equal(a, b), "load_state_dict did not restore the streams"

        # a nested fork is the same stream, not a restart
        tracker = tp_random.manual_seed(3, mesh)
        with tracker.fork():
            with tp_random.fork():
                nested = _mask()
            after = _mask()
        assert torch.equal(nested, run[0]) and not torch.equal(after, run[0])

        with tracker.fork(), pytest.raises(RuntimeError, match="inside fork"):
            tracker.state_dict()
        other_rank = dict(tracker.state_dict(), tp_rank=1 - tracker.tp_rank)
        with pytest.raises(ValueError, match="load each rank's own state"):
            tracker.load_state_dict(other_rank)


def test_same_seed_same_masks_and_state_dict_round_trip():
    run_distributed(_reproducible, 2)


def _seeding_errors() -> None:
    with _clean_tracker():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        with pytest.raises(ValueError, match=r"same value, found seeds \[0, 1\]"):
            tp_random.manual_seed(dist.get_rank(), mesh)
        with pytest.raises(TypeError, match="seed must be an int"):
            tp_random.manual_seed(True, mesh)
        mesh_2d = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "model"))
        with pytest.raises(ValueError, match="dimension named 'tp'"):
            tp_random.manual_seed(0, mesh_2d)
        with pytest.raises(TypeError, match="TensorParallelRNGTracker or None"):
            tp_random.set_rng_tracker(mesh)
        assert tp_random.get_rng_tracker() is None


def test_seeding_errors():
    run_distributed(_seeding_errors, 2)


def _default_install() -> None:
    with _clean_tracker():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(5)
        with tp_random.fork():  # no tracker: a no-op, the default stream draws
            unforked = _mask()
        torch.manual_seed(5)
        assert torch.equal(unforked, _mask())
        torch.manual_seed(5)
        state = torch.get_rng_state()
        tracker = tp_random._ensure_tracker(mesh)
        assert torch.equal(torch.get_rng_state(), state), "installing reseeded the default"
        assert tp_random._ensure_tracker(mesh) is tracker, "a fitting tracker was replaced"
        with tracker.fork():
            auto = _mask()
        # the same TP stream as manual_seed(5)
        with tp_random.manual_seed(5, mesh).fork():
            assert torch.equal(auto, _mask())
        explicit = tp_random.get_rng_tracker()
        torch.manual_seed(6)
        assert tp_random._ensure_tracker(mesh) is explicit, "the user's tracker was replaced"

        tp_random.set_rng_tracker(None)
        first = tp_random._ensure_tracker(mesh)
        torch.manual_seed(7)  # a new seed: a new automatic stream
        second = tp_random._ensure_tracker(mesh)
        assert second is not first and second.seed == 7


def test_default_tracker():
    run_distributed(_default_install, 2)


def _parallelize_module_installs() -> None:
    with _clean_tracker():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(5)
        linear = nn.Linear(4, 4)
        state = torch.get_rng_state()
        with pytest.raises(ValueError):  # a bad plan changes nothing, installs nothing
            parallelize_module(linear, mesh, {"nothing": ColwiseParallel()})
        assert tp_random.get_rng_tracker() is None
        parallelize_module(linear, mesh, ColwiseParallel())
        tracker = tp_random.get_rng_tracker()
        assert tracker is not None and tracker.seed == 5 and tracker.tp_rank == dist.get_rank()
        assert torch.equal(torch.get_rng_state(), state), "parallelize_module reseeded"


def test_parallelize_module_installs_a_tracker():
    run_distributed(_parallelize_module_installs, 2)


# --------------------------------------------------------------------------- (d): checkpointing


class _TPMLP(nn.Module):
    """A column-parallel hidden layer with dropout in the fork region (each rank holds other
    columns), then a replicated dropout on the output."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.up(x))
        with tp_random.fork():
            h = F.dropout(h, 0.5, self.training)
        return F.dropout(self.down(h), 0.2, self.training)


def _checkpointed(module: nn.Module, context_fn=None) -> nn.Module:
    kwargs = {} if context_fn is None else {"context_fn": context_fn}
    module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False, **kwargs)
    return module


def _train(model: nn.Module, inputs: list[tuple], seed: int, mesh) -> list[torch.Tensor]:
    """Two steps from the same seed; the outputs, every (local) gradient and the final
    TP stream state."""
    tracker = tp_random.manual_seed(seed, mesh)
    results = []
    for args in inputs:
        model.zero_grad(set_to_none=True)
        out = model(*args)
        loss = (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
        loss.backward()
        results.append(out.detach())
        for p in model.parameters():
            g = p.grad
            results.append((g.to_local() if isinstance(g, DTensor) else g).clone())
    results.append(tracker.generator.get_state())
    return results


def _all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _checkpoint_replays_fork_masks() -> None:
    with _clean_tracker():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(0)
        base = _TPMLP()
        inputs = [(torch.randn(4, 8),), (torch.randn(4, 8),)]
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}

        def build(wrap) -> nn.Module:
            return wrap(parallelize_module(copy.deepcopy(base), mesh, plan))

        plain = _train(build(lambda m: m), inputs, 0, mesh)
        replayed = _train(
            build(lambda m: _checkpointed(m, tp_random.checkpoint_contexts)), inputs, 0, mesh
        )
        assert _all_equal(plain, replayed), "checkpointing changed the forward or the gradients"
        # without the contexts the fork region draws new masks when it is recomputed
        redrawn = _train(build(_checkpointed), inputs, 0, mesh)
        assert not _all_equal(plain[:-1], redrawn[:-1]), "the negative control passed"

        # sequence-parallel dropout in checkpointed Llama blocks: the default stream, which
        # checkpoint restores itself
        config = LlamaConfig(
            dim=32, n_layers=2, n_heads=4, vocab_size=101, max_seq_len=16, dropout=0.2
        )
        torch.manual_seed(0)
        llama = Llama(config)
        tokens = [(torch.randint(0, 101, (2, 8)),), (torch.randint(0, 101, (2, 8)),)]

        def build_llama(checkpointed: bool) -> nn.Module:
            model = parallelize_module(
                copy.deepcopy(llama), mesh, llama_plan(sequence_parallel=True)
            )
            if checkpointed:
                for layer in model.layers:
                    _checkpointed(layer, tp_random.checkpoint_contexts)
            return model

        assert _all_equal(
            _train(build_llama(False), tokens, 1, mesh), _train(build_llama(True), tokens, 1, mesh)
        ), "checkpointing changed a sequence-parallel Llama"


def test_checkpoint_replays_fork_masks_and_gradients():
    run_distributed(_checkpoint_replays_fork_masks, 2)


# --------------------------------------------------------------------------- (e): SP dropout


_CASES = [
    # shape, sequence dim, p, dtype
    ((2, 16, 8), 1, 0.5, torch.float32),
    ((3, 7, 5), 1, 0.1, torch.float32),  # uneven shards
    ((9, 4), 0, 0.3, torch.float64),
    ((2, 3, 4), 1, 0.5, torch.bfloat16),  # on 4 ranks, one shard is empty
    ((2, 5, 6), -1, 0.5, torch.float32),
]


def _sequence_parallel_dropout_equals_single_device() -> None:
    with _clean_tracker():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        rank, size = dist.get_rank(), dist.get_world_size()
        for shape, dim, p, dtype in _CASES:
            torch.manual_seed(0)
            full = torch.randn(shape, dtype=dtype)
            weight = torch.randn(shape, dtype=dtype)
            d = dim % len(shape)
            chunk = -(-shape[d] // size)
            start = min(rank * chunk, shape[d])
            length = min(start + chunk, shape[d]) - start

            def ref_slice(t: torch.Tensor, d=d, start=start, length=length) -> torch.Tensor:
                return t.narrow(d, start, length)

            x = full.clone().requires_grad_()
            torch.manual_seed(1)
            expected = F.dropout(x, p, training=True)
            expected_state = torch.get_rng_state()
            (expected * weight).sum().backward()
            assert 0 < (expected == 0).sum() < expected.numel(), "a trivial mask proves nothing"

            local = ref_slice(full).clone().requires_grad_()
            torch.manual_seed(1)
            y = tp_random.sequence_parallel_dropout(
                local, p, device_mesh=mesh, sequence_dim=dim, global_shape=shape
            )
            assert torch.equal(torch.get_rng_state(), expected_state), "consumed differently"
            (y * ref_slice(weight)).sum().backward()
            assert torch.equal(y, ref_slice(expected)), (shape, dim)
            assert torch.equal(local.grad, ref_slice(x.grad)), (shape, dim)

            # the same through a DTensor, sharded and replicated
            for placement, piece in ((Shard(d), ref_slice(full)), (Replicate(), full)):
                dt = DTensor.from_local(
                    piece,
                    mesh,
                    (placement,),
                    run_check=False,
                    shape=full.shape,
                    stride=full.stride(),
                )
                torch.manual_seed(1)
                out = tp_random.sequence_parallel_dropout(dt, p)
                assert out.placements == (placement,)
                assert torch.equal(out.full_tensor(), expected.detach()), (shape, placement)

        x = torch.ones(2, 4, 3)
        assert tp_random.sequence_parallel_dropout(x, 0.5, training=False, device_mesh=mesh) is x
        assert tp_random.sequence_parallel_dropout(x, 0.0, device_mesh=mesh) is x
        with pytest.raises(ValueError, match="between 0 and 1"):
            tp_random.sequence_parallel_dropout(x, 1.5, device_mesh=mesh)
        with pytest.raises(ValueError, match="is not shard"):
            tp_random.sequence_parallel_dropout(x, 0.5, device_mesh=mesh, global_shape=(2, 5, 3))
        with pytest.raises(ValueError, match="needs the device_mesh"):
            tp_random.sequence_parallel_dropout(x, 0.5)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.four_ranks)])
def test_sequence_parallel_dropout_equals_single_device_slice(world_size):
    run_distributed(_sequence_parallel_dropout_equals_single_device, world_size)


def _reseed_every_forward(module: nn.Module, args: tuple) -> None:
    # check_parity runs the reference, then the TP model: each starts its step's forward
    # from the same default-generator state, and draws its masks with its own code
    module._forward_calls = getattr(module, "_forward_calls", 0) + 1
    torch.manual_seed(1000 + module._forward_calls)


def _llama_dropout_parity(sequence_parallel: bool) -> None:
    with _clean_tracker():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(0)
        config = LlamaConfig(
            dim=64, n_layers=2, n_heads=4, vocab_size=1001, max_seq_len=32, dropout=0.1
        )
        model = Llama(config).train()
        model.register_forward_pre_hook(_reseed_every_forward)
        tokens = torch.randint(0, config.vocab_size, (2, 16))
        targets = torch.randint(0, config.vocab_size, (2, 16))

        def loss_fn(logits: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

        _, ref = check_parity(
            model,
            mesh,
            llama_plan(sequence_parallel=sequence_parallel),
            (tokens,),
            loss_fn=loss_fn,
            optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.5),
            steps=2,
            rtol=1e-5,
            atol=1e-5,
        )
        # the dropout was real: the same step in eval mode gives another loss
        train_loss = loss_fn(ref(tokens))
        assert not torch.allclose(train_loss, loss_fn(ref.eval()(tokens)))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_llama_dropout_matches_single_device(sequence_parallel):
    run_distributed(_llama_dropout_parity, 2, sequence_parallel)
