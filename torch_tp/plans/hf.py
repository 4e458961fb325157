"""Tensor-parallel plans for Hugging Face transformers' Llama, Mistral, Qwen2 and GPT-2, and
every other transformers model's own plan (:func:`plan_for`, :func:`transformers_plan`).

The layout is Megatron's: each attention and MLP block runs with one all-reduce in the forward
and one in the backward. In every model:

* the vocabulary embedding is row-parallel over the vocabulary (``"embedding_rowwise"``):
  every rank looks up the token ids that fall in its slice of the vocabulary, and one
  all-reduce sums the partial embeddings.
* the norm in front of each attention and MLP block returns a replicated DTensor
  (:class:`~torch_tp.PrepareModuleOutput`), so the projections reading it (q/k/v, gate/up)
  enter the tensor-parallel region together: their input gradients are all-reduced once per
  block. The residual stream adds the norm's input and stays a plain tensor.
* the attention module carries :class:`~torch_tp.AttentionHeads`, which refuses the plan
  before anything changes when the heads do not split evenly over the TP degree.
* the projections into a block are column-parallel (each rank holds whole heads and a slice
  of the MLP), the projections out of it row-parallel.
* ``lm_head`` is column-parallel with the logits all-gathered (``"colwise_gather_output"``),
  so the model returns whole logits and transformers' loss and ``generate`` work unchanged.

**Llama, Mistral, Qwen2** share one decoder layout (transformers 5.x module names):
``model.embed_tokens``, decoder layers ``model.layers.<i>`` with ``input_layernorm``,
``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm`` and a gated MLP
``mlp.{gate,up,down}_proj``, a final norm and an ``lm_head``. The projections follow
transformers' own ``base_model_tp_plan`` (``"colwise"`` for q/k/v and gate/up, ``"rowwise"``
for o and down). Qwen2's q/k/v biases are sharded with their weights. Their attention code reads
the number of heads from the projected tensors, so it runs unchanged on each rank's heads; the
numbers of attention heads and of key/value heads must both divide by the TP degree.

**GPT-2** (``transformer.wte``, blocks ``transformer.h.<i>`` with ``ln_1``, ``attn``,
``ln_2``, ``mlp``) computes with transformers' ``Conv1D`` (a Linear with a transposed weight).
Its ``attn.c_attn`` packs q, k and v into one projection: it is sharded part by part
(:class:`~torch_tp.PackedColwiseParallel`), so each rank computes ``[q_r, k_r, v_r]`` for its
own heads, and ``GPT2Attention``'s ``num_heads`` and ``split_size`` are divided by the TP degree
so that it splits that local output. ``lm_head`` shares its weight with ``wte``; both are
sharded over the vocabulary (``Shard(0)``) and stay tied. The position embedding ``wpe`` and
the norms' parameters are replicated.

Example::
    >>> # xdoctest: +SKIP("distributed")
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from transformers import AutoModelForCausalLM
    >>> from torch_tp import parallelize_module
    >>> from torch_tp.plans.hf import plan_for
    >>> model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.2-1B")
    >>> tp_mesh = init_device_mesh("cuda", (8,))
    >>> parallelize_module(model, tp_mesh, plan_for(model))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard

from torch_tp.plan import key_matches_any
from torch_tp.plans._context import with_context_parallel
from torch_tp.plans._peft import prefixed, without_tuner_layers, wrapped_model
from torch_tp.plans._sequence import with_sequence_parallel
from torch_tp.style import (
    AttentionHeads,
    ColwiseParallel,
    PackedColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
)

__all__ = [
    "PLANS",
    "expert_parallel_plan",
    "gpt2_plan",
    "llama_plan",
    "mistral_plan",
    "plan_for",
    "qwen2_plan",
    "transformers_plan",
]


def _replicated_norm_output() -> PrepareModuleOutput:
    """The norm feeding an attention or MLP block hands its projections a replicated DTensor.

    q, k and v (gate and up; GPT-2's c_attn and c_fc) then enter the tensor-parallel region
    through this one boundary, so their input gradients add up locally and are all-reduced
    once per block, whatever wraps the projections' calls (``CommDebugMode``, full backward
    hooks). The residual stream adds the norm's *input*, so it stays a plain tensor.
    """
    return PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=False
    )


def _decoder_plan(base_model: bool) -> dict[str, ParallelStyle]:
    """The Megatron plan of a Llama-like ``*ForCausalLM`` (or of its base model)."""
    prefix = "" if base_model else "model."
    layer = f"{prefix}layers.*"
    plan: dict[str, ParallelStyle] = {
        # vocabulary-parallel lookup of replicated ids, partial embeddings all-reduced
        f"{prefix}embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        # whole heads per rank, or refuse the plan before anything changes
        f"{layer}.self_attn": AttentionHeads(
            "config.num_attention_heads", "config.num_key_value_heads"
        ),
        # q, k and v read the same replicated input and each produce its rank's heads
        f"{layer}.input_layernorm": _replicated_norm_output(),
        f"{layer}.self_attn.q_proj": ColwiseParallel(),
        f"{layer}.self_attn.k_proj": ColwiseParallel(),
        f"{layer}.self_attn.v_proj": ColwiseParallel(),
        f"{layer}.self_attn.o_proj": RowwiseParallel(),
        f"{layer}.post_attention_layernorm": _replicated_norm_output(),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
        f"{layer}.mlp.down_proj": RowwiseParallel(),
    }
    if not base_model:
        # whole logits on every rank: transformers' loss and generate() run unchanged
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def llama_plan(*, base_model: bool = False) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of transformers' ``LlamaForCausalLM``.

    Keyword Args:
        base_model (bool, optional): return the plan of the base ``LlamaModel`` instead: the
            keys lose their ``model.`` prefix and there is no ``lm_head``. Default: ``False``.

    Returns:
        A dict from module paths (with ``*`` over the decoder layers) to styles, for
        :func:`torch_tp.parallelize_module`.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from torch_tp import parallelize_module
        >>> from torch_tp.plans.hf import llama_plan
        >>> model = LlamaForCausalLM(LlamaConfig(num_attention_heads=32, num_key_value_heads=8))
        >>> parallelize_module(model, tp_mesh, llama_plan())
    """
    return _decoder_plan(base_model)


def mistral_plan(*, base_model: bool = False) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of transformers' ``MistralForCausalLM`` (``MistralModel`` with
    ``base_model=True``): the same layout and arguments as :func:`llama_plan`."""
    return _decoder_plan(base_model)


def qwen2_plan(*, base_model: bool = False) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of transformers' ``Qwen2ForCausalLM`` (``Qwen2Model`` with
    ``base_model=True``): the same layout and arguments as :func:`llama_plan`; the q/k/v
    biases are sharded with their weights (``Shard(0)``)."""
    return _decoder_plan(base_model)


def gpt2_plan(*, base_model: bool = False) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of transformers' ``GPT2LMHeadModel``.

    ``attn.c_attn`` (q, k and v packed) is sharded part by part, and the attention module's
    ``num_heads`` and ``split_size`` are divided by the TP degree, which must divide the number
    of heads. ``lm_head`` and ``wte`` share one vocabulary-sharded weight.

    Keyword Args:
        base_model (bool, optional): return the plan of the base ``GPT2Model`` instead: the
            keys lose their ``transformer.`` prefix and there is no ``lm_head``.
            Default: ``False``.

    Returns:
        A dict from module paths (with ``*`` over the blocks) to styles, for
        :func:`torch_tp.parallelize_module`.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> from torch_tp import parallelize_module
        >>> from torch_tp.plans.hf import gpt2_plan
        >>> model = GPT2LMHeadModel(GPT2Config())
        >>> parallelize_module(model, tp_mesh, gpt2_plan())
    """
    prefix = "" if base_model else "transformer."
    block = f"{prefix}h.*"
    plan: dict[str, ParallelStyle] = {
        # vocabulary-parallel lookup (Shard(0), as lm_head's tied weight)
        f"{prefix}wte": RowwiseParallel(input_layouts=Replicate()),
        f"{block}.ln_1": _replicated_norm_output(),
        # GPT2Attention.forward splits c_attn's output by split_size: make it this rank's share
        f"{block}.attn": AttentionHeads("num_heads", divide=("num_heads", "split_size")),
        f"{block}.attn.c_attn": PackedColwiseParallel(3),
        f"{block}.attn.c_proj": RowwiseParallel(),
        f"{block}.ln_2": _replicated_norm_output(),
        f"{block}.mlp.c_fc": ColwiseParallel(),
        f"{block}.mlp.c_proj": RowwiseParallel(),
    }
    if not base_model:
        # the weight tied with wte, sharded the same way; whole logits on every rank
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


#: ``config.model_type`` -> the function returning that family's plan. :func:`plan_for`
#: looks models up here; a new family is one more entry.
PLANS: dict[str, Callable[..., dict[str, ParallelStyle]]] = {
    "gpt2": gpt2_plan,
    "llama": llama_plan,
    "mistral": mistral_plan,
    "qwen2": qwen2_plan,
}


def plan_for(
    model: nn.Module, *, sequence_parallel: bool = False, cp_degree: int | None = None
) -> dict[str, ParallelStyle | str]:
    """The tensor-parallel plan of a transformers model.

    Llama, Mistral, Qwen2 and GPT-2 (by ``model.config.model_type``, see :data:`PLANS`) get
    torch_tp's ready plan, that of a causal LM or of a base model (``base_model=True``); any
    other transformers model gets its own plan, ``model._tp_plan``, as plan names, less the
    keys that name nothing in this model (see :func:`transformers_plan`), corrected where it
    would compute something else than one device. A PEFT model is planned as the model it
    wraps. Every plan it returns is shape-checked first (:func:`torch_tp.shapes.check_shapes`,
    at two ranks, on meta copies). Which plan a model gets (other heads included), the
    corrections, and PEFT: the guide's "transformers models" (``docs/transformers.md``) and
    "Fine-tuning with adapters" (``docs/adapters.md``).

    Args:
        model: a transformers model: one of the families in :data:`PLANS`, or one whose
            ``_tp_plan`` is set (its config class declares ``base_model_tp_plan``); or a
            PEFT ``PeftModel`` wrapping one.

    Keyword Args:
        sequence_parallel (bool, optional): shard the activations between blocks on the
            sequence (``Shard(1)``): the norms run on their shard, each attention and MLP
            gathers the sequence once and reduce-scatters its output back (the guide's
            "Sequence parallelism", ``docs/transformers.md``). For decoder models laid out
            as Llama's (``embed_tokens``, layers of ``input_layernorm``, ``self_attn``,
            ``post_attention_layernorm`` and ``mlp``, a final ``norm``); others are refused.
            The sequence length must divide by the TP degree: for training and prefill, not
            token-by-token decoding. Default: ``False``.
        cp_degree (int, optional): over 1, the plan also splits each sequence over a ``cp``
            mesh dimension: :class:`~torch_tp.ContextParallel` on the decoder layers
            (``"model.layers.*"``). Apply it on a mesh with dimensions ``("cp", "tp")``
            (each style on its own); the inputs are in the guide's "Context parallelism"
            (``docs/context_parallel.md``). Default: ``None`` (no cp dimension).

    Returns:
        A dict from module (and parameter) paths to styles or plan names, for
        :func:`torch_tp.parallelize_module`.

    Raises:
        ValueError: ``sequence_parallel`` for a model not laid out as Llama's, or with
            ``cp_degree`` over 1 (the message names the module and what was expected); or
            the model has no ``config.model_type``, or it is not one of :data:`PLANS`
            and declares no ``_tp_plan`` (the message lists the supported types); or its own
            plan leaves out a parameter that computes on a sharded activation and is not one
            value (the message names it); or a rank would compute another shape than one
            device (the shape check: the message names the module, the source line and
            both shapes).

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> from torch_tp import parallelize_module
        >>> from torch_tp.plans.hf import plan_for
        >>> model = Qwen2ForCausalLM(Qwen2Config())
        >>> parallelize_module(model, tp_mesh, plan_for(model))
    """
    wrapped = wrapped_model(model)
    if wrapped is not None:  # a PeftModel: the plan of the model it wraps, under its path
        path, inner = wrapped
        plan = plan_for(inner, sequence_parallel=sequence_parallel, cp_degree=cp_degree)
        return prefixed(plan, path)
    # PEFT's tuner layers (q_proj wrapping its nn.Linear as q_proj.base_layer) seen as the
    # layers they wrap: the plan names q_proj, which the styles resolve to the base layer
    model = without_tuner_layers(model)
    supported = ", ".join(sorted(PLANS))
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        raise ValueError(
            f"cannot choose a plan for {type(model).__qualname__}: it has no "
            f"config.model_type (expected a transformers model; supported types: {supported}, "
            "or any model with a _tp_plan)"
        )
    make_plan = PLANS.get(model_type)
    if make_plan is None:
        if getattr(model, "_tp_plan", None):
            plan = _packed_experts(transformers_plan(model))
            correct = _CORRECTIONS.get(model_type)
            if correct is not None:
                plan = correct(model, plan)
            plan = _shape_checked(model, _with_unplanned_parameters(model, plan))
            return _with_sequence_or_context(model, plan, sequence_parallel, cp_degree)
        raise ValueError(
            f"no tensor-parallel plan for model_type {model_type!r} "
            f"({type(model).__qualname__}): it declares no _tp_plan of its own, and torch_tp's "
            f"ready plans cover these only; supported types: {supported}"
        )
    prefix = getattr(model, "base_model_prefix", None) or "model"
    base_model = not isinstance(getattr(model, prefix, None), nn.Module)
    plan = _shape_checked(model, make_plan(base_model=base_model))
    return _with_sequence_or_context(model, plan, sequence_parallel, cp_degree)


def _with_sequence_or_context(
    model: nn.Module, plan: dict, sequence_parallel: bool, cp_degree: int | None
) -> dict:
    if sequence_parallel is True and cp_degree not in (None, 1):
        raise ValueError(
            f"plan_for: sequence_parallel=True with cp_degree={cp_degree!r}: torch_tp has no "
            "plan for a transformers model with both; choose one"
        )
    plan = with_sequence_parallel(model, plan, sequence_parallel)
    return with_context_parallel(model, plan, cp_degree)


def _shape_checked(model: nn.Module, plan: dict) -> dict:
    """``plan``, once the shape check (:func:`torch_tp.shapes.check_shapes`, at two
    ranks, on token ids) finds that every rank computes one device's shapes with at most the
    planned dimension divided.

    A model the check cannot trace on the meta device (it needs other inputs, or its shapes
    depend on values), or whose plan does not apply at two ranks, keeps its plan: applying it
    checks what it can, and parity tests (:func:`torch_tp.testing.check_parity`) the rest.

    Raises:
        ValueError: a rank computes another shape, or its forward raises: the message names
            each module, source line, op and both shapes.
    """
    import torch

    from torch_tp.shapes import ShapeCheckError, check_shapes

    ids = torch.zeros(2, 8, dtype=torch.long)
    inputs = {"input_ids": ids}
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    try:
        problems = check_shapes(model, plan, 2, example_inputs=inputs)
    except (ShapeCheckError, ValueError):
        return plan
    if problems:
        raise ValueError(
            f"the tensor-parallel plan of {type(model).__qualname__} computes other shapes "
            "on a rank than on one device (the shape check at two ranks): "
            + "; ".join(str(p) for p in problems)
        )
    return plan


def _packed_experts(plan: dict[str, str]) -> dict[str, str]:
    """``plan`` with its ``"colwise"`` entry for the stacked ``gate_up_proj`` of experts
    planned ``moe_tp_experts`` stated as what that style does to it: each rank holds its
    slice of every expert's gate rows and of its up rows (``"packed_colwise"``). A plain
    column split would give one rank the gates and the other the ups (the experts split
    ``gate_up`` in halves); transformers' plans for Inkling write ``"colwise"`` there."""
    return {
        key: (
            "packed_colwise"
            if name == "colwise"
            and key.endswith(".gate_up_proj")
            and plan.get(key.rsplit(".", 1)[0]) == "moe_tp_experts"
            else name
        )
        for key, name in plan.items()
    }


def _doge(model: nn.Module, plan: dict[str, str]) -> dict[str, str | ParallelStyle]:
    """Doge's attention masks its scores with a dynamic mask: ``dt_proj`` mixes the values of
    every key/value head into one value per key/value head, scaled by ``A`` (one per head).
    Its own plan makes ``dt_proj`` row-parallel with a replicated output, a mask for every
    head on each rank's heads. Here each rank gets its own heads' part of it (the row-parallel
    sum reduce-scattered over the heads), ``A`` is sharded with the heads (the attention
    computing on its shard, ``local_params``), and the per-head q/k norms sum their
    gradients over the ranks."""
    result: dict[str, str | ParallelStyle] = dict(plan)
    for key in plan:
        attention, _, name = key.rpartition(".")
        if name != "dt_proj":
            continue
        result[key] = RowwiseParallel(output_layouts=Shard(-1))
        result[attention] = "local_params"
        result[f"{attention}.A"] = "colwise"
        result[f"{attention}.q_norm"] = "replicated_with_grad_allreduce"
        result[f"{attention}.k_norm"] = "replicated_with_grad_allreduce"
    return result


def _gemma3n(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Gemma 3n's MLPs with activation sparsity cut their gate at the mean plus a multiple of
    the standard deviation over all of its features, which a column-parallel gate would
    take over its shard only: those MLPs stay whole (replicated, computing on the replicated
    activations), the others are sharded as its plan says."""
    pattern = getattr(model.config, "activation_sparsity_pattern", None) or []
    sparse = {i for i, p in enumerate(pattern) if p}
    if not sparse:
        return plan
    result = {}
    for key, name in plan.items():
        head, star, tail = key.partition(".layers.*.")
        if star and tail.startswith("mlp."):
            for i in range(len(pattern)):
                if i not in sparse:
                    result[f"{head}.layers.{i}.{tail}"] = name
        else:
            result[key] = name
    return result


#: Corrections of models' own plans, by ``model_type``: where a plan transformers ships
#: would compute something else than one device, what makes it right.
_CORRECTIONS: dict[str, Callable[[nn.Module, dict], dict]] = {
    "doge": _doge,
    "gemma3n_text": _gemma3n,
}


def _with_unplanned_parameters(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` with the parameters it leaves out but that compute on sharded activations
    taken care of: a parameter that acts on every feature alike (one value, broadcast, like
    apertus' ``act_fn.alpha_p``) gets its module replicated with its gradient summed
    (``replicated_with_grad_allreduce``); any other one is refused.

    Found by the dry-run report (:func:`torch_tp.report.plan_report`) on a meta-device copy
    of ``model``. A model the report cannot run on the meta device keeps its plan as it is.

    Raises:
        ValueError: a parameter no entry lays out computes on a sharded activation and is not
            one value, or one the plan replicates without summing its gradient computes on
            one: the message names it and the layout it meets.
    """
    import copy
    import warnings

    import torch

    from torch_tp.report import plan_report

    memo: dict[int, object] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (
            nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
        )
    try:
        meta_model = copy.deepcopy(model, memo)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = plan_report(meta_model, plan, 2, batch_size=1, seq_len=8)
    except Exception:  # noqa: BLE001 - the report's own limits; the plan is checked when applied
        return plan
    unplanned = [
        p
        for p in report.problems
        if p.severity == "error" and p.message.startswith("the parameter")
    ]
    # a parameter the plan replicates without summing its gradient, on a shard: refused
    refused = [
        p.message
        for p in report.problems
        if p.severity == "error" and p.message.startswith("the replicated parameter")
    ]
    if not unplanned and not refused:
        return plan
    added = {}
    for problem in unplanned:
        names = [
            name
            for name, _ in model.named_parameters()
            if key_matches_any(problem.where, [name.split(".")])
        ]
        if names and all(model.get_parameter(n).numel() == 1 for n in names):
            added[problem.where.rsplit(".", 1)[0]] = "replicated_with_grad_allreduce"
        else:
            refused.append(problem.message)
    if refused:
        raise ValueError(
            f"{type(model).__qualname__}'s own tensor-parallel plan leaves parameters that "
            "compute on sharded activations with a partial gradient on each rank: "
            + "; ".join(refused)
        )
    return {**plan, **added}


def transformers_plan(model: nn.Module) -> dict[str, str]:
    """A transformers model's own plan, ``model._tp_plan``, less the keys that name nothing.

    transformers writes one plan per model class, for every config of it, and skips at load
    time the keys that match no module. So a plan may hold keys that a given model has no
    module for: the dense MLP's keys in a config whose layers are all mixture-of-experts
    (and the experts' in one whose layers are all dense), the q/k norms of a config that has
    none, or Llama 4's causal LM repeating its base model's keys without the ``model.``
    prefix. :func:`torch_tp.parallelize_module` refuses such a key (a typo would look the
    same); this plan leaves out exactly the keys that match no module and no parameter of
    ``model``, so it is the plan transformers applies to this model. A key that names
    anything is kept as it is, right or wrong for torch_tp: the plan is checked, and
    refused if wrong, by :func:`torch_tp.parallelize_module`.

    Args:
        model: a transformers model whose ``_tp_plan`` is set.

    Returns:
        A dict from module and parameter paths to transformers' plan names, in the order of
        ``model._tp_plan``.

    Raises:
        ValueError: the model has no ``_tp_plan``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from transformers import OlmoeConfig, OlmoeForCausalLM
        >>> model = OlmoeForCausalLM(OlmoeConfig())
        >>> parallelize_module(model, tp_mesh, transformers_plan(model))
    """
    tp_plan = getattr(model, "_tp_plan", None)
    if not tp_plan:
        raise ValueError(
            f"{type(model).__qualname__} declares no tensor-parallel plan: expected a "
            "transformers model with a _tp_plan (its config class's base_model_tp_plan)"
        )
    return _naming_something(model, tp_plan)


def _naming_something(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``plan`` whose keys name a submodule or parameter of ``model``, in
    order (transformers' plans are written for the largest config: a model whose layers are
    all mixture-of-experts has no dense MLP for the dense keys to name)."""
    paths = [path.split(".") for path, _ in model.named_modules(remove_duplicate=False) if path]
    paths += [path.split(".") for path, _ in model.named_parameters(remove_duplicate=False)]
    return {key: name for key, name in plan.items() if key_matches_any(key, paths)}


def expert_parallel_plan(model: nn.Module) -> dict[str, str]:
    """A transformers MoE model's own plan with its experts split over the ranks: its
    ``_tp_plan`` (attention and dense layers tensor-parallel) with the entries of its
    config's ``base_model_ep_plan`` in place of the experts' ones.

    transformers' expert-parallel plan names the experts ``"ep_dispatch_experts"`` and their
    stacked weights ``"grouped_gemm"``: in torch_tp, :class:`~torch_tp.ExpertParallel` with
    replicated tokens (``input_layouts=Replicate()``), each rank computing its
    ``n_experts / n`` experts on the tokens routed to them and one all-reduce summing the
    results (one backward too), the parameters ``Shard(0)``. The routers stay whole.

    Args:
        model: a transformers model whose config class declares ``base_model_ep_plan``
            (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...).

    Returns:
        A dict from module and parameter paths to plan names, for
        :func:`torch_tp.parallelize_module` on the tensor-parallel mesh (whose size must
        divide the number of experts).

    Keys that name nothing in ``model`` are left out, as :func:`transformers_plan` leaves
    them out (a model whose layers are all mixture-of-experts has no dense MLP).

    Raises:
        ValueError: the model has no ``_tp_plan`` or its config no ``base_model_ep_plan``.

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> from transformers import MixtralConfig, MixtralForCausalLM
        >>> model = MixtralForCausalLM(MixtralConfig())
        >>> parallelize_module(model, tp_mesh, expert_parallel_plan(model))
    """
    tp_plan = getattr(model, "_tp_plan", None)
    ep_plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None)
    if not tp_plan or not ep_plan:
        raise ValueError(
            f"{type(model).__qualname__} declares no expert-parallel plan: expected a "
            "transformers model with a _tp_plan and a config with base_model_ep_plan (found "
            f"_tp_plan={'set' if tp_plan else 'none'}, base_model_ep_plan="
            f"{'set' if ep_plan else 'none'})"
        )
    # _tp_plan prefixes the base model's keys with its attribute name ("model.")
    prefix = getattr(model, "base_model_prefix", "") or ""
    prefix = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    plan = {**dict(tp_plan), **{prefix + key: name for key, name in ep_plan.items()}}
    return _naming_something(model, plan)
