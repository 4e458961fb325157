"""The transformers zoo: every causal LM that declares a tensor-parallel plan, at TP=2.

The test walks the installed transformers' causal-LM mapping at run time, so a new release is
tried automatically. Each architecture whose config class declares ``base_model_tp_plan`` is
built from a tiny config (random weights, float64 where the model computes in it, else
float32; eager attention and experts; two layers, or one of each kind where the layers
differ; four heads, four experts; a sliding window shorter than the sequence), and
``parallelize_module(model, mesh, plan_for(model))`` must shard it as the plan says and give
the single-device logits, loss, every gradient, the same 8 greedy ``generate`` tokens, and
the same 8 tokens sampled with ``generate(do_sample=True, top_p=0.9)`` after the same seed
(on every rank).

Sharded as planned: every parameter a style of the plan lays out must have the placement
that style's contract declares (:func:`torch_tp.plan.planned_placements`, as the dry-run
report reads it), a parameter no style lays out must not be sharded, and each rank must hold
the parameter bytes :func:`torch_tp.report.plan_report` predicts. The same values: within
``rtol=1e-10`` in a float64 model (:data:`TOLERANCES`; float32's tolerance in a float32 one,
and in the float64 ones :data:`FLOAT32_PARTS` names, which compute a part in float32).

What each architecture does is recorded in one file, ``test/zoo_status.json``: those that
pass, those that fail (with the reason: the error's first line, or what differs and by how
much), and those transformers itself cannot build or run on one device at this size; for
each that runs, the planned parameters sharded, replicated and left whole, the parameter
bytes per rank (live and predicted) and on one device, the largest logits and gradient
differences and how much of the tolerance they use. The test compares the live results with
the file (the status and reason, the counts, bytes and tolerances exactly, the differences
against the tolerance), so a fix, a new failure or a plan that shards less fails the test;
rewrite the file with::

    TORCH_TP_ZOO_UPDATE=1 python -m pytest test/test_zoo.py

(``TORCH_TP_ZOO_ONLY=llama,mixtral`` runs, compares or rewrites those only)

and render it as a markdown table (for the docs) with::

    python test/test_zoo.py
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

STATUS_FILE = Path(__file__).with_name("zoo_status.json")
UPDATE_ENV = "TORCH_TP_ZOO_UPDATE"
WORLD_SIZE = 2
VOCAB = 128
SEQ = 12
PROMPT = 5
NEW_TOKENS = 8
# sampling: the same seed before generate on one device and under TP (transformers #36634
# reports other tokens per rank)
SAMPLE_SEED = 1234
SAMPLING = {"do_sample": True, "top_p": 0.9, "max_new_tokens": NEW_TOKENS}
# one architecture's check, on both ranks (the slowest, the hybrid linear-attention ones
# running transformers' reference kernels, take a few seconds)
TIMEOUT = 90.0
# float32's default tolerance (torch.testing.assert_close's)
TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-5}
# The comparison, by the model's dtype. float64: its unit roundoff is 1.1e-16, and TP changes
# only the order of a few sums (over a hidden size of 32, 4 heads, 2 ranks), so the logits
# and gradients differ by about 1e-15 (1.4e-14 at most: no element uses more than 0.2% of
# the tolerance); rtol=1e-10 leaves that margin and still catches any float32-sized error
# (1e-7) and any real bug.
# atol=1e-12 covers values that cancel to about zero (a gradient element summed from terms
# of size one whose roundoff is 1e-16 each): an absolute 1e-12 is 1e-12 of the activations'
# size, far below anything a wrong shard gives.
TOLERANCES = {"float64": {"rtol": 1e-10, "atol": 1e-12}, "float32": TOLERANCE}
# Float64 models that compute a part in float32 whatever the parameters' dtype (an explicit
# cast in transformers' code): TP's other order of summation (1e-16) can round to another
# float32 value there, so their differences are float32-sized (1e-9 to 1e-6), and they are
# compared with float32's tolerance, the reason recorded in the status file. Found by running
# them: with those casts made float64 (torch.Tensor.float/.to/.type and softmax's dtype
# patched), every one of them differs by at most 3e-13 and is within rtol=1e-10 (5% of it at
# most). Every other float64 model is held to 1e-10.
_ROUTER = "its MoE router computes in float32"
_NORMS = "its RMSNorms apply their weight in float32"
FLOAT32_PARTS: dict[str, str] = {
    **dict.fromkeys(
        (
            "afmoe",
            "axk1",
            "axk2",
            "bailing_hybrid",
            "beam",
            "deepseek_v2",
            "deepseek_v3",
            "deepseek_v32",
            "dots1",
            "dots3_note_text",
            "exaone_moe",
            "flint",
            "glm4_moe",
            "glm4_moe_lite",
            "glm_moe_dsa",
            "hy_v3",
            "hy_v4",
            "inkling_text",
            "kimi_linear",
            "kolibri1",
            "longcat_flash",
            "mimo_v2_flash",
            "minimax",
            "minimax_m2",
            "minimax_m3_vl_text",
            "mixtral",
            "solar_open",
        ),
        _ROUTER,
    ),
    **dict.fromkeys(("gemma3_text", "gemma4_unified_text", "qwen3_5_text"), _NORMS),
    **dict.fromkeys(("gemma4_text", "qwen3_5_moe_text", "qwen3_next"), f"{_NORMS}, {_ROUTER}"),
    "gemma3n_text": f"{_NORMS}, its AltUp router computes in float32",
    "llama4": "its MoE router and rotary embedding (complex) compute in float32",
    "llama4_text": "its MoE router and rotary embedding (complex) compute in float32",
    "nemotron_h": "its MoE router and its Mamba mixer compute in float32",
}

PASS, FAIL, DOES_NOT_BUILD = "pass", "fail", "does_not_build"

# Config fields, set where the architecture's config has them (else left at its default).
_TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    # larger than the usual 0.02: routing and greedy decoding get clear winners
    "initializer_range": 0.2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": None,  # generate exactly NEW_TOKENS tokens
    "sliding_window": 6,  # shorter than the sequence
    "attention_chunk_size": 8,
    # mixture of experts: four experts, two per token, a dense first layer where the config
    # says which layers are dense (so that the plan's dense and MoE keys both name modules)
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_k": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "shared_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 16,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    "mlp_only_layers": [0],
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    "decoder_sparse_step": 1,
    "interleave_moe_layer_step": 2,  # Llama 4
    "enable_moe_block": True,  # Gemma 4
    "top_k_experts": 2,
    "intermediate_size_mlp": 32,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "output_router_logits": True,  # the load-balancing loss joins the loss
    "router_aux_loss_coef": 0.1,
    # multi-head latent attention
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "index_head_dim": 8,
    "index_n_heads": 2,
    "index_topk": 4,
    # linear attention and Mamba mixers
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_head_dim": 8,
    "linear_num_heads": 4,
    "mamba_n_heads": 4,
    "mamba_num_heads": 4,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_d_state": 8,
    "ssm_state_size": 8,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "mamba_chunk_size": 8,
    "mamba_dt_rank": 8,
    # Gemma 3n
    "num_kv_shared_layers": 0,
    "laurel_rank": 8,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": VOCAB,
    # per-layer overrides of the full-size model
    "per_layer_config": {},
    # multimodal configs' encoders
    "num_blocks": 2,
    "ext_pw_out_channel": 32,
    "depthwise_separable_out_channel": 32,
    "nemo_conv_channels": 32,
    "image_size": 28,
}
# What the generic fields above cannot say, by model_type.
_OVERRIDES: dict[str, dict[str, Any]] = {
    # all layers Mamba by default, and transformers' cache needs one attention layer
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"]},
    # no default layer kinds at all
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # LongCat-Flash names its sizes its own way
    "longcat_flash": {
        "num_layers": 2,
        "ffn_hidden_size": 32,
        "expert_ffn_hidden_size": 16,
        "moe_topk": 2,
        "zero_expert_num": 2,
    },
    # every layer MoE by default: one dense layer, so that the plan's dense keys name one
    "cohere2_moe": {"mlp_layer_types": ["dense", "sparse"], "prefix_dense_intermediate_size": 32},
    "mellum": {"mlp_layer_types": ["dense", "sparse"]},
    # the defaults build no model at all: the indexer's sizes (None) are required
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 8,
        "indexer_budget": 4,
        "indexer_compress_ratio": 2,
        "hc_lowrank": 8,
        "ple_embed_dim": 16,
        "heads_per_ngram": 2,
        "ngram_vocab_size_base": 256,
        "split_ngram_parts": 2,
    },
    # the defaults build no model at all: no rotary parameters for the attention layers
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    },
    "deepseek_v4": {"o_lora_rank": 16, "o_groups": 2, "hc_mult": 2},
}
# names of the per-layer kind lists: the tiny model takes one layer of each kind
_LAYER_KINDS = ("layer_types", "layers_block_type")


def zoo() -> dict[str, tuple[str, str]]:
    """``model_type -> (causal LM class name, config class name)`` of every causal LM of the
    installed transformers whose config class declares a ``base_model_tp_plan``."""
    import transformers
    from transformers.models.auto import configuration_auto, modeling_auto

    found = {}
    for model_type, model_class in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if isinstance(model_class, (list, tuple)):
            model_class = model_class[0]
        config_name = configuration_auto.CONFIG_MAPPING_NAMES.get(model_type)
        config_class = getattr(transformers, config_name or "", None)
        if getattr(config_class, "base_model_tp_plan", None):
            found[model_type] = (model_class, config_name)
    return dict(sorted(found.items()))


def _tiny_fields(default: Any) -> dict[str, Any]:
    """The fields of :data:`_TINY` that ``default`` (a config) has, sub-configs shrunk too."""
    fields = {}
    known = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    for key, value in _TINY.items():
        if key not in known:
            continue
        if isinstance(getattr(type(default), key, None), property):
            continue  # derived from other fields (Jamba's layer_types)
        fields[key] = value
    if "kv_lora_rank" in known:
        # multi-head latent attention: a key/value head per query head; head_dim is the
        # rotary part's
        fields.update(num_key_value_heads=fields.get("num_attention_heads", 4), head_dim=4)
        if "qk_head_dim" in known:
            fields["qk_head_dim"] = 8
    layers = fields.get("num_hidden_layers", 2)
    for key in _LAYER_KINDS:
        kinds = getattr(default, key, None)
        derived = isinstance(getattr(type(default), key, None), property)
        if isinstance(kinds, (list, tuple)) and kinds and not derived:
            distinct = list(dict.fromkeys(kinds))
            if len(distinct) > 1:  # one layer of each kind (dense and MoE, attention and not)
                layers = max(layers, len(distinct))
                fields[key] = distinct
    if "num_hidden_layers" in fields:
        fields["num_hidden_layers"] = layers
    for key in _LAYER_KINDS:
        if key in fields and len(fields[key]) < layers:
            fields[key] = fields[key] + [fields[key][-1]] * (layers - len(fields[key]))
    mlp_kinds = getattr(default, "mlp_layer_types", None)
    if isinstance(mlp_kinds, (list, tuple)) and mlp_kinds:
        distinct = list(dict.fromkeys(mlp_kinds))
        fields["mlp_layer_types"] = (distinct * layers)[:layers]
    for key, value in list(vars(default).items()):
        if key == "moe_layers":  # Llama 4's MoE layer indices: derived from the step
            continue
        if isinstance(value, list) and key not in fields and key not in _LAYER_KINDS:
            default_layers = getattr(default, "num_hidden_layers", None)
            if default_layers and len(value) == default_layers:  # a per-layer list
                fields[key] = value[:layers]
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
            fields[key] = _tiny_fields(value)
    return fields


def tiny_config(model_type: str) -> Any:
    """The tiny config of ``model_type`` that the zoo builds its model from."""
    import transformers

    _, config_name = zoo()[model_type]
    config_class = getattr(transformers, config_name)
    fields = {**_tiny_fields(config_class()), **_OVERRIDES.get(model_type, {})}
    for key, value in list(fields.items()):
        if isinstance(value, dict) and key != "per_layer_config":
            sub = getattr(config_class(), key)
            fields[key] = type(sub)(**value)
    return config_class(**fields)


def build(model_type: str) -> nn.Module:
    """The tiny model of ``model_type``: random weights (seeded), norms and biases random
    too, float64 where its forward runs in float64, in eval mode (no dropout)."""
    import transformers

    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    )
    with torch.no_grad():
        # norms start at one and biases at zero: random values show one sliced wrongly
        for name, param in model.named_parameters():
            if param.is_floating_point() and ("norm" in name or name.endswith("bias")):
                param.uniform_(0.5, 1.5)
    model.eval()
    try:
        double = copy.deepcopy(model).double()
        double(input_ids=torch.randint(2, VOCAB, (1, 4)), use_cache=False)
        return double
    except Exception:
        return model.float()


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".strip()


def rank_error_reason(error: BaseException) -> str:
    """A failed rank's exception, as its traceback's last line says it (the first line of a
    ``RankError`` only names the rank)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    last = next((line for line in reversed(lines) if not line.startswith("rank ")), "")
    return f"{_first_line(error)} {last}".strip()


def _grad(param: torch.Tensor) -> torch.Tensor | None:
    grad = param.grad
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@dataclasses.dataclass(frozen=True)
class _Reference:
    """What one device computes for an architecture: logits, loss, every gradient (by
    name), the greedy and the sampled tokens, and how many keys its own plan has."""

    logits: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    generated: torch.Tensor
    sampled: torch.Tensor
    plan_keys: int


# the single-device results, per worker process and architecture
_REFERENCES: dict[str, _Reference] = {}


def _reference(
    model_type: str, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor
) -> _Reference:
    """Run a copy of ``model`` on one device, and keep what it computes."""
    reference = copy.deepcopy(model)
    out = reference(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    generated = reference.generate(ids[:, :PROMPT], do_sample=False, max_new_tokens=NEW_TOKENS)
    torch.manual_seed(SAMPLE_SEED)
    sampled = reference.generate(ids[:, :PROMPT], **SAMPLING)
    result = _REFERENCES[model_type] = _Reference(
        out.logits.detach(),
        out.loss.detach(),
        {name: p.grad for name, p in reference.named_parameters()},
        generated,
        sampled,
        len(getattr(reference, "_tp_plan", None) or {}),
    )
    return result


def tolerance(model_type: str, dtype: str) -> dict[str, Any]:
    """The comparison's ``rtol``/``atol`` for ``model_type`` built in ``dtype``, and, where it
    is looser than the dtype's, why (see :data:`FLOAT32_PARTS`)."""
    if dtype == "float64" and model_type in FLOAT32_PARTS:
        return {**TOLERANCES["float32"], "why": FLOAT32_PARTS[model_type]}
    return dict(TOLERANCES.get(dtype, TOLERANCE))


def _normalized(placement: Any, ndim: int) -> Any:
    """``Shard(-1)`` as ``Shard(ndim - 1)``: the placement a DTensor reports."""
    from torch.distributed.tensor import Shard

    if type(placement) is Shard and placement.dim < 0:
        return Shard(placement.dim + ndim)
    return placement


def _planned(model: nn.Module, plan: Any) -> tuple[dict[str, Any], int, int]:
    """What the plan promises for ``model`` (not yet parallelized), read from its styles'
    contracts as the dry-run report reads them: every parameter a style lays out (by its
    name in the model) with the placement the style's contract declares for it
    (:func:`torch_tp.plan.planned_placements`) and the plan key and style that lay
    it out; and the parameter bytes on the rank with the largest shards and on one device,
    as :func:`torch_tp.report.plan_report` predicts them (its ``per_rank_bytes`` and
    ``unsharded_bytes``: sums of its parameter table, computed here without its meta trace,
    which costs about a second a model)."""
    from torch_tp import _names
    from torch_tp.plan import planned_placements, resolve_plan
    from torch_tp.report.plan import _parameter_groups

    entries = resolve_plan(model, plan)
    names = {id(param): name for name, param in model.named_parameters()}
    placements = {}
    for entry in entries:
        for name, placement in planned_placements(entry).items():
            owner, _, leaf = name.rpartition(".")
            param = getattr(entry.module.get_submodule(owner), leaf, None)
            if param is not None:  # a contract names a Linear's bias whether it has one or not
                style = f"{entry.key!r} ({_names.describe(entry.style)})"
                placements[names[id(param)]] = (_normalized(placement, param.ndim), style)
    groups = _parameter_groups(model, entries, WORLD_SIZE)
    return placements, sum(g.local_bytes for g in groups), sum(g.global_bytes for g in groups)


def _sharding(
    tp: nn.Module, planned: dict[str, Any], predicted_bytes: int
) -> tuple[dict[str, Any], list[str]]:
    """How ``tp`` (parallelized) is laid out against what its plan promised: the counts of
    planned parameters sharded and replicated and of parameters the plan leaves whole, this
    rank's parameter bytes, and the problems (a planned parameter whose placement is not the
    contract's, by name; a parameter no style declares that is distributed anyway; bytes per
    rank other than predicted)."""
    from torch.distributed.tensor import Replicate

    problems = []
    for name, (expected, style) in planned.items():
        param = tp.get_parameter(name)
        if not isinstance(param, DTensor) or param.placements != (expected,):
            found = repr(param.placements[0]) if isinstance(param, DTensor) else "a plain tensor"
            problems.append(f"{name} is {found}, but plan key {style} declares {expected!r}")
    unique = dict(tp.named_parameters())  # a tied parameter once, by its first name
    live_bytes = 0
    for name, param in unique.items():
        local = param.to_local() if isinstance(param, DTensor) else param
        live_bytes += local.numel() * local.element_size()
        # a parameter the plan does not lay out is whole on every rank: a plain tensor, or
        # a replicated DTensor (a style replicates the submodules it runs itself: a normed
        # embedding's norm)
        if isinstance(param, DTensor) and name not in planned and not _replicated(param):
            problems.append(
                f"{name} is {param.placements[0]!r}, though no style of the plan lays it out"
            )
    # torch.chunk's shards: the first rank holds the largest, the others no more
    first = torch.distributed.get_rank() == 0
    if live_bytes > predicted_bytes or (first and live_bytes != predicted_bytes):
        problems.append(
            f"{live_bytes} bytes of parameters on rank {torch.distributed.get_rank()}, "
            f"the plan predicts {predicted_bytes}"
        )
    summary = {
        "params_sharded": sum(not isinstance(p, Replicate) for p, _ in planned.values()),
        "params_replicated": sum(isinstance(p, Replicate) for p, _ in planned.values()),
        "params_whole": sum(name not in planned for name in unique),
        "param_bytes_per_rank": live_bytes,
        "predicted_param_bytes_per_rank": predicted_bytes,
    }
    return summary, problems


def _replicated(param: DTensor) -> bool:
    return all(p.is_replicate() for p in param.placements)


def _used(actual: torch.Tensor, expected: torch.Tensor, tol: dict[str, Any]) -> float:
    """The largest ``|actual - expected| / (atol + rtol * |expected|)``: how much of the
    tolerance the difference uses (``assert_close`` passes at 1 or less)."""
    actual, expected = actual.double(), expected.double()
    bound = tol["atol"] + tol["rtol"] * expected.abs()
    return ((actual - expected).abs() / bound).max().item() if expected.numel() else 0.0


def _check(model_type: str, make_plan: Any = None) -> dict[str, Any]:
    """One architecture on every rank: its status, its sharding against the plan's
    prediction and, when it runs, its differences from one device.

    ``make_plan(model)`` gives the plan; by default :func:`torch_tp.plans.hf.plan_for`.
    """
    from helpers import tp_mesh

    import torch_tp
    from torch_tp.plans.hf import PLANS, plan_for

    start = time.perf_counter()
    torch.manual_seed(0)
    ids = torch.randint(2, VOCAB, (2, SEQ))
    labels = torch.randint(2, VOCAB, (2, SEQ))
    # transformers itself, on one device (once per worker: test_zoo_auto checks the same
    # models with another plan)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build(model_type)
            ref = _REFERENCES.get(model_type) or _reference(model_type, model, ids, labels)
    except Exception as error:
        return {"status": DOES_NOT_BUILD, "reason": _first_line(error)}
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    tol = tolerance(model_type, dtype)
    result: dict[str, Any] = {"status": FAIL, "dtype": dtype}
    if "why" in tol:
        result["tolerance"] = tol
    tol = {"rtol": tol["rtol"], "atol": tol["atol"]}
    problems = []
    # torch_tp at TP=2
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = (make_plan or plan_for)(model)
            planned, predicted_bytes, one_device_bytes = _planned(model, plan)
            result["param_bytes"] = one_device_bytes
            tp = torch_tp.parallelize_module(model, tp_mesh(), plan)
            # sharded as planned, before anything runs
            sharding, problems = _sharding(tp, planned, predicted_bytes)
            result.update(sharding)
            out = tp(input_ids=ids, labels=labels, use_cache=False)
            loss = out.loss.full_tensor() if isinstance(out.loss, DTensor) else out.loss
            loss.backward()
            logits = out.logits
            if isinstance(logits, DTensor):
                logits = logits.full_tensor()
            grads = {name: _grad(p) for name, p in tp.named_parameters()}
            generated = tp.generate(ids[:, :PROMPT], do_sample=False, max_new_tokens=NEW_TOKENS)
            torch.manual_seed(SAMPLE_SEED)
            sampled = tp.generate(ids[:, :PROMPT], **SAMPLING)
    except Exception as error:
        result["reason"] = "; ".join([*problems, _first_line(error)])
        return result
    result["max_logits_diff"] = float(f"{_max_diff(logits, ref.logits):.2e}")
    # the keys of transformers' plan that name nothing in this config (see transformers_plan)
    unmatched = ref.plan_keys - len(plan)
    if unmatched > 0 and model.config.model_type not in PLANS and make_plan is None:
        result["unmatched_plan_keys"] = unmatched
    if not result["params_sharded"]:
        problems.append("no parameter is sharded")
    used = {"logits": _used(logits, ref.logits, tol), "loss": _used(loss, ref.loss, tol)}
    if used["logits"] > 1:
        problems.append(f"logits differ by {result['max_logits_diff']:.1e}")
    if used["loss"] > 1:
        problems.append(f"loss differs by {_max_diff(loss, ref.loss):.1e}")
    grad_diff = 0.0
    for name, ref_grad in ref.grads.items():
        grad = grads.get(name)
        if (grad is None) != (ref_grad is None):
            problems.append(f"gradient of {name} is None on {'TP' if grad is None else '1 device'}")
            break
        if grad is not None:
            grad_diff = max(grad_diff, _max_diff(grad, ref_grad))
            used[name] = _used(grad, ref_grad, tol)
            if used[name] > 1:
                problems.append(f"gradient of {name} differs by {_max_diff(grad, ref_grad):.1e}")
                break
    result["max_grad_diff"] = float(f"{grad_diff:.2e}")
    # how much of the tolerance the worst logit, loss or gradient element uses (at most 1)
    result["tolerance_used"] = float(f"{max(used.values()):.2e}")
    if not torch.equal(generated, ref.generated):
        problems.append("generate gives other tokens")
    # every rank compares with its own single-device run: equal here means equal everywhere
    if not torch.equal(sampled, ref.sampled):
        problems.append("generate(do_sample=True, top_p=0.9) gives other tokens")
    if problems:
        result["reason"] = "; ".join(problems)
    else:
        result["status"] = PASS
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


# --------------------------------------------------------------------------- the file


_NUMBER = re.compile(r"\d+\.\d+(e[-+]?\d+)?|\de[-+]?\d+|0x[0-9a-f]+")


def _comparable(entry: dict[str, Any]) -> tuple[str, str]:
    """What must match between runs: the status and the reason, numbers masked (they vary
    with the machine's rounding)."""
    return entry["status"], _NUMBER.sub("#", entry.get("reason", ""))


# what the status files' fields mean
FIELDS = (
    "Per model: params_sharded and params_replicated count the parameters the plan lays out, "
    "by the placement their style's contract declares (and each has, checked live), "
    "params_whole those it leaves whole; param_bytes is one device's parameter bytes, "
    "param_bytes_per_rank rank 0's live and predicted_param_bytes_per_rank plan_report's "
    "prediction; max_logits_diff and max_grad_diff are the largest absolute differences from "
    "one device, tolerance_used the largest |difference| / (atol + rtol * |expected|) (at "
    "most 1 to pass); tolerance, where a float64 model is held to float32's, says why"
)
# compared exactly with the recorded values: what the plan lays out, where and how much
EXACT = (
    "dtype",
    "tolerance",
    "params_sharded",
    "params_replicated",
    "params_whole",
    "param_bytes",
    "param_bytes_per_rank",
    "predicted_param_bytes_per_rank",
    "unmatched_plan_keys",
)


def differences(live: dict[str, Any], old: dict[str, Any], exact: tuple = EXACT) -> list[str]:
    """How a live result differs from the recorded one: its status or reason (numbers
    masked), any field of ``exact`` (counts, bytes, tolerances), and, for a pass, a
    difference from one device beyond the tolerance (the recorded differences themselves
    are not compared: they vary with the machine's rounding)."""
    found = []
    if _comparable(live) != _comparable(old):
        found.append(
            f"recorded {old['status']} {old.get('reason', '')!r}, "
            f"now {live['status']} {live.get('reason', '')!r}"
        )
    for key in exact:
        if live.get(key) != old.get(key):
            found.append(f"{key}: recorded {old.get(key)!r}, now {live.get(key)!r}")
    if live["status"] == PASS and not live.get("tolerance_used", 2) <= 1:
        found.append(f"differences beyond the tolerance ({live.get('tolerance_used')} of it)")
    return found


def _load() -> dict[str, Any]:
    if not STATUS_FILE.exists():
        return {}
    return json.loads(STATUS_FILE.read_text())


def status_counts(models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """How many architectures of a status file's ``models`` pass, fail and do not build."""
    return {
        status: sum(e["status"] == status for e in models.values())
        for status in (PASS, FAIL, DOES_NOT_BUILD)
    }


def write_status(
    path: Path,
    about: str,
    results: dict[str, dict[str, Any]],
    counts: Callable[[dict[str, dict[str, Any]]], dict[str, Any]] = status_counts,
) -> None:
    """Write a zoo sweep's status file: what it checks (``about``), the library versions, the
    ``counts`` and each architecture's entry (sorted, its timing left out)."""
    import transformers

    models = {
        model_type: {k: v for k, v in entry.items() if k != "seconds"}
        for model_type, entry in sorted(results.items())
    }
    data = {
        "about": about,
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "counts": counts(models),
        "models": models,
    }
    path.write_text(json.dumps(data, indent=1) + "\n")


def _write(results: dict[str, dict[str, Any]]) -> None:
    about = (
        "torch_tp.plans.hf.plan_for at TP=2 against one device, for every causal LM of "
        "the transformers below that declares a base_model_tp_plan; written by "
        f"{UPDATE_ENV}=1 python -m pytest test/test_zoo.py. {FIELDS}"
    )
    write_status(STATUS_FILE, about, results)


def sharding_cells(entry: dict[str, Any]) -> list[str]:
    """The table's sharding columns for one entry: planned parameters sharded / replicated /
    left whole, and parameter bytes per rank of one device's (empty where it did not run)."""
    if "params_sharded" not in entry:
        return ["", ""]
    counts = f"{entry['params_sharded']} / {entry['params_replicated']} / {entry['params_whole']}"
    return [counts, f"{entry['param_bytes_per_rank']:,} of {entry['param_bytes']:,}"]


def difference_cell(entry: dict[str, Any]) -> str:
    """The largest logits and gradient differences from one device (and the tolerance, where
    it is float32's in a float64 model), or the reason it fails."""
    if entry["status"] != PASS:
        return entry.get("reason", "").replace("|", "\\|")
    cell = f"{entry['max_logits_diff']:.1e} / {entry['max_grad_diff']:.1e}"
    if "tolerance" in entry:
        cell += f" (float32 tolerance: {entry['tolerance']['why']})"
    return cell.replace("|", "\\|")


def markdown(data: dict[str, Any] | None = None) -> str:
    """The status file as a markdown table, for the docs: one row per architecture."""
    data = _load() if data is None else data
    counts = data.get("counts", {})
    lines = [
        f"transformers {data.get('transformers')}, torch {data.get('torch')}, TP=2: "
        f"{counts.get(PASS, 0)} pass, {counts.get(FAIL, 0)} fail, "
        f"{counts.get(DOES_NOT_BUILD, 0)} do not build at tiny size.",
        "",
        "| model_type | status | dtype | parameters sharded / replicated / whole "
        "| parameter bytes per rank | max logits / gradient difference, or reason |",
        "|---|---|---|---|---|---|",
    ]
    labels = {PASS: "passes", FAIL: "fails", DOES_NOT_BUILD: "does not build"}
    for model_type, entry in data.get("models", {}).items():
        cells = [f"`{model_type}`", labels[entry["status"]], entry.get("dtype", "")]
        cells += [*sharding_cells(entry), difference_cell(entry)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the tests


def selected() -> list[str]:
    """The architectures to run: all, or those named in ``TORCH_TP_ZOO_ONLY`` (comma-separated,
    for working on a few; the comparison, or the rewrite, then covers only those)."""
    only = os.environ.get("TORCH_TP_ZOO_ONLY")
    every = list(zoo())
    if not only:
        return every
    return [m for m in every if m in only.split(",")]


@pytest.mark.slow
def test_zoo_matches_status_file():
    pytest.importorskip("transformers")
    from torch_tp.testing import RankError, RankTimeout, run_distributed

    results = {}
    chosen = selected()
    for model_type in chosen:
        try:
            ranks = run_distributed(_check, WORLD_SIZE, model_type, timeout=TIMEOUT)
            results[model_type] = ranks[0]
        except RankTimeout:
            results[model_type] = {"status": FAIL, "reason": f"hangs (over {TIMEOUT:.0f} s)"}
        except RankError as error:  # a rank's worker died, or ranks disagreed
            results[model_type] = {"status": FAIL, "reason": rank_error_reason(error)}
    data = _load()
    recorded = data.get("models", {})
    if os.environ.get(UPDATE_ENV):
        _write({**recorded, **results} if len(chosen) < len(zoo()) else results)
        return
    import transformers

    changes = []
    names = set(results) | (set(recorded) if len(chosen) == len(zoo()) else set())
    for model_type in sorted(names):
        live, old = results.get(model_type), recorded.get(model_type)
        if live is None:
            changes.append(f"{model_type}: recorded, but no longer in transformers' zoo")
        elif old is None:
            changes.append(f"{model_type}: new, {live['status']} {live.get('reason', '')}")
        else:
            changes += [f"{model_type}: {change}" for change in differences(live, old)]
    versions = (
        f"recorded with transformers {data.get('transformers')} and torch {data.get('torch')}, "
        f"run with transformers {transformers.__version__} and torch {torch.__version__}"
    )
    assert not changes, (
        f"the zoo differs from {STATUS_FILE.name} ({versions}; if that is what you meant, "
        f"rewrite it with `{UPDATE_ENV}=1 python -m pytest test/test_zoo.py`):\n  "
        + "\n  ".join(changes)
    )


def _meta_model(model_type: str, **fields: Any) -> nn.Module:
    import transformers

    config = tiny_config(model_type)
    for key, value in fields.items():
        setattr(config, key, value)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_plan_for_takes_the_models_own_plan_less_keys_that_name_nothing():
    pytest.importorskip("transformers")
    from torch_tp.plan import resolve_plan
    from torch_tp.plans.hf import plan_for

    # every layer mixture-of-experts: the dense MLP's keys name nothing
    model = _meta_model("qwen3_moe", mlp_only_layers=[])
    plan = plan_for(model)
    dropped = set(model._tp_plan) - set(plan)
    assert dropped == {f"model.layers.*.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    assert list(plan) == [k for k in model._tp_plan if k not in dropped]  # order kept
    assert all(plan[k] == model._tp_plan[k] for k in plan)  # transformers' names, as they are
    resolve_plan(model, plan)  # strict: every key left names a module or a parameter
    # with a dense layer they name one, and stay
    model = _meta_model("qwen3_moe", mlp_only_layers=[0])
    assert plan_for(model) == dict(model._tp_plan)


def test_plan_for_drops_llama4s_unprefixed_duplicates_only():
    pytest.importorskip("transformers")
    from torch_tp.plans.hf import plan_for

    model = _meta_model("llama4_text")
    plan = plan_for(model)
    dropped = set(model._tp_plan) - set(plan)
    assert all(not key.startswith(("model.", "lm_head")) for key in dropped), dropped
    assert all(key.startswith(("model.", "lm_head")) for key in plan), plan


def test_plan_for_sums_the_gradient_of_a_broadcast_parameter_its_plan_leaves_out(monkeypatch):
    """apertus' own plan leaves out ``mlp.act_fn`` (xIELU, whose ``alpha_p``/``alpha_n`` are
    single values computing on the column-sharded hidden layer): plan_for replicates it with
    its gradient summed. Doge's q/k norms, which are not single values, are refused by name
    when its own plan is taken as it is (its own plan would give them silently wrong
    gradients; plan_for corrects Doge's plan, see below)."""
    pytest.importorskip("transformers")
    from torch_tp.plans import hf

    model = _meta_model("apertus")
    plan = hf.plan_for(model)
    assert "model.layers.*.mlp.act_fn" not in model._tp_plan
    assert plan["model.layers.*.mlp.act_fn"] == "replicated_with_grad_allreduce"
    monkeypatch.delitem(hf._CORRECTIONS, "doge")
    with pytest.raises(ValueError, match=r"q_norm\.weight, which no plan entry lays out"):
        hf.plan_for(_meta_model("doge"))


def test_plan_for_corrects_plans_that_compute_something_else():
    pytest.importorskip("transformers")
    from torch.distributed.tensor import Shard

    from torch_tp import RowwiseParallel
    from torch_tp.plans.hf import plan_for

    # Doge: each rank its own heads' part of the dynamic mask
    plan = plan_for(_meta_model("doge"))
    attention = "model.layers.*.self_attn"
    assert plan[f"{attention}.dt_proj"] == RowwiseParallel(output_layouts=Shard(-1))
    assert plan[attention] == "local_params" and plan[f"{attention}.A"] == "colwise"
    assert plan[f"{attention}.q_norm"] == "replicated_with_grad_allreduce"
    # Gemma 3n: the MLPs with activation sparsity (a cut over all of the gate's features)
    # stay whole, the others are sharded
    model = _meta_model("gemma3n_text", activation_sparsity_pattern=[0.95, 0.0])
    plan = plan_for(model)
    assert "model.layers.*.mlp.gate_proj" not in plan
    assert "model.layers.0.mlp.gate_proj" not in plan
    assert plan["model.layers.1.mlp.gate_proj"] == model._tp_plan["model.layers.*.mlp.gate_proj"]
    assert plan["model.layers.1.mlp.down_proj"] == "rowwise"


def test_plan_for_keeps_a_key_that_names_something_even_if_wrong():
    pytest.importorskip("transformers")
    from torch_tp.plans.hf import plan_for

    model = _meta_model("olmo2")
    model._tp_plan = {**model._tp_plan, "model.norm": "colwise", "model.nothing.*": "colwise"}
    plan = plan_for(model)
    assert plan["model.norm"] == "colwise"  # refused later by parallelize_module, not here
    assert "model.nothing.*" not in plan


def recorded_problems(models: dict[str, dict[str, Any]]) -> list[str]:
    """What is wrong with a status file's passes: a pass must have sharded parameters, the
    parameter bytes per rank the plan predicts (fewer than one device's), differences within
    its tolerance, and the tolerance this file gives its dtype and architecture."""
    problems = []
    for model_type, entry in models.items():
        if entry["status"] != PASS:
            continue
        wanted = tolerance(model_type, entry["dtype"])
        checks = {
            "no sharded parameter": entry["params_sharded"] > 0,
            "bytes per rank other than predicted": entry["param_bytes_per_rank"]
            == entry["predicted_param_bytes_per_rank"]
            < entry["param_bytes"],
            "differences beyond the tolerance": entry["tolerance_used"] <= 1,
            "another tolerance": entry.get("tolerance") == (wanted if "why" in wanted else None),
        }
        problems += [f"{model_type}: {what}" for what, ok in checks.items() if not ok]
    return problems


def test_status_file_passes_are_sharded_as_planned_and_within_tolerance():
    data = _load()
    assert data, f"{STATUS_FILE.name} is missing: the status file is part of the test"
    models = data["models"]
    statuses = (PASS, FAIL, DOES_NOT_BUILD)
    assert data["counts"] == {s: sum(e["status"] == s for e in models.values()) for s in statuses}
    assert not recorded_problems(models)


def test_markdown_table():
    data = {
        "transformers": "5.0",
        "torch": "2.13",
        "counts": {PASS: 2, FAIL: 1, DOES_NOT_BUILD: 0},
        "models": {
            "llama": {"status": PASS, "dtype": "float64", **_SHARDED, **_DIFFS},
            "mixtral": {
                "status": PASS,
                "dtype": "float64",
                "tolerance": {**TOLERANCE, "why": "its router's softmax"},
                **_SHARDED,
                **_DIFFS,
            },
            "x": {"status": FAIL, "dtype": "float32", "reason": "ValueError: a | b"},
        },
    }
    assert markdown(data).splitlines()[-3:] == [
        "| `llama` | passes | float64 | 16 / 0 / 5 | 83,200 of 165,120 | 1.3e-15 / 2.0e-16 |",
        "| `mixtral` | passes | float64 | 16 / 0 / 5 | 83,200 of 165,120 | 1.3e-15 / 2.0e-16 "
        "(float32 tolerance: its router's softmax) |",
        "| `x` | fails | float32 |  |  | ValueError: a \\| b |",
    ]


_SHARDED = {
    "params_sharded": 16,
    "params_replicated": 0,
    "params_whole": 5,
    "param_bytes": 165120,
    "param_bytes_per_rank": 83200,
    "predicted_param_bytes_per_rank": 83200,
}
_DIFFS = {"max_logits_diff": 1.3e-15, "max_grad_diff": 2e-16, "tolerance_used": 1e-4}


if __name__ == "__main__":
    sys.stdout.write(markdown())
