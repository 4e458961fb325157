"""parallelize_module: plan resolution, wildcards, strict plans, atomic application, errors."""

from __future__ import annotations

import ast
import copy
import pathlib

import pytest
import torch
import torch.nn as nn
from helpers import tp_mesh
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.testing import assert_close

import torch_tp
from torch_tp import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch_tp.models import Llama, LlamaConfig
from torch_tp.testing import check_parity, device_type, run_distributed


def _llama() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16))


def _snapshot(model: nn.Module):
    """Everything parallelize_module could change: parameters (type and value), hooks and
    instance attributes of every module."""
    return {
        name: (
            {k: (type(v), v.detach().clone()) for k, v in module.named_parameters(recurse=False)},
            dict(module._forward_pre_hooks),
            dict(module._forward_hooks),
            sorted(vars(module)),
        )
        for name, module in model.named_modules()
    }


def _assert_unchanged(model: nn.Module, before) -> None:
    after = _snapshot(model)
    assert after.keys() == before.keys()
    for name in before:
        params_b, pre_b, post_b, attrs_b = before[name]
        params_a, pre_a, post_a, attrs_a = after[name]
        assert pre_a == pre_b and post_a == post_b, f"hooks of {name!r} changed"
        assert attrs_a == attrs_b, f"attributes of {name!r} changed"
        assert params_a.keys() == params_b.keys()
        for k in params_b:
            assert params_a[k][0] is params_b[k][0], f"{name}.{k} changed type"
            assert_close(params_a[k][1], params_b[k][1])


def _expect_error(model, plan, error, match, **kwargs):
    mesh = tp_mesh()
    before = _snapshot(model)
    with pytest.raises(error, match=match):
        parallelize_module(model, mesh, plan, **kwargs)
    _assert_unchanged(model, before)


# --------------------------------------------------------------------------- plan errors


def _unmatched_key() -> None:
    # the error comes after valid keys were resolved: nothing may have been applied
    plan = {
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.w_q": ColwiseParallel(),
    }
    _expect_error(_llama(), plan, ValueError, r"'layers\.\*\.attention\.w_q'.*'w_q'")
    _expect_error(_llama(), {"layer.0.attention": ColwiseParallel()}, ValueError, "'layer'")


def test_unmatched_key_raises_value_error_and_changes_nothing():
    run_distributed(_unmatched_key, 2)


def _unmatched_key_not_strict() -> None:
    mesh = tp_mesh()
    model = _llama()
    plan = {"layers.*.attention.wq": ColwiseParallel(), "missing": RowwiseParallel()}
    with pytest.warns(UserWarning, match="'missing'"):
        parallelize_module(model, mesh, plan, strict=False)
    assert isinstance(model.layers[1].attention.wq.weight, DTensor)


def test_strict_false_warns_and_skips():
    run_distributed(_unmatched_key_not_strict, 2)


def _not_a_style() -> None:
    plan = {"layers.*.attention.wq": ColwiseParallel(), "output": 3}
    _expect_error(_llama(), plan, TypeError, r"plan key 'output'.*ParallelStyle.*int 3")
    plan = {"layers.*.attention.wq": ColwiseParallel(), "output": "colwsie"}
    _expect_error(_llama(), plan, ValueError, r"plan key 'output': unknown style name 'colwsie'")
    _expect_error(_llama(), {"output": ColwiseParallel}, TypeError, "plan key 'output'")
    _expect_error(_llama(), [ColwiseParallel()], TypeError, "parallelize_plan")
    _expect_error(_llama(), {1: ColwiseParallel()}, TypeError, "plan key 1")


def test_value_not_a_style_raises_type_error():
    run_distributed(_not_a_style, 2)


def _unsupported_module_types() -> None:
    plan = {"layers.*.attention.wq": ColwiseParallel(), "layers.0.attention": ColwiseParallel()}
    _expect_error(
        _llama(),
        plan,
        NotImplementedError,
        r"ColwiseParallel.*'layers\.0\.attention'.*Attention.*nn\.Linear, nn\.Embedding and "
        r"Conv1D",
    )
    _expect_error(
        _llama(),
        {"layers.1.feed_forward": RowwiseParallel()},
        NotImplementedError,
        r"RowwiseParallel.*'layers\.1\.feed_forward'.*FeedForward.*supports nn\.Linear",
    )
    _expect_error(
        _llama(),
        {"norm": SequenceParallel(), "output": SequenceParallel()},
        NotImplementedError,
        r"SequenceParallel.*'output'.*Linear.*supports nn\.LayerNorm, nn\.RMSNorm, nn\.Dropout",
    )
    _expect_error(nn.Conv1d(4, 4, 1), ColwiseParallel(), NotImplementedError, "Conv1d")


def test_unsupported_module_type_names_path_type_and_supported_types():
    run_distributed(_unsupported_module_types, 2)


def _embedding_options() -> None:
    _expect_error(nn.Embedding(10, 4, sparse=True), RowwiseParallel(), ValueError, "sparse")
    _expect_error(nn.Embedding(10, 4, max_norm=1.0), ColwiseParallel(), ValueError, "max_norm")
    _expect_error(
        nn.Embedding(10, 4, scale_grad_by_freq=True), RowwiseParallel(), ValueError, "scale_grad"
    )
    _expect_error(
        nn.Linear(4, 4), RowwiseParallel(output_layouts=Partial()), ValueError, "biased Linear"
    )


def test_options_that_cannot_be_sharded():
    run_distributed(_embedding_options, 2)


def _two_keys_one_module() -> None:
    plan = {"layers.*.attention.wq": ColwiseParallel(), "layers.1.attention.wq": ColwiseParallel()}
    _expect_error(
        _llama(),
        plan,
        ValueError,
        r"'layers\.1\.attention\.wq' is matched by plan keys 'layers\.\*\.attention\.wq'",
    )


def test_module_matched_by_two_keys():
    run_distributed(_two_keys_one_module, 2)


def _already_parallelized() -> None:
    mesh = tp_mesh()
    model = _llama()
    parallelize_module(model, mesh, {"layers.0.attention.wq": ColwiseParallel()})
    _expect_error(
        model,
        {"layers.1.attention.wq": ColwiseParallel(), "layers.0.attention.wq": RowwiseParallel()},
        ValueError,
        r"'layers\.0\.attention\.wq'.*already parallelized with ColwiseParallel",
    )
    # a style-less module whose parameters are DTensors (distributed by other means)
    linear = nn.Linear(4, 4)
    linear.weight = nn.Parameter(
        torch.distributed.tensor.distribute_tensor(linear.weight.detach(), mesh, [Replicate()])
    )
    _expect_error(linear, ColwiseParallel(), ValueError, "'weight' is already a DTensor")
    # other modules can still be parallelized later
    parallelize_module(model, mesh, {"layers.1.attention.wq": ColwiseParallel()})


def test_parallelizing_twice_raises():
    run_distributed(_already_parallelized, 2)


def _mesh_errors() -> None:
    mesh2d = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r'1-D.*mesh\["tp"\]'):
        parallelize_module(nn.Linear(4, 4), mesh2d, ColwiseParallel())
    # the tp dimension of a 2-D mesh is fine
    model = parallelize_module(nn.Linear(4, 4), mesh2d["tp"], ColwiseParallel())
    assert model.weight.device_mesh == mesh2d["tp"]
    with pytest.raises(RuntimeError, match=r"no `with mesh:` block.*torchrun --nproc-per-node"):
        parallelize_module(nn.Linear(4, 4), None, ColwiseParallel())


@pytest.mark.four_ranks
def test_mesh_must_be_one_dimensional():
    run_distributed(_mesh_errors, 4)


def test_no_process_group_says_how_to_start():
    # this process is no rank of anything: torch's own error would be "No device mesh is
    # currently active!", which does not say that the ranks were never started
    assert not torch.distributed.is_initialized()
    model = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match=r"no process group.*torchrun --nproc-per-node N"):
        parallelize_module(model, None, ColwiseParallel())
    assert not isinstance(model.weight, DTensor)


def test_style_argument_errors_as_upstream():
    # upstream raises AssertionError from these constructors; code out there catches it
    with pytest.raises(AssertionError, match="same length"):
        PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=Replicate())
    with pytest.raises(AssertionError, match="should not be None"):
        PrepareModuleInput(input_layouts=Shard(0))
    with pytest.raises(AssertionError, match="same length"):
        PrepareModuleInput(input_kwarg_layouts={"a": Shard(0)}, desired_input_kwarg_layouts={})
    with pytest.raises(AssertionError, match="same length"):
        PrepareModuleOutput(output_layouts=(Shard(0), None), desired_output_layouts=Replicate())
    with pytest.raises(TypeError, match="input_layouts"):
        ColwiseParallel(input_layouts="replicate")
    with pytest.raises(TypeError, match="desired_input_layouts"):
        PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=("x",))


# --------------------------------------------------------------------------- resolution


def _wildcards() -> None:
    mesh = tp_mesh()
    model = _llama()
    plan = {
        "layers.*.attention.w[qkv]": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(),
        "layers.1.feed_forward.w?": ColwiseParallel(),
    }
    parallelize_module(model, mesh, plan)
    placements = {
        name: p.placements for name, p in model.named_parameters() if isinstance(p, DTensor)
    }
    expected = {}
    for i in range(2):
        for w in "qkv":
            expected[f"layers.{i}.attention.w{w}.weight"] = (Shard(0),)
        expected[f"layers.{i}.attention.wo.weight"] = (Shard(1),)
    for w in "123":
        expected[f"layers.1.feed_forward.w{w}.weight"] = (Shard(0),)
    assert placements == expected


def test_wildcards_match_per_segment():
    run_distributed(_wildcards, 2)


def _wildcard_plan_parity() -> None:
    model = _llama()
    tokens = torch.randint(0, 64, (2, 8))
    plan = {
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(),
    }
    check_parity(model, tp_mesh(), plan, (tokens,))


def test_wildcard_plan_parity():
    run_distributed(_wildcard_plan_parity, 2)


def _root_and_mesh_context() -> None:
    mesh = tp_mesh()
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    # "" names the module itself; the mesh comes from the context when not given
    with mesh:
        linear = parallelize_module(nn.Linear(8, 6), None, {"": ColwiseParallel()})
    assert linear.weight.placements == (Shard(0),)
    with mesh:
        model = parallelize_module(
            nn.Linear(8, 6), parallelize_plan=RowwiseParallel(input_layouts=Replicate())
        )
    assert model.weight.placements == (Shard(1),)
    assert model(x).shape == (3, 6)


def test_empty_key_and_mesh_context():
    run_distributed(_root_and_mesh_context, 2)


def _no_plan() -> None:
    model = nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="No parallelize_plan"):
        assert parallelize_module(model, tp_mesh()) is model
    assert not isinstance(model.weight, DTensor)


def test_no_plan_warns_and_does_nothing():
    run_distributed(_no_plan, 2)


def _shared_style_object() -> None:
    # one style object may be used for several keys (upstream's plans do it)
    mesh = tp_mesh()
    colwise = ColwiseParallel()
    model = _llama()
    parallelize_module(
        model, mesh, {"layers.0.attention.wq": colwise, "layers.1.attention.wq": colwise}
    )
    assert model.layers[1].attention.wq.weight.placements == (Shard(0),)


def test_one_style_object_for_several_modules():
    run_distributed(_shared_style_object, 2)


# --------------------------------------------------------------------------- values


def test_styles_are_comparable_printable_values():
    assert ColwiseParallel() == ColwiseParallel()
    assert ColwiseParallel() != ColwiseParallel(output_layouts=Replicate())
    assert ColwiseParallel() != RowwiseParallel()
    assert repr(ColwiseParallel()) == (
        "ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(dim=-1), "
        "use_local_output=True)"
    )
    assert repr(SequenceParallel(sequence_dim=0)) == (
        "SequenceParallel(sequence_dim=0, use_local_output=False)"
    )
    style = PrepareModuleInputOutput(
        input_layouts=(Shard(0), None),
        desired_input_layouts=(Replicate(), None),
        output_layouts=Replicate(),
        desired_output_layouts=Shard(0),
    )
    assert style == copy.deepcopy(style)
    assert "input_layouts=(Shard(dim=0), None)" in repr(style)
    # src_data_rank is a call argument, not part of the style's identity
    other = ColwiseParallel()
    other.src_data_rank = None
    assert other == ColwiseParallel()


def test_public_names_match_upstream():
    import torch.distributed.tensor.parallel as upstream

    for name in (
        "ColwiseParallel",
        "ParallelStyle",
        "PrepareModuleInput",
        "PrepareModuleInputOutput",
        "PrepareModuleOutput",
        "RowwiseParallel",
        "SequenceParallel",
        "parallelize_module",
    ):
        ours, theirs = getattr(torch_tp, name), getattr(upstream, name)
        assert getattr(torch_tp.api if name == "parallelize_module" else torch_tp.style, name)
        import inspect

        ours_sig = inspect.signature(ours)
        theirs_sig = inspect.signature(theirs)
        # same parameters, kinds and defaults (ours may add keyword-only extras at the end)
        theirs_params = list(theirs_sig.parameters.values())
        ours_params = list(ours_sig.parameters.values())[: len(theirs_params)]
        assert [(p.name, p.kind, repr(p.default)) for p in ours_params] == [
            (p.name, p.kind, repr(p.default)) for p in theirs_params
        ], name


def test_nothing_imports_upstream_tensor_parallel():
    root = pathlib.Path(torch_tp.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n.startswith("torch.distributed.tensor.parallel") for n in names):
                offenders.append(str(path.relative_to(root)))
    assert not offenders, offenders


@pytest.mark.slow  # a fresh interpreter: reloading in this one would not re-run submodules
def test_no_warnings_on_import():
    import subprocess
    import sys

    code = "import torch_tp, torch_tp.plans.hf, torch_tp.testing, torch_tp.checkpoint"
    run = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and not run.stderr, run.stderr


def _runtime_errors_name_path_and_style() -> None:
    mesh = tp_mesh()
    model = _llama()
    # the attention takes (x, rope): one layout for two inputs fails at the first forward
    plan = {
        "layers.*.attention": PrepareModuleInput(
            input_layouts=Replicate(), desired_input_layouts=Replicate()
        )
    }
    parallelize_module(model, mesh, plan)
    with pytest.raises(ValueError, match=r"PrepareModuleInput\(.*\) on 'layers\.0\.attention'"):
        model(torch.randint(0, 64, (1, 4)))

    style = PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(None, None))
    block = parallelize_module(_llama(), mesh, {"layers.1.feed_forward": style})
    with pytest.raises(AssertionError, match=r"'layers\.1\.feed_forward'.*input 0.*str"):
        block.layers[1].feed_forward("not a tensor", None)


def test_runtime_errors_name_path_and_style():
    run_distributed(_runtime_errors_name_path_and_style, 2)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


def _tied_weights() -> None:
    _expect_error(
        _Tied(),
        {"embed": RowwiseParallel(input_layouts=Replicate())},
        ValueError,
        r"'embed'.*'weight' \(Shard\(dim=0\) here\) is shared with 'head\.weight' \(not in "
        r"the plan\) \(tied weights\)",
    )


def test_tied_weights_are_refused():
    run_distributed(_tied_weights, 2)


def _uneven_sequence() -> None:
    mesh = tp_mesh()
    from torch_tp.plans.llama import llama_plan

    model = parallelize_module(_llama(), mesh, llama_plan(sequence_parallel=True))
    with pytest.raises(ValueError, match=r"'tok_embeddings'.*size 7, which does not divide by"):
        model(torch.randint(0, 64, (2, 7)))


def test_sequence_parallel_uneven_sequence_is_a_clear_error():
    run_distributed(_uneven_sequence, 2)
