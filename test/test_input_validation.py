"""No silent wrong answers from inputs: bad token ids, bad layouts, bad plans as data.

Each case here used to give a different model, a zero row, a late or unreadable error; each
now fails early with a message naming the module path, the style and what was expected
versus found, bounded in size whatever the input.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
import torch.nn as nn
from helpers import tp_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from torch_tp import (
    AttentionHeads,
    ColwiseParallel,
    PackedColwiseParallel,
    PackedRowwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    ReplicateParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch_tp.__main__ import main as cli
from torch_tp.plan import from_dict, resolve_plan
from torch_tp.testing import run_distributed

# an error message that echoes a user value shows a bounded prefix of it
_MAX_MESSAGE = 2000


# --------------------------------------------------------------------------- token ids

_VOCAB = 10
_BAD_IDS = [_VOCAB, -1, 10**9]


def _out_of_range_ids(style_name: str, bad: int) -> tuple[str, str, bool]:
    """The error a TP embedding raises on one bad id, and whether a good batch still runs
    afterwards (no rank was left waiting in a collective)."""
    styles = {
        "rowwise": RowwiseParallel(input_layouts=Replicate()),
        "rowwise_shard1": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "colwise": ColwiseParallel(),
        "colwise_gather": ColwiseParallel(output_layouts=Replicate()),
    }
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("tok_embeddings", nn.Embedding(_VOCAB, 8))
    parallelize_module(model, tp_mesh(), {"tok_embeddings": styles[style_name]})
    ids = torch.tensor([[1, bad, 3, bad]])
    try:
        model(ids)
        kind, message = "no error", ""
    except Exception as err:  # noqa: BLE001 - the type is what the test checks
        kind, message = type(err).__name__, str(err)
    good = model(torch.tensor([[1, 2, 3, 4]]))
    return kind, message, good.shape[-1] > 0


@pytest.mark.parametrize("bad", _BAD_IDS)
@pytest.mark.parametrize("style_name", ["rowwise", "rowwise_shard1", "colwise", "colwise_gather"])
def test_out_of_range_token_ids_raise_index_error_on_every_rank(style_name, bad):
    with pytest.raises(IndexError):  # as on one device
        nn.Embedding(_VOCAB, 8)(torch.tensor([[1, bad, 3, bad]]))
    for kind, message, still_runs in run_distributed(_out_of_range_ids, 2, style_name, bad):
        assert kind == "IndexError", (kind, message)
        assert "'tok_embeddings'" in message, message
        assert ("RowwiseParallel" if "rowwise" in style_name else "ColwiseParallel") in message
        if "rowwise" in style_name:  # the range and the value (colwise: F.embedding's own)
            assert f"[0, {_VOCAB})" in message and str(bad) in message, message
        assert still_runs


# --------------------------------------------------------------------------- Shard dims


class _Block(nn.Module):
    """A 3-D activation through one submodule, ``inner``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _shard_out_of_range(case: str) -> tuple[str, str]:
    cases = {
        "colwise_input": (nn.Linear(8, 8), ColwiseParallel(input_layouts=Shard(99))),
        "colwise_input_negative": (nn.Linear(8, 8), ColwiseParallel(input_layouts=Shard(-4))),
        "colwise_output": (nn.Linear(8, 8), ColwiseParallel(output_layouts=Shard(99))),
        "rowwise_input": (nn.Linear(8, 8), RowwiseParallel(input_layouts=Shard(99))),
        "rowwise_output": (nn.Linear(8, 8), RowwiseParallel(output_layouts=Shard(3))),
        "sequence_parallel": (nn.LayerNorm(8), SequenceParallel(sequence_dim=99)),
        "prepare_input": (
            nn.Identity(),
            PrepareModuleInput(input_layouts=Shard(99), desired_input_layouts=Replicate()),
        ),
        "prepare_output": (
            nn.Identity(),
            PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(99)),
        ),
    }
    inner, style = cases[case]
    torch.manual_seed(0)
    model = _Block(inner)
    # the forward's own error: the first-forward check, which refuses the output layouts
    # among these before they run (test_forward_check.py), is off
    parallelize_module(model, tp_mesh(), {"inner": style}, check_forward=False)
    width = 4 if case == "rowwise_output" else 8  # a local shard of the rowwise input
    try:
        model(torch.randn(2, 4, width))
    except Exception as err:  # noqa: BLE001 - the type is what the test checks
        return type(err).__name__, str(err)
    return "no error", ""


@pytest.mark.parametrize(
    "case",
    [
        "colwise_input",
        "colwise_input_negative",
        "colwise_output",
        "rowwise_input",
        "rowwise_output",
        "sequence_parallel",
        "prepare_input",
        "prepare_output",
    ],
)
def test_shard_dim_out_of_range_names_module_style_and_rank(case):
    """A ``Shard(d)`` with ``d`` outside ``[-ndim, ndim)`` of the 3-D activation it lays out
    is an error naming the module, the style and the tensor's rank; it used to be wrapped
    silently (``Shard(99)`` of a 3-D tensor gathering on dim 0) or fail in DTensor's
    internals."""
    styles = {
        "colwise": "ColwiseParallel(",
        "rowwise": "RowwiseParallel(",
        "sequence": "SequenceParallel(",
        "prepare": "PrepareModule",
    }
    style = styles[case.split("_")[0]]
    for kind, message in run_distributed(_shard_out_of_range, 2, case):
        assert kind == "ValueError", (kind, message)
        assert message.startswith(style) and "on 'inner'" in message, message
        assert "3-D" in message and "Shard(dim=" in message, message


class _SkewedColwise(ColwiseParallel):
    """A user style laying a Linear's weight out on a dimension it does not have."""

    def _parameter_placements(self, module: nn.Module):
        return {"weight": Shard(2), "bias": Shard(0)}


def _parameter_placement_out_of_range() -> tuple[str, str, bool]:
    model = _Block(nn.Linear(8, 8))
    try:
        parallelize_module(model, tp_mesh(), {"inner": _SkewedColwise()})
    except Exception as err:  # noqa: BLE001 - the type is what the test checks
        untouched = not any(hasattr(p, "placements") for p in model.parameters())
        return type(err).__name__, str(err), untouched
    return "no error", "", False


def test_parameter_placement_out_of_range_is_refused_before_anything_changes():
    for kind, message, untouched in run_distributed(_parameter_placement_out_of_range, 2):
        assert kind == "ValueError", (kind, message)
        assert "'inner'" in message and "_SkewedColwise" in message, message
        assert "'weight'" in message and "Shard(dim=2)" in message and "2-D" in message
        assert untouched


# --------------------------------------------------------------------------- plans as data


@pytest.mark.parametrize(
    "data,argument",
    [
        ({"style": "ColwiseParallel", "use_local_output": "false"}, "use_local_output"),
        ({"style": "RowwiseParallel", "use_local_output": 0}, "use_local_output"),
        ({"style": "SequenceParallel", "use_local_output": "true"}, "use_local_output"),
        ({"style": "ReplicateParallel", "sum_gradients": "yes"}, "sum_gradients"),
        ({"style": "PackedColwiseParallel", "use_local_output": 1}, "use_local_output"),
        (
            {
                "style": "PrepareModuleInputOutput",
                "output_layouts": "Replicate()",
                "desired_output_layouts": "Replicate()",
                "use_local_input": "false",
            },
            "use_local_input",
        ),
    ],
)
def test_flags_in_data_must_be_bools(data, argument):
    with pytest.raises(TypeError, match=rf"plan key 'a\.b'.*{data['style']}.*{argument}"):
        from_dict({"a.b": data})


@pytest.mark.parametrize(
    "build",
    [
        lambda: ColwiseParallel(use_local_output="false"),
        lambda: RowwiseParallel(use_local_output=None),
        lambda: PackedRowwiseParallel(2, use_local_output="no"),
        lambda: SequenceParallel(use_local_output=1),
        lambda: ReplicateParallel(sum_gradients="false"),
        lambda: PrepareModuleInput(use_local_output="false"),
        lambda: PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=0
        ),
        lambda: SequenceParallel(sequence_dim="1"),
        lambda: SequenceParallel(sequence_dim=True),
    ],
)
def test_style_objects_refuse_non_bool_flags_and_non_int_dims(build):
    with pytest.raises(TypeError, match="use_local_output|sum_gradients|sequence_dim"):
        build()


def test_split_factor_must_be_positive():
    data = {"style": "PrepareModuleInput", "input_layouts": "StridedShard(0, split_factor=0)",
            "desired_input_layouts": "Replicate()"}  # fmt: skip
    with pytest.raises(ValueError, match=r"plan key 'a'.*split_factor.*positive.*found 0"):
        from_dict({"a": data})
    with pytest.raises(ValueError, match="split_factor.*positive"):
        PrepareModuleInput(
            input_layouts=_StridedShard(0, split_factor=0), desired_input_layouts=Replicate()
        )
    with pytest.raises(ValueError, match="split_factor.*positive"):
        PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=_StridedShard(1, split_factor=-2)
        )


@pytest.mark.parametrize(
    "value",
    [["colwise"], {"style": ["colwise"]}, {"style": {"style": "ColwiseParallel"}}, 3, None],
)
def test_plan_values_say_what_they_may_be(value):
    with pytest.raises(TypeError) as info:
        from_dict({"a": value})
    message = str(info.value)
    assert "unhashable" not in message and "plan key 'a'" in message, message
    assert "style name" in message and "'style'" in message, message


def test_plan_keys_must_be_strings():
    with pytest.raises(TypeError, match="plan key 1: module paths must be str"):
        from_dict({1: "colwise"})


def test_deep_nesting_is_refused():
    value: object = "ColwiseParallel"
    for _ in range(100_000):
        value = {"style": value}
    with pytest.raises((TypeError, ValueError), match="plan key 'a'") as info:
        from_dict({"a": value})
    assert len(str(info.value)) < _MAX_MESSAGE

    nested: object = "num_heads"
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(ValueError, match=r"plan key 'a'.*nest.*deeper than 32"):
        from_dict({"a": {"style": "AttentionHeads", "num_heads": 4, "divide": nested}})


@pytest.mark.slow  # the quick run stays under 2 minutes
def test_error_messages_show_a_bounded_prefix_of_user_values():
    cases = [
        {"a": {"style": "AttentionHeads", "num_heads": 4, "divide": list(range(300_000))}},
        {"a": {"style": "ColwiseParallel", "input_layouts": "Shard(" + "1" * 300_000}},
        {"a": {"style": "C" * 300_000}},
        {"a": "c" * 300_000},
        {"a" * 300_000: {"style": "ColwiseParallel", "bogus": 1}},
        {"a": {"style": "ColwiseParallel", "bogus": list(range(300_000))}},
        {"a": {"style": "PrepareModuleInput", "input_layouts": ["Replicate()"] * 300_000}},
        {"a": {"style": "ColwiseParallel", "use_local_output": list(range(300_000))}},
    ]
    for plan in cases:
        with pytest.raises((TypeError, ValueError, AssertionError)) as info:
            from_dict(plan)
        assert len(str(info.value)) < _MAX_MESSAGE, str(info.value)[:300]
    # a plan of objects given to parallelize_module, with a value that is no style
    with pytest.raises(TypeError, match=r"plan key '0'.*\(300000 items\)") as info:
        resolve_plan(nn.Sequential(nn.Linear(2, 2)), {"0": ["colwise"] * 300_000})
    assert len(str(info.value)) < _MAX_MESSAGE


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.config = list(range(300_000))


@pytest.mark.parametrize(
    "name", ["forward.__globals__", "__class__", "_parameters", "proj.__dict__", "a..b", "1x"]
)
def test_attention_heads_attributes_are_public_names(name):
    """An attribute path can reach only public attributes: ``forward.__globals__`` would
    walk into a module's globals (and print them in the error)."""
    with pytest.raises(ValueError, match="public attribute"):
        AttentionHeads(name)
    with pytest.raises(ValueError, match="plan key 'attn'.*public attribute"):
        from_dict({"attn": {"style": "AttentionHeads", "num_heads": name}})
    with pytest.raises(ValueError, match="public attribute"):
        AttentionHeads(4, divide=(name,))


def test_attention_heads_errors_show_a_bounded_value():
    style = AttentionHeads("config")
    with pytest.raises(ValueError, match="'config' is a list, not an int") as info:
        style._validate(_Attention(), _FakeMesh())
    assert len(str(info.value)) < _MAX_MESSAGE
    with pytest.raises(ValueError, match="positive"):
        AttentionHeads(0)


class _FakeMesh:
    def size(self) -> int:
        return 2


def test_packed_parts_type():
    with pytest.raises(TypeError, match="parts must be an int"):
        PackedColwiseParallel("3")
    with pytest.raises(ValueError, match="parts must be a positive int"):
        PackedColwiseParallel(0)


def test_prepare_module_input_output_arguments_are_checked():
    with pytest.raises(TypeError, match="use_local_input"):
        PrepareModuleInputOutput(
            output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_input="x"
        )


# --------------------------------------------------------------------------- command line


_BAD_PLANS = {
    "shard_str_flag": {"output": {"style": "ColwiseParallel", "use_local_output": "false"}},
    "split_factor": {
        "layers.*.attention": {
            "style": "PrepareModuleInput",
            "input_layouts": ["StridedShard(0, split_factor=0)", None],
            "desired_input_layouts": ["Replicate()", None],
        }
    },
    "list_value": {"output": ["colwise"]},
    "list_style": {"output": {"style": ["colwise"]}},
    "big": {
        "layers.*.attention": {
            "style": "AttentionHeads",
            "num_heads": 4,
            "divide": list(range(300_000)),
        }
    },
    "globals": {
        "layers.*.attention": {"style": "AttentionHeads", "num_heads": "forward.__globals__"}
    },
    "shard_99": {"output": {"style": "ColwiseParallel", "input_layouts": "Shard(99)"}},
}


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli(["plan", *argv])
    return status, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("name", sorted(_BAD_PLANS))
def test_cli_bad_plan_file_exits_2_with_one_error_line(tmp_path, name):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_BAD_PLANS[name]))
    status, out, err = _cli("--model", "llama-tiny", "--plan", str(path), "--tp", "2",
                            "--seq-len", "16")  # fmt: skip
    assert status == 2, (status, out[-500:], err[-2000:])
    assert err.startswith("error: ") and "Traceback" not in err, err[-2000:]
    assert len(err.splitlines()) <= 3 and len(err) < _MAX_MESSAGE, err[:2000]


def test_cli_unreadable_plan_files_exit_2(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"a": ' + '{"style": ' * 100_000 + '"colwise"' + "}" * 100_001)
    missing = tmp_path / "missing.json"
    broken = tmp_path / "broken.json"
    broken.write_text('{"a": ')
    for path in (deep, missing, broken):
        status, out, err = _cli("--model", "llama-tiny", "--plan", str(path), "--tp", "2",
                                "--seq-len", "16")  # fmt: skip
        assert status == 2, (path.name, status, err[-2000:])
        assert err.startswith("error: ") and "Traceback" not in err, err[-2000:]
        assert len(err.splitlines()) <= 3 and len(err) < _MAX_MESSAGE, err[:2000]


def test_cli_bad_plan_attribute_exits_2(tmp_path, monkeypatch):
    """A plan given as module:attribute whose value is no style: one bounded error line."""
    (tmp_path / "bad_plan_module.py").write_text('PLAN = {"output": ["colwise"] * 300_000}\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    status, _, err = _cli("--model", "llama-tiny", "--plan", "bad_plan_module:PLAN", "--tp", "2",
                          "--seq-len", "16")  # fmt: skip
    assert status == 2 and err.startswith("error: TypeError: plan key 'output'"), err[:2000]
    assert "Traceback" not in err and len(err.splitlines()) <= 3, err[:2000]
    assert len(err) < _MAX_MESSAGE, err[:2000]
