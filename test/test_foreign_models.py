"""auto() on models written the way widely copied public codebases write them.

Each model of ``test/foreign_models.py``, ``test/foreign_models_more.py`` and
``test/foreign_models_more2.py`` is either refused by :func:`torch_tp.plans.auto.auto` with
the real reason, or planned so that it trains exactly like one device at TP=2 in float64
(forward, loss, every gradient, the parameters after an SGD step). What each one gets is
listed in ``docs/plans.md`` ("auto() on models from public codebases").

The quick run checks every outcome (no process group needed: auto() reads the module tree
and the sources, and shape-checks its plan on the meta device with each model's example
inputs), the shape check's part in it, and the parity of nanoGPT's ``view(B, T, -1, ...)``
variant, the one that used to run silently wrong. The parity of every planned model is one
slow test (one ``run_distributed`` call for all of them).
"""

from __future__ import annotations

import re
import sys
import warnings

import pytest
import torch
from foreign_models import MODELS as BASE_MODELS
from foreign_models_more import MORE_MODELS as MORE_MODELS_1
from foreign_models_more2 import MORE_MODELS as MORE_MODELS_2
from helpers import tp_mesh

from torch_tp import AttentionHeads, ColwiseParallel, RowwiseParallel
from torch_tp.models import Llama, tiny_config
from torch_tp.plans.auto import ReplicatedModulesWarning, UncheckedPlanWarning, auto
from torch_tp.testing import check_parity, run_distributed

MODELS = {**BASE_MODELS, **MORE_MODELS_1, **MORE_MODELS_2}

# name -> what auto() must do: a refusal's message (a regex), or the plan entries it must hold
# and the modules its ReplicatedModulesWarning must name ({} if none)
REFUSED = {
    "bert": r"'encoder\.layer\.\*\.attention' spreads its Linear layers over its children "
    r"'attention\.self' \(query, key, value\) and 'attention\.output' \(dense\)",
    "t5_encoder": r"'block\.0\.layer\.0\.SelfAttention\.relative_attention_bias' \(Embedding, "
    r"weight \[12, 4\]\) holds one value per head \(4 heads\)",
    "mlp_mixer": r"cannot tell the hidden size of the blocks 'blocks\.\*'.*each group reads and "
    r"writes a width of its own",
    "moe_loop": r"'layers\.\*\.feed_forward\.experts' is a nn\.ModuleList of Linear layers inside "
    r"the repeated blocks \(experts",
    # foreign_models_more.py: q, k, v packed per head (GPT-NeoX, BLOOM), clamped then chunked
    # (MPT), unflattened (Baichuan): no split auto() recognizes
    "gpt_neox": r"'gpt_neox\.layers\.\*\.attention': cannot tell how forward splits the fused "
    r"'gpt_neox\.layers\.\*\.attention\.query_key_value' into q, k and v",
    "bloom": r"'transformer\.h\.\*\.self_attention': cannot tell how forward splits the fused "
    r"'transformer\.h\.\*\.self_attention\.query_key_value' into q, k and v",
    "mpt": r"'transformer\.blocks\.\*\.attn': cannot tell how forward splits the fused "
    r"'transformer\.blocks\.\*\.attn\.Wqkv' into q, k and v",
    "baichuan": r"'model\.layers\.\*\.self_attn': cannot tell how forward splits the fused "
    r"'model\.layers\.\*\.self_attn\.W_pack' into q, k and v",
    # multi-query packed in one projection: hidden + 2 x head_dim = 48 features
    "falcon_7b": r"the shapes in 'transformer\.h\.\*\.self_attention' do not chain: the "
    r"row-parallel self_attention\.dense reads 32 features, but the column-parallel layers "
    r"write \[48\] \(self_attention\.query_key_value \(32->48\)\)",
    "gpt_bigcode": r"the shapes in 'transformer\.h\.\*\.attn' do not chain: the row-parallel "
    r"attn\.c_proj reads 32 features, but the column-parallel layers write \[48\] "
    r"\(attn\.c_attn \(32->48\)\)",
    # grouped-query heads packed in one projection: (4 + 2 x 2) x 8 = 64 features, as wide as
    # a fused gate/up, in a module named for attention
    "falcon_40b": r"cannot tell what 'transformer\.h\.\*\.self_attention' is: its column-parallel "
    r"layers self_attention\.query_key_value \(32->64\) feed the row-parallel "
    r"self_attention\.dense \(32->32\)",
    "chatglm2": r"cannot tell what 'encoder\.layers\.\*\.self_attention' is: its column-parallel "
    r"layers self_attention\.query_key_value \(32->64\) feed the row-parallel "
    r"self_attention\.dense \(32->32\)",
    # a head count under a name the rules do not know: llm-foundry's kv_n_heads is read as a
    # size, nanochat's n_kv_head is not found (the query count, standing in, does not fit)
    "llm_foundry_mpt": r"'transformer\.blocks\.\*\.attn': forward reads self\.kv_n_heads = 4, "
    r"which equals the head count; auto\(\) cannot tell whether it is a size",
    "nanochat": r"'transformer\.h\.\*\.attn': found 4 query heads but no key/value head count "
    r"\(looked for num_key_value_heads, .*\), so took 4, which does not fit its shapes: "
    r"attn\.c_v writes 16 features",
    # the attention's and the MLP's projections right in the block, one group
    "olmo": r"cannot tell what the block 'transformer\.blocks\.\*' is: its column-parallel layers "
    r"attn_out \(32->32\), att_proj \(32->96\), ff_proj \(32->128\) feed the row-parallel "
    r"ff_out \(64->32\).*these are the block's own children: an attention's and an MLP's",
    "olmo_llama_block": r"the Linear layers of the block 'transformer\.blocks\.\*' are its own "
    r"children \(.*\), 3 of them writing the hidden size 32 \(attn_out, ff_out, q_proj\)",
    # foreign_models_more2.py: a group of Linear layers that writes no width it reads (GEGLU's
    # ff.net.0.proj apart from ff.net.2, DiT's adaLN modulation, vit-pytorch's to_qkv apart
    # from to_out.0), with no input embedding to tell the hidden size
    "diffusers_transformer2d": r"cannot tell the hidden size of the blocks "
    r"'transformer_blocks\.\*': no width both read and written by every group of Linear layers "
    r".*'transformer_blocks\.\*\.attn1\.to_out': attn1\.to_out\.0 32->32; "
    r".*'transformer_blocks\.\*\.ff\.net\.0': ff\.net\.0\.proj 32->256; "
    r"'transformer_blocks\.\*\.ff\.net': ff\.net\.2 128->32",
    "dit": r"cannot tell the hidden size of the blocks 'blocks\.\*': no width both read and "
    r"written by every group of Linear layers .*'blocks\.\*\.adaLN_modulation': "
    r"adaLN_modulation\.1 32->192\)",
    "vit_pytorch": r"cannot tell the hidden size of the blocks 'transformer\.layers\.\*': no width "
    r"both read and written by every group of Linear layers \('transformer\.layers\.\*\.0': "
    r"0\.to_qkv 32->96; 'transformer\.layers\.\*\.0\.to_out': 0\.to_out\.0 32->32",
    # blocks in one nn.Sequential with the embedding, the final norm and the head
    "palm_pytorch": r"the root module \(Sequential\) holds repeated blocks \(2 x Residual\) beside "
    r"other modules \(Embedding, Linear, PaLMLayerNorm\)",
    # projections that are no nn.Linear: a module with a weight and F.linear, torch.einsum
    "gemma_pytorch": r"the blocks 'model\.layers\.\*' hold no nn\.Linear \(or Conv1D\) layer, .*"
    r"their matrices \(self_attn\.qkv_proj\.weight, .*\) are multiplied some other way",
    "gemma_flax_port": r"the blocks 'blocks\.\*' hold no nn\.Linear \(or Conv1D\) layer, .*"
    r"their matrices \(attn\.attn_vec_einsum\.w, .*\) are multiplied some other way",
}

_GATHERED_Q = ColwiseParallel(output_layouts=torch.distributed.tensor.Replicate())
_GATHERED_O = RowwiseParallel(input_layouts=torch.distributed.tensor.Replicate())

PLANNED: dict[str, tuple[dict, dict]] = {
    # forward reads the input's width (B, T, C = x.size()) and uses it for the per-head views
    # and the output: the attention computes whole heads on every rank, its weights sharded
    "nanogpt": (
        {
            "transformer.h.*.attn.c_attn": _GATHERED_Q,
            "transformer.h.*.attn.c_proj": _GATHERED_O,
            "transformer.h.*.mlp.c_fc": ColwiseParallel(),
            "transformer.h.*.mlp.c_proj": RowwiseParallel(),
        },
        {"transformer.h.*.attn": "reads the width of its input"},
    ),
    "nanogpt_any_heads": (
        {"transformer.h.*.attn.c_attn": _GATHERED_Q, "transformer.h.*.mlp.c_fc": ColwiseParallel()},
        {"transformer.h.*.attn": r"reads the width of its input \(C from x\.size\(\)\)"},
    ),
    "mingpt": (
        {"transformer.h.*.attn.c_attn": _GATHERED_Q, "transformer.h.*.mlp.c_fc": ColwiseParallel()},
        {"transformer.h.*.attn": "reads the width of its input"},
    ),
    "gpt_fast": (
        {
            "layers.*.attention": AttentionHeads(
                "n_head", divide=("dim", "n_head", "n_local_heads")
            ),
        },
        {},
    ),
    # the KV cache is a tensor sized by the key/value heads, which no style reshapes
    "meta_llama": (
        {"layers.*.attention.wq": _GATHERED_Q, "layers.*.feed_forward.w1": ColwiseParallel()},
        {"layers.*.attention": r"holds tensors sized by the heads \(cache_k, cache_v\)"},
    ),
    "llama2c": (
        {
            "layers.*.attention": AttentionHeads(
                "n_local_heads", "n_kv_heads", divide=("n_local_heads", "n_local_kv_heads")
            ),
            "layers.*.attention.wq": ColwiseParallel(),
            "output": ColwiseParallel(output_layouts=torch.distributed.tensor.Replicate()),
        },
        {},
    ),
    "timm_vit": (
        {"blocks.*.attn.qkv": _GATHERED_Q, "blocks.*.mlp.fc1": ColwiseParallel()},
        {"blocks.*.attn": "reads the width of its input"},
    ),
    "torchvision_vit_mha": (
        {"encoder.layers.*.mlp.0": ColwiseParallel(), "encoder.layers.*.mlp.3": RowwiseParallel()},
        {"encoder.layers.*.self_attention": "parameters of its own"},
    ),
    "rwkv": ({}, {"blocks.*.att": "parameters of its own", "blocks.*.ffn": "parameters"}),
    "conformer": (
        {
            "conformer_layers.*.self_attn": AttentionHeads("num_heads", divide=("num_heads",)),
            "conformer_layers.*.ffn1.sequential.1": ColwiseParallel(),
        },
        {"conformer_layers.*.conv_module": "convolution"},
    ),
    "esm2": (
        {"layers.*.self_attn.q_proj": _GATHERED_Q, "layers.*.fc1": ColwiseParallel()},
        {"layers.*.self_attn": r"reads the width of its input \(embed_dim from query\.size\(\)\)"},
    ),
    "torch_transformer_encoder": (
        {
            "embedding": RowwiseParallel(input_layouts=torch.distributed.tensor.Replicate()),
            "encoder.layers.*.linear1": ColwiseParallel(),
            "encoder.layers.*.linear2": RowwiseParallel(),
        },
        {"encoder.layers.*.self_attn": "parameters of its own"},
    ),
    "distilbert": (
        {"transformer.layer.*.attention": AttentionHeads("n_heads", divide=("dim", "n_heads"))},
        {},
    ),
    # foreign_models_more.py
    "phi": (
        {
            "model.layers.*.self_attn": AttentionHeads(
                "num_heads",
                "num_key_value_heads",
                divide=("hidden_size", "num_heads", "num_key_value_heads"),
            ),
            "model.layers.*.self_attn.q_proj": ColwiseParallel(),
            "model.layers.*.self_attn.dense": RowwiseParallel(),
            "model.layers.*.mlp.fc1": ColwiseParallel(),
            "lm_head": ColwiseParallel(output_layouts=torch.distributed.tensor.Replicate()),
        },
        {},
    ),
    # the head count passed to _split_heads as an argument; rotary on part of each head
    "gpt_j": (
        {
            "transformer.h.*.attn": AttentionHeads(
                "num_attention_heads", divide=("num_attention_heads",)
            ),
            "transformer.h.*.attn.q_proj": ColwiseParallel(),
            "transformer.h.*.attn.out_proj": RowwiseParallel(),
            "transformer.h.*.mlp.fc_in": ColwiseParallel(),
        },
        {},
    ),
    # foreign_models_more2.py
    # StableLM-2's q and k norms: one LayerNorm per head in an nn.ModuleList, zipped with the
    # heads in forward: a rank's heads would meet the first norms (this plan used to shard the
    # heads and replicate the norms, which trained wrong): the attention is computed whole
    "stablelm": (
        {
            "model.layers.*.self_attn.q_proj": _GATHERED_Q,
            "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        },
        {
            "model.layers.*.self_attn": r"holds one module per head \(q_layernorm\.norms: 4 "
            r"modules, k_layernorm\.norms: 2 modules\)"
        },
    ),
    "starcoder2": (
        {
            "model.layers.*.self_attn": AttentionHeads(
                "num_heads",
                "num_key_value_heads",
                divide=("hidden_size", "num_heads", "num_key_value_heads"),
            ),
            "model.layers.*.self_attn.k_proj": ColwiseParallel(),
            "model.layers.*.mlp.c_fc": ColwiseParallel(),
            "model.embed_tokens": RowwiseParallel(
                input_layouts=torch.distributed.tensor.Replicate()
            ),
        },
        {},
    ),
    # ALiBi of all the heads, built by the model and added to each rank's scores: the shape
    # check sends the attention back to be computed whole
    "jais": (
        {
            "transformer.h.*.attn.c_attn": _GATHERED_Q,
            "transformer.h.*.attn.c_proj": _GATHERED_O,
            "transformer.h.*.mlp.c_fc2": ColwiseParallel(),
            "transformer.h.*.mlp.c_proj": RowwiseParallel(),
        },
        {
            "transformer.h.*.attn": r"the shape check found 'transformer\.h\.0\.attn' at \S+: add_ "
            r"of \(2, 2, 8, 8\) and \(1, 4, 8, 8\) raises on a rank"
        },
    ),
    # Linear subclasses with their own forward; the cross-attention's key and value read the
    # audio features (replicated), sharded like the self-attention's
    "whisper_decoder": (
        {
            "blocks.*.attn": AttentionHeads("n_head", divide=("n_head",)),
            "blocks.*.cross_attn": AttentionHeads("n_head", divide=("n_head",)),
            "blocks.*.cross_attn.key": ColwiseParallel(),
            "blocks.*.cross_attn.out": RowwiseParallel(),
            "blocks.*.mlp.0": ColwiseParallel(),
            "blocks.*.mlp.2": RowwiseParallel(),
        },
        {},
    ),
    # the attention holds q_bias, v_bias and a relative-position bias table (one value per
    # head): left whole, as a "mixer" with parameters of its own
    "beit": (
        {"blocks.*.mlp.fc1": ColwiseParallel(), "blocks.*.mlp.fc2": RowwiseParallel()},
        {"blocks.*.attn": "parameters of its own: q_bias, v_bias, relative_position_bias_table"},
    ),
}


def test_every_model_is_listed():
    assert sorted([*REFUSED, *PLANNED]) == sorted(MODELS)
    assert len(MODELS) >= 42


def _plan(name: str) -> tuple[dict, list]:
    """auto()'s plan of the model (shape-checked with its example inputs), and the
    ReplicatedModulesWarnings; no other warning."""
    torch.manual_seed(0)
    model = MODELS[name].build()
    args, kwargs = MODELS[name].inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = auto(model, tp_degree=2, example_inputs=args, example_kwargs=kwargs)
    others = [w.message for w in caught if not isinstance(w.message, ReplicatedModulesWarning)]
    assert not others, others
    return plan, [w.message for w in caught if isinstance(w.message, ReplicatedModulesWarning)]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_with_the_real_reason(name):
    with pytest.raises(ValueError, match=REFUSED[name]):
        _plan(name)


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_planned(name):
    plan, replicated = _plan(name)
    entries, left_whole = PLANNED[name]
    for key, style in entries.items():
        assert plan.get(key) == style, (key, plan.get(key))
    modules = [m for w in replicated for m in w.modules]
    assert sorted(modules) == sorted(left_whole), modules
    for module, reason in left_whole.items():
        assert any(
            re.search(rf"'{re.escape(module)}': [^;]*{reason}", str(w)) for w in replicated
        ), (
            module,
            reason,
            [str(w) for w in replicated],
        )


def test_shape_check_sends_back_what_the_rules_miss(monkeypatch):
    # without the rule that finds nanoGPT reading C from x.size(), the shape check finds the
    # per-head view that fails on a rank, and auto() computes that attention whole
    module = sys.modules["torch_tp.plans.auto.attention"]  # (torch_tp.plans.auto is the function)
    monkeypatch.setattr(module, "_unsplittable_heads", lambda *args: None)
    for name in ("nanogpt", "nanogpt_any_heads", "esm2", "meta_llama"):
        plan, replicated = _plan(name)
        key = PLANNED[name][0]
        assert all(plan.get(k) == v for k, v in key.items() if "attn" in k or "attention" in k)
        (warning,) = replicated
        assert "the shape check found" in str(warning), str(warning)
    plan, _ = _plan("nanogpt_any_heads")
    assert plan["transformer.h.*.attn.c_attn"] == _GATHERED_Q
    # llama2.c calls self.attention.forward(...), which runs no module hooks: the check finds
    # the problem in the block, on a line of the attention's class (here without the head
    # count n_local_heads, so the attention gets no AttentionHeads and fails on a rank)
    monkeypatch.setattr(module, "_HEAD_NAMES", ("num_heads", "n_heads", "n_head"))
    plan, (warning,) = _plan("llama2c")
    assert plan["layers.*.attention.wq"] == _GATHERED_Q
    assert "the shape check found 'layers.0' at" in str(warning), str(warning)


def test_shape_problem_elsewhere_is_refused(monkeypatch):
    # a problem outside any attention or MLP (here made up, at the root module) has no
    # fallback: refused with the problem
    import torch_tp.shapes as shapes

    problem = shapes.ShapeProblem("", "model.py:1", "view", (2, 8), (2, 4), "a made-up problem")
    monkeypatch.setattr(shapes, "check_shapes", lambda *args, **kwargs: [problem])
    with pytest.raises(ValueError, match=r"fails the shape check .*the root module at model.py:1"):
        _plan("llama2c")


def test_unchecked_plan_warns():
    # a ViT does not take the default token ids: the shape check cannot run, and says so
    model = MODELS["timm_vit"].build()
    with pytest.warns(UncheckedPlanWarning, match=r"could not check the shapes .*example_inputs"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReplicatedModulesWarning)
            auto(model, tp_degree=2)
    # without tp_degree the check runs at 2, where 3 heads do not split: a plan, unchecked
    with torch.device("meta"):
        llama = Llama(tiny_config(dim=48, n_heads=3, n_kv_heads=3))
    with pytest.warns(UncheckedPlanWarning, match=r"at degree 2: .*pass tp_degree"):
        assert auto(llama)["layers.*.attention.wq"] == ColwiseParallel()


# --------------------------------------------------------------------------- parity at TP=2


def _parity(names: list[str]) -> dict[str, str]:
    """check_parity of auto()'s plan for each model; the failures, by model."""
    mesh = tp_mesh()
    failures = {}
    for name in names:
        foreign = MODELS[name]
        torch.manual_seed(0)
        model = foreign.build()
        args, kwargs = foreign.inputs()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ReplicatedModulesWarning)
                plan = auto(
                    model, tp_degree=mesh.size(), example_inputs=args, example_kwargs=kwargs
                )
            check_parity(
                model,
                mesh,
                plan,
                args,
                kwargs,
                loss_fn=foreign.loss,
                optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.5),
                rtol=foreign.tol,
                atol=foreign.tol,
            )
        except Exception as err:  # every rank fails alike: the same model and inputs
            failures[name] = f"{type(err).__name__}: {str(err)[:500]}"
    return failures


def test_nanogpt_any_heads_parity():
    # the variant that ran silently wrong (one head of 16 per rank instead of two of 8)
    assert run_distributed(_parity, 2, ["nanogpt_any_heads"])[0] == {}


def test_modules_per_head_keep_the_attention_whole(monkeypatch):
    # without the rule, auto() splits StableLM-2's heads and replicates their per-head norms:
    # the plan that trained wrong (each rank's heads met the first heads' norms; the parity of
    # the plan it makes now is in test_every_planned_model_parity)
    module = sys.modules["torch_tp.plans.auto.attention"]
    monkeypatch.setattr(module, "_modules_per_head", lambda *args: [])
    plan, _ = _plan("stablelm")
    assert isinstance(plan["model.layers.*.self_attn"], AttentionHeads), plan


@pytest.mark.slow
def test_every_planned_model_parity():
    names = sorted(set(PLANNED) - {"nanogpt_any_heads"})
    assert run_distributed(_parity, 2, names, timeout=300.0)[0] == {}


def _meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _meta(v) for k, v in value.items()}
    return value


# forwards the report's layout trace used to stop on or misread: DistilBERT reads a value
# (.item()) and meets a CPU scalar, ESM-2 reads a value, gpt-fast multiplies the head-sharded
# query by a rotary table broadcast over the heads (reported as "layouts do not chain")
_REPORT_QUICK = ("distilbert", "esm2", "gpt_fast")


@pytest.mark.parametrize(
    "name",
    [n if n in _REPORT_QUICK else pytest.param(n, marks=pytest.mark.slow) for n in sorted(PLANNED)],
)
def test_report_traces_the_planned_model(name):
    from torch_tp.report import plan_report

    plan, _ = _plan(name)
    args, kwargs = MODELS[name].inputs()
    with torch.device("meta"):
        model = MODELS[name].build()
    report = plan_report(
        model, plan, 2, batch_size=2, seq_len=8, example_inputs=_meta(args or kwargs)
    )
    assert [p for p in report.problems if p.severity == "error"] == []
