"""auto() on models written the way widely copied public codebases write them.

Each model of ``test/foreign_models.py`` is either refused by :func:`torch_tp.plans.auto.auto`
with the real reason, or planned so that it trains exactly like one device at TP=2 in
float64 (forward, loss, every gradient, the parameters after an SGD step). What each one
gets is listed in ``docs/plans.md`` ("auto() on models from public codebases").

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
from foreign_models import MODELS
from helpers import tp_mesh

from torch_tp import AttentionHeads, ColwiseParallel, RowwiseParallel
from torch_tp.models import Llama, tiny_config
from torch_tp.plans.auto import ReplicatedModulesWarning, UncheckedPlanWarning, auto
from torch_tp.testing import check_parity, run_distributed

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
}


def test_every_model_is_listed():
    assert sorted([*REFUSED, *PLANNED]) == sorted(MODELS)
    assert len(MODELS) >= 12


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
