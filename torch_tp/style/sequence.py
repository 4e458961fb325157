"""Styles that replicate a module's parameters, and styles that only move layouts.

:class:`SequenceParallel` (norms and dropout on a sequence shard) and
:class:`ReplicateParallel` (a module computing on local views of replicated parameters) share
``_ReplicatedParameters``. :class:`PrepareModuleInput`, :class:`PrepareModuleOutput` and
:class:`PrepareModuleInputOutput` own no parameters: they move a module's inputs and outputs
between layouts.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from torch_tp import _torch_compat as compat
from torch_tp import runtime
from torch_tp.contract import Boundary, Layout, StyleContract
from torch_tp.random import sequence_parallel_dropout
from torch_tp.style.base import (
    ParallelStyle,
    check_flag,
    check_int,
    check_kwarg_layouts,
    check_layouts,
    check_not_distributed,
    check_whole_not_distributed,
    close_partial_region,
    distribute_and_wrap,
    distribute_whole,
    enter_partial_region,
    error_in_module,
    in_partial_region,
    open_partial_region,
    run_on_local_parameters,
    style_arguments,
    style_at,
    swap_back,
    swap_in_local_parameters,
    unstyled_submodules,
)

__all__ = [
    "SequenceParallel",
    "ReplicateParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
]


class _ReplicatedParameters(ParallelStyle):
    """What :class:`SequenceParallel` and :class:`ReplicateParallel` share: the module's own
    parameters become replicated DTensors, and its own forward runs inside ``_forward``."""

    def _parameter_placements(self, module: nn.Module) -> dict[str, Placement]:
        return {name: Replicate() for name, _ in module.named_parameters(recurse=False)}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_and_wrap(self, module, device_mesh, self._parameter_placements(module))

    @abstractmethod
    def _forward(
        self, module: nn.Module, rt: runtime.DTensorRuntime, own_forward, *inputs, **kwargs
    ):
        """The module's forward, given its own (unbound) ``own_forward``."""


class SequenceParallel(_ReplicatedParameters):
    """Run a normalization or dropout layer on a sequence shard of its input.

    The module's parameters are replicated (broadcast from ``src_data_rank``, so they need
    not be ones); its first input is taken as sharded on ``sequence_dim`` (a local tensor is
    annotated so, a DTensor is moved there), and so is its output. Gradients of the
    replicated parameters are summed over the sequence shards, so every rank holds the full
    gradient. This is the sequence parallelism of `Reducing Activation Recomputation in Large
    Transformer Models <https://arxiv.org/abs/2205.05198>`__.

    Supported modules: ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.Dropout``, and hand-written norms
    whose class name ends in ``RMSNorm`` or ``LayerNorm`` and whose parameters are 1-D (the
    per-feature scale and shift of Llama-style models) and their own: a submodule holding
    parameters that no style of the plan takes (a gated norm's ``Linear``) is refused.
    ``nn.Dropout`` draws the mask the single-device model would draw from the same seed and
    keeps this rank's slice of it.

    Keyword Args:
        sequence_dim (int, optional): the sequence dimension of the input. Default: 1.
        use_local_output (bool, optional): return the local :class:`torch.Tensor` instead of a
            :class:`DTensor`. Default: ``False``.
        output_layouts (Placement, optional): the layout of the output: the sequence shard
            (``Shard(sequence_dim)``), or ``Replicate()``, the whole sequence gathered once
            for the column-parallel projections of the block the norm feeds (their input
            gradients are added up locally and reduce-scattered back once).
            Default: ``None`` (the sequence shard).

    Returns:
        A :class:`ParallelStyle` that runs the module sequence-parallel.

    Raises:
        ValueError: ``output_layouts`` is neither the sequence shard nor ``Replicate()``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module, SequenceParallel
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> m = Model(...)  # a module with a "norm" nn.LayerNorm submodule
        >>> tp_mesh = init_device_mesh("cuda", (8,))
        >>> # "norm" takes a sequence shard and returns a DTensor sharded on the sequence
        >>> sharded_mod = parallelize_module(m, tp_mesh, {"norm": SequenceParallel()})
    """

    contract = StyleContract(
        # a norm or dropout on a sequence shard (dim 1), handing on a local tensor
        names={"sequence_parallel": {"use_local_output": True}},
        arguments=lambda s: {
            "sequence_dim": s.sequence_sharding[0].dim,
            "use_local_output": s.use_local_output,
            **({"output_layouts": s.output_layouts} if s.gathers_output else {}),
        },
        modules=(nn.LayerNorm, nn.RMSNorm, nn.Dropout, "*RMSNorm", "*LayerNorm"),
        parameters=lambda s, m: s._parameter_placements(m),
        # computed on a sequence shard: each rank's gradient covers its positions only
        partial_gradients=lambda s, m: tuple(n for n, _ in m.named_parameters(recurse=False)),
        inputs=lambda s, m: Boundary((Layout(s.sequence_sharding[0], s.sequence_sharding[0]),)),
        outputs=lambda s, m: Boundary(
            (
                Layout(
                    s.sequence_sharding[0],
                    s.sequence_sharding[0] if s.output_layouts is None else s.output_layouts,
                    s.use_local_output,
                ),
            )
        ),
        local_forward=lambda s, m: True,
    )

    def __init__(
        self,
        *,
        sequence_dim: int = 1,
        use_local_output: bool = False,
        output_layouts: Placement | None = None,
    ) -> None:
        super().__init__()
        self.sequence_sharding = (Shard(check_int(sequence_dim, "sequence_dim")),)
        self.use_local_output = check_flag(use_local_output, "use_local_output")
        if output_layouts == self.sequence_sharding[0]:
            output_layouts = None  # the default, stated
        if output_layouts is not None and not isinstance(output_layouts, Replicate):
            raise ValueError(
                f"SequenceParallel hands its output on sharded on the sequence "
                f"({self.sequence_sharding[0]!r}) or gathered (Replicate()), found output_layouts="
                f"{output_layouts!r}"
            )
        # None: the sequence shard (upstream's only layout)
        self.output_layouts = output_layouts

    @property
    def gathers_output(self) -> bool:
        """Whether the output is handed on gathered (``output_layouts=Replicate()``)."""
        return isinstance(self.output_layouts, Replicate)

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        self._check_kind(module)
        stock = isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.Dropout))
        if not stock and any(p.ndim != 1 for p in module.parameters(recurse=False)):
            raise NotImplementedError(
                f"SequenceParallel supports hand-written norms ({type(module).__qualname__}) "
                "whose parameters are per-feature scales and shifts (1-D), found "
                f"{[tuple(p.shape) for p in module.parameters(recurse=False)]}"
            )
        unstyled = {id(sub) for sub in unstyled_submodules(module)}
        inner = [
            f"{path}.{name}"
            for path, sub in module.named_modules()
            if id(sub) in unstyled
            for name, _ in sub.named_parameters(recurse=False)
        ]
        if inner:
            # its own parameters are replicated and their gradients summed; a submodule's
            # would compute on the shard with nothing summing their gradients
            raise NotImplementedError(
                f"SequenceParallel runs {type(module).__qualname__} on a sequence shard with its "
                f"own parameters replicated, found parameters of submodules no style plans: "
                f"{inner}"
            )
        check_not_distributed(module)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)
        placements = self._parameter_placements(module)
        return distribute_and_wrap(self, module, device_mesh, placements, self._boundaries(module))

    def _forward(
        self,
        module: nn.Module,
        rt: runtime.DTensorRuntime,
        own_forward,
        boundaries: tuple[Layout, Layout],
        *inputs,
        **kwargs,
    ):
        entry, exit = boundaries  # the contract's layouts (_boundaries)
        if not inputs or not isinstance(inputs[0], torch.Tensor):
            found = type(inputs[0]).__name__ if inputs else "no input"
            raise ValueError(
                f"{style_at(self, module)}: expecting the first input to be a torch.Tensor or "
                f"DTensor, found {found}"
            )
        x = inputs[0]
        try:
            layout = runtime.normalize(entry.to, x.ndim)
            computed = runtime.normalize(exit.given, x.ndim)
            handed_on = runtime.normalize(exit.to, x.ndim)
        except runtime.ShardDimError as err:
            raise error_in_module(self, module, err) from None
        global_shape = None  # a local input: even shards, as everywhere
        if isinstance(x, DTensor):
            x = rt.redistribute(x, layout)
            global_shape = x.shape
            if handed_on != computed and global_shape[layout.dim] % rt.mesh.size():
                # the same global shape on every rank: every rank raises alike
                raise ValueError(
                    f"{style_at(self, module)}: the sequence (dim {layout.dim}) of length "
                    f"{global_shape[layout.dim]} does not split evenly over the "
                    f"{rt.mesh.size()} ranks; make it a multiple of {rt.mesh.size()}"
                )
            x = x.to_local()
        if own_forward is nn.Dropout.forward:
            if not module.training or module.p == 0.0:
                out = x  # the identity, as nn.Dropout's
            else:
                # a mask of the local shape would be the same on every rank, and not the
                # single-device one: draw the full mask and keep this rank's slice
                out = sequence_parallel_dropout(
                    x,
                    module.p,
                    module.training,
                    module.inplace,
                    device_mesh=rt.mesh,
                    sequence_dim=layout.dim,
                    global_shape=global_shape,
                )
        else:
            # the module's own forward, on the local sequence shard: a norm treats every
            # position alike, so the shard's result is the shard of the whole result
            out = run_on_local_parameters(module, rt, True, own_forward, x, *inputs[1:], **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        # handed on as the contract says: as computed, or gathered once (the readers'
        # partial input gradients reduce-scattered back), a local tensor or a DTensor
        return rt.prepare(out, computed, handed_on, exit.local)


class ReplicateParallel(_ReplicatedParameters):
    """Replicate a module's parameters as DTensors; the module computes on local tensors.

    Every rank keeps the whole module, and its parameters become ``Replicate()`` DTensors,
    like every other parameter of the model (one kind of parameter for the optimizer,
    gradient clipping and checkpoints). The module's own forward runs unchanged on local
    views of them, on whatever local tensors it is given; no input or output is moved.

    A module that sees the whole activation (a router, a norm in the replicated region)
    computes the whole gradient on every rank: keep ``sum_gradients=False``. A module that
    sees only this rank's share of it (per-head ``q_norm``/``k_norm`` after a column-parallel
    projection) gets a partial gradient on each rank: ``sum_gradients=True`` sums them over
    the ranks (in the one all-reduce at the end of backward that sums all partial gradients).
    So does a router under dispatch expert parallelism (``ExpertParallel()`` with sequence
    parallelism: each rank routes its own tokens). Without ``sum_gradients``,
    :func:`parallelize_module` refuses the module where the plan shows that it computes on a
    shard (a module planned beside it takes its input as a shard that nothing planned there
    produces: :func:`torch_tp.plan_checks.unsummed_gradients`), and the dry-run report flags it
    wherever its trace finds it computing on one.

    A router on the whole (gathered) tokens of a block whose gradients are partial sums
    (tensor-parallel experts leaving their output partial, under sequence parallelism: see
    :class:`PrepareModuleInput`'s ``partial_input_gradients``) gets partial gradients of its
    routing weights from the experts, but the whole gradient, on every rank, of the
    probabilities a load-balancing loss is computed from (every rank computes that loss
    alike): ``whole_gradient_outputs`` names those outputs, whose gradient rank 0 alone hands
    back (zeros on the others), so that the sum over the ranks counts it once, exactly.

    Keyword Args:
        sum_gradients (bool, optional): sum the parameters' gradients over the ranks.
            Default: ``False``.
        whole_gradient_outputs (tuple of int, optional): positions of the outputs whose
            gradient is whole on every rank where the module's other gradients are partial
            sums; needs ``sum_gradients``. Default: ``()``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> plan = {"layers.*.self_attn.q_norm": ReplicateParallel(sum_gradients=True)}
    """

    contract = StyleContract(
        names={
            # every rank keeps the whole module; parameters are replicated DTensors
            "replicate": {},
            # a module that sees this rank's share of the activation (per-head q_norm/k_norm)
            "replicated_with_grad_allreduce": {"sum_gradients": True},
            # transformers' router of expert-parallel experts: ExpertParallel selects each
            # rank's routing slots itself, so the router stays whole on every rank
            "ep_router": {},
        },
        arguments=lambda s: {
            "sum_gradients": s.sum_gradients,
            **(
                {"whole_gradient_outputs": s.whole_gradient_outputs}
                if s.whole_gradient_outputs
                else {}
            ),
        },
        # the whole module: its own parameters and its unstyled submodules' (dotted names)
        parameters=lambda s, m: s._whole_placements(m),
        partial_gradients=lambda s, m: tuple(s._whole_placements(m)) if s.sum_gradients else (),
        # no boundary of its own: the report follows its ops, whose outputs are laid out
        # like the inputs it was given
        # no collective: inside a partial-sum region its gradients are partial sums
        partial_sum=lambda s: "either" if s.sum_gradients else None,
    )

    def __init__(
        self, *, sum_gradients: bool = False, whole_gradient_outputs: tuple[int, ...] = ()
    ) -> None:
        super().__init__()
        self.sum_gradients = check_flag(sum_gradients, "sum_gradients")
        outputs = (
            tuple(whole_gradient_outputs)
            if isinstance(whole_gradient_outputs, (tuple, list))
            else None
        )
        if outputs is None or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in outputs
        ):
            raise TypeError(
                "whole_gradient_outputs must be a tuple of output positions (ints >= 0), "
                f"found {whole_gradient_outputs!r}"
            )
        if outputs and not self.sum_gradients:
            raise ValueError(
                "whole_gradient_outputs counts a whole gradient once in gradients summed over "
                "the ranks: it needs sum_gradients=True"
            )
        self.whole_gradient_outputs = outputs

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        inner = {id(sub) for sub in unstyled_submodules(module)}
        styled = [
            path
            for path, sub in module.named_modules()
            if path and id(sub) not in inner and compat.direct_parameters(sub)
        ]
        if styled:
            raise ValueError(
                "ReplicateParallel keeps the whole module on every rank, and its submodules "
                f"{styled} have styles of their own in the plan: remove their entries (they "
                "are replicated with the module), or give the module's own parameters a "
                "style that leaves its submodules alone"
            )
        check_whole_not_distributed(module)

    def _whole_placements(self, module: nn.Module) -> dict[str, Placement]:
        """Every parameter the style replicates: the module's own, and those of its
        submodules without a style of their own (``"w1.weight"``), which ``_apply``
        replicates with it."""
        placements = self._parameter_placements(module)
        inner = {id(sub) for sub in unstyled_submodules(module)}
        for path, sub in module.named_modules():
            if path and id(sub) in inner:
                for name, _ in sub.named_parameters(recurse=False):
                    placements[f"{path}.{name}"] = Replicate()
        return placements

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)
        return distribute_whole(self, module, device_mesh, self._parameter_placements(module))

    def _forward(
        self,
        module: nn.Module,
        rt: runtime.DTensorRuntime,
        own_forward,
        inner: list[nn.Module],
        *inputs,
        **kwargs,
    ):
        swapped = swap_in_local_parameters(inner, rt, self.sum_gradients)
        try:
            out = run_on_local_parameters(
                module, rt, self.sum_gradients, own_forward, *inputs, **kwargs
            )
        finally:
            swap_back(swapped)
        if not self.whole_gradient_outputs:
            return out
        outputs = out if isinstance(out, tuple) else (out,)
        if max(self.whole_gradient_outputs) >= len(outputs):
            raise ValueError(
                f"{style_at(self, module)}: whole_gradient_outputs {self.whole_gradient_outputs} "
                f"names outputs the module does not return (it returns {len(outputs)})"
            )
        outputs = tuple(
            runtime.gradient_on_rank_zero(value, rt.mesh)
            if i in self.whole_gradient_outputs
            and isinstance(value, torch.Tensor)
            and value.requires_grad
            else value
            for i, value in enumerate(outputs)
        )
        return outputs if isinstance(out, tuple) else outputs[0]


class PrepareModuleInput(ParallelStyle):
    """Lay out a module's inputs as DTensors before its forward runs.

    Each positional input with a layout in ``input_layouts`` (and each keyword input named
    in ``input_kwarg_layouts``) is annotated with that layout if it is a local tensor, then
    moved to the matching desired layout. ``None`` leaves an input untouched.

    Keyword Args:
        input_layouts (Union[Placement, Tuple[Optional[Placement]]]): the layouts of the
            positional inputs; ``None`` is a placeholder for an input to leave alone.
            Default: ``None`` (positional inputs are left alone).
        desired_input_layouts (Union[Placement, Tuple[Optional[Placement]]]): the layouts the
            module should receive; same length as ``input_layouts``. Default: ``None``.
        input_kwarg_layouts (Dict[str, Placement]): the layouts of keyword inputs.
            Default: ``None``.
        desired_input_kwarg_layouts (Dict[str, Placement]): the layouts the module should
            receive for keyword inputs. Default: ``None``.
        use_local_output (bool, optional): give the module local :class:`torch.Tensor` inputs
            instead of DTensors. Default: ``False``.
        partial_input_gradients (bool, optional): the module computes with its whole inputs
            (every desired layout ``Replicate()``) against sharded weights and leaves its
            results partial sums (tensor-parallel experts and a row-parallel layer with
            ``output_layouts=Partial()``), so each rank's gradient of an input is a partial
            sum too: an input laid out ``Shard(d)`` gets the sum, reduce-scattered back
            (the sequence gathered forward, its gradient reduce-scattered backward); an input
            laid out ``Replicate()`` gets the sum, all-reduced back, unless it is the input of
            an enclosing module prepared this way: then it hands this rank's partial sum back
            as it is, to be summed where that region began (a whole gradient, computed alike
            on every rank, is handed back by rank 0 alone). Default: ``False``.

    Returns:
        A :class:`ParallelStyle` that prepares the module's inputs.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module, PrepareModuleInput
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> block = TransformerBlock(...)  # a module with an "attn" submodule
        >>> tp_mesh = init_device_mesh("cuda", (8,))
        >>> # the first input of "attn" arrives sharded on dim 0 and is replicated
        >>> parallelize_module(
        ...     block,
        ...     tp_mesh,
        ...     {"attn": PrepareModuleInput(
        ...         input_layouts=(Shard(0), None),
        ...         desired_input_layouts=(Replicate(), None),
        ...     )},
        ... )
    """

    contract = StyleContract(
        arguments=lambda s: {
            "input_layouts": s.input_layouts,
            "desired_input_layouts": s.desired_input_layouts,
            "input_kwarg_layouts": s.input_kwarg_layouts if s.with_kwargs else None,
            "desired_input_kwarg_layouts": s.desired_input_kwarg_layouts or None,
            "use_local_output": s.use_local_output,
            **({"partial_input_gradients": True} if s.partial_input_gradients else {}),
        },
        inputs=lambda s, m: s._boundary(),
    )

    def __init__(
        self,
        *,
        input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
        partial_input_gradients: bool = False,
    ) -> None:
        self.input_layouts = check_layouts(input_layouts, "input_layouts")
        self.desired_input_layouts = check_layouts(desired_input_layouts, "desired_input_layouts")
        self.use_local_output = check_flag(use_local_output, "use_local_output")
        self.partial_input_gradients = check_flag(
            partial_input_gradients, "partial_input_gradients"
        )
        if self.input_layouts is not None:
            # AssertionError, as upstream raises: callers may catch it
            if self.desired_input_layouts is None:
                raise AssertionError("desired module inputs should not be None!")
            if len(self.input_layouts) != len(self.desired_input_layouts):
                raise AssertionError(
                    "input_layouts and desired_input_layouts should have same length! "
                    f"found {len(self.input_layouts)} and {len(self.desired_input_layouts)}"
                )
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = check_kwarg_layouts(input_kwarg_layouts, "input_kwarg_layouts")
        self.desired_input_kwarg_layouts = check_kwarg_layouts(
            desired_input_kwarg_layouts, "desired_input_kwarg_layouts"
        )
        if self.with_kwargs and len(self.input_kwarg_layouts) != len(
            self.desired_input_kwarg_layouts
        ):
            raise AssertionError(
                "input_kwarg_layouts and desired_input_kwarg_layouts should have same length!"
            )
        if self.partial_input_gradients:
            self._check_partial_input_gradients()

    def _check_partial_input_gradients(self) -> None:
        pairs = list(zip(self.input_layouts or (), self.desired_input_layouts or (), strict=True))
        pairs += [
            (layout, self.desired_input_kwarg_layouts.get(name))
            for name, layout in self.input_kwarg_layouts.items()
        ]
        for layout, desired in pairs:
            if layout is None:
                continue
            if not isinstance(desired, Replicate) or not isinstance(layout, (Replicate, Shard)):
                raise ValueError(
                    "partial_input_gradients: the module computes with whole inputs, so each "
                    "input must be laid out Replicate() or Shard(d) and desired Replicate(); "
                    f"found {layout} desired {desired}"
                )
            if isinstance(layout, Shard) and not self.use_local_output:
                raise ValueError(
                    "partial_input_gradients with an input laid out Shard(d) hands the module "
                    "its gathered local tensor: set use_local_output (use_local_input) too"
                )

    def _boundary(self) -> Boundary:
        local = self.use_local_output
        grad = Partial() if self.partial_input_gradients else None
        args = tuple(
            None if layout is None else Layout(layout, desired, local, grad)
            for layout, desired in zip(
                self.input_layouts or (), self.desired_input_layouts or (), strict=True
            )
        )
        kwargs = {
            name: Layout(layout, self.desired_input_kwarg_layouts.get(name), local, grad)
            for name, layout in self.input_kwarg_layouts.items()
        }
        return Boundary(args, kwargs, exact=self.input_layouts is not None)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rt = runtime.for_mesh(device_mesh)
        boundary = self._boundary()  # the contract's layouts, which the hooks compute with
        if self.with_kwargs:
            module.register_forward_pre_hook(
                functools.partial(self._prepare_with_kwargs, rt, boundary), with_kwargs=True
            )
        else:
            module.register_forward_pre_hook(functools.partial(self._prepare_hook, rt, boundary))
        if self.partial_input_gradients:
            # the region's whole inputs are known while its forward runs (in_partial_region)
            module.register_forward_hook(close_partial_region, always_call=True)
        return module

    def _prepare_hook(
        self,
        rt: runtime.DTensorRuntime,
        boundary: Boundary,
        module: nn.Module,
        inputs: tuple[Any, ...],
    ):
        if self.partial_input_gradients:
            open_partial_region(module)
        return self._prepare_args(rt, boundary, module, inputs)

    def _prepare_with_kwargs(
        self,
        rt: runtime.DTensorRuntime,
        boundary: Boundary,
        module: nn.Module,
        inputs: tuple[Any, ...],
        kwargs: dict,
    ):
        if self.partial_input_gradients:
            open_partial_region(module)
        prepared = {
            key: self._prepare_one(module, key, value, rt, boundary.kwargs.get(key))
            for key, value in kwargs.items()
        }
        return self._prepare_args(rt, boundary, module, inputs), prepared

    def _prepare_args(
        self,
        rt: runtime.DTensorRuntime,
        boundary: Boundary,
        module: nn.Module,
        inputs: tuple[Any, ...],
    ) -> tuple[Any, ...]:
        if not boundary.exact:  # input_layouts=None: positional inputs left alone
            return inputs
        if len(inputs) != len(boundary.args):
            raise ValueError(
                f"{style_at(self, module)}: module inputs and input_layouts should have same "
                f"length! found {len(inputs)} inputs for {len(boundary.args)} layouts"
            )
        return tuple(
            self._prepare_one(module, i, value, rt, layout)
            for i, (value, layout) in enumerate(zip(inputs, boundary.args, strict=True))
        )

    def _prepare_one(
        self,
        module: nn.Module,
        where: int | str,
        value: Any,
        rt: runtime.DTensorRuntime,
        layout: Layout | None,
    ):
        """Prepare one input as ``layout`` says (``None``: left alone); ``where`` is its
        position, or its keyword (named on error only: this runs for every input of every
        call)."""
        if layout is None:
            return value
        if not isinstance(value, torch.Tensor):
            what = f"input {where}" if isinstance(where, int) else f"keyword input {where!r}"
            # AssertionError, as upstream raises
            raise AssertionError(
                f"{style_at(self, module)}: expecting {what} to be a torch.Tensor for layout "
                f"{layout.given}, found {type(value).__name__}"
            )
        try:
            if isinstance(layout.grad, Partial):  # partial_input_gradients
                return self._enter_partial(rt, value, layout)
            return rt.prepare(value, layout.given, layout.to, layout.local)
        except runtime.ShardDimError as err:
            raise error_in_module(self, module, err) from None

    def _enter_partial(self, rt: runtime.DTensorRuntime, value: torch.Tensor, layout: Layout):
        """One whole input whose gradient comes back a partial sum (``partial_input_gradients``)."""
        given = layout.given
        if isinstance(given, Shard) or isinstance(value, DTensor) or not in_partial_region(value):
            # gathered (or, replicated, handed on), and the partial gradients summed back
            # into the layout
            local = rt.enter(value, layout)
            if not layout.local:
                return DTensor.from_local(local, rt.mesh)
            # recorded, so that a style inside that would sum its own gradients can refuse
            enter_partial_region(local)
            return local
        # a replicated local input of an enclosing partial-gradient region (which sums the
        # gradients where it began): handed back as it is
        return value if layout.local else runtime.replicated_from_local(value, rt.mesh)


# set on a module once PrepareModuleOutput found every parameter inside its partial sum planned
_PARTIAL_SUM_CHECKED = "_torch_tp_partial_sum_checked"


@torch.compiler.assume_constant_result
def _mesh_ranks(mesh: DeviceMesh) -> frozenset[int]:
    """The global ranks of ``mesh``. A constant of the mesh, which torch.compile takes as
    one (the mesh tensor's values are data to its tracer, and a set of them could not be
    traced)."""
    return frozenset(mesh.mesh.flatten().tolist())


class PrepareModuleOutput(ParallelStyle):
    """Lay out a module's outputs as DTensors after its forward runs.

    Each output with a layout in ``output_layouts`` is annotated with that layout if it is a
    local tensor, then moved to the matching desired layout; ``None`` leaves an output
    untouched. A module returning one tensor gets one tensor back.

    Keyword Args:
        output_layouts (Union[Placement, Tuple[Optional[Placement]]]): the layouts of the
            outputs; ``None`` is a placeholder for an output to leave alone.
        desired_output_layouts (Union[Placement, Tuple[Placement]]): the layouts to return;
            same length as ``output_layouts``.
        use_local_output (bool, optional): return local :class:`torch.Tensor` outputs instead
            of DTensors. Default: ``True``.

    Returns:
        A :class:`ParallelStyle` that prepares the module's outputs.

    Raises:
        ValueError: at the module's first call, when an output is laid out ``Partial()`` (a
            partial sum over the ranks, summed here) and a parameter inside the module is
            distributed by no style over the mesh's ranks: computed whole on every rank, it
            would be counted once per rank. Raised on every rank alike, naming it.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module, PrepareModuleOutput
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> block = TransformerBlock(...)
        >>> tp_mesh = init_device_mesh("cuda", (8,))
        >>> # the block's replicated output is returned sharded on dim 0
        >>> parallelize_module(
        ...     block,
        ...     tp_mesh,
        ...     PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
        ... )
    """

    contract = StyleContract(
        arguments=lambda s: {
            "output_layouts": s.output_layouts,
            "desired_output_layouts": s.desired_output_layouts,
            "use_local_output": s.use_local_output,
        },
        outputs=lambda s, m: Boundary(
            tuple(
                None if layout is None else Layout(layout, desired, s.use_local_output)
                for layout, desired in zip(s.output_layouts, s.desired_output_layouts, strict=True)
            ),
            exact=True,
        ),
    )

    def __init__(
        self,
        *,
        output_layouts: Placement | tuple[Placement | None, ...],
        desired_output_layouts: Placement | tuple[Placement, ...],
        use_local_output: bool = True,
    ) -> None:
        self.output_layouts = check_layouts(output_layouts, "output_layouts")
        self.desired_output_layouts = check_layouts(
            desired_output_layouts, "desired_output_layouts"
        )
        self.use_local_output = check_flag(use_local_output, "use_local_output")
        if self.output_layouts is None or self.desired_output_layouts is None:
            raise AssertionError("output_layouts and desired_output_layouts must be given!")
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise AssertionError(
                "output_layouts and desired_output_layouts should have same length! found "
                f"{len(self.output_layouts)} and {len(self.desired_output_layouts)}"
            )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rt = runtime.for_mesh(device_mesh)
        if any(isinstance(layout, Partial) for layout in self.output_layouts):
            # before any input hook's collective
            module.register_forward_pre_hook(
                functools.partial(self._check_partial_sum, rt), prepend=True
            )
        boundary = type(self).contract.outputs(self, module)  # which the hook computes with
        module.register_forward_hook(functools.partial(self._prepare_hook, rt, boundary))
        return module

    def _check_partial_sum(self, rt: runtime.DTensorRuntime, module: nn.Module, inputs: Any):
        """On the first call (every style of the model applied by then, in however many
        ``parallelize_module`` calls): refuse a module inside whose parameters no style
        distributed over this mesh's ranks. Its output is a partial sum: a submodule
        computing whole on every rank would have its share counted once per rank (or, feeding
        a partial sum, a partial gradient nobody sums). The same module tree on every rank:
        every rank raises alike."""
        if getattr(module, _PARTIAL_SUM_CHECKED, False):
            return
        ranks = _mesh_ranks(rt.mesh)
        for path, sub in module.named_modules():
            for name, param in sub.named_parameters(recurse=False):
                mesh = param.device_mesh if isinstance(param, DTensor) else None
                if mesh is None or not (mesh is rt.mesh or ranks <= _mesh_ranks(mesh)):
                    where = f"{path}.{name}" if path else name
                    raise ValueError(
                        f"{style_at(self, module)}: its output is a partial sum over the "
                        f"{rt.mesh.size()} ranks, summed once at its end, but parameter "
                        f"{where!r} ({type(sub).__name__}) inside it is distributed by no "
                        "style over those ranks: computed whole on every rank, its share of "
                        "the output would be counted once per rank (or its gradient, from a "
                        "partial sum, left partial). Plan that module: tensor-parallel with "
                        "its output a partial sum, or ReplicateParallel(sum_gradients=True) "
                        "for a router or gate that only weighs the partial sums"
                    )
        setattr(module, _PARTIAL_SUM_CHECKED, True)

    def _prepare_hook(
        self,
        rt: runtime.DTensorRuntime,
        boundary: Boundary,
        module: nn.Module,
        inputs: Any,
        outputs: Any,
    ):
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if len(outputs) != len(boundary.args):
            raise ValueError(
                f"{style_at(self, module)}: module outputs and output_layouts should have same "
                f"length! found {len(outputs)} outputs for {len(boundary.args)} layouts"
            )
        prepared = []
        for i, (value, layout) in enumerate(zip(outputs, boundary.args, strict=True)):
            if layout is None:
                prepared.append(value)
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{style_at(self, module)}: expecting output {i} to be a torch.Tensor for "
                    f"layout {layout.given}, found {type(value).__name__}"
                )
            try:
                prepared.append(rt.prepare(value, layout.given, layout.to, layout.local))
            except runtime.ShardDimError as err:
                raise error_in_module(self, module, err) from None
        return prepared[0] if len(prepared) == 1 else tuple(prepared)


class PrepareModuleInputOutput(ParallelStyle):
    """Lay out a module's inputs before and its outputs after its forward runs.

    The combination of :class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one
    module; see those for the meaning of each argument.

    Keyword Args:
        input_layouts (Union[Placement, Tuple[Optional[Placement]]]): the layouts of the
            positional inputs. Default: ``None``.
        desired_input_layouts (Union[Placement, Tuple[Optional[Placement]]]): the layouts the
            module should receive. Default: ``None``.
        input_kwarg_layouts (Dict[str, Placement]): the layouts of keyword inputs.
            Default: ``None``.
        desired_input_kwarg_layouts (Dict[str, Placement]): the layouts the module should
            receive for keyword inputs. Default: ``None``.
        use_local_input (bool, optional): give the module local tensors instead of DTensors.
            Default: ``False``.
        output_layouts (Union[Placement, Tuple[Optional[Placement]]]): the layouts of the
            outputs.
        desired_output_layouts (Union[Placement, Tuple[Placement]]): the layouts to return.
        use_local_output (bool, optional): return local tensors instead of DTensors.
            Default: ``True``.
        partial_input_gradients (bool, optional): the module's gradients of its whole inputs
            are partial sums (see :class:`PrepareModuleInput`). Default: ``False``.

    Returns:
        A :class:`ParallelStyle` that prepares the module's inputs and outputs.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from torch_tp import parallelize_module, PrepareModuleInputOutput
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> block = TransformerBlock(...)
        >>> tp_mesh = init_device_mesh("cuda", (8,))
        >>> parallelize_module(
        ...     block,
        ...     tp_mesh,
        ...     {"attn": PrepareModuleInputOutput(
        ...         input_layouts=(Shard(0), None),
        ...         desired_input_layouts=(Replicate(), None),
        ...         output_layouts=Replicate(),
        ...         desired_output_layouts=Shard(0),
        ...     )},
        ... )
    """

    contract = StyleContract(
        arguments=lambda s: {
            **{
                ("use_local_input" if k == "use_local_output" else k): v
                for k, v in style_arguments(s.prepare_module_input).items()
            },
            **style_arguments(s.prepare_module_output),
        },
        inputs=lambda s, m: s.prepare_module_input._boundary(),
        outputs=lambda s, m: PrepareModuleOutput.contract.outputs(s.prepare_module_output, m),
    )

    def __init__(
        self,
        *,
        input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_input: bool = False,
        output_layouts: Placement | tuple[Placement | None, ...],
        desired_output_layouts: Placement | tuple[Placement, ...],
        use_local_output: bool = True,
        partial_input_gradients: bool = False,
    ) -> None:
        check_flag(use_local_input, "use_local_input")
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
            partial_input_gradients=partial_input_gradients,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts,
            desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module
