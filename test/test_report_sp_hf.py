"""The dry-run report of transformers' models under sequence parallelism, against a measured run.

``plan_report`` on a meta-device copy of the model, with ``plan_for(model,
sequence_parallel=True)``, must predict every collective of one training step at TP=2 (batch
2 x 12, ``labels=ids``, ``use_cache=False``): per pass, per kind, the number of calls and their
bytes; and each rank's parameter bytes. Measured with ``benchmarks/bench_moe.py``'s
``MoECounter`` (every collective, by pass; CommDebugMode's module tracker fails inside
transformers' experts), which counts the agreed
checks (the embedding's ids, each MoE layer's expert ids: all-reduces of one or two integers)
apart: the report counts them as the all-reduces they are. Llama (the final norm's gathered
output, sliced for lm_head, reduce-scatters lm_head's partial input gradient back onto the
sequence) and three MoE families (the experts' output, which the report makes without running
their routing, still carries the MLP region's gradient back: its reduce-scatter's backward
all-gather).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from helpers import tp_mesh
from torch import nn
from torch.distributed.tensor import DTensor

from torch_tp import parallelize_module
from torch_tp.report import plan_report
from torch_tp.testing import run_distributed

transformers = pytest.importorskip(
    "transformers",
    reason="the Hugging Face model tests need transformers (pip install -e '.[test]')",
)

from torch_tp.plans.hf import plan_for  # noqa: E402  (needs transformers' models only to run)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

BATCH, SEQ = 2, 12
# the report's names of the kinds, and the counter's agreed checks, as the counter's kinds
_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce(check)": "all_reduce",
}

_Totals = dict[str, dict[str, tuple[int, int]]]  # pass -> kind -> (calls, bytes)


def _model(family: str) -> nn.Module:
    """The tests' own models: test_transformers.py's Llama (float32, 2 layers, 2 KV heads),
    test_transformers_moe.py's MoE families (float64, 2 layers, 4 experts)."""
    if family == "llama":
        from test_transformers import _model as dense

        return dense("llama", kv_heads=2)
    from test_transformers_moe import _model as moe

    return moe(family)


def _totals(calls: Iterable[tuple[str, str, int]]) -> _Totals:
    """``(pass, kind, bytes)`` calls summed per pass and kind."""
    counts: Counter[tuple[str, str]] = Counter()
    nbytes: Counter[tuple[str, str]] = Counter()
    for phase, kind, size in calls:
        key = (phase, _KINDS.get(kind, kind))
        counts[key] += 1
        nbytes[key] += size
    return {
        phase: {kind: (counts[p, kind], nbytes[p, kind]) for p, kind in counts if p == phase}
        for phase in ("forward", "backward")
    }


def _measured(family: str) -> _Totals:
    """On each rank: one forward and backward under the sequence-parallel plan, every
    collective by pass (the counter's bytes: an all-gather's output, a reduce-scatter's
    input, an all-reduce's tensor, as the report's)."""
    import bench_moe

    model = _model(family)
    parallelize_module(model, tp_mesh(), plan_for(model, sequence_parallel=True))
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    with bench_moe.MoECounter() as counter:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    totals = _totals(
        ("backward" if r.backward else "forward", r.kind, r.nbytes) for r in counter.records
    )
    # the memory the report predicts: this rank's parameter bytes
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return totals, sum(t.numel() * t.element_size() for t in local)


def _predicted(family: str) -> _Totals:
    with torch.device("meta"):
        model = _model(family)
    report = plan_report(
        model,
        plan_for(model, sequence_parallel=True),
        2,
        batch_size=BATCH,
        seq_len=SEQ,
        device_type="cpu",
    )
    assert not report.errors, report.errors
    totals = _totals((c.phase, c.kind, c.bytes) for c in report.collectives for _ in range(c.count))
    return totals, report.per_rank_bytes


@pytest.mark.fast_runtime  # plain DTensor sums the norms' (and routers') gradients apart
@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "mixtral",
        pytest.param("qwen3_moe", marks=pytest.mark.slow),  # a dense first layer
        pytest.param("olmoe", marks=pytest.mark.slow),  # q/k norms over the gathered heads
    ],
)
def test_report_predicts_the_sequence_parallel_step(family):
    measured = run_distributed(_measured, 2, family)
    assert measured[0] == measured[1], measured  # the ranks issue the same collectives
    assert _predicted(family) == measured[0]
