"""torch.compile of a tensor-parallel model runs on CPU (inductor) and matches eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import full_tensor, tp_mesh
from torch.testing import assert_close

from torch_tp import parallelize_module
from torch_tp.models import Llama, LlamaConfig
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import run_distributed


def _compiled_matches_eager(sequence_parallel: bool) -> None:
    mesh = tp_mesh()
    torch.manual_seed(0)
    config = LlamaConfig(dim=32, n_layers=1, n_heads=4, vocab_size=101, max_seq_len=16)
    eager = Llama(config)
    parallelize_module(eager, mesh, llama_plan(sequence_parallel=sequence_parallel))
    compiled = copy.deepcopy(eager)
    compiled_fn = torch.compile(compiled, fullgraph=True)
    tokens = torch.randint(0, config.vocab_size, (2, 8))
    targets = torch.randint(0, config.vocab_size, (2, 8))
    for model in (eager, compiled_fn):
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    assert_close(compiled_fn(tokens), eager(tokens), rtol=1e-5, atol=1e-5)
    for (name, p_eager), (_, p_compiled) in zip(
        eager.named_parameters(), compiled.named_parameters(), strict=True
    ):
        assert_close(
            full_tensor(p_compiled.grad), full_tensor(p_eager.grad), rtol=1e-5, atol=1e-5, msg=name
        )


@pytest.mark.slow
def test_compiled_matches_eager():
    # with sequence parallelism (all-gathers and reduce-scatters in the graph); a minute of
    # compiling per variant, so the variant without it (all-reduces) is left out
    run_distributed(_compiled_matches_eager, 2, True, timeout=600)
