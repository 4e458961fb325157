"""transformers' mixture-of-experts models under their own ``_tp_plan``, against one device.

Mixtral, Qwen2-MoE (shared expert and its gate), Qwen3-MoE (per-head q/k norms), OLMoE
(gathered attention), DeepSeek-V3 (multi-head latent attention left replicated, shared
experts) and Llama 4 (text; experts stored transposed, a shared expert): tiny configs with
random weights, two layers (one dense where the model has dense layers, so that the plan's
dense-MLP keys match a module), four experts. ``parallelize_module(model, mesh,
model._tp_plan)`` at TP=2, with transformers' parameter-level entries
(``"...experts.gate_up_proj": "packed_colwise"``) next to the experts' ``"moe_tp_experts"``,
must give the single-device logits, loss (the load-balancing loss included where the model
has one), every gradient (routers' too) and greedy ``generate`` tokens.
"""

from __future__ import annotations

import textwrap

import expecttest
import pytest
import torch
import torch.distributed as dist
from helpers import tp_mesh
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from torch_tp import TensorParallelExperts, parallelize_module
from torch_tp._torch_compat import StridedShard
from torch_tp.plan import resolve_plan
from torch_tp.plans.hf import expert_parallel_plan
from torch_tp.testing import check_parity, run_distributed

transformers = pytest.importorskip(
    "transformers",
    reason="the Hugging Face model tests need transformers (pip install -e '.[test]')",
)

VOCAB = 128

# every model: 2 layers, 4 heads (2 KV heads), hidden 32, experts' hidden 16, 4 experts
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": None,  # generate exactly max_new_tokens tokens
    "tie_word_embeddings": False,
    # larger than the default 0.02, so that routing and greedy decoding have clear winners
    "initializer_range": 0.2,
    "attn_implementation": "eager",
    # the experts' loop over experts: torch's grouped_mm (transformers' default) has no
    # float64 kernel
    "experts_implementation": "eager",
}

# model_type: (causal LM class, config class, config fields beyond _COMMON)
MODELS = {
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        {
            "intermediate_size": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 6,  # shorter than the sequence
            "output_router_logits": True,  # the load-balancing loss joins the loss
            "router_aux_loss_coef": 0.1,
        },
    ),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        {
            "intermediate_size": 32,  # the dense layer's MLP
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mlp_only_layers": [0],
            "use_sliding_window": True,
            "sliding_window": 6,
            "max_window_layers": 2,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.1,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {
            "head_dim": 8,
            "intermediate_size": 32,
            "moe_intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mlp_only_layers": [0],
            "use_sliding_window": True,
            "sliding_window": 6,
            "max_window_layers": 2,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.1,
        },
    ),
    "olmoe": (
        "OlmoeForCausalLM",
        "OlmoeConfig",
        {
            "intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.1,
        },
    ),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        {
            "num_key_value_heads": 4,  # multi-head latent attention: as many as the heads
            "intermediate_size": 32,
            "moe_intermediate_size": 16,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "v_head_dim": 8,
        },
    ),
    "llama4": (
        "Llama4ForCausalLM",
        "Llama4TextConfig",
        {
            "head_dim": 8,
            "intermediate_size": 16,  # the experts'
            "intermediate_size_mlp": 32,  # the dense layer's
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 2,  # layer 0 dense, layer 1 MoE
            "attention_chunk_size": 8,
        },
    ),
}


def _model(family: str) -> torch.nn.Module:
    """A float64 model with random weights, the same on every rank (same seed)."""
    causal_lm, config_class, fields = MODELS[family]
    fields = {**_COMMON, **fields}
    torch.manual_seed(0)
    model = getattr(transformers, causal_lm)(getattr(transformers, config_class)(**fields))
    with torch.no_grad():
        # norms start at one and biases at zero: make them random, so that a norm or bias
        # sliced or replicated wrongly shows
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.uniform_(0.5, 1.5)
    # float64: the experts' sums split over ranks round differently, and the routers' top-k
    # and softmax amplify that in float32; in float64 the comparison is tight
    return model.double()


def _plan(model: torch.nn.Module) -> dict[str, str]:
    """``model._tp_plan``, as transformers gives it.

    Llama4ForCausalLM's plan repeats the base model's keys without the ``model.`` prefix;
    they name nothing in the causal LM (transformers skips keys that match nothing, torch_tp
    refuses them unless ``strict=False``): left out here, and checked in
    :func:`test_llama4_unprefixed_keys_match_nothing`.
    """
    plan = dict(model._tp_plan)
    if type(model).__name__ == "Llama4ForCausalLM":
        plan = {k: v for k, v in plan.items() if k.startswith(("model.", "lm_head"))}
    return plan


def _experts(model: torch.nn.Module) -> torch.nn.Module:
    return model.model.layers[1].get_submodule(
        "feed_forward.experts" if hasattr(model.model.layers[1], "feed_forward") else "mlp.experts"
    )


def _parity(family: str, expert_parallel: bool = False) -> dict[str, float]:
    world_size = dist.get_world_size()
    model = _model(family)
    ids = torch.randint(2, VOCAB, (2, 12))
    labels = torch.randint(2, VOCAB, (2, 12))
    # Llama 4 computes its rotary embedding and q/k norm in float32 whatever the model's
    # dtype: a sum split over ranks, rounded to float32 there, differs by float32's rounding
    tolerance = {"rtol": 1.3e-6, "atol": 1e-5} if family == "llama4" else {}
    plan = expert_parallel_plan(model) if expert_parallel else _plan(model)
    tp, reference = check_parity(
        model,
        tp_mesh(),
        plan,
        kwargs={"input_ids": ids, "labels": labels, "use_cache": False},
        # compares every output (logits, loss, router logits) with assert_close, then every
        # gradient, DTensor gradients gathered to full tensors
        loss_fn=lambda out: out.loss,
        **tolerance,
    )
    # the largest differences, for the record
    with torch.no_grad():
        out, ref = tp(input_ids=ids, use_cache=False), reference(input_ids=ids, use_cache=False)
    diffs = {"logits": (out.logits - ref.logits).abs().max().item(), "grad": 0.0}
    for name, param in tp.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param, DTensor) else param.grad
        diff = (grad - reference.get_parameter(name).grad).abs().max().item()
        diffs["grad"] = max(diffs["grad"], diff)

    experts = _experts(tp)
    if expert_parallel:  # whole experts per rank
        assert experts.gate_up_proj.placements == (Shard(0),)
        assert experts.down_proj.to_local().shape == (4 // world_size, 32, 16)
    else:
        _check_tensor_parallel_experts(experts, family, world_size)
    prompt = ids[:, :5]
    generated = tp.generate(prompt, do_sample=False, max_new_tokens=8)
    expected = reference.generate(prompt, do_sample=False, max_new_tokens=8)
    assert expected.shape == (2, 13), expected.shape
    # a decoding that repeats one token would hide a broken KV cache
    assert len(set(expected[:, 5:].flatten().tolist())) > 3, expected
    assert torch.equal(generated, expected), (generated, expected)
    return diffs


def _check_tensor_parallel_experts(experts: nn.Module, family: str, world_size: int) -> None:
    """The experts really are sharded on their hidden dimension, as the plan's entries say."""
    transposed = family == "llama4"  # Llama4TextExperts: [E, dim, 2 * hidden], [E, hidden, dim]
    gate_up, down = experts.gate_up_proj, experts.down_proj
    assert gate_up.placements == (StridedShard(2 if transposed else 1, split_factor=2),)
    assert down.placements == (Shard(1 if transposed else 2),)
    hidden = 16 // world_size
    assert down.to_local().shape == ((4, hidden, 32) if transposed else (4, 32, hidden))


@pytest.mark.parametrize(
    "family",
    [
        # the quick run (-m "not slow") keeps Mixtral and Llama 4 (transposed experts; its
        # Llama4TextMoe adds the routed experts' output in place to its shared expert's
        # row-parallel output, out.add_(...), which both runtimes hand on modifiable)
        f if f in ("mixtral", "llama4") else pytest.param(f, marks=pytest.mark.slow)
        for f in MODELS
    ],
)
def test_moe_model_matches_single_device(family):
    diffs = run_distributed(_parity, 2, family)[0]
    assert diffs["logits"] < (1e-5 if family == "llama4" else 1e-12), diffs


@pytest.mark.parametrize(
    "family",
    # llama4: no EP plan; the quick run keeps one model
    [
        f if f == "mixtral" else pytest.param(f, marks=pytest.mark.slow)
        for f in MODELS
        if f != "llama4"
    ],
)
def test_moe_model_expert_parallel_plan_matches_single_device(family):
    diffs = run_distributed(_parity, 2, family, True)[0]
    assert diffs["logits"] < 1e-12, diffs


def _grouped_mm_parity() -> None:
    """transformers' default experts kernel (torch's grouped matmul, float32 only on CPU),
    which sizes its groups by the module's num_experts: each rank's while it computes."""
    causal_lm, config_class, fields = MODELS["mixtral"]
    fields = {**_COMMON, **fields, "experts_implementation": "grouped_mm"}
    torch.manual_seed(0)
    model = getattr(transformers, causal_lm)(getattr(transformers, config_class)(**fields))
    ids = torch.randint(2, VOCAB, (2, 12))
    tp, _ = check_parity(
        model,
        tp_mesh(),
        expert_parallel_plan(model),
        kwargs={"input_ids": ids, "labels": ids, "use_cache": False},
        loss_fn=lambda out: out.loss,
        rtol=1e-4,
        atol=1e-5,
    )
    assert _experts(tp).num_experts == 4  # the module's own count is left as it was


def test_expert_parallel_with_transformers_grouped_mm_kernel():
    run_distributed(_grouped_mm_parity, 2)


def _refused_before_anything_changes() -> None:
    model = _model("mixtral")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    plan = _plan(model)
    plan["model.layers.*.mlp.experts.down_proj"] = "colwise"  # transformers' rowwise is right
    with pytest.raises(ValueError, match=r"places it Shard\(2\): the entry must state"):
        parallelize_module(model, tp_mesh(), plan)
    for name, param in model.named_parameters():
        assert not isinstance(param, DTensor), name
        assert torch.equal(param, before[name]), name


def test_a_wrong_parameter_entry_is_refused_before_anything_changes():
    run_distributed(_refused_before_anything_changes, 2)


# --------------------------------------------------------------------------- plans (no ranks)


def _meta_model(family: str) -> nn.Module:
    with torch.device("meta"):
        return _model(family)


@pytest.mark.parametrize("family", list(MODELS))
def test_parameter_entries_agree_with_their_modules_style(family):
    """Each parameter entry of the plan states what the experts' style does to that
    parameter; it adds no entry of its own."""
    model = _meta_model(family)
    plan = _plan(model)
    entries = resolve_plan(model, plan)
    paths = {entry.path for entry in entries}
    parameter_keys = [k for k in plan if k.split(".")[-2:-1] == ["experts"]]
    assert [k.rpartition(".")[2] for k in parameter_keys] == ["gate_up_proj", "down_proj"], plan
    assert not any(".experts." in path for path in paths)  # nothing below the experts
    experts = [entry.path for entry in entries if entry.style == TensorParallelExperts()]
    assert experts == [
        path for path, module in model.named_modules() if hasattr(module, "gate_up_proj")
    ]
    assert experts, "no MoE layer"
    # routers and shared experts' gates that the plan leaves out stay plain modules
    assert not any(path.endswith((".gate", ".router", "shared_expert_gate")) for path in paths)


def _wrap(error: Exception) -> str:
    """An error message in lines that fit the source."""
    return textwrap.fill(str(error), 90, break_long_words=False, break_on_hyphens=False)


class ParameterEntryErrorsTest(expecttest.TestCase):
    def test_a_parameter_entry_that_disagrees_is_refused(self):
        model = _meta_model("mixtral")
        plan = _plan(model)
        plan["model.layers.*.mlp.experts.gate_up_proj"] = "colwise"
        with self.assertRaises(ValueError) as info:
            resolve_plan(model, plan)
        self.assertExpectedInline(
            _wrap(info.exception),
            """\
plan key 'model.layers.*.mlp.experts.gate_up_proj'
(ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(dim=-1),
use_local_output=True)) names the parameter 'gate_up_proj' of 'model.layers.0.mlp.experts'
(MixtralExperts), not a module; it would place it Shard(1), but TensorParallelExperts()
(plan key 'model.layers.*.mlp.experts') places it StridedShard(1, split_factor=2): the
entry must state that placement (as 'packed_colwise' does), or be removed""",
        )

    def test_llama4s_transposed_experts_take_the_transposed_entries(self):
        model = _meta_model("llama4")
        plan = _plan(model)
        # Mixtral's entries, on Llama 4's transposed experts
        plan["model.layers.*.feed_forward.experts.gate_up_proj"] = "packed_colwise"
        plan["model.layers.*.feed_forward.experts.down_proj"] = "rowwise"
        with self.assertRaises(ValueError) as info:
            resolve_plan(model, plan)
        self.assertExpectedInline(
            _wrap(info.exception),
            """\
plan key 'model.layers.*.feed_forward.experts.gate_up_proj'
(PackedColwiseParallel(parts=2, input_layouts=Replicate(), output_layouts=None,
use_local_output=True)) names the parameter 'gate_up_proj' of
'model.layers.1.feed_forward.experts' (Llama4TextExperts), not a module; it would place it
StridedShard(1, split_factor=2), but TensorParallelExperts() (plan key
'model.layers.*.feed_forward.experts') places it StridedShard(2, split_factor=2): the
entry must state that placement (as 'packed_rowwise' does), or be removed""",
        )

    def test_a_parameter_entry_without_its_modules_style_is_refused(self):
        model = _meta_model("olmoe")
        plan = _plan(model)
        del plan["model.layers.*.mlp.experts"]
        for strict in (True, False):  # never skipped: it names something
            with self.assertRaises(ValueError) as info:
                resolve_plan(model, plan, strict=strict)
            self.assertExpectedInline(
                _wrap(info.exception),
                """\
plan key 'model.layers.*.mlp.experts.gate_up_proj' (PackedColwiseParallel(parts=2,
input_layouts=Replicate(), output_layouts=None, use_local_output=True)) names the
parameter 'gate_up_proj' of 'model.layers.0.mlp.experts' (OlmoeExperts), not a module; a
parameter entry states how the style of the parameter's module lays it out, and no plan
key gives 'model.layers.0.mlp.experts' a style: add one that places 'gate_up_proj' (for
stacked experts, 'moe_tp_experts'), or name a module""",
            )

    def test_a_parameter_its_modules_style_does_not_place_is_refused(self):
        class Experts(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.gate_up_proj = nn.Parameter(torch.empty(4, 8, 4))
                self.down_proj = nn.Parameter(torch.empty(4, 4, 4))
                self.scale = nn.Parameter(torch.empty(4, 4))

        model = nn.ModuleDict({"experts": Experts()})
        plan = {"experts": "moe_tp_experts", "experts.scale": "colwise"}
        with self.assertRaises(ValueError) as info:
            resolve_plan(model, plan)
        self.assertExpectedInline(
            _wrap(info.exception),
            """\
plan key 'experts.scale' (ColwiseParallel(input_layouts=Replicate(),
output_layouts=Shard(dim=-1), use_local_output=True)) names the parameter 'scale' of
'experts' (Experts), not a module; the style of that module, TensorParallelExperts() (plan
key 'experts'), does not place 'scale', so the entry would do nothing: remove it, or give
the module a style that places it""",
        )
        # an entry that agrees is accepted, whichever order the keys come in
        plan = {"experts.down_proj": "rowwise", "experts": "moe_tp_experts"}
        assert [(e.path, e.style) for e in resolve_plan(model, plan)] == [
            ("experts", TensorParallelExperts())
        ]
        # a style that lays out no Linear weight states nothing about a parameter
        plan = {"experts": "moe_tp_experts", "experts.down_proj": "moe_tp_experts"}
        with self.assertRaisesRegex(ValueError, "lays out no Linear weight"):
            resolve_plan(model, plan)


def test_llama4_unprefixed_keys_match_nothing():
    """Llama4ForCausalLM's ``_tp_plan`` also holds the base model's keys unprefixed, which name
    nothing in the causal LM: refused by default, skipped with a warning under
    ``strict=False``, as transformers skips them."""
    model = _meta_model("llama4")
    plan = dict(model._tp_plan)
    dead = [k for k in plan if not k.startswith(("model.", "lm_head"))]
    if not dead:
        pytest.skip("this transformers' Llama4ForCausalLM plan names only its own modules")
    assert dead == list(transformers.Llama4TextConfig.base_model_tp_plan)
    with pytest.raises(
        ValueError, match=r"key 'layers\.\*\.self_attn\.q_proj' matches no submodule"
    ):
        resolve_plan(model, plan)
    with pytest.warns(UserWarning, match="matches no submodule") as warned:
        entries = resolve_plan(model, plan, strict=False)
    assert len(warned) == len(dead)
    assert entries == resolve_plan(model, _plan(model))


def test_experts_placements_follow_the_layout():
    for family, (gate_up, down) in {
        "mixtral": (StridedShard(1, split_factor=2), Shard(2)),
        "llama4": (StridedShard(2, split_factor=2), Shard(1)),
    }.items():
        experts = _experts(_meta_model(family))
        placements = TensorParallelExperts.contract.parameters(TensorParallelExperts(), experts)
        assert placements == {"gate_up_proj": gate_up, "down_proj": down}, family


def test_expert_parallel_plan_leaves_out_keys_that_name_nothing():
    """A Qwen2-MoE whose layers are all mixture-of-experts has no dense MLP: the dense keys
    of its _tp_plan name nothing, and the expert-parallel plan leaves them out (as
    transformers_plan does) instead of refusing the model."""
    causal_lm, config_class, fields = MODELS["qwen2_moe"]
    config = getattr(transformers, config_class)(**{**_COMMON, **fields, "mlp_only_layers": []})
    with torch.device("meta"):
        model = getattr(transformers, causal_lm)(config)
    plan = expert_parallel_plan(model)
    dense = {f"model.layers.*.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    assert dense <= set(model._tp_plan) and not dense & set(plan)
    assert (
        plan["model.layers.*.mlp.experts"]
        == model.config.base_model_ep_plan["layers.*.mlp.experts"]
    )
    entries = resolve_plan(model, plan)  # strict: every key names something
    assert any(entry.path == "model.layers.0.mlp.experts" for entry in entries)
