"""The dry-run report of a PEFT LoRA model under a tensor-parallel plan, against a measured run.

``plan_report`` on a meta-device PEFT model (``get_peft_model`` on the tiny transformers
Llama, LoRA on all seven projections; on a tiny GPT-2, LoRA on its packed ``c_attn`` and
its other ``Conv1D`` layers) with ``plan_for`` the model: the hosted LoRA layers are traced
as the run computes them (their base layer's style computes the adapters:
``torch_tp.style.adapters``), not through PEFT's own forward, which would mix DTensors and
plain tensors. The report must predict every collective of one training step at TP=2 (per
pass and kind: calls and bytes) as measured on the parallelized model, in both orders
(``get_peft_model`` first, or ``parallelize_module`` first), and each rank's parameter
bytes and LoRA factors' local shapes:
a row-parallel adapter's ``r`` features ride in its base's reduction (more bytes, no more
calls), the column-parallel ``lora_A`` gradients (partial sums; under sequence parallelism
the row-parallel ``lora_B``'s too) join the one all-reduce of replicated parameters at the
end of backward, and the frozen base gives no gradient where nothing trainable is upstream
(the first layer's input). The printed table (and ``python -m torch_tp plan``) shows each
``lora_A``/``lora_B`` with its placement and shape per rank, and a line of the adapters'
bytes per rank. A LoRA variant (DoRA) is reported as an error.
"""

from __future__ import annotations

import contextlib
import io
from collections import Counter

import expecttest
import pytest
import torch
from helpers import tiny_hf_llama, tp_mesh
from torch import nn
from torch.distributed.tensor import DTensor

from torch_tp import parallelize_module
from torch_tp.__main__ import main as cli
from torch_tp.report import plan_report
from torch_tp.report.trace import generalize_path
from torch_tp.testing import run_distributed

peft = pytest.importorskip("peft", reason="the adapter tests need peft (pip install -e '.[peft]')")
transformers = pytest.importorskip("transformers", reason="the adapter tests need transformers")

from test_report import _CollectiveBytes  # noqa: E402  (the report tests' counter)

from torch_tp.plans.hf import plan_for  # noqa: E402  (needs transformers)

BATCH, SEQ = 2, 8
_ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(targets: list[str] = _ALL_SEVEN, **options):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, **options)


# GPT-2: LoRA on its packed c_attn (a Conv1D planned PackedColwiseParallel: lora_B strided
# like the fused weight), attn.c_proj, mlp.c_fc and mlp.c_proj
_GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]


def _model(family: str) -> nn.Module:
    """The plain model, on the current default device: the tests' tiny Llama (as
    ``helpers.tiny_hf_llama``) or a tiny GPT-2 (tied embeddings)."""
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
        )  # fmt: skip
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config)
    return tiny_hf_llama()


def _family_lora(family: str) -> peft.LoraConfig:
    if family == "gpt2":
        return _lora(_GPT2_TARGETS, fan_in_fan_out=True)
    return _lora()


def _adapter_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Each LoRA factor's local shape on this rank, by generalized name."""
    return {
        generalize_path(name): tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
        for name, p in model.named_parameters()
        if ".lora_" in name
    }


def _plan(model: nn.Module, sequence_parallel: bool) -> dict:
    """``plan_for`` the model before PEFT wraps it (its keys name the wrapped model's layers
    too: a wrapper stands for its base layer)."""
    return plan_for(model, sequence_parallel=sequence_parallel)


def _measured(family: str, order: int, sequence_parallel: bool) -> tuple[dict, int, dict]:
    """On each rank: one forward and backward of the PEFT model under the plan, every
    collective by pass ((calls, bytes) per kind); this rank's parameter bytes; its factors'
    local shapes."""
    model = _model(family)
    plan = _plan(model, sequence_parallel)
    if order == 1:
        model = peft.get_peft_model(model, _family_lora(family))
        inner = model.base_model.model
        parallelize_module(inner, tp_mesh(), plan)
    else:
        parallelize_module(model, tp_mesh(), plan)
        model = peft.get_peft_model(model, _family_lora(family))
        inner = model.base_model.model
    model.train()
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with _CollectiveBytes() as forward:
        logits = model(input_ids=ids, use_cache=False).logits
    with _CollectiveBytes() as backward:
        logits.sum().backward()
    totals = {
        phase: {kind: (mode.counts[kind], mode.bytes[kind]) for kind in mode.counts}
        for phase, mode in (("forward", forward), ("backward", backward))
    }
    local = [p.to_local() if isinstance(p, DTensor) else p for p in inner.parameters()]
    return totals, sum(t.numel() * t.element_size() for t in local), _adapter_shapes(inner)


def _meta_peft_llama(
    lora: peft.LoraConfig | None = None, layers: int = 2, sequence_parallel: bool = False
) -> tuple[nn.Module, dict]:
    """The tests' tiny Llama (as ``helpers.tiny_hf_llama``), on the meta device, with PEFT's
    LoRA (the PEFT model's base model), and its plan."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        attn_implementation="eager",
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
        plan = _plan(model, sequence_parallel)
        return peft.get_peft_model(model, lora or _lora()).base_model.model, plan


def _predicted(family: str, sequence_parallel: bool):
    with torch.device("meta"):
        model = _model(family)
        plan = _plan(model, sequence_parallel)
        model = peft.get_peft_model(model, _family_lora(family)).base_model.model
    report = plan_report(model, plan, 2, batch_size=BATCH, seq_len=SEQ, device_type="cpu")
    assert not report.errors, report.errors
    counts: Counter[tuple[str, str]] = Counter()
    nbytes: Counter[tuple[str, str]] = Counter()
    for c in report.collectives:
        counts[c.phase, c.kind] += c.count
        nbytes[c.phase, c.kind] += c.count * c.bytes
    totals = {
        phase: {kind: (counts[p, kind], nbytes[p, kind]) for p, kind in counts if p == phase}
        for phase in ("forward", "backward")
    }
    shapes = {}
    for group in report.adapter_parameters:  # one per factor and projection: the layers alike
        shapes.update({group.name: group.local_shape})
    return totals, report.per_rank_bytes, shapes, report


@pytest.mark.fast_runtime  # the report predicts the default runtime's collectives
@pytest.mark.parametrize(
    "family, sequence_parallel",
    [("llama", False), ("llama", True), ("gpt2", False)],
    ids=["llama", "llama_sequence_parallel", "gpt2"],
)
def test_report_predicts_the_lora_step(family, sequence_parallel):
    totals, per_rank, shapes, report = _predicted(family, sequence_parallel)
    for order in (1, 2):
        measured = run_distributed(_measured, 2, family, order, sequence_parallel)
        assert measured[0] == measured[1], measured  # the ranks issue the same collectives
        assert (totals, per_rank, shapes) == measured[0], order
    # the adapters' own bytes per rank (float32): Llama's 2 layers x 7 projections x 2
    # factors, GPT-2's 2 layers x 4 Conv1D x 2
    adapters = report.adapter_parameters
    count, rank_bytes = sum(g.count for g in adapters), sum(g.local_bytes for g in adapters)
    assert (count, rank_bytes) == ((16, 10240) if family == "gpt2" else (28, 11776))


class PeftReportTableTest(expecttest.TestCase):
    def test_lora_on_a_column_and_a_row_parallel_layer(self):
        model, plan = _meta_peft_llama(_lora(["q_proj", "o_proj"]), layers=1)
        report = plan_report(model, plan, 2, batch_size=BATCH, seq_len=SEQ)
        self.assertExpectedInline(
            str(report),
            """\
Plan report: LlamaForCausalLM, 13.92K parameters, TP degree 2, batch 2 x 8 tokens, float32

Plan
  key                                      modules  style
  model.embed_tokens                             1  "rowwise_split_input"
  model.layers.*.self_attn                       1  AttentionHeads(num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads)
  model.layers.*.input_layernorm                 1  PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Replicate(),), use_local_output=False)
  model.layers.*.self_attn.q_proj                1  "colwise"
  model.layers.*.self_attn.k_proj                1  "colwise"
  model.layers.*.self_attn.v_proj                1  "colwise"
  model.layers.*.self_attn.o_proj                1  "rowwise"
  model.layers.*.post_attention_layernorm        1  PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Replicate(),), use_local_output=False)
  model.layers.*.mlp.gate_proj                   1  "colwise"
  model.layers.*.mlp.up_proj                     1  "colwise"
  model.layers.*.mlp.down_proj                   1  "rowwise"
  lm_head                                        1  "colwise_gather_output"

Parameters (per rank: the largest shard, torch.chunk convention)
  parameter                                              count  placement    global   per rank  bytes/rank  unsharded
  model.embed_tokens.weight                                  1  Shard(0)     64 x 32  32 x 32      4.0 KiB    8.0 KiB
  model.layers.*.self_attn.q_proj.weight                     1  Shard(0)     32 x 32  16 x 32      2.0 KiB    4.0 KiB
  model.layers.*.self_attn.q_proj.lora_A.default.weight      1  Replicate()  4 x 32   4 x 32         512 B      512 B
  model.layers.*.self_attn.q_proj.lora_B.default.weight      1  Shard(0)     32 x 4   16 x 4         256 B      512 B
  model.layers.*.self_attn.k_proj.weight                     1  Shard(0)     16 x 32  8 x 32       1.0 KiB    2.0 KiB
  model.layers.*.self_attn.v_proj.weight                     1  Shard(0)     16 x 32  8 x 32       1.0 KiB    2.0 KiB
  model.layers.*.self_attn.o_proj.weight                     1  Shard(1)     32 x 32  32 x 16      2.0 KiB    4.0 KiB
  model.layers.*.self_attn.o_proj.lora_A.default.weight      1  Shard(1)     4 x 32   4 x 16         256 B      512 B
  model.layers.*.self_attn.o_proj.lora_B.default.weight      1  Replicate()  32 x 4   32 x 4         512 B      512 B
  model.layers.*.mlp.gate_proj.weight                        1  Shard(0)     64 x 32  32 x 32      4.0 KiB    8.0 KiB
  model.layers.*.mlp.up_proj.weight                          1  Shard(0)     64 x 32  32 x 32      4.0 KiB    8.0 KiB
  model.layers.*.mlp.down_proj.weight                        1  Shard(1)     32 x 64  32 x 32      4.0 KiB    8.0 KiB
  model.layers.*.input_layernorm.weight                      1  -            32       32             128 B      128 B
  model.layers.*.post_attention_layernorm.weight             1  -            32       32             128 B      128 B
  model.norm.weight                                          1  -            32       32             128 B      128 B
  lm_head.weight                                             1  Shard(0)     64 x 32  32 x 32      4.0 KiB    8.0 KiB
  total per rank (51.3% of unsharded)                       16                                    27.9 KiB   54.4 KiB
  of which LoRA adapters (hosted)                            4                                     1.5 KiB    2.0 KiB

Plan quality (sharded: of the parameters matrix products read, and of their FLOPs in one forward; a block: all its layers)
  block                 linear parameters  matmul FLOPs
  model.layers.*        100% of 9.22K      100% of 311.30 KFLOP
  (outside the blocks)  100% of 2.05K      100% of 65.54 KFLOP

Collectives per step (model forward and backward, batch 2 x 8; the loss is not included)
  pass      collective              count  bytes each  bytes total  from
  forward   all_reduce                  1     2.0 KiB      2.0 KiB  model.embed_tokens
  forward   all_reduce                  1        16 B         16 B  model.embed_tokens
  forward   all_reduce                  1     2.2 KiB      2.2 KiB  model.layers.*.self_attn.o_proj
  forward   all_reduce                  1     2.0 KiB      2.0 KiB  model.layers.*.mlp.down_proj
  forward   all_gather_into_tensor      1     4.0 KiB      4.0 KiB  lm_head
  forward   total                       5                 10.3 KiB
  backward  all_reduce                  1     2.0 KiB      2.0 KiB  lm_head
  backward  all_reduce                  1     2.0 KiB      2.0 KiB  model.layers.*.post_attention_layernorm
  backward  all_reduce                  1       512 B        512 B  (replicated parameters)
  backward  total                       3                  4.5 KiB

Problems
  none found""",  # noqa: E501
        )


def test_a_lora_variant_is_an_error_of_the_report():
    model, plan = _meta_peft_llama(_lora(["q_proj"], use_dora=True), layers=1)
    report = plan_report(model, plan, 2, batch_size=BATCH, seq_len=SEQ)
    error = report.errors[0]  # (then the refused layer's base, run unplanned, as any refused)
    assert error.where == "model.layers.*.self_attn.q_proj"
    assert "DoraLinearVariant" in error.message and "Plain LoRA" in error.message


def cli_peft_llama() -> nn.Module:
    """``python -m torch_tp plan --model test_peft_report:cli_peft_llama``: the one-layer PEFT
    Llama (built on the meta device by the CLI)."""
    return _meta_peft_llama(_lora(["q_proj", "o_proj"]), layers=1)[0]


def test_cli_reports_the_adapters():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli(["plan", "--model", "test_peft_report:cli_peft_llama", "--plan", "hf",
                      "--tp", "2", "--batch-size", str(BATCH), "--seq-len", str(SEQ)])  # fmt: skip
    assert status == 0, out.getvalue()
    model, plan = _meta_peft_llama(_lora(["q_proj", "o_proj"]), layers=1)
    report = plan_report(model, plan, 2, batch_size=BATCH, seq_len=SEQ)
    assert out.getvalue().strip() == str(report).strip()
    assert "of which LoRA adapters (hosted)                            4" in out.getvalue()
