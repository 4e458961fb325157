"""Mixture-of-experts layers: :class:`ExpertParallel` (whole experts per rank, the tokens
sent to them), :class:`TensorParallelExperts` (every expert sharded on its hidden dimension)
and :class:`IdentityExpertParallel`, with the checks of the routing they share.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from torch_tp import _torch_compat as compat
from torch_tp import runtime
from torch_tp._torch_compat import StridedShard
from torch_tp.contract import Boundary, Layout, StyleContract, Transfer
from torch_tp.style import adapters as _adapters
from torch_tp.style import expert_adapters as _expert_adapters
from torch_tp.style.base import (
    ParallelStyle,
    check_not_distributed,
    distribute_and_wrap,
    in_partial_region,
    plan_root,
    run_on_local_parameters,
    short_repr,
    style_at,
)

__all__ = [
    "TensorParallelExperts",
    "ExpertParallel",
    "ExpertTensorParallel",
    "IdentityExpertParallel",
]


class TensorParallelExperts(ParallelStyle):
    """Shard every expert of a mixture-of-experts layer on its hidden dimension.

    For an experts module with stacked SwiGLU weights, as transformers' MoE models and
    :class:`torch_tp.models.moe.Experts` hold them: ``gate_up_proj`` ``[n_experts, 2 * hidden,
    dim]`` (each expert's gate rows, then its up rows) and ``down_proj`` ``[n_experts, dim,
    hidden]``, called as ``experts(hidden_states, top_k_index, top_k_weights)`` on replicated
    tokens. Rank ``r`` holds slice ``r`` of every expert's gate rows and of its up rows
    (DTensor's strided shard of dim 1, as :class:`PackedColwiseParallel`) and the matching
    columns of ``down_proj`` (``Shard(2)``). The module's own forward, run on those slices,
    gives every token a partial sum of its experts' outputs, summed over the ranks in one
    all-reduce; in the backward the gradients of the tokens and of the routing weights,
    partial sums too, are summed in one all-reduce. The routing itself (the indices) is the
    same on every rank. This is transformers' ``moe_tp_experts``.

    Experts stored transposed, ``gate_up_proj`` ``[n_experts, dim, 2 * hidden]`` and
    ``down_proj`` ``[n_experts, hidden, dim]`` (Llama 4's ``Llama4TextExperts``, which
    multiply ``x @ w`` and take the tokens already routed and weighted as their one input),
    are sharded alike on their hidden dimension: ``gate_up_proj`` strided on dim 2,
    ``down_proj`` on dim 1. The two layouts are told apart by the shapes, which no sizes
    make ambiguous. Experts without a gate, ``up_proj`` ``[n_experts, hidden, dim]`` and
    ``down_proj`` ``[n_experts, dim, hidden]`` (Nemotron-H), are sharded on the same
    dimension: ``up_proj`` ``Shard(1)``, ``down_proj`` ``Shard(2)``.

    With ``output_layouts=Partial()`` neither all-reduce happens here: the output is this
    rank's partial sum, and the gradients of the tokens and routing weights are handed back
    as this rank's partial sums, for a caller that sums them itself (a block whose sequence
    is gathered before and whose output is reduce-scattered after, as
    :class:`PrepareModuleInputOutput` with ``partial_input_gradients`` does: one all-gather
    and one reduce-scatter each way for the whole block).

    Keyword Args:
        output_layouts (Placement, optional): ``Replicate()``, the experts' output summed over
            the ranks, or ``Partial()``, left a partial sum (and the inputs' gradients too).
            Default: ``None``, ``Replicate()``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> plan = {
        ...     "layers.*.feed_forward.router": ReplicateParallel(),
        ...     "layers.*.feed_forward.experts": TensorParallelExperts(),
        ... }
    """

    contract = StyleContract(
        names={"moe_tp_experts": {}},
        arguments=lambda s: _output_arguments(s),
        parameters=lambda s, m: s._parameter_placements(m),
        # every rank computes with all the tokens and routing weights: partial gradients
        # (summed here, or handed back as they are with a partial output)
        inputs=lambda s, m: (
            Boundary(
                (
                    Layout(Replicate(), Replicate(), grad=Partial()),
                    None,
                    Layout(Replicate(), Replicate(), grad=Partial()),
                ),
                coalesced=True,
            )
            if isinstance(s.output_layouts, Replicate)
            else None
        ),
        outputs=lambda s, m: Boundary((Layout(Partial(), s.output_layouts),)),
        local_forward=lambda s, m: True,
        # whether any rank's expert ids are out of range, agreed (see _check_expert_ids)
        transfers=lambda s, m, inputs, degree: (
            (Transfer("forward", "all_reduce", 4),) if len(inputs) >= 2 else ()
        ),
    )

    def _meta_output(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """For the dry-run report: the routing counts are values a meta tensor lacks."""
        return _tokens_like(args)

    def __init__(self, *, output_layouts: Placement | None = None) -> None:
        super().__init__()
        self.output_layouts = _check_output_layouts(output_layouts)

    @staticmethod
    def _transposed(module: nn.Module) -> bool | None:
        """Whether the experts are stored transposed (``[E, H, 2I]``, ``[E, I, H]``), or not
        (``[E, 2I, H]``, ``[E, H, I]``); ``None``: neither (or no stacked weights)."""
        gate_up = getattr(module, "gate_up_proj", None)
        down = getattr(module, "down_proj", None)
        if not all(isinstance(p, torch.Tensor) and p.ndim == 3 for p in (gate_up, down)):
            return None
        (e, a, b), (e2, c, d) = gate_up.shape, down.shape
        # gate_up_proj may stack more experts than down_proj: identity ("zero") experts
        # after the routed ones (LongCat-Flash), which use neither
        if a == 2 * d and b == c and e >= e2:
            return False
        if e != e2:
            return None
        if b == 2 * c and a == d:
            return True  # both at once would need hidden == 0
        return None

    @staticmethod
    def _ungated(module: nn.Module) -> bool:
        """Experts without a gate: ``up_proj`` ``[E, I, H]`` and ``down_proj`` ``[E, H, I]``
        (Nemotron-H's ``down(act(up(x)))``), and no ``gate_up_proj``."""
        up, down = getattr(module, "up_proj", None), getattr(module, "down_proj", None)
        if getattr(module, "gate_up_proj", None) is not None or not all(
            isinstance(p, torch.Tensor) and p.ndim == 3 for p in (up, down)
        ):
            return False
        (e, i, h), (e2, h2, i2) = up.shape, down.shape
        return e == e2 and i == i2 and h == h2

    def _parameter_placements(self, module: nn.Module) -> dict[str, Placement]:
        # each rank: its slice of every expert's gate rows and of its up rows (strided),
        # the matching slice of down_proj's hidden dimension
        if self._ungated(module):
            return {"up_proj": Shard(1), "down_proj": Shard(2)}
        if self._transposed(module):
            return {"gate_up_proj": StridedShard(2, split_factor=2), "down_proj": Shard(1)}
        return {"gate_up_proj": StridedShard(1, split_factor=2), "down_proj": Shard(2)}

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        if self._ungated(module):
            hidden = module.up_proj.shape[1]
            if hidden % device_mesh.size():
                raise ValueError(
                    f"the experts' hidden size {hidden} does not divide by the "
                    f"{device_mesh.size()} ranks"
                )
            check_not_distributed(module)
            return
        gate_up = getattr(module, "gate_up_proj", None)
        down = getattr(module, "down_proj", None)
        stacked = all(isinstance(p, nn.Parameter) and p.ndim == 3 for p in (gate_up, down))
        if not stacked:
            raise NotImplementedError(
                "TensorParallelExperts supports experts modules with stacked parameters "
                "gate_up_proj [n_experts, 2 * hidden, dim] and down_proj [n_experts, dim, "
                "hidden] (or both transposed: [n_experts, dim, 2 * hidden] and [n_experts, "
                f"hidden, dim]), found {type(module).__qualname__} without them"
            )
        transposed = self._transposed(module)
        if transposed is None:
            raise ValueError(
                f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are "
                "not the stacked weights of SwiGLU experts ([E, 2I, H] and [E, H, I], or "
                "transposed [E, H, 2I] and [E, I, H])"
            )
        hidden = down.shape[1] if transposed else down.shape[2]
        n = device_mesh.size()
        if hidden % n:
            raise ValueError(
                f"the experts' hidden size {hidden} does not divide by the {n} ranks: "
                "each rank must hold the same slice of every expert's gate and up rows"
            )
        check_not_distributed(module)

    # PEFT's LoRA on the stacked weights (target_parameters=): see style/expert_adapters.py
    _hosts_parameter_adapters = True

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)  # an unsupported module must not be half-applied
        module = distribute_and_wrap(
            self,
            module,
            device_mesh,
            self.contract.parameters(self, module),
            self._entry_and_exit(module),
        )
        # hosts PEFT's LoRA on the weights, now or when PEFT wraps the experts later
        _adapters.remember(module, self, runtime.for_mesh(device_mesh))
        return module

    def _check_adapters(self, wrapper: nn.Module, base: nn.Module) -> None:
        """Raise unless this style can host ``wrapper``'s LoRA on ``base``'s weights."""
        _expert_adapters.check(self, wrapper, base)

    def _adapter_placements(self, base: nn.Module, wrapper: nn.Module) -> tuple[dict, dict]:
        """The placements of ``lora_A`` and ``lora_B`` of ``wrapper`` (LoRA on one of
        ``base``'s stacked weights): laid out like that weight."""
        return _expert_adapters.placements_of(self, wrapper, base)

    def _host_adapters(self, wrapper: nn.Module, base: nn.Module, device_mesh: DeviceMesh):
        """Lay out ``wrapper``'s LoRA (on ``base``'s weights) to match them and add each
        delta to its weight's local slice in the experts' forward."""
        _, rt = _adapters.remembered(base)
        _expert_adapters.host(self, wrapper, base, rt)

    def _forward(
        self,
        module: nn.Module,
        rt: runtime.DTensorRuntime,
        own_forward,
        layouts: tuple[Boundary | None, Layout],
        hidden_states: torch.Tensor,
        *routing: torch.Tensor,
        adapters: list | None = None,
    ) -> torch.Tensor:
        if len(routing) not in (0, 2):
            raise TypeError(
                f"{style_at(self, module)}: expected experts(hidden_states, top_k_index, "
                "top_k_weights), or experts(hidden_states) for tokens routed already, found "
                f"{1 + len(routing)} positional inputs"
            )
        _refuse_whole_in_partial_region(self, module, hidden_states)
        if routing:
            top_k_index, top_k_weights = routing
            stacked = module.up_proj if self._ungated(module) else module.gate_up_proj
            _check_expert_ids(self, module, rt, top_k_index, stacked.shape[0])
        entry, exit = layouts
        # the tokens and routing weights read whole, or (a partial output) as they are: the
        # caller sums their partial gradients (and the output) itself
        hidden_states, *routing = _enter_tokens(self, module, rt, entry, (hidden_states, *routing))
        if adapters:  # PEFT's LoRA on the weights: each local slice plus its delta's
            own_forward = functools.partial(
                _expert_adapters.adapted_forward, own_forward, rt, adapters
            )
        partial = run_on_local_parameters(module, rt, False, own_forward, hidden_states, *routing)
        return _leave_tokens(rt, exit, partial)


class ExpertParallel(ParallelStyle):
    """Split the experts of a mixture-of-experts layer over the ranks, whole experts per rank.

    For an experts module called as ``experts(hidden_states, top_k_index, top_k_weights)``
    on flattened tokens, whose parameters are stacked per expert on dim 0 (transformers' MoE
    models, :class:`torch_tp.models.moe.Experts`; biases such as ``gate_up_proj_bias [E, 2I]``
    too). With ``E`` experts over ``n`` ranks, rank ``r`` holds experts ``r * E / n`` to
    ``(r + 1) * E / n - 1``: every parameter is ``Shard(0)``. The module's own forward runs on
    those experts only, with the tokens routed to them; routing is dropless (no capacity, no
    token dropped; an expert or a rank that gets no token is fine).

    Where the tokens are:

    * ``input_layouts=Shard(0)`` (the default): each rank brings its own tokens (a
      data-parallel rank's batch, or this rank's sequence shard). Each (token, expert) pair
      is sent to the rank holding the expert by an all-to-all with data-dependent counts,
      computed there, and sent back by a second all-to-all; each rank then adds its tokens'
      results, times their routing weights, itself. Forward: one all-to-all of the counts and
      two of tokens; backward: the two reverse all-to-alls. The output is this rank's tokens',
      and the routing weights' gradient is local.
    * ``input_layouts=Replicate()``: every rank has all the tokens (expert parallelism over
      the tensor-parallel ranks, after a row-parallel attention). Nothing needs dispatching:
      each rank computes its experts on the tokens routed to them, and the partial outputs
      are summed in one all-reduce; in the backward the tokens' and routing weights' partial
      gradients are summed in one all-reduce. This is transformers' ``ep_dispatch_experts``
      plan (``grouped_gemm`` parameters).

    Expert ids outside ``[0, E)`` on any rank raise a ``ValueError`` naming the module on every
    rank, before any token moves: with ``Shard(0)`` the count of such ids travels with the
    exchanged counts; with ``Replicate()`` it is agreed in one all-reduce of one number. No
    rank is left waiting for another.

    Keyword Args:
        input_layouts (Placement, optional): ``Shard(0)`` (each rank its own tokens) or
            ``Replicate()`` (the same tokens on every rank). Default: ``None``, ``Shard(0)``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> # data parallel with experts split over the same ranks
        >>> plan = {
        ...     "layers.*.feed_forward.router": ReplicateParallel(sum_gradients=True),
        ...     "layers.*.feed_forward.experts": ExpertParallel(),
        ... }
    """

    contract = StyleContract(
        # transformers' expert-parallel plan: the same tokens on every rank; its parameter
        # entries ("grouped_gemm") state the experts' split
        names={
            "ep_dispatch_experts": {"input_layouts": Replicate()},
            "grouped_gemm": {"input_layouts": Replicate()},
        },
        arguments=lambda s: {"input_layouts": s.input_layouts},
        parameters=lambda s, m: {name: Shard(0) for name, _ in m.named_parameters(recurse=False)},
        inputs=lambda s, m: Boundary(
            (s._tokens_layout(), None, s._tokens_layout()), coalesced=True
        ),
        outputs=lambda s, m: Boundary(
            (
                Layout(Shard(0), Shard(0))
                if isinstance(s.input_layouts, Shard)
                else Layout(Partial(), Replicate()),
            )
        ),
        # computed on local tensors: the all-to-alls are declared as transfers
        local_forward=lambda s, m: True,
        transfers=lambda s, m, inputs, degree: s._transfers(m, inputs, degree),
        caveat=lambda s, m: (
            None
            if isinstance(s.input_layouts, Replicate)
            else "the all-to-alls' sizes follow the routing: shown for balanced routing (each "
            "rank receives as many routing slots as it sends; the mean over the ranks is that "
            "whatever the routing)"
        ),
    )

    def _parameter_entry(self, parameter: torch.Tensor) -> Placement:
        """A plan entry naming a parameter of this style's module (transformers'
        ``"...experts.gate_up_proj": "grouped_gemm"``): the stacked experts split on dim 0."""
        return Shard(0)

    def _meta_output(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """For the dry-run report: the routing counts are values a meta tensor lacks."""
        return _tokens_like(args)

    def __init__(self, *, input_layouts: Placement | None = None) -> None:
        super().__init__()
        input_layouts = Shard(0) if input_layouts is None else input_layouts
        if not (isinstance(input_layouts, Replicate) or input_layouts == Shard(0)):
            raise ValueError(
                "input_layouts must be Shard(0) (each rank its own tokens) or Replicate() "
                f"(the same tokens on every rank), found {short_repr(input_layouts)}"
            )
        self.input_layouts = input_layouts

    def _transfers(self, module: nn.Module, inputs: tuple, degree: int) -> tuple[Transfer, ...]:
        """The all-to-alls of dispatched tokens (none for replicated ones), under balanced
        routing: each rank sends its tokens' routing slots out and receives as many back."""
        if isinstance(self.input_layouts, Replicate):
            # the count of expert ids out of range, agreed (one int64)
            return (Transfer("forward", "all_reduce", 8),) if len(inputs) >= 2 else ()
        if len(inputs) < 2:
            return ()
        hidden, top_k_index = inputs[0], inputs[1]
        rows = hidden.shape[0] // degree * top_k_index.shape[-1]
        tokens = rows * hidden.shape[-1] * hidden.element_size()
        n_experts = next(module.parameters()).shape[0]
        counts = degree * (n_experts // degree + 1) * top_k_index.element_size()
        return (
            Transfer("forward", "all_to_all", counts),
            Transfer("forward", "all_to_all", tokens),
            Transfer("forward", "all_to_all", tokens),
            Transfer("backward", "all_to_all", tokens),
            Transfer("backward", "all_to_all", tokens),
        )

    def _tokens_layout(self) -> Layout:
        if isinstance(self.input_layouts, Replicate):
            # every rank computes with all of them: their gradients are partial sums
            return Layout(Replicate(), Replicate(), grad=Partial())
        return Layout(Shard(0), Shard(0))

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._validate(module, device_mesh)
        params = dict(module.named_parameters(recurse=False))
        if not params:
            raise NotImplementedError(
                f"ExpertParallel splits an experts module's own parameters, stacked per expert "
                f"on dim 0; {type(module).__qualname__} has none"
            )
        n_experts = {name: (p.shape[0] if p.ndim else None) for name, p in params.items()}
        if len(set(n_experts.values())) != 1 or None in n_experts.values():
            raise ValueError(
                "every parameter of an experts module must be stacked per expert on dim 0 "
                f"(the same leading size), found leading sizes {n_experts}"
            )
        experts, n = next(iter(n_experts.values())), device_mesh.size()
        if experts % n:
            raise ValueError(
                f"{experts} experts do not split over {n} ranks: each rank must hold the same "
                f"number of whole experts (use an expert-parallel degree that divides {experts})"
            )
        check_not_distributed(module)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)  # an unsupported module must not be half-applied
        n_experts = next(module.parameters()).shape[0]
        placements = self.contract.parameters(self, module)
        return distribute_and_wrap(
            self, module, device_mesh, placements, self._entry_and_exit(module), n_experts
        )

    def _forward(
        self,
        module: nn.Module,
        rt: runtime.DTensorRuntime,
        own_forward,
        layouts: tuple[Boundary | None, Layout],
        n_experts: int,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        entry, exit = layouts
        replicated = isinstance(self.input_layouts, Replicate)
        hidden_states, top_k_index, top_k_weights = _enter_tokens(
            self, module, rt, entry, (hidden_states, top_k_index, top_k_weights)
        )
        out = _route(
            self, module, rt, rt.mesh, own_forward, n_experts, hidden_states, top_k_index,
            top_k_weights, replicated=replicated,
        )  # fmt: skip
        return _leave_tokens(rt, exit, out)

    @staticmethod
    def _run_experts(
        module: nn.Module,
        rt: runtime.DTensorRuntime,
        own_forward,
        rows: torch.Tensor,
        counts: list[int],
    ) -> torch.Tensor:
        """The module's own forward on this rank's experts: ``rows`` are tokens, in runs of
        ``counts`` for local experts ``0, 1, ...`` (cycling when there are more runs than
        experts, one cycle per source rank); each row is its own token, of weight one."""
        local_experts = compat.local_tensor(next(module.parameters())).shape[0]
        expert = torch.arange(len(counts), device=rows.device) % local_experts
        ids = expert.repeat_interleave(
            torch.tensor(counts, device=rows.device), output_size=rows.shape[0]
        ).unsqueeze(-1)
        names = list(compat.direct_parameters(module))

        def compute(mod: nn.Module, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            # transformers' experts size their grouped matmul by their num_experts: this
            # rank's, while they compute
            with _attribute_as(mod, "num_experts", local_experts, only_if_int=True):
                out = own_forward(mod, rows, ids, rows.new_ones(ids.shape))
            if not rows.shape[0]:
                # no token for this rank's experts: keep its parameters and the rows in the
                # graph, so that the parameters get (zero) gradients as on one device and
                # the backward's collectives run on this rank as on the others
                anchor = rows.sum() + sum(getattr(mod, name).sum() for name in names)
                out = out + anchor * 0
            return out

        return run_on_local_parameters(module, rt, False, compute, rows, ids)


def _route(
    style: ParallelStyle,
    module: nn.Module,
    rt: runtime.DTensorRuntime,
    mesh: DeviceMesh,
    own_forward,
    n_experts: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    replicated: bool,
    agree_over: DeviceMesh | None = None,
) -> torch.Tensor:
    """The experts' output for ``hidden_states``' tokens, the experts split whole over the
    1-D ``mesh`` (``rt`` holds the module's parameters: :meth:`ExpertParallel._run_experts`).

    ``replicated``: every rank has every token; each computes its experts on the slots routed
    to them, and the output is this rank's partial sum (the caller reduces it). Otherwise each
    rank's tokens go to their experts' ranks and back by all-to-all over ``mesh``, and the
    output is this rank's tokens' whole (over ``mesh``) output. ``agree_over``: another mesh
    whose ranks must raise together for ids out of range (the ``tp`` ranks of
    :class:`ExpertTensorParallel`, which reduce the output over it): the count of such ids is
    agreed over it first (one all-reduce of one number), then travels with the counts."""
    n, rank = mesh.size(), mesh.get_local_rank()
    local_experts = n_experts // n
    # the routing slots grouped by expert, ids out of range counted last
    slots = top_k_index.reshape(-1)
    in_range = (slots >= 0) & (slots < n_experts)
    slots = torch.where(in_range, slots, n_experts)
    order = slots.argsort(stable=True)
    counts = torch.bincount(slots, minlength=n_experts + 1)
    if replicated:
        # the same routing on every rank: each takes the slots of its own experts. The
        # ids out of range are agreed over the mesh (one all-reduce of one number), so
        # that one rank's bad routing is an error on all, not a wait in the reduction
        group = mesh.get_group()
        flag = counts[-1:].to(runtime.flag_device(group), copy=True)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
        sent = torch.cat([counts, flag.to(counts.device)]).tolist()
        if sent[-1]:
            error = _bad_expert_ids(style, module, n_experts) if sent[-2] else None
            runtime.raise_agreed(error, [group])
        sent = sent[:-1]
        bad = ""
        first = sum(sent[: rank * local_experts])
        mine = sent[rank * local_experts : (rank + 1) * local_experts]
    else:
        # each rank's count per expert to the rank holding it, with the number of ids out
        # of range: every rank learns whether any rank must raise, before any token moves
        out_of_range = counts[-1:]
        if agree_over is not None and agree_over.size() > 1:  # (over one rank: agreed)
            group = agree_over.get_group()
            flag = out_of_range.to(runtime.flag_device(group), copy=True)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
            out_of_range = flag.to(counts.device)
        outgoing = torch.cat([counts[:-1].view(n, local_experts), out_of_range.expand(n, 1)], dim=1)
        incoming = _all_to_all(
            outgoing.reshape(-1), mesh, [local_experts + 1] * n, [local_experts + 1] * n
        )
        both = torch.cat([counts[:-1], incoming]).tolist()
        sent, received = both[:n_experts], both[n_experts:]
        per_source = [
            received[r * (local_experts + 1) : (r + 1) * (local_experts + 1)] for r in range(n)
        ]
        bad_ranks = [str(r) for r, row in enumerate(per_source) if row[-1]]
        also = ", or on a rank of its tensor-parallel group" if agree_over is not None else ""
        bad = bad_ranks and f" (on rank {', '.join(bad_ranks)} of the expert-parallel group{also})"
    if bad:
        raise ValueError(
            f"{style_at(style, module)}: the router gave expert ids outside [0, {n_experts})"
            f"{bad}; top_k_index must hold ids of the module's experts"
        )
    top_k = top_k_index.shape[-1]
    routed = order[: sum(sent[:n_experts])]
    weights = top_k_weights.reshape(-1)[routed].unsqueeze(-1)
    token = routed // top_k
    if replicated:
        token = token[first : first + sum(mine)]
        weights = weights[first : first + sum(mine)]
        rows = hidden_states[token]
        out_rows = ExpertParallel._run_experts(module, rt, own_forward, rows, mine)
    else:
        to_rank = [sum(sent[r * local_experts : (r + 1) * local_experts]) for r in range(n)]
        from_rank = [sum(row[:-1]) for row in per_source]
        rows = _all_to_all_expert_parallel_region(hidden_states[token], mesh, from_rank, to_rank)
        # rows from each source rank, by local expert within each
        out_rows = ExpertParallel._run_experts(
            module, rt, own_forward, rows, [c for row in per_source for c in row[:-1]]
        )
        out_rows = _all_to_all_expert_parallel_region(out_rows, mesh, to_rank, from_rank)
    return torch.zeros_like(hidden_states).index_add(0, token, out_rows * weights)


def _refuse_dtensor_tokens(style: ParallelStyle, module: nn.Module, inputs: tuple) -> None:
    if any(isinstance(t, DTensor) for t in inputs):
        raise ValueError(
            f"{style_at(style, module)}: expected this rank's tokens as local tensors, found a "
            "DTensor (give the module local tensors, e.g. with use_local_output=True)"
        )


def _enter_tokens(
    style: ParallelStyle,
    module: nn.Module,
    rt: runtime.DTensorRuntime,
    entry: Boundary | None,
    values: tuple,
) -> tuple:
    """The experts' inputs as ``entry`` states them: those it reads whole (``to=Replicate()``,
    partial gradients) entered together, their gradients summed in one all-reduce; without
    any, this rank's local tensors as they are (a partial output, whose caller sums their
    gradients; expert-parallel tokens, which are this rank's own)."""
    layouts = entry.args if entry is not None else ()
    whole = [
        i
        for i, layout in enumerate(layouts[: len(values)])
        if layout is not None and isinstance(layout.to, Replicate)
    ]
    if not whole:
        _refuse_dtensor_tokens(style, module, values)
        return values
    entered = list(values)
    for i, value in zip(
        whole, rt.enter_replicated_many(tuple(values[i] for i in whole)), strict=True
    ):
        entered[i] = value
    return tuple(entered)


def _leave_tokens(rt: runtime.DTensorRuntime, exit: Layout, partial: torch.Tensor) -> torch.Tensor:
    """The experts' output as ``exit`` states it: summed into ``exit.to``, or as computed (a
    partial sum its caller reduces; expert-parallel tokens, back on the rank they came from)."""
    if exit.to == exit.given:
        return partial
    return rt.exit(partial, exit, partial.shape)


class IdentityExpertParallel(ParallelStyle):
    """An identity ("zero") expert inside tensor-parallel experts: its output divided by the
    TP degree.

    LongCat-Flash routes some slots to experts that return the token itself. Under
    :class:`TensorParallelExperts` every rank computes those with the whole token, and the
    experts' output is summed over the ranks: each rank's identity output must be its
    ``1/n`` share of it. The gradients of the token and of the routing weight then come back
    ``1/n`` on each rank, and the experts' input reduction sums them whole. (With ``n`` a
    power of two, the division is exact.) This is transformers' ``moe_identity_expert``; it
    goes on the ``nn.Identity`` module next to the stacked weights.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> plan = {
        ...     "layers.*.mlp.experts": "moe_tp_experts",
        ...     "layers.*.mlp.experts.identity_expert": "moe_identity_expert",
        ... }
    """

    contract = StyleContract(
        names={"moe_identity_expert": {}},
        arguments=lambda s: {},
        modules=(nn.Identity,),
        local_forward=lambda s, m: True,
    )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)
        n = device_mesh.size()
        module.register_forward_hook(lambda mod, args, output: output / n)
        return module


class ExpertTensorParallel(ParallelStyle):
    """Split the experts of a mixture-of-experts layer over two mesh dimensions: whole
    experts over the first (``ep``), each expert's matrices over the second (``tp``).

    Applied on a 2-D mesh ``(ep, tp)`` with named dimensions, to an experts module with
    stacked weights as :class:`TensorParallelExperts` takes them (``gate_up_proj`` ``[E, 2I,
    H]`` and ``down_proj`` ``[E, H, I]``, their transposes, or ungated ``up_proj``). Rank
    ``(e, t)`` holds experts ``e * E / ep`` to ``(e + 1) * E / ep - 1`` and, of each, slice ``t``
    of its gate rows and of its up rows and the matching slice of ``down_proj``: each
    parameter is ``(Shard(0), p)`` where ``p`` is :class:`TensorParallelExperts`'s placement.
    This is expert tensor parallelism (Megatron-core's ETP, torchtitan's
    ``ExpertTensorParallel``).

    The tokens: each rank of ``ep`` brings its own (expert parallelism borrowed from data
    parallelism: each ``ep`` rank its own batch), the same on every rank of ``tp`` (attention
    and the dense layers tensor-parallel on ``mesh["tp"]``; under sequence parallelism the MoE
    block gathers the sequence before the experts, as for :class:`TensorParallelExperts`).
    Each (token, expert) pair is sent to its expert's ``ep`` rank by an all-to-all over ``ep``
    (the counts, then the tokens), computed there on that rank's ``tp`` slices, and sent
    back by a second all-to-all; each rank adds its tokens' results, times their routing
    weights, and the partial sums are summed over ``tp`` in one all-reduce. In the backward:
    the two reverse all-to-alls, and one all-reduce over ``tp`` of the tokens' and routing
    weights' gradients. An expert's gradient gathers the contributions of every ``ep``
    rank's tokens (the all-to-all's backward): the sum over the ``ep`` ranks' losses, as for
    :class:`ExpertParallel` over data-parallel ranks.

    Expert ids outside ``[0, E)`` on any rank raise a ``ValueError`` naming the module on
    every rank before any token moves: their count is agreed over ``tp`` (one all-reduce of
    one number) and travels with the counts over ``ep``.

    With ``output_layouts=Partial()`` the sum over ``tp`` is left to the caller, as for
    :class:`TensorParallelExperts`: the output is this rank's partial sum over ``tp``, and
    the tokens' and routing weights' gradients are handed back as partial sums over ``tp``
    (a block gathering its sequence over ``tp`` before and reduce-scattering its output
    after).

    Keyword Args:
        output_layouts (Placement, optional): ``Replicate()`` (summed over ``tp``) or
            ``Partial()`` (left a partial sum over ``tp``). Default: ``None``,
            ``Replicate()``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("ep", "tp"))
        >>> parallelize_module(model, mesh["tp"], dense_plan)  # attention, router, ...
        >>> experts = {"layers.*.feed_forward.experts": ExpertTensorParallel()}
        >>> parallelize_module(model, mesh, experts)  # the 2-D mesh
    """

    contract = StyleContract(
        names={"ep_tp_experts": {}},
        arguments=lambda s: _output_arguments(s),
        parameters=lambda s, m: {
            name: (Shard(0), placement)
            for name, placement in TensorParallelExperts()._parameter_placements(m).items()
        },
        # over tp (the mesh's last dimension), as TensorParallelExperts: the tokens and
        # routing weights read whole, their partial gradients and the output summed
        inputs=lambda s, m: TensorParallelExperts.contract.inputs(s, m),
        outputs=lambda s, m: TensorParallelExperts.contract.outputs(s, m),
        local_forward=lambda s, m: True,
        # over ep: the counts and the tokens' all-to-alls; over tp: the agreed id check
        transfers=lambda s, m, inputs, degree: s._transfers(m, inputs, degree),
        caveat=lambda s, m: ExpertParallel.contract.caveat(ExpertParallel(), m),
        mesh_ndim=2,
    )

    def _meta_output(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """For the dry-run report: the routing counts are values a meta tensor lacks."""
        return _tokens_like(args)

    def __init__(self, *, output_layouts: Placement | None = None) -> None:
        super().__init__()
        self.output_layouts = _check_output_layouts(output_layouts)

    def _transfers(
        self, module: nn.Module, inputs: tuple, degree: tuple[int, int]
    ) -> tuple[Transfer, ...]:
        """What :func:`_route` sends, under balanced routing: the id check agreed over tp
        (one int64), then over ep the counts and each ep rank's own tokens' routing slots,
        out and back (the tokens are this ep rank's: each brings its own batch)."""
        if len(inputs) < 2:
            return ()
        ep = degree[0]
        hidden, top_k_index = inputs[0], inputs[1]
        tokens = hidden.shape[0] * top_k_index.shape[-1] * hidden.shape[-1] * hidden.element_size()
        stacked = module.up_proj if TensorParallelExperts._ungated(module) else module.gate_up_proj
        counts = ep * (stacked.shape[0] // ep + 1) * top_k_index.element_size()
        return (
            Transfer("forward", "all_reduce", 8, mesh_dim=1),
            Transfer("forward", "all_to_all", counts, mesh_dim=0),
            Transfer("forward", "all_to_all", tokens, mesh_dim=0),
            Transfer("forward", "all_to_all", tokens, mesh_dim=0),
            Transfer("backward", "all_to_all", tokens, mesh_dim=0),
            Transfer("backward", "all_to_all", tokens, mesh_dim=0),
        )

    def _validate(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        self._check_kind(module)
        names = device_mesh.mesh_dim_names
        if device_mesh.ndim != 2 or not names:
            raise ValueError(
                "ExpertTensorParallel takes a 2-D mesh with named dimensions, (ep, tp): "
                "experts split over the first, each expert's matrices over the second; found "
                f"a {device_mesh.ndim}-D mesh with dims {names}"
            )
        if {"ep", "tp"} <= set(names) and tuple(names) != ("ep", "tp"):
            raise ValueError(
                f"the mesh's dims are {names}: ExpertTensorParallel splits the experts over the "
                "first and each expert's matrices over the second; pass mesh['ep', 'tp']"
            )
        ep, tp = device_mesh[names[0]], device_mesh[names[1]]
        # each expert's matrices: as TensorParallelExperts over tp (stacked, hidden divisible)
        TensorParallelExperts()._validate(module, tp)
        placed = set(TensorParallelExperts()._parameter_placements(module))
        others = sorted(set(compat.direct_parameters(module)) - placed)
        if others:
            raise NotImplementedError(
                f"ExpertTensorParallel splits the stacked expert weights only; "
                f"{type(module).__qualname__} also holds {', '.join(map(repr, others))}"
            )
        stacked = module.up_proj if TensorParallelExperts._ungated(module) else module.gate_up_proj
        experts, n = stacked.shape[0], ep.size()
        if experts % n:
            raise ValueError(
                f"{experts} experts do not split over the {n} ranks of {names[0]!r}: each rank "
                f"must hold the same number of whole experts (use an expert-parallel degree "
                f"that divides {experts})"
            )
        root = plan_root()
        if root is not None and hasattr(ep, "mesh"):  # (the dry-run report's stand-in: none)
            _check_dense_on_tp(root, module, ep, tp)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module, device_mesh)  # an unsupported module must not be half-applied
        names = device_mesh.mesh_dim_names
        ungated = TensorParallelExperts._ungated(module)
        n_experts = (module.up_proj if ungated else module.gate_up_proj).shape[0]
        ep, tp = device_mesh[names[0]], runtime.for_mesh(device_mesh[names[1]])
        placements = self.contract.parameters(self, module)
        layouts = self._entry_and_exit(module)
        return distribute_and_wrap(
            self, module, device_mesh, placements, layouts, ep, tp, n_experts
        )

    def _forward(
        self,
        module: nn.Module,
        rt: runtime.DTensorRuntime,
        own_forward,
        layouts: tuple[Boundary | None, Layout],
        ep: DeviceMesh,
        tp: runtime.DTensorRuntime,
        n_experts: int,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        _refuse_dtensor_tokens(self, module, (hidden_states, top_k_index, top_k_weights))
        _refuse_whole_in_partial_region(self, module, hidden_states)
        # every tp rank computes with all its ep rank's tokens: their gradients are partial
        # sums over tp, summed in one all-reduce (or by the caller, with a partial output)
        entry, exit = layouts
        hidden_states, top_k_index, top_k_weights = _enter_tokens(
            self, module, tp, entry, (hidden_states, top_k_index, top_k_weights)
        )
        partial = _route(
            self, module, rt, ep, own_forward, n_experts, hidden_states, top_k_index,
            top_k_weights, replicated=False, agree_over=tp.mesh,
        )  # fmt: skip
        return _leave_tokens(tp, exit, partial)


def _check_dense_on_tp(root: nn.Module, experts: nn.Module, ep: DeviceMesh, tp: DeviceMesh) -> None:
    """Raise ``ValueError`` when a tensor-parallel parameter of the model, already
    distributed by an earlier call, is split over ranks that ``ep`` splits too: the dense
    layers' tensor-parallel dimension must be the experts' ``tp``, orthogonal to ``ep``."""
    ep_ranks = set(ep.mesh.flatten().tolist())
    tp_ranks = set(tp.mesh.flatten().tolist())
    mine = {id(p) for p in experts.parameters()}
    seen: set[int] = set()
    for name, param in root.named_parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is None or id(param) in mine or mesh.ndim != 1 or id(mesh) in seen:
            continue
        seen.add(id(mesh))
        ranks = set(mesh.mesh.flatten().tolist())
        if ranks != tp_ranks and len(ranks & ep_ranks) > 1:
            raise ValueError(
                f"{name!r} is tensor-parallel over ranks {sorted(ranks)}, which the experts' "
                f"ep dimension (ranks {sorted(ep_ranks)}) splits too: ep must be orthogonal "
                f"to the tensor-parallel dimension (the experts' tp, ranks {sorted(tp_ranks)}); "
                "apply the dense plan on mesh['tp'] of the same (ep, tp) mesh"
            )


def _refuse_whole_in_partial_region(
    style: ParallelStyle, module: nn.Module, hidden_states: torch.Tensor
) -> None:
    """A replicated output (and whole input gradients) inside a block whose gradients are
    partial sums would be counted once per rank: refused, on every rank alike."""
    if isinstance(style.output_layouts, Replicate) and in_partial_region(hidden_states):
        raise ValueError(
            f"{style_at(style, module)}: the tokens come from a block whose input gradients are "
            "partial sums and whose output is reduced after it (PrepareModuleInputOutput("
            "partial_input_gradients=True, output_layouts=Partial()), as moe_llama_plan("
            "experts='tp', sequence_parallel=True) plans the feed-forward): the experts must "
            f"leave their output partial, {type(style).__name__}(output_layouts=Partial()), "
            "found output_layouts=Replicate()"
        )


def _check_output_layouts(output_layouts: Placement | None) -> Placement:
    """``Replicate()`` (the default) or ``Partial()`` (sum), else a ``ValueError``."""
    layout = Replicate() if output_layouts is None else output_layouts
    if not (isinstance(layout, Replicate) or layout == Partial()):
        raise ValueError(
            "output_layouts must be Replicate() (the experts' partial outputs summed here) or "
            f"Partial() (left partial sums, for the caller to reduce), found {short_repr(layout)}"
        )
    return layout


def _output_arguments(style: ParallelStyle) -> dict[str, Any]:
    """A contract's arguments: ``output_layouts`` where it is not the default."""
    layout = style.output_layouts
    return {} if isinstance(layout, Replicate) else {"output_layouts": layout}


def _check_expert_ids(
    style: ParallelStyle,
    module: nn.Module,
    rt: runtime.DTensorRuntime,
    top_k_index: torch.Tensor,
    n_experts: int,
) -> None:
    """Refuse expert ids outside ``[0, n_experts)``, on every rank if any rank has one. The
    routing is meant to be the same on every rank (replicated tokens); so that one rank's
    bad routing does not leave the others waiting in the experts' reduction, the verdict is
    agreed over the mesh first (one all-reduce of one number; one flag read back, a host
    sync on a GPU)."""
    if top_k_index.is_meta or torch.compiler.is_compiling():
        return
    bad = ((top_k_index < 0) | (top_k_index >= n_experts)).any().reshape(1)
    group = rt.mesh.get_group()
    flag = bad.to(device=runtime.flag_device(group), dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    if flag.item():
        error = _bad_expert_ids(style, module, n_experts) if bad.item() else None
        runtime.raise_agreed(error, [group])


def _bad_expert_ids(style: ParallelStyle, module: nn.Module, n_experts: int) -> ValueError:
    return ValueError(
        f"{style_at(style, module)}: the router gave expert ids outside [0, {n_experts}); "
        "top_k_index must hold ids of the module's experts"
    )


@contextlib.contextmanager
def _attribute_as(module: nn.Module, name: str, value: Any, *, only_if_int: bool = False):
    """``module.<name>`` set to ``value`` inside the block (when it has an int such attribute,
    with ``only_if_int``), restored after it."""
    old = getattr(module, name, None)
    if only_if_int and (not isinstance(old, int) or isinstance(old, bool)):
        yield
        return
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _tokens_like(args: tuple) -> torch.Tensor:
    """An experts module's output for the dry-run report: like its tokens (its first input),
    without running its forward (which reads the routing)."""
    return torch.empty_like(args[0])


# ------------------------------------------------------------------------------------------
# The experts' all-to-all: a data-dependent number of rows to each rank, which no DTensor
# placement describes, so both runtimes dispatch tokens to their experts through it
# ------------------------------------------------------------------------------------------


def _all_to_all_expert_parallel_region(
    x: torch.Tensor, mesh: DeviceMesh, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    """Rows of ``x`` (``input_splits[r]`` of them, in order, for rank ``r``) sent to their
    ranks; this rank receives ``output_splits[r]`` rows from rank ``r``, stacked in rank
    order. The backward sends the rows' gradients back the same way reversed."""
    return _AllToAllRegion.apply(x, mesh, output_splits, input_splits)


class _AllToAllRegion(torch.autograd.Function):
    """Rows to the ranks that compute with them (tokens to their experts), uneven counts;
    the backward is the reverse all-to-all of their gradients."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, mesh: DeviceMesh, output_splits: list[int], input_splits: list[int]
    ) -> torch.Tensor:
        ctx.mesh, ctx.output_splits, ctx.input_splits = mesh, output_splits, input_splits
        return _all_to_all(x, mesh, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _all_to_all(grad, ctx.mesh, ctx.input_splits, ctx.output_splits)
        return back, None, None, None


def _all_to_all(
    x: torch.Tensor, mesh: DeviceMesh, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    x = x.contiguous()
    if runtime.mesh_size(mesh) == 1:
        return x
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_splits, input_splits, group=mesh.get_group())
    return out
