"""Parity between a tensor-parallel model and a single-device copy of it.

:func:`check_parity` is how a plan is tested: copy the model (the single-device reference),
parallelize the original, check that its full state is the copy's exactly, train both side
by side and compare output, loss, every gradient and every parameter, failing on the first
difference with its name.

Every rank runs the whole check. All collectives of a step (gathering the output, the
gradients, the parameters) run before anything is compared: if ranks disagreed on whether
something differs, a rank that stopped early would leave the others waiting in a collective.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from torch_tp.runtime import normalize
from torch_tp.runtime.boundaries import contiguous_stride

__all__ = ["check_parity", "gather_full"]

# Seed of the random weights of the default loss; any fixed value works.
_LOSS_SEED = 1234


def _as_placements(
    placement: Placement | Sequence[Placement], device_mesh: DeviceMesh
) -> list[Placement]:
    placements = [placement] if isinstance(placement, Placement) else list(placement)
    if len(placements) != device_mesh.ndim or not all(isinstance(p, Placement) for p in placements):
        raise ValueError(
            f"expected one Placement per mesh dimension ({device_mesh.ndim}), found {placement!r}"
        )
    return placements


def gather_full(
    tensor: Tensor, device_mesh: DeviceMesh, placement: Placement | Sequence[Placement]
) -> Tensor:
    """Return the full tensor of which ``tensor`` is this rank's local piece.

    Differentiable: the gradient of the full tensor flows back to the local piece. Shards may
    be uneven (sizes as :func:`torch.chunk` splits them, which is how DTensor shards): the
    global size is found by all-gathering the local sizes. A :class:`DTensor` is gathered
    with ``full_tensor()`` and ``placement`` is ignored. Must be called on every rank.

    Args:
        tensor: the local piece on this rank.
        device_mesh: the mesh ``tensor`` is laid out on.
        placement: how ``tensor`` is laid out: a :class:`Placement` for a 1-D mesh (e.g.
            ``Shard(-1)``, ``Partial()``), or one per mesh dimension.

    Returns:
        The full tensor, the same on every rank.

    Example::

        >>> mesh = init_device_mesh("cpu", (2,))
        >>> local = torch.full((2, 3), float(dist.get_rank()))
        >>> gather_full(local, mesh, Shard(0))  # a 4 x 3 tensor on both ranks  # doctest: +SKIP
        tensor([[0., 0., 0.],
                [0., 0., 0.],
                [1., 1., 1.],
                [1., 1., 1.]])
    """
    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    placements = _as_placements(placement, device_mesh)
    shape = list(tensor.shape)
    normalized = [normalize(p, tensor.ndim) for p in placements]
    # The last mesh dimension splits innermost: undo it first, so that each all-gather sums
    # sizes that are already the same across the group of the next (outer) mesh dimension.
    for mesh_dim in reversed(range(device_mesh.ndim)):
        p = normalized[mesh_dim]
        if not isinstance(p, Shard):
            continue
        if not 0 <= p.dim < tensor.ndim:
            raise ValueError(f"{p} is out of range for a {tensor.ndim}-D tensor")
        local = torch.tensor([shape[p.dim]], dtype=torch.int64, device=tensor.device)
        group = device_mesh.get_group(mesh_dim)
        sizes = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, local, group=group)
        shape[p.dim] = int(sum(int(s.item()) for s in sizes))
    full = DTensor.from_local(
        tensor,
        device_mesh,
        normalized,
        run_check=False,
        shape=torch.Size(shape),
        stride=contiguous_stride(shape),
    )
    return full.full_tensor()


def _gather_output(out: Any, placements: Any, device_mesh: DeviceMesh) -> Any:
    """Gather every tensor of a (possibly nested) model output to a full tensor."""
    if isinstance(out, DTensor):
        return out.full_tensor()
    if isinstance(out, Tensor):
        return out if placements is None else gather_full(out, device_mesh, placements)
    if isinstance(out, (tuple, list)):
        if isinstance(placements, (tuple, list)):
            if len(placements) != len(out):
                raise ValueError(
                    f"output_placements has {len(placements)} entries but the output has "
                    f"{len(out)} elements"
                )
            items = [
                _gather_output(o, p, device_mesh) for o, p in zip(out, placements, strict=True)
            ]
        else:
            items = [_gather_output(o, placements, device_mesh) for o in out]
        if isinstance(out, tuple) and hasattr(out, "_fields"):  # a namedtuple
            return type(out)(*items)
        return type(out)(items)
    if isinstance(out, Mapping):
        gathered = {k: _gather_output(v, placements, device_mesh) for k, v in out.items()}
        try:
            return type(out)(**gathered)
        except Exception:
            return gathered
    return out


def _tensor_leaves(out: Any, path: str = "") -> list[tuple[str, Tensor]]:
    if isinstance(out, Tensor):
        return [(path, out)]
    if isinstance(out, (tuple, list)):
        return [leaf for i, o in enumerate(out) for leaf in _tensor_leaves(o, f"{path}[{i}]")]
    if isinstance(out, Mapping):
        return [leaf for k, v in out.items() for leaf in _tensor_leaves(v, f"{path}[{k!r}]")]
    return []


def _default_loss(out: Any) -> Tensor:
    # Weighting by fixed random values makes every output element's gradient different, so
    # a gradient routed to the wrong place shows up (the gradient of a plain sum would not).
    gen = torch.Generator().manual_seed(_LOSS_SEED)
    terms = []
    for _, t in _tensor_leaves(out):
        if not t.is_floating_point():
            continue
        weight = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        terms.append((t * weight.to(device=t.device, dtype=t.dtype)).sum())
    if not terms:
        raise ValueError("the output has no floating-point tensor; pass a loss_fn")
    return sum(terms[1:], terms[0])


def _full(t: Tensor | None) -> Tensor | None:
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


def _full_state_dict(module: nn.Module) -> dict[str, Any]:
    return {k: _full(v) if isinstance(v, Tensor) else v for k, v in module.state_dict().items()}


def _compare(what: str, actual: Any, expected: Any, tol: dict[str, float]) -> None:
    if (actual is None) != (expected is None):
        missing = "the TP model" if actual is None else "the reference"
        raise AssertionError(f"{what} differs: it is None in {missing} only")
    if actual is None:
        return
    try:
        torch.testing.assert_close(actual, expected, **tol)
    except AssertionError as e:
        raise AssertionError(f"{what} differs: {e}") from None


def check_parity(
    model: nn.Module,
    device_mesh: DeviceMesh,
    parallelize_plan: Any,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    tp_args: tuple[Any, ...] | None = None,
    tp_kwargs: dict[str, Any] | None = None,
    output_placements: Placement | Sequence[Any] | None = None,
    loss_fn: Callable[[Any], Tensor] | None = None,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    steps: int = 1,
    rtol: float | None = None,
    atol: float | None = None,
) -> tuple[nn.Module, nn.Module]:
    """Check that a tensor-parallel model trains exactly like a single-device copy of it.

    Parallelizes ``model`` with ``torch_tp.parallelize_module(model, device_mesh,
    parallelize_plan)``, checks that the full state of the result equals exactly a
    single-device copy made beforehand (the reference), then for each step runs both models,
    computes a loss on the full output of each, backpropagates, optionally steps an optimizer
    on each, and compares with :func:`torch.testing.assert_close`: the output, the loss, the
    gradient of every parameter (in ``named_parameters()`` order), then every parameter after
    the optimizer step. Must be called on every rank (e.g. from a function run with
    :func:`torch_tp.testing.run_distributed`), with the same model and inputs on every rank.

    Args:
        model: the unsharded model, identical on every rank (build it after the same seed).
            It is parallelized in place.
        device_mesh: the mesh to parallelize on.
        parallelize_plan: anything ``torch_tp.parallelize_module`` accepts.
        args: positional inputs of the reference model (and of the TP model by default).
        kwargs: keyword inputs of the reference model (and of the TP model by default).
        tp_args: positional inputs of the TP model, if they differ (e.g. pre-sharded).
        tp_kwargs: keyword inputs of the TP model, if they differ.
        output_placements: how the TP model's output is laid out when it is a local tensor:
            a placement (e.g. ``Shard(-1)``, gathered with :func:`gather_full`), or ``None``
            if it is already full. For a tuple or list output, either one value for every
            tensor or a tuple with one value per element. DTensor outputs are always gathered
            with ``full_tensor()``.
        loss_fn: maps the full output to a scalar loss. Default: the sum over all floating
            point tensors ``t`` of the output of ``(t * R).sum()``, with ``R`` a fixed random
            tensor of ``t``'s shape (the same on every rank and for both models).
        optimizer_fn: builds an optimizer from parameters, e.g.
            ``lambda ps: torch.optim.SGD(ps, lr=0.1)``. Default: no optimizer step.
        steps: the number of training steps.
        rtol: relative tolerance; give both ``rtol`` and ``atol`` or neither (the defaults of
            :func:`torch.testing.assert_close` for the dtype).
        atol: absolute tolerance.

    Returns:
        ``(tp_model, reference)`` after the last step.

    Raises:
        AssertionError: on the first difference, naming the step and what differs, e.g.
            ``step 0: gradient of 'layers.0.attention.wq.weight' differs: ...``.

    Example::

        >>> def mlp_parity() -> None:  # at module level, run with run_distributed(mlp_parity)
        ...     torch.manual_seed(0)
        ...     model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        ...     mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
        ...     plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        ...     check_parity(
        ...         model, mesh, plan, (torch.randn(4, 8),),
        ...         optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.1), steps=2,
        ...     )
    """
    import torch_tp

    if (rtol is None) != (atol is None):
        raise ValueError("rtol and atol must be given together (or neither)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, found {steps!r}")
    tol = {} if rtol is None else {"rtol": rtol, "atol": atol}
    kwargs = {} if kwargs is None else kwargs
    tp_args = args if tp_args is None else tp_args
    tp_kwargs = kwargs if tp_kwargs is None else tp_kwargs
    loss_fn = _default_loss if loss_fn is None else loss_fn

    reference = copy.deepcopy(model)
    tp_model = torch_tp.parallelize_module(model, device_mesh, parallelize_plan)
    # Distributing the parameters must not change them: the TP model's full state is the
    # single-device model's, exactly (every rank gathers every entry before any comparison,
    # so a rank that finds a difference cannot leave the others waiting in a collective).
    tp_state = _full_state_dict(tp_model)
    for name, expected in reference.state_dict().items():
        actual = tp_state.get(name)
        if isinstance(expected, Tensor):
            _compare(
                f"{name!r} after parallelize_module (the model must be identical on every rank)",
                actual,
                expected,
                {"rtol": 0.0, "atol": 0.0},
            )

    tp_names = [name for name, _ in tp_model.named_parameters()]
    ref_names = [name for name, _ in reference.named_parameters()]
    if tp_names != ref_names:
        raise AssertionError(
            "the parameters differ: only in the TP model: "
            f"{sorted(set(tp_names) - set(ref_names))}, only in the reference: "
            f"{sorted(set(ref_names) - set(tp_names))}, names in order: {tp_names} vs "
            f"{ref_names}"
        )
    tp_optim = ref_optim = None
    if optimizer_fn is not None:
        tp_optim = optimizer_fn(tp_model.parameters())
        ref_optim = optimizer_fn(reference.parameters())

    for step in range(steps):
        tp_model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)

        ref_out = reference(*args, **kwargs)
        tp_out = _gather_output(tp_model(*tp_args, **tp_kwargs), output_placements, device_mesh)
        ref_loss, tp_loss = loss_fn(ref_out), loss_fn(tp_out)
        ref_loss.backward()
        tp_loss.backward()
        tp_loss = _full(tp_loss)
        tp_grads = [_full(p.grad) for p in tp_model.parameters()]
        ref_grads = [p.grad for p in reference.parameters()]

        ref_leaves, tp_leaves = _tensor_leaves(ref_out), _tensor_leaves(tp_out)
        if [path for path, _ in tp_leaves] != [path for path, _ in ref_leaves]:
            raise AssertionError(
                f"step {step}: the output structure differs: the TP model returned tensors at "
                f"{[p or 'output' for p, _ in tp_leaves]}, the reference at "
                f"{[p or 'output' for p, _ in ref_leaves]}"
            )
        for (path, tp_t), (_, ref_t) in zip(tp_leaves, ref_leaves, strict=True):
            _compare(f"step {step}: output{path}", tp_t, ref_t, tol)
        _compare(f"step {step}: loss", tp_loss, ref_loss, tol)
        for name, tp_g, ref_g in zip(ref_names, tp_grads, ref_grads, strict=True):
            _compare(f"step {step}: gradient of {name!r}", tp_g, ref_g, tol)

        if tp_optim is not None and ref_optim is not None:
            tp_optim.step()
            ref_optim.step()
            tp_params = [_full(p.detach()) for p in tp_model.parameters()]
            for name, tp_p, ref_p in zip(ref_names, tp_params, reference.parameters(), strict=True):
                _compare(
                    f"step {step}: parameter {name!r} after the optimizer step",
                    tp_p,
                    ref_p.detach(),
                    tol,
                )
    return tp_model, reference
