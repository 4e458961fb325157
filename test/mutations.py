"""Deliberate bugs that the test suite must catch: a mutation check for torch_tp.

Each :class:`Mutation` is one targeted semantic bug in ``torch_tp/`` (a dropped gradient
reduction, a rotated vocabulary shard, ...), written as an exact piece of source and its
replacement, with the test ids that must fail under it. The applier copies ``torch_tp/``,
``test/`` and ``pyproject.toml`` to a scratch directory, applies one mutation there, and runs
``python -m pytest <tests> -x -q -p no:cacheprovider -n 0`` in it, with the scratch directory first
on ``PYTHONPATH`` and as the working directory: ``import torch_tp`` resolves to the mutated
copy in pytest's process and in the spawned ranks of ``torch_tp.testing.run_distributed``
(not to the editable install of the checkout; ``--verify-isolation`` shows it). A mutation is
caught when pytest exits with 1 (a test failed); an exit of 2 to 5 (a collection or import
error, an internal error, bad arguments, no test collected) proves nothing and counts as not
caught.

Run from the repository root::

    python test/mutations.py                  # every mutation, one after another
    python test/mutations.py --only NAME -v   # one (repeatable), with the failure that caught it
    python test/mutations.py --only NAME --tests TEST ...  # which other tests catch it?
    python test/mutations.py --baseline       # first run each one's tests unmutated: they pass
    python test/mutations.py --list           # names, files and tests
    python test/mutations.py --check          # the list is well formed; every old text once
    python test/mutations.py --table          # the table of CONTRIBUTING.md
    python test/mutations.py --verify-isolation

Every ``old`` text must occur exactly once in its file; the check refuses the list otherwise,
so that code that moved fails loudly instead of leaving a mutation that changes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = [
    "MUTATIONS",
    "Mutation",
    "Result",
    "apply",
    "check_list",
    "markdown_table",
    "run",
    "scratch_copy",
]

ROOT = Path(__file__).resolve().parents[1]

# pytest's exit codes (pytest.ExitCode): only TESTS_FAILED shows that a test caught the bug
_EXIT = {
    -1: "killed at the timeout",
    0: "passed",
    1: "failed",
    2: "interrupted (collection or import error)",
    3: "internal error",
    4: "usage error",
    5: "no tests collected",
}


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One deliberate bug.

    Attributes:
        name: a short identifier (``--only NAME``).
        file: the mutated file, relative to the repository root (under ``torch_tp/``).
        old: source text that occurs exactly once in ``file``.
        new: what replaces it.
        tests: pytest node ids (relative to the repository root) that must fail under it.
        description: one line: the bug, in words.
    """

    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    description: str


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        name="rowwise_contract_skips_the_reduction",
        file="torch_tp/style/linear.py",
        old="(Layout(Partial(), s.output_layouts[0], s.use_local_output),)",
        new="(Layout(s.output_layouts[0], s.output_layouts[0], s.use_local_output),)",
        tests=("test/test_llama.py::test_llama_parity[False-2]",),
        description="RowwiseParallel's contract says its output is computed already reduced: "
        "the forward, which computes the layouts its contract states (the one statement of "
        "them), hands on the partial sums unreduced",
    ),
    Mutation(
        name="partial_gradients_not_reduced",
        file="torch_tp/runtime/boundaries.py",
        old="flat = all_reduce(torch.cat([t.reshape(-1) for t in locals_]), mesh)",
        new="flat = torch.cat([t.reshape(-1) for t in locals_])",
        tests=("test/test_style.py::test_sequence_parallel_norms[rmsnorm-2]",),
        description="the end-of-backward all-reduce of replicated parameters' partial "
        "gradients (sequence-parallel norms) is dropped",
    ),
    Mutation(
        name="copy_to_region_backward_not_reduced",
        file="torch_tp/runtime/boundaries.py",
        old="""    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad, ctx.mesh), None""",
        new="""    def backward(ctx, grad: torch.Tensor):
        return grad, None""",
        tests=("test/test_llama.py::test_llama_parity[False-2]",),
        description="a column-parallel input's backward (copy to region) skips its all-reduce",
    ),
    Mutation(
        name="rowwise_linear_wrong_shard_dim",
        file="torch_tp/style/linear.py",
        old="in_dim = 1 if isinstance(module, nn.Linear) else 0",
        new="in_dim = 0 if isinstance(module, nn.Linear) else 0",
        tests=("test/test_style.py::test_rowwise_linear[True-2]",),
        description="`RowwiseParallel` shards a Linear's weight on the output features (dim 0)",
    ),
    Mutation(
        name="vocab_embedding_rotated",
        file="torch_tp/style/linear.py",
        old="start, stop = runtime.shard_range(module.num_embeddings, rt.mesh)",
        new="start, stop = runtime.chunk_range(module.num_embeddings, rt.mesh.size(), "
        "(rt.mesh.get_local_rank() + 1) % rt.mesh.size())",
        tests=("test/test_transformers.py::test_gpt2_matches_single_device[2]",),
        description="the vocabulary-parallel embedding looks up the ids of the next rank's "
        "vocabulary shard (GPT-2's even vocabulary: no index error, wrong rows)",
    ),
    Mutation(
        name="loss_parallel_vocab_rotated",
        file="torch_tp/loss.py",
        old="vocab_start, _ = chunk_range(vocab_size, mesh.size(tp_dim), "
        "mesh.get_local_rank(tp_dim))",
        new="vocab_start, _ = chunk_range(vocab_size, mesh.size(tp_dim), "
        "(mesh.get_local_rank(tp_dim) + 1) % mesh.size(tp_dim))",
        tests=("test/test_loss.py::test_options[mean-0.0-all_tokens]",),
        description="`loss_parallel`'s target offsets are those of the next rank's "
        "vocabulary shard",
    ),
    Mutation(
        name="loss_parallel_sum_not_reduced",
        file="torch_tp/loss.py",
        old='totals = compat.functional_collectives.all_reduce(torch.stack(sums, dim=1), "sum", '
        "group)",
        new="totals = torch.stack(sums, dim=1)",
        tests=("test/test_loss.py::test_options[mean-0.0-all_tokens]",),
        description="the vocabulary-parallel cross-entropy's all-reduce of the exponentials' "
        "and target logits' sums is dropped",
    ),
    Mutation(
        name="loss_parallel_max_not_reduced",
        file="torch_tp/loss.py",
        old="shift, flag = reduced[:-1], reduced[-1:]",
        new="shift, flag = local_max, reduced[-1:]",
        tests=("test/test_loss.py::test_options[mean-0.0-all_tokens]",),
        description="each rank shifts its logits by its own maximum, not the global one",
    ),
    Mutation(
        name="replicate_sum_gradients_ignored",
        file="torch_tp/style/sequence.py",
        old="""        swapped = swap_in_local_parameters(inner, rt, self.sum_gradients)
        try:
            out = run_on_local_parameters(
                module, rt, self.sum_gradients, own_forward, *inputs, **kwargs
            )""",
        new="""        swapped = swap_in_local_parameters(inner, rt, False)
        try:
            out = run_on_local_parameters(
                module, rt, False, own_forward, *inputs, **kwargs
            )""",
        tests=(
            "test/test_moe.py::test_data_parallel_tokens_dispatched_to_their_experts[balanced-2]",
        ),
        description="`ReplicateParallel(sum_gradients=True)` leaves its parameters' partial "
        "gradients unsummed",
    ),
    Mutation(
        name="partial_sum_inner_gradients_not_summed",
        file="torch_tp/style/regions.py",
        old="swapped = swap_in_local_parameters(inner, rt, True)",
        new="swapped = swap_in_local_parameters(inner, rt, False)",
        tests=(
            "test/test_partial_sum.py::"
            "test_llama4_feed_forward_under_transformers_4x_plan_matches_one_device",
        ),
        description="`PartialSumParallel` leaves the partial gradients of the replicated "
        "modules inside its region (Llama 4's router) unsummed",
    ),
    Mutation(
        name="clip_norm_not_reduced",
        file="torch_tp/clip.py",
        old="""        dist.all_reduce(part, op=op, group=group)
        norms = norms.index_copy(0, index, part)""",
        new="""        norms = norms.index_copy(0, index, part)""",
        tests=("test/test_fsdp.py::test_clip_grad_norm_tp_only[False-0.5-2.0]",),
        description="`clip_grad_norm_` takes each rank's norm of its shards for the total "
        "(the all-reduce of the partial norms is dropped)",
    ),
    Mutation(
        name="auto_attention_unsharded",
        file="torch_tp/plans/auto/attention.py",
        old="""    for layer in group.layers:
        if layer.style is not None:
            result.styles[layer.name] = layer.style
    result.groups.append(group)""",
        new="""    for layer in group.layers:
        if layer.style is not None and group.kind != "attention":
            result.styles[layer.name] = layer.style
    result.groups.append(group)""",
        tests=("test/test_auto_plan.py::test_reference_llama_matches_ready_plan",),
        description="`auto()` plans no style for an attention's projections (left replicated)",
    ),
    Mutation(
        name="rng_tp_seed_off_by_one",
        file="torch_tp/random.py",
        old="return (self.seed + _TP_SEED_OFFSET + tp_rank) % _SEED_MODULUS",
        new="return (self.seed + _TP_SEED_OFFSET + tp_rank + 1) % _SEED_MODULUS",
        tests=(
            "test/test_random.py::test_replicated_region_agrees_fork_region_differs_by_tp_rank",
        ),
        description="the tensor-parallel stream of rank r is seeded with seed + 2718 + r + 1",
    ),
    Mutation(
        name="hf_checkpoint_gate_up_swapped",
        file="torch_tp/checkpoint/_hf_conversion.py",
        old="                for p, e in inputs:",
        new="                for p, e in reversed(inputs):",
        tests=("test/test_hf_checkpoint.py::test_load_pretrained_reads_each_ranks_slices[moe]",),
        description="a rank's slices of a concatenation (stacked experts' `gate_up_proj`) are "
        "read from its sources in reverse order: `up_proj` rows as `gate_proj`'s",
    ),
    Mutation(
        name="hf_save_in_the_models_layout",
        file="torch_tp/checkpoint/hf.py",
        old='written = revert(model, gathered) if layout == "transformers" else gathered',
        new="written = gathered",
        tests=("test/test_hf_checkpoint.py::test_save_pretrained_loads_with_from_pretrained",),
        description="`save_pretrained` writes the model's own names (stacked experts) where "
        "transformers writes the Hub's per-expert keys",
    ),
    Mutation(
        name="hf_load_swaps_shared_memory",
        file="torch_tp/checkpoint/_staging.py",
        old="if mine and _alone(local) and local.stride() == tensor.stride():",
        new="if local.stride() == tensor.stride():",
        tests=("test/test_hf_checkpoint.py::test_load_pretrained_hands_its_buffers_to_the_model",),
        description="a loaded buffer replaces a tensor's memory that another tensor also "
        "views (the view keeps the old values)",
    ),
    Mutation(
        name="pipeline_gradients_unscaled",
        file="torch_tp/pipeline.py",
        old="""        loss_fn=loss_fn,
        **schedule_kwargs,
    )""",
        new="""        loss_fn=loss_fn,
        **{**schedule_kwargs, "scale_grads": False},
    )""",
        tests=("test/test_pipeline.py::test_pp2_tp2_matches_one_device[ScheduleGPipe-1]",),
        description="the pipeline schedule sums the micro-batches' gradients instead of "
        "averaging them",
    ),
    Mutation(
        name="expert_tokens_misrouted",
        file="torch_tp/style/experts.py",
        old="expert = torch.arange(len(counts), device=rows.device) % local_experts",
        new="expert = (torch.arange(len(counts), device=rows.device) + 1) % local_experts",
        tests=(
            "test/test_moe.py::test_data_parallel_tokens_dispatched_to_their_experts[balanced-2]",
        ),
        description="each run of dispatched tokens is computed by the next local expert",
    ),
    Mutation(
        name="expert_all_to_all_backward_skipped",
        file="torch_tp/style/experts.py",
        old="back = _all_to_all(grad, ctx.mesh, ctx.input_splits, ctx.output_splits)",
        new="back = grad",
        tests=(
            "test/test_moe.py::test_data_parallel_tokens_dispatched_to_their_experts[skewed-2]",
        ),
        description="the expert-parallel dispatch's backward returns the gradients where they "
        "are instead of sending them back (no reverse all-to-all)",
    ),
    Mutation(
        name="sequence_gather_backward_local_slice",
        file="torch_tp/runtime/boundaries.py",
        old="""    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.mesh, ctx.dim), None, None""",
        new="""    def backward(ctx, grad: torch.Tensor):
        size = grad.shape[ctx.dim] // ctx.mesh.size()
        piece = grad.narrow(ctx.dim, ctx.mesh.get_local_rank() * size, size)
        return piece.contiguous(), None, None""",
        tests=("test/test_llama.py::test_llama_parity[True-2]",),
        description="`_GatherFromSequenceRegion.backward` keeps this rank's slice of the "
        "gradient instead of reduce-scattering the partial sums",
    ),
    Mutation(
        name="shape_check_replays_unlike_layers",
        file="torch_tp/_repeats.py",
        old="""            entries.append(("attr", path, name, _value(value, index, sub)))""",
        new="""            entries.append(("attr", path, name, None))""",
        tests=("test/test_shape_check.py::test_a_layer_unlike_the_first_is_traced_itself",),
        description="the shape check takes layers whose attributes differ for repeats of the "
        "first and replays its output: a wrong view in a later layer goes unreported",
    ),
    Mutation(
        name="ring_attention_keeps_key_value_gradients_away",
        file="torch_tp/_ring.py",
        old="""    _wait(_exchange(ctx, [sent], [home]))
    return home""",
        new="""    _wait(_exchange(ctx, [sent], [home]))
    return sent""",
        tests=(
            "test/test_context_parallel.py::test_cp2_matches_one_device",
            "test/test_ring_attention.py::test_parity_cp2",
        ),
        description="ring attention's backward leaves each key/value block's gradients on "
        "the rank that finished them instead of sending them home: every rank's keys and "
        "values get another rank's gradient",
    ),
    Mutation(
        name="colwise_reduces_inside_a_partial_region",
        file="torch_tp/style/linear.py",
        old="            if isinstance(entry.given, Replicate) and in_partial_region(input):",
        new="""            if False:""",
        tests=(
            "test/test_sequence_parallel_hf.py::test_sequence_parallel_plan_matches_one_device",
        ),
        description="a column-parallel layer reading the whole input of a partial-sum region "
        "(a dense MLP under transformers' sequence-parallel plan) all-reduces its input "
        "gradient, and the region reduce-scatters it again: the gradient is summed twice",
    ),
    Mutation(
        name="clip_norm_not_reduced_over_stages",
        file="torch_tp/clip.py",
        old="""        total = total.clone()
        dist.all_reduce(total, op=op, group=pp_mesh.get_group())""",
        new="""        total = total.clone()""",
        tests=("test/test_clip_pp.py::test_clip_grad_norm_over_pipeline_stages[2.0-1.0]",),
        description="`clip_grad_norm_(..., pp_mesh=...)` takes each stage's own norm for the "
        "total (the all-reduce over the pipeline stages is dropped)",
    ),
    Mutation(
        name="partial_region_read_from_tensor_dict",
        file="torch_tp/style/base.py",
        old="""    if not _OPEN_REGIONS:  # the common case, read first: no region is running
        return False""",
        new="""    if isinstance(value, torch.Tensor) and value.__dict__.get("_torch_tp_region"):
        return True
    if not _OPEN_REGIONS:
        return False""",
        tests=("test/test_compile.py::test_compiled_colwise_rowwise_matches_one_device[mlp]",),
        description="the hot path asks whether a column-parallel layer's input is a region's "
        "by reading the tensor's `__dict__`, which torch.compile cannot trace: compiling a "
        "plain ColwiseParallel/RowwiseParallel MLP fails",
    ),
    Mutation(
        name="lora_dropout_mask_drawn_on_the_shard",
        file="torch_tp/style/adapters.py",
        old="""            xa = xa * rt.enter_sharded(dropout(whole), Replicate(), shard)""",
        new="""            xa = dropout(xa)""",
        tests=("test/test_peft.py::test_adapter_options[dropout-peft_first]",),
        description="a row-parallel LoRA adapter draws its dropout mask on its slice of the "
        "input instead of one device's mask over the whole input: other masks, other losses",
    ),
    Mutation(
        name="lora_a_gradient_not_summed",
        file="torch_tp/style/adapters.py",
        old="""        A = rt.local_parameter(lora.A, "weight", partial=True)""",
        new="""        A = rt.local_parameter(lora.A, "weight")""",
        tests=("test/test_peft.py::test_subsets_of_the_projections[column_only-peft_first]",),
        description="a column-parallel base's whole lora_A keeps each rank's share of its "
        "gradient (its columns'), never summed over the ranks",
    ),
    Mutation(
        name="lora_b_gradient_not_summed_on_a_partial_output",
        file="torch_tp/style/linear.py",
        old="""            partial_out = sharded or isinstance(exit.to, Partial)""",
        new="""            partial_out = sharded""",
        tests=(
            "test/test_peft_compose.py::test_sequence_parallel_lora_matches_single_device[peft_first-0.0]",
        ),
        description="under sequence parallelism the MLP's down projection leaves its output a "
        "partial sum, and with it each rank's lora_B gradient: left unsummed",
    ),
    Mutation(
        name="load_hook_only_where_dtensors_were",
        file="torch_tp/_state_dict.py",
        old="    if vars(module).get(_ACCEPTS) or not any(True for _ in _direct_tensors(module)):",
        new="""    if vars(module).get(_ACCEPTS) or not any(
        isinstance(t, DTensor) for _, t in _direct_tensors(module)
    ):""",
        tests=("test/test_load_state_dict.py::test_fsdp2_tp_full_state_dict_loads",),
        description="load_state_dict takes full tensors only in the modules that held "
        "DTensors when the plan was applied: the norms FSDP2 shards afterwards refuse them",
    ),
    Mutation(
        name="embedding_ids_shape_not_agreed",
        file="torch_tp/style/linear.py",
        old="        code = 2 * _shape_code(ids.shape)",
        new="        code = 0",
        tests=(
            "test/test_input_agreement.py::"
            "test_ids_of_different_shapes_are_refused_on_every_rank[transformers-False]",
        ),
        description="the vocabulary-parallel embedding's agreed check leaves out the ids' "
        "shape: ranks given (2, 8) and (4, 4) ids sum rows of different tokens, no error",
    ),
    Mutation(
        name="forward_check_not_disabled_by_a_later_call",
        file="torch_tp/_forward_check.py",
        old="        if root is None or root is module or _contains(root, module) or "
        "_contains(module, root):",
        new="        if root is None:",
        tests=(
            "test/test_forward_check.py::test_a_plan_applied_over_several_calls_is_not_refused",
        ),
        description="a plan applied over several parallelize_module calls keeps the first "
        "call's first-forward check, which sees half the plan and refuses a right model",
    ),
    Mutation(
        name="forward_check_first_signature_only",
        file="torch_tp/_forward_check.py",
        old="        if key is None or key in self.seen:",
        new="        if key is None or self.seen:",
        tests=(
            "test/test_forward_check.py::test_the_check_runs_once_per_input_signature_and_then_goes",
        ),
        description="the first-forward check runs for the first input signature only: a "
        "later shape the plan gets wrong runs unchecked",
    ),
    Mutation(
        name="forward_errors_hide_the_signature",
        file="torch_tp/_forward_errors.py",
        old="    wrapper.__wrapped__ = forward  # type: ignore[attr-defined]\n",
        new="",
        tests=("test/test_forward_errors.py::test_the_forward_keeps_its_signature",),
        description="the forward wrapper that adds the plan's context to errors hides the "
        "module's own signature (Trainer then drops every dataset column)",
    ),
    Mutation(
        name="forward_errors_context_on_own_errors",
        file="torch_tp/_forward_errors.py",
        old="    return code.co_filename.startswith(_ROOTS[1]) and code.co_code",
        new="    return False and code.co_code",
        tests=("test/test_forward_errors.py::test_swapped_mlp_styles_name_the_module_and_the_fix",),
        description="torch_tp's own errors get a second context after them, whose source "
        "line differs between ranks that took different branches",
    ),
    Mutation(
        name="forward_errors_one_code_object",
        file="torch_tp/_forward_errors.py",
        old="    own = types.FunctionType(_forward.__code__.replace(), ",
        new="    own = _forward or types.FunctionType(_forward.__code__.replace(), ",
        tests=(
            "test/test_forward_errors.py::"
            "test_each_parallelized_model_compiles_with_a_cache_of_its_own",
        ),
        description="every parallelized model's forward wrapper shares one code object: "
        "torch.compile's 8 cache entries per code object run out at the ninth model",
    ),
    Mutation(
        name="forward_errors_farthest_first",
        file="torch_tp/_forward_errors.py",
        old='        return sorted(found, key=lambda item: item[0].count("."))',
        new="        return found",
        tests=(
            "test/test_forward_errors.py::"
            "test_a_sharded_lm_head_before_transformers_loss_names_the_head",
        ),
        description="an error's context lists the planned modules in the model's order, a "
        "language model's 22 projections before the head the loss reads",
    ),
)


_ERROR = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Timeout)\b:?")


@dataclasses.dataclass
class Result:
    """The outcome of one mutation: pytest's exit code, the seconds it took, its output."""

    mutation: Mutation
    returncode: int
    seconds: float
    output: str

    @property
    def caught(self) -> bool:
        """Whether a named test failed (exit 1); collection errors prove nothing."""
        return self.returncode == 1

    @property
    def reason(self) -> str:
        """The failed test and the error that failed it (the innermost, for a rank's), or
        ``""``."""
        lines = [line[1:].strip() for line in self.output.splitlines() if line.startswith("E ")]
        errors = [
            i
            for i, line in enumerate(lines)
            if _ERROR.match(line) and not line.startswith("torch_tp.testing._harness.")
        ]
        error = ""
        if errors:
            detail = [line for line in lines[errors[-1] + 1 :] if line][:1]
            error = " ".join([lines[errors[-1]], *detail])
        failed = [line.split(" - ")[0] for line in self.output.splitlines()]
        failed = [line for line in failed if line.startswith(("FAILED ", "ERROR "))]
        return ": ".join(filter(None, [failed[0] if failed else "", error]))

    @property
    def verdict(self) -> str:
        if self.caught:
            return "caught"
        return f"NOT CAUGHT: pytest {_EXIT.get(self.returncode, f'exit {self.returncode}')}"


# --------------------------------------------------------------------------------- checks


def _test_function(node_id: str) -> tuple[str, str]:
    path, _, rest = node_id.partition("::")
    return path, re.sub(r"\[.*\]$", "", rest.split("::")[-1])


def check_list(root: Path = ROOT, mutations: Sequence[Mutation] = MUTATIONS) -> list[str]:
    """Everything wrong with ``mutations`` against the source under ``root``: duplicate names,
    files outside ``torch_tp/``, an ``old`` text that is not there exactly once, a ``new``
    equal to it, no test, a test file or test function that does not exist. Empty when the
    list is well formed."""
    problems = []
    names = [m.name for m in mutations]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{name}: the name is used twice")
    for m in mutations:
        where = f"{m.name} ({m.file})"
        if not re.fullmatch(r"[a-z0-9_]+", m.name):
            problems.append(f"{where}: the name must be lower_case_with_underscores")
        if not m.file.startswith("torch_tp/") or not m.file.endswith(".py"):
            problems.append(f"{where}: mutations change Python files under torch_tp/")
        if not m.description or "\n" in m.description:
            problems.append(f"{where}: the description must be one line")
        if m.old == m.new:
            problems.append(f"{where}: new text equals the old one")
        path = root / m.file
        if not path.is_file():
            problems.append(f"{where}: no such file")
        else:
            count = path.read_text().count(m.old)
            if count != 1:
                problems.append(
                    f"{where}: the old text occurs {count} times, expected exactly once "
                    f"(the code moved? update the mutation): {m.old!r}"
                )
        if not m.tests:
            problems.append(f"{where}: no test named to catch it")
        for node_id in m.tests:
            test_file, function = _test_function(node_id)
            source = root / test_file
            if not test_file.startswith("test/") or not source.is_file():
                problems.append(f"{where}: test file of {node_id!r} not found")
            elif not re.search(rf"^def {re.escape(function)}\(", source.read_text(), re.M):
                problems.append(f"{where}: no test function {function!r} in {test_file}")
    return problems


def markdown_table(mutations: Sequence[Mutation] = MUTATIONS) -> str:
    """The table of mutations and the tests that catch them, as in CONTRIBUTING.md."""
    lines = ["| Mutation | File | The bug | Caught by |", "| --- | --- | --- | --- |"]
    for m in mutations:
        tests = "<br>".join(f"`{t.removeprefix('test/')}`" for t in m.tests)
        lines.append(f"| `{m.name}` | `{m.file}` | {m.description} | {tests} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ applying

_COPIED = ("torch_tp", "test", "pyproject.toml")


def scratch_copy(destination: Path, root: Path = ROOT) -> Path:
    """Copy what pytest needs (``torch_tp/``, ``test/``, ``pyproject.toml``) under
    ``destination``, without caches; return ``destination``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in _COPIED:
        source = root / name
        if source.is_dir():
            shutil.copytree(source, destination / name, ignore=ignore)
        else:
            shutil.copy2(source, destination / name)
    return destination


def apply(mutation: Mutation, tree: Path) -> None:
    """Apply ``mutation`` to the copy at ``tree`` (its ``old`` text exactly once, or raise)."""
    path = tree / mutation.file
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise ValueError(
            f"mutation {mutation.name}: its old text occurs {count} times in {mutation.file}, "
            "expected exactly once"
        )
    path.write_text(text.replace(mutation.old, mutation.new))


def _environment(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    # the scratch copy first, ahead of the editable install of the checkout (whose finder
    # comes after sys.path anyway); the ranks are spawned with the parent's sys.path
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tree), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    )
    env.pop("TORCH_TP_RUNTIME", None)  # the mutations target the default (fast) runtime
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["COLUMNS"] = "400"  # pytest's summary line of a failure, not cut at 80 characters
    return env


def _pytest(tree: Path, tests: Iterable[str], timeout: float) -> tuple[int, str]:
    # -n 0: in one process, as the few tests of one mutation start faster there (and -x
    # stops at their first failure)
    command = [
        sys.executable,
        "-m",
        "pytest",
        *tests,
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        "0",
    ]
    try:
        done = subprocess.run(
            command,
            cwd=tree,
            env=_environment(tree),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode()
        return -1, f"{out}\n[killed after {timeout:.0f} s]"
    return done.returncode, done.stdout


def run(
    mutation: Mutation | None, tests: Sequence[str] | None = None, timeout: float = 600.0
) -> Result:
    """Apply ``mutation`` (``None``: none, the baseline) to a fresh scratch copy and run its
    tests (or ``tests``) there."""
    named = tuple(tests) if tests else mutation.tests if mutation else ()
    with tempfile.TemporaryDirectory(prefix="torch_tp_mutation_") as scratch:
        tree = scratch_copy(Path(scratch))
        if mutation is not None:
            apply(mutation, tree)
        start = time.perf_counter()
        code, output = _pytest(tree, named, timeout)
        seconds = time.perf_counter() - start
    return Result(mutation, code, seconds, output)  # type: ignore[arg-type]


# ------------------------------------------------------------------------ isolation proof

_PROBE = """
import os

import torch_tp
from torch_tp.testing import run_distributed


def _where() -> list[str]:
    import torch_tp.style

    return [torch_tp.__file__, torch_tp.style.__file__]


def test_probe():
    root = os.environ["MUTATION_SCRATCH"]
    found = [torch_tp.__file__] + [f for rank in run_distributed(_where, 2) for f in rank]
    assert all(f.startswith(root) for f in found), found
"""


def verify_isolation() -> bool:
    """Show that a scratch copy is what runs, in pytest's process and in the ranks: a probe
    test finds ``torch_tp`` (and a module the ranks import themselves) under the scratch
    directory, and a mutation that makes ``import torch_tp`` raise makes the run fail."""
    ok = True
    with tempfile.TemporaryDirectory(prefix="torch_tp_mutation_") as scratch:
        tree = scratch_copy(Path(scratch))
        (tree / "test" / "test_mutation_probe.py").write_text(_PROBE)
        os.environ["MUTATION_SCRATCH"] = str(tree.resolve())
        code, output = _pytest(tree, ["test/test_mutation_probe.py"], 300)
        print(f"probe (torch_tp from the scratch copy in pytest and in 2 ranks): exit {code}")
        if code != 0:
            print(output)
            ok = False
        init = tree / "torch_tp" / "__init__.py"
        init.write_text('raise ImportError("mutated scratch copy")\n' + init.read_text())
        code, output = _pytest(tree, ["test/test_mutation_probe.py"], 300)
        raised = "mutated scratch copy" in output
        print(f"import torch_tp made to raise: exit {code}, the mutated copy raised: {raised}")
        ok = ok and code != 0 and raised
    print("isolation verified" if ok else "ISOLATION NOT VERIFIED")
    return ok


# ----------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", metavar="NAME", help="run this mutation")
    parser.add_argument("--tests", nargs="+", help="run these tests instead of the named ones")
    parser.add_argument("--baseline", action="store_true", help="run the tests unmutated first")
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    parser.add_argument("--check", action="store_true", help="check the list and exit")
    parser.add_argument("--table", action="store_true", help="print the Markdown table")
    parser.add_argument("--verify-isolation", action="store_true")
    parser.add_argument("-v", "--verbose", action="store_true", help="print why each failed")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run")
    args = parser.parse_args(argv)

    if args.table:
        print(markdown_table())
        return 0
    if args.verify_isolation:
        return 0 if verify_isolation() else 1
    problems = check_list()
    if problems:
        print("the mutation list is out of date:", *problems, sep="\n  ", file=sys.stderr)
        return 2
    if args.check:
        print(f"{len(MUTATIONS)} mutations, every old text found once")
        return 0
    by_name = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.only or () if n not in by_name]
    if unknown:
        parser.error(f"unknown mutation {', '.join(unknown)}; known: {', '.join(by_name)}")
    chosen = [by_name[n] for n in args.only] if args.only else list(MUTATIONS)
    if args.list:
        for m in chosen:
            print(f"{m.name}  ({m.file})\n    {m.description}\n    " + "\n    ".join(m.tests))
        return 0

    failed = []
    total = time.perf_counter()
    for m in chosen:
        if args.baseline:
            base = run(None, args.tests or m.tests, args.timeout)
            print(f"{m.name:40s} baseline {_EXIT.get(base.returncode, base.returncode):>8s}"
                  f" {base.seconds:6.1f} s", flush=True)  # fmt: skip
            if base.returncode != 0:
                print(base.output)
                failed.append(f"{m.name} (baseline)")
                continue
        result = run(m, args.tests, args.timeout)
        print(f"{m.name:40s} {result.verdict:>8s} {result.seconds:6.1f} s", flush=True)
        if result.caught and args.verbose:
            print(f"    {result.reason}")
        if not result.caught:
            print(result.output[-4000:])
            failed.append(m.name)
    print(f"{len(chosen) - len(failed)} of {len(chosen)} caught in "
          f"{time.perf_counter() - total:.0f} s")  # fmt: skip
    if failed:
        print("not caught:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
