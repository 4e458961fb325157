"""torch.compile of a tensor-parallel model runs on CPU (inductor) and trains like one device.

The reference is the eager single-device model, copied before parallelizing: the compiled
TP model must match it (output, loss, every gradient, every parameter after an optimizer
step), so a collective whose backward is wrong fails here even though the compiled and the
eager TP model would agree with each other.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import full_tensor, reference_llama, sgd, tp_mesh
from torch.testing import assert_close

from torch_tp import parallelize_module
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import run_distributed

# float64: inductor may reorder a reduction, which moves float64 results by ~1e-15
TOLERANCE = {"rtol": 1e-10, "atol": 1e-12}
STEPS = 2


def _compiled_matches_one_device(sequence_parallel: bool) -> None:
    mesh = tp_mesh()
    config = {"dim": 32, "n_layers": 1, "n_heads": 4, "vocab_size": 101, "max_seq_len": 16}
    reference = reference_llama(0, **config).double()
    model = copy.deepcopy(reference)  # the reference: built before parallelizing
    parallelize_module(model, mesh, llama_plan(sequence_parallel=sequence_parallel))
    compiled = torch.compile(model, fullgraph=True)
    ref_optim, tp_optim = sgd(reference.parameters()), sgd(model.parameters())
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        tokens = torch.randint(0, config["vocab_size"], (2, 8), generator=gen)
        targets = torch.randint(0, config["vocab_size"], (2, 8), generator=gen)
        losses, outputs = [], []
        for net in (reference, compiled):
            logits = net(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            outputs.append(full_tensor(logits.detach()))
            losses.append(full_tensor(loss.detach()))
        assert_close(outputs[1], outputs[0], **TOLERANCE, msg=f"step {step}: logits")
        assert_close(losses[1], losses[0], **TOLERANCE, msg=f"step {step}: loss")
        pairs = list(zip(reference.named_parameters(), model.parameters(), strict=True))
        for (name, ref), tp in pairs:
            assert_close(
                full_tensor(tp.grad), ref.grad, **TOLERANCE, msg=f"step {step}: grad of {name}"
            )
        ref_optim.step()
        tp_optim.step()
        ref_optim.zero_grad()
        tp_optim.zero_grad()
        for (name, ref), tp in pairs:
            assert_close(
                full_tensor(tp.detach()),
                ref.detach(),
                **TOLERANCE,
                msg=f"step {step}: {name} after the optimizer step",
            )


@pytest.mark.slow
def test_compiled_matches_one_device():
    # with sequence parallelism (all-gathers and reduce-scatters in the graph); a minute of
    # compiling per variant, so the variant without it (all-reduces) is left out
    run_distributed(_compiled_matches_one_device, 2, True, timeout=600)
