"""``python -m torch_tp plan`` says what the API does: ``--sequence-parallel`` and
``--loss-parallel`` shape a transformers model's plan as ``plan_for`` does, repeated per-layer
problems print once with the layers counted, planning's warnings are listed under Problems,
a missing ``--plan`` suggests ``--plan auto``, and a ``--seq-len`` above the model's
positions is flagged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Shard

from torch_tp.__main__ import main as cli
from torch_tp.report import PlanReport, Problem, plan_report


def _tiny_llama_dir(path: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ).save_pretrained(path)
    return path


def _expected(directory: Path, shape) -> str:
    """The report of the transformers model in ``directory`` under ``shape(model)``."""
    from torch_tp.cli.plan import _build_model

    model = _build_model(str(directory), 16)
    return str(plan_report(model, shape(model), 2, batch_size=1, seq_len=16))


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    status = cli(["plan", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_sequence_parallel_flag_is_plan_for_sequence_parallel(tmp_path, capsys):
    from torch_tp.plans.hf import plan_for

    directory = _tiny_llama_dir(tmp_path)
    status, out, err = _run(
        capsys, "--model", str(directory), "--tp", "2", "--seq-len", "16", "--sequence-parallel"
    )
    assert status == 0, err
    assert out.rstrip("\n") == _expected(directory, lambda m: plan_for(m, sequence_parallel=True))


def test_loss_parallel_flag_leaves_the_logits_sharded(tmp_path, capsys):
    from torch_tp.plans.hf import plan_for
    from torch_tp.style import ColwiseParallel

    def vocabulary_parallel(model):
        plan = plan_for(model)
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        return plan

    directory = _tiny_llama_dir(tmp_path)
    status, out, err = _run(
        capsys, "--model", str(directory), "--tp", "2", "--seq-len", "16", "--loss-parallel"
    )
    assert status == 0, err
    assert out.rstrip("\n") == _expected(directory, vocabulary_parallel)
    # the logits are not gathered
    assert not any("all_gather" in line and "lm_head" in line for line in out.splitlines())


def test_flags_are_refused_with_plans_they_do_not_shape(capsys):
    status, _, err = _run(
        capsys, "--model", "llama-tiny", "--plan", "auto", "--tp", "2", "--sequence-parallel"
    )
    assert status == 2 and "--sequence-parallel" in err and "--plan auto" in err, err


def _report(problems: list[Problem]) -> str:
    report = PlanReport("M", 0, 2, 1, 16, torch.float32, [], [], [], problems)
    return str(report).split("\nProblems\n", 1)[1]


def test_problems_repeated_per_layer_print_once_with_the_layers_counted():
    message = "cannot apply S on 'model.layers.{}.self_attn' (LlamaAttention): 4 heads over 3"
    problems = [Problem("error", "model.layers.*.self_attn", message.format(i)) for i in range(32)]
    problems += [Problem("error", f"h.{i}.mlp", "uneven") for i in (0, 2, 5)]
    problems.append(Problem("warning", "model.layers.3.mlp", "its own line"))
    problems.append(Problem("warning", "model.layers.4.mlp", "another line"))
    assert _report(problems).splitlines() == [
        "  error    model.layers.*.self_attn: cannot apply S on 'model.layers.{0..31}.self_attn' "
        "(LlamaAttention): 4 heads over 3 (32 layers)",
        "  error    h.{0,2,5}.mlp: uneven (3 layers)",
        "  warning  model.layers.3.mlp: its own line",
        "  warning  model.layers.4.mlp: another line",
    ]


def test_cli_collapses_a_problem_of_every_layer(tmp_path, capsys):
    directory = _tiny_llama_dir(tmp_path)
    status, out, _ = _run(capsys, "--model", str(directory), "--tp", "3", "--seq-len", "16")
    assert status == 1
    lines = [line for line in out.splitlines() if "cannot apply AttentionHeads" in line]
    assert len(lines) == 1, out
    assert "'model.layers.{0..1}.self_attn'" in lines[0] and lines[0].endswith("(2 layers)")


@pytest.mark.slow  # auto() and two traces of nanoGPT
def test_planning_warnings_are_listed_under_problems(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    status, out, err = _run(
        capsys, "--model", "foreign_models:_nanogpt", "--plan", "auto", "--tp", "2",
        "--seq-len", "16",
    )  # fmt: skip
    assert status == 0, err
    problems = out.split("\nProblems\n", 1)[1]
    assert "  warning  ReplicatedModulesWarning: auto() leaves modules whole" in problems, out


def test_missing_plan_suggests_auto(capsys):
    status, _, err = _run(capsys, "--model", "torch_tp.models:Llama", "--tp", "2")
    assert status == 2 and "--plan is required" in err and "--plan auto" in err, err


def test_seq_len_above_the_positions_of_a_transformers_model_is_flagged(tmp_path, capsys):
    directory = _tiny_llama_dir(tmp_path)
    status, out, err = _run(capsys, "--model", str(directory), "--tp", "2", "--seq-len", "128")
    assert status == 0, err
    problems = out.split("\nProblems\n", 1)[1]
    assert "warning  --seq-len: 128 tokens per sequence is more than the 64 positions" in problems
    assert "config.max_position_embeddings" in problems, out
    # within the positions: nothing said
    status, out, _ = _run(capsys, "--model", str(directory), "--tp", "2", "--seq-len", "64")
    assert status == 0 and "--seq-len" not in out, out


def test_seq_len_above_max_seq_len_is_said_when_the_trace_fails(capsys):
    status, _, err = _run(
        capsys, "--model", "torch_tp.models:Llama", "--plan", "llama", "--tp", "2",
        "--seq-len", "128",
    )  # fmt: skip
    assert status == 2, err
    assert "--seq-len: 128 tokens per sequence is more than the 64 positions" in err, err
    assert "config.max_seq_len" in err, err
