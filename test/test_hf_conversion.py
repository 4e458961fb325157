"""A rank's slices of a converted parameter, read through transformers' own weight converters
(``torch_tp.checkpoint._hf_conversion``): for every operation transformers' conversion mappings
use, and chains of them, the elements a shard holds are read from the checkpoint tensors they
come from, and only those. The expected values are transformers' operations applied to the
whole tensors; the shards are the index sets DTensor layouts give (blocks, strided halves,
single experts), placed as the checkpoint code places them."""

from __future__ import annotations

import itertools
import types
import warnings

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

from transformers.core_model_loading import (  # noqa: E402
    Chunk,
    Concatenate,
    Interleave,
    MergeModulelist,
    PermuteForRope,
    Split,
    Transpose,
    WeightConverter,
    WeightRenaming,
)

from torch_tp.checkpoint._hf_conversion import CheckpointLayout  # noqa: E402
from torch_tp.checkpoint._staging import consecutive_runs  # noqa: E402


def _whole(converter, sources, model, layer_name=""):
    """transformers' operations on the whole tensors (what from_pretrained computes)."""
    stage = {p: [sources[k] for k in keys] for p, keys in _by_pattern(converter, sources).items()}
    for op in converter.operations:
        stage = op.convert(
            stage,
            source_patterns=converter.source_patterns,
            target_patterns=converter.target_patterns,
            full_layer_name=layer_name,
            model=model,
            config=getattr(model, "config", None),
        )
    return {k: (v[0] if isinstance(v, list) else v) for k, v in stage.items()}


def _by_pattern(converter, sources):
    out = {}
    for pattern in converter.source_patterns:
        needle = pattern.replace("*", "{}")
        keys = [k for k in sources if any(needle.format(i) in k for i in range(16))]
        keys = keys if "*" in pattern else [k for k in sources if pattern in k]
        out[pattern] = sorted(
            keys, key=lambda k: [int(t) if t.isdigit() else t for t in k.split(".")]
        )
    return out


def _held_sets(size: int) -> list[list[int]]:
    """Index sets a shard holds along a dim: all, each half, a strided pair of quarters."""
    half, quarter = size // 2, size // 4
    sets = [list(range(size)), list(range(half)), list(range(half, size))]
    if quarter:
        sets.append(list(range(quarter)) + list(range(half, half + quarter)))
    return sets


def _read_shards(layout, name, full, sources):
    """Every shard layout of ``name``: read it, compare with ``full``, count the elements read."""
    shape = full.shape
    for held in itertools.product(*(_held_sets(n) for n in shape)):
        runs = [consecutive_runs(h) for h in held]
        pieces = [
            (tuple(w for w, _ in c), tuple(m for _, m in c)) for c in itertools.product(*runs)
        ]
        dst = torch.full([len(h) for h in held], float("nan"), dtype=full.dtype)
        read = []

        def reader(key, region, read=read):
            part = sources[key][region] if region else sources[key]
            read.append(part.numel())
            return part.clone()

        layout.copy_to(name, pieces, dst, reader)
        expected = full[torch.meshgrid(*map(torch.tensor, held), indexing="ij")]
        torch.testing.assert_close(dst, expected, rtol=0, atol=0, msg=f"{name} {held}")
        yield sum(read), dst.numel()


def _layout(converter, sources, targets, model=None, renamings=(), dtypes=None):
    model = model if model is not None else nn.Module()
    targets = {n: torch.empty(s) for n, s in targets.items()}
    shapes = {k: tuple(v.shape) for k, v in sources.items()}
    dtypes = {k: v.dtype for k, v in sources.items()} | (dtypes or {})
    return CheckpointLayout(model, targets, shapes, dtypes, [*renamings, converter])


def _experts(pattern: str, count: int, shape, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        pattern.format(e): torch.randn(*shape, generator=g, dtype=torch.float64)
        for e in range(count)
    }


def _check_exact(converter, sources, targets, model=None, renamings=()):
    layout = _layout(converter, sources, targets, model, renamings)
    assert not layout.errors, layout.errors
    whole = _whole(converter, sources, model, next(iter(targets)))
    for name in targets:
        assert layout.shapes[name] == tuple(targets[name]), name
        (full,) = [v for k, v in whole.items() if name.endswith(k)]
        for read, held in _read_shards(layout, name, full, sources):
            assert read == held  # this shard's elements, and nothing else
    return layout


def test_per_expert_gate_and_up_merged_and_concatenated():
    # Mixtral: experts.<e>.w1 (gate) and w3 (up) [I, H] -> experts.gate_up_proj [E, 2I, H]
    sources = {**_experts("m.experts.{}.w1.weight", 4, (6, 4)),
               **_experts("m.experts.{}.w3.weight", 4, (6, 4), seed=1)}  # fmt: skip
    converter = WeightConverter(
        ["experts.*.w1.weight", "experts.*.w3.weight"], "experts.gate_up_proj",
        operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
    )  # fmt: skip
    _check_exact(converter, sources, {"m.experts.gate_up_proj": (4, 12, 4)})


def test_per_expert_down_merged_and_renamed():
    sources = _experts("block_sparse_moe.experts.{}.w2.weight", 4, (4, 6))
    converter = WeightConverter(
        "experts.*.w2.weight", "experts.down_proj", operations=[MergeModulelist(dim=0)]
    )
    renaming = WeightRenaming(".block_sparse_moe.", ".mlp.")
    sources = {"layers.0." + k: v for k, v in sources.items()}
    layout = _check_exact(
        converter, sources, {"layers.0.mlp.experts.down_proj": (4, 4, 6)}, renamings=[renaming]
    )
    assert "layers.0.mlp.experts.down_proj" in layout.converted


def test_one_tensor_chunked_into_two_parameters():
    # hrm_text: a fused gate_up_proj.weight [2I, H] -> gate_proj.weight, up_proj.weight
    sources = {"mlp.gate_up_proj.weight": torch.randn(8, 4, dtype=torch.float64)}
    converter = WeightConverter(
        "gate_up_proj.weight", ["gate_proj.weight", "up_proj.weight"], operations=[Chunk(dim=0)]
    )
    _check_exact(converter, sources, {"mlp.gate_proj.weight": (4, 4), "mlp.up_proj.weight": (4, 4)})


def test_merged_then_transposed():
    sources = _experts("experts.{}.up.weight", 4, (6, 4))
    converter = WeightConverter(
        "experts.*.up.weight", "experts.up_proj", operations=[MergeModulelist(0), Transpose(1, 2)]
    )
    _check_exact(converter, sources, {"experts.up_proj": (4, 4, 6)})


def test_transposed_only_where_the_shapes_say_so():
    model = nn.Module()
    model.a = nn.Linear(5, 3, bias=False)  # weight [3, 5]
    model.b = nn.Linear(5, 3, bias=False)
    for key, shape in (("a.w", (3, 5)), ("b.w", (5, 3))):  # as the model has it; transposed
        sources = {key: torch.randn(*shape, dtype=torch.float64)}
        converter = WeightConverter(
            key, key[0] + ".weight", operations=[Transpose(0, 1, check_dims=True)]
        )
        _check_exact(converter, sources, {key[0] + ".weight": (3, 5)}, model=model)


def test_interleaved_gate_and_up():
    # inkling2_text: w13_weight with gate and up rows interleaved -> [gate rows; up rows]
    sources = {"mlp.w13_weight": torch.randn(8, 3, dtype=torch.float64)}
    converter = WeightConverter("w13_weight", "gate_up_proj", operations=[Interleave(dim=0)])
    _check_exact(converter, sources, {"mlp.gate_up_proj": (8, 3)})


def test_tensors_of_different_sizes_concatenated():
    # a convolution's weight kept as several tensors in the checkpoint
    sources = {
        "mixer.conv_q.weight": torch.randn(3, 4, dtype=torch.float64),
        "mixer.conv_kv.weight": torch.randn(5, 4, dtype=torch.float64),
    }
    converter = WeightConverter(
        ["conv_q.weight", "conv_kv.weight"], "conv1d.weight", operations=[Concatenate(dim=0)]
    )
    _check_exact(converter, sources, {"mixer.conv1d.weight": (8, 4)})


def test_one_tensor_split_by_the_model_sizes():
    model = nn.Module()
    model.attn = nn.Module()
    for name, rows in (("q", 6), ("k", 2), ("v", 2)):
        setattr(model.attn, name, nn.Linear(4, rows, bias=False))
    sources = {"attn.qkv.weight": torch.randn(10, 4, dtype=torch.float64)}
    converter = WeightConverter(
        "qkv.weight", ["q.weight", "k.weight", "v.weight"], operations=[Split(dim=0)]
    )
    targets = {"attn.q.weight": (6, 4), "attn.k.weight": (2, 4), "attn.v.weight": (2, 4)}
    _check_exact(converter, sources, targets, model=model)


def test_an_operation_without_a_slice_rule_is_applied_whole_with_a_warning():
    model = nn.Module()
    model.config = types.SimpleNamespace(num_attention_heads=2)
    sources = {"attn.q.weight": torch.randn(8, 4, dtype=torch.float64)}
    converter = WeightConverter("q.weight", "q_proj.weight", operations=[PermuteForRope()])
    layout = _layout(converter, sources, {"attn.q_proj.weight": (8, 4)}, model)
    (full,) = _whole(converter, sources, model).values()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for read, _ in _read_shards(layout, "attn.q_proj.weight", full, sources):
            assert read == 32  # the whole source, for every shard
    assert len(caught) == 1 and "PermuteForRope" in str(caught[0].message), caught


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            "gap",
            r"'experts.\*.w1.weight' keys are numbered \[0, 2, 3\], not 0 to 2: "
            r"'experts.1.w1.weight' missing",
        ),
        ("shape", r"one shape: 'experts.2.w3.weight' has \[5, 4\], the others \[6, 4\]"),
        ("dtype", r"one dtype: 'experts.2.w3.weight' has torch.float16, the others torch.float64"),
        ("F4", r"'experts.3.w1.weight' has the dtype F4, which cannot be loaded"),
    ],
    ids=["gap", "shape", "dtype", "F4"],
)
def test_a_conversion_that_cannot_be_applied_is_named(change, expected):
    sources = {**_experts("experts.{}.w1.weight", 4, (6, 4)),
               **_experts("experts.{}.w3.weight", 4, (6, 4), seed=1)}  # fmt: skip
    if change == "gap":
        del sources["experts.1.w1.weight"]
    elif change == "F4":
        pass  # as safetensors names a dtype torch has no counterpart of
    elif change == "shape":
        sources["experts.2.w3.weight"] = torch.randn(5, 4, dtype=torch.float64)
    else:
        sources["experts.2.w3.weight"] = sources["experts.2.w3.weight"].half()
    converter = WeightConverter(
        ["experts.*.w1.weight", "experts.*.w3.weight"], "experts.gate_up_proj",
        operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
    )  # fmt: skip
    unreadable = {"experts.3.w1.weight": "F4"} if change == "F4" else None
    layout = _layout(converter, sources, {"experts.gate_up_proj": (4, 12, 4)}, dtypes=unreadable)
    (error,) = layout.errors
    assert "WeightConverter(['experts.*.w1.weight', 'experts.*.w3.weight']" in error, error
    assert "'experts.0.w1.weight'" in error, error
    assert pytest.importorskip("re").search(expected, error), error
    assert "experts.gate_up_proj" not in layout.shapes


def test_a_key_renamed_to_nothing_in_the_model_is_unexpected_by_its_own_name():
    renaming = WeightRenaming(".block_sparse_moe.", ".mlp.")
    sources = {"layers.0.block_sparse_moe.bias": torch.zeros(2), "layers.0.norm": torch.zeros(2)}
    layout = CheckpointLayout(
        nn.Module(),
        {"layers.0.norm": torch.empty(2)},
        {k: tuple(v.shape) for k, v in sources.items()},
        {k: v.dtype for k, v in sources.items()},
        [renaming],
    )
    assert sorted(layout.shapes) == ["layers.0.block_sparse_moe.bias", "layers.0.norm"]
