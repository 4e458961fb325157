"""The dry-run report for pipelines (``torch_tp.report.pipeline_report``): per stage its
modules, parameter bytes per rank, saved activations and what it sends; the schedule's
bubble and point-to-point bytes; and the problems, on meta models, in one process."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from torch_tp.models import Llama, LlamaConfig
from torch_tp.pipeline import split_model
from torch_tp.plans.llama import llama_plan
from torch_tp.report import pipeline_report, plan_report

CONFIG = LlamaConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32)


def _meta_llama() -> Llama:
    with torch.device("meta"):
        return Llama(CONFIG)


def test_stages_hold_what_split_model_gives():
    report = pipeline_report(_meta_llama(), pp_degree=2, n_microbatches=4, batch_size=8, seq_len=32)
    real = split_model(Llama(CONFIG), 2)
    assert [s.modules for s in report.stages] == [
        "tok_embeddings, layers.0-1",
        "layers.2-3, norm, output",
    ]
    for row, stage in zip(report.stages, real, strict=True):
        params = list(stage.parameters())
        assert row.parameters == sum(p.numel() for p in params)
        assert row.parameter_bytes == sum(p.numel() * p.element_size() for p in params)
    assert [s.rank for s in report.stages] == [0, 1]
    assert report.errors == [] and "Bubble: 20.0%" in str(report)


def test_parameter_bytes_per_rank_follow_the_plan():
    plain = pipeline_report(_meta_llama(), pp_degree=2, n_microbatches=2, batch_size=2, seq_len=8)
    sharded = pipeline_report(
        _meta_llama(),
        pp_degree=2,
        n_microbatches=2,
        batch_size=2,
        seq_len=8,
        tp_degree=2,
        plan=llama_plan(),
    )
    for stage, row, plain_row in zip(
        split_model(_meta_llama(), 2), sharded.stages, plain.stages, strict=True
    ):
        from torch_tp.pipeline import _plan_for_stage

        shape = (1, 8) if stage.first else (1, 8, CONFIG.dim)
        dtype = torch.long if stage.first else torch.float32
        expected = plan_report(
            stage,
            _plan_for_stage(llama_plan(), stage),
            2,
            batch_size=1,
            seq_len=8,
            example_inputs=lambda b, s, shape=shape, dtype=dtype: torch.zeros(shape, dtype=dtype),
        ).per_rank_bytes
        assert row.parameter_bytes == expected
        # the norms stay whole: a little more than half
        assert plain_row.parameter_bytes / 2 < row.parameter_bytes < plain_row.parameter_bytes * 0.6


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_point_to_point_bytes_and_bubble(sequence_parallel):
    m, p, micro, seq = 4, 2, 2, 32
    report = pipeline_report(
        _meta_llama(),
        pp_degree=p,
        n_microbatches=m,
        batch_size=m * micro,
        seq_len=seq,
        tp_degree=2,
        plan=llama_plan(sequence_parallel=sequence_parallel),
        sequence_parallel=sequence_parallel,
    )
    hidden = micro * seq * CONFIG.dim * 4 // (2 if sequence_parallel else 1)  # float32
    # forward activations, backward gradients
    assert [s.output_bytes for s in report.stages] == [2 * hidden, 0]
    assert report.p2p_bytes == 2 * m * hidden
    assert report.bubble == pytest.approx((p - 1) / (m + p - 1))
    # the second stage's input is a sequence shard under sequence parallelism: it chains
    assert report.problems == []


def test_interleaved_bubble_and_in_flight():
    report = pipeline_report(
        _meta_llama(),
        pp_degree=2,
        n_microbatches=4,
        batch_size=8,
        seq_len=16,
        schedule="ScheduleInterleaved1F1B",
        stages_per_rank=2,
    )
    assert [s.rank for s in report.stages] == [0, 1, 0, 1]
    assert report.bubble == pytest.approx(1 / (2 * 4 + 1))
    gpipe = pipeline_report(
        _meta_llama(),
        pp_degree=2,
        n_microbatches=4,
        batch_size=8,
        seq_len=16,
        schedule="ScheduleGPipe",
    )
    one_f_one_b = pipeline_report(
        _meta_llama(), pp_degree=2, n_microbatches=4, batch_size=8, seq_len=16
    )
    assert [s.in_flight for s in gpipe.stages] == [4, 4]
    assert [s.in_flight for s in one_f_one_b.stages] == [2, 1]
    assert gpipe.rank_bytes(0)[1] > one_f_one_b.rank_bytes(0)[1]


def test_saved_activations_equal_a_real_run():
    """The bytes the meta run counts as saved for the backward are those a real float32
    stage saves for one micro-batch, to within the attention kernel's own statistics (CPU's
    fused attention also saves its log-sum-exp, 256 bytes a layer here)."""
    report = pipeline_report(_meta_llama(), pp_degree=2, n_microbatches=2, batch_size=4, seq_len=8)
    torch.manual_seed(0)
    stages = split_model(Llama(CONFIG), 2)
    out = torch.randint(0, CONFIG.vocab_size, (2, 8))
    for row, stage in zip(report.stages, stages, strict=True):
        saved = 0

        def pack(t):
            nonlocal saved
            if not isinstance(t, torch.nn.Parameter):
                saved += t.numel() * t.element_size()
            return t

        with saved_tensors_hooks(pack, lambda t: t):
            out = stage(out)
        assert saved > 0
        assert row.activation_bytes == pytest.approx(saved, rel=0.01)
        out = out.detach()


@pytest.mark.parametrize(
    ("kwargs", "severity", "match"),
    [
        ({"n_microbatches": 3, "batch_size": 8}, "error", "not a multiple of n_microbatches 3"),
        ({"n_microbatches": 1, "batch_size": 1}, "error", "needs at least 2 micro-batches"),
        ({"split": [1]}, "warning", "unbalanced parameters: stage 1 holds"),
        (
            {"seq_len": 7, "tp_degree": 2, "sequence_parallel": True},
            "error",
            "seq_len 7 does not divide by the TP degree 2",
        ),
        ({"stages_per_rank": 2}, "error", "runs one stage per rank, not 2"),
        ({"n_microbatches": 2, "batch_size": 2}, "warning", "the bubble is 33%"),
    ],
)
def test_problems(kwargs, severity, match):
    args = {"pp_degree": 2, "n_microbatches": 4, "batch_size": 8, "seq_len": 8, **kwargs}
    report = pipeline_report(_meta_llama(), **args)
    found = [p for p in report.problems if match in p.message]
    assert found and found[0].severity == severity, report.problems
    assert match in str(report)


def test_good_input_has_no_problem():
    report = pipeline_report(_meta_llama(), pp_degree=2, n_microbatches=8, batch_size=8, seq_len=8)
    assert report.problems == []


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="on the meta device"):
        pipeline_report(Llama(CONFIG), pp_degree=2, n_microbatches=2, batch_size=2, seq_len=8)
    with pytest.raises(ValueError, match="knows the schedules"):
        pipeline_report(
            _meta_llama(),
            pp_degree=2,
            n_microbatches=2,
            batch_size=2,
            seq_len=8,
            schedule="ScheduleZBVZeroBubble",
        )
    with pytest.raises(ValueError, match="pp_degree must be a positive int"):
        pipeline_report(_meta_llama(), pp_degree=0, n_microbatches=2, batch_size=2, seq_len=8)


def test_a_transformers_decoder():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    report = pipeline_report(model, pp_degree=2, n_microbatches=2, batch_size=2, seq_len=8)
    assert [s.modules for s in report.stages] == [
        "model.embed_tokens, model.layers.0-1",
        "model.layers.2-3, model.norm, lm_head",
    ]
    # the hidden states both ways, the padding mask forward
    assert report.stages[0].output_bytes == 2 * (1 * 8 * 32 * 4) + 1 * 8 * 8
