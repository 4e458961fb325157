"""Smoke tests of ``benchmarks/``: they prove the pieces work at a minimal size, never timings.

What is asserted: the hand-written Megatron-style baseline computes the single-device loss
and gradients (it must be right to be a fair baseline) with exactly the minimum collectives
(deterministic counts and bytes); the collective counter agrees with ``CommDebugMode``; the
upstream "comm-optimal" plan mirrors torch_tp's Llama plan; the script runs end to end on
the shared test ranks and as its own command.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from torch_tp import AttentionHeads
from torch_tp import __main__ as cli
from torch_tp.models import Llama, LlamaConfig
from torch_tp.plans.llama import llama_plan
from torch_tp.testing import run_distributed

# The benchmark scripts are not a package: import them from their directory (the test ranks
# import this module too, so they get the same path).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_compile  # noqa: E402
import bench_forward_check  # noqa: E402
import bench_generate  # noqa: E402
import bench_hf_checkpoint  # noqa: E402
import bench_meta_init  # noqa: E402
import bench_moe  # noqa: E402
import bench_pipeline  # noqa: E402
import bench_tp  # noqa: E402
import bench_transformers  # noqa: E402
import megatron  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]

_CONFIG = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64}
_BATCH, _SEQ = 2, 8
_F32 = 4  # bytes


def _reference() -> tuple[Llama, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    reference = Llama(LlamaConfig(**_CONFIG, max_seq_len=_SEQ))
    tokens = torch.randint(0, _CONFIG["vocab_size"], (_BATCH, _SEQ + 1))
    return reference, tokens[:, :-1], tokens[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _shard_dim(name: str) -> int | None:
    """The dimension the baseline splits parameter ``name`` on (``None``: replicated)."""
    if name in ("tok_embeddings.weight", "output.weight"):
        return 0
    for linear, dim in {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "wo": 1, "w2": 1}.items():
        if name.endswith(f".{linear}.weight"):
            return dim
    return None


def _megatron_step(sequence_parallel: bool) -> dict[str, tuple[int, int]]:
    """On each rank: one baseline step, checked against the single-device model."""
    reference, inputs, targets = _reference()
    model = megatron.MegatronLlama(reference, dist.group.WORLD, sequence_parallel=sequence_parallel)
    with bench_tp.CollectiveCounter() as counter:
        loss = _loss(model(inputs), targets)
        loss.backward()
        model.reduce_norm_grads()
    ref_loss = _loss(reference(inputs), targets)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)

    world, rank = dist.get_world_size(), dist.get_rank()
    ref_params = dict(reference.named_parameters())
    params = dict(model.named_parameters())
    assert set(params) == set(ref_params)
    for name, param in params.items():
        full = ref_params[name].grad
        dim = _shard_dim(name)
        expected = full if dim is None else full.chunk(world, dim)[rank]
        torch.testing.assert_close(param.grad, expected, msg=lambda m, n=name: f"{n}: {m}")
    return counter.summary()


def test_megatron_baseline_matches_single_device_with_minimal_collectives() -> None:
    layers, dim, vocab = _CONFIG["n_layers"], _CONFIG["dim"], _CONFIG["vocab_size"]
    activation = _BATCH * _SEQ * dim * _F32  # one (batch, seq, dim) float32 activation
    logits = _BATCH * _SEQ * vocab * _F32
    # per block: forward one reduction after attention and one after the MLP; backward one
    # input-gradient reduction before each; plus the embedding (forward) and the output
    # layer's input (backward); the logits are gathered on the vocabulary once
    summaries = run_distributed(_megatron_step, 2, False)
    assert (
        summaries[0]
        == summaries[1]
        == {
            "all_reduce": (4 * layers + 2, (4 * layers + 2) * activation),
            "all_gather": (1, logits),
        }
    )
    # with sequence parallelism every all-reduce becomes an all-gather and a reduce-scatter,
    # the output layer gathers its input too, and the norm gradients (2 per block and the
    # final norm) are summed in one coalesced all-reduce
    summaries = run_distributed(_megatron_step, 2, True)
    assert (
        summaries[0]
        == summaries[1]
        == {
            "all_reduce": (1, (2 * layers + 1) * dim * _F32),
            "all_gather": (4 * layers + 3, (4 * layers + 2) * activation + logits),
            "reduce_scatter": (4 * layers + 2, (4 * layers + 2) * activation),
        }
    )


def _counts_both_ways(library: str, sequence_parallel: bool) -> tuple[int, int]:
    """Collectives of one step as counted by bench_tp's counter and by CommDebugMode."""
    reference, inputs, targets = _reference()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    variant = bench_tp.Variant(library, sequence_parallel)
    model, after_backward = bench_tp.build_variant(variant, reference, mesh)

    def step() -> None:
        _loss(model(inputs), targets).backward()
        if after_backward is not None:
            after_backward()

    with bench_tp.CollectiveCounter() as counter:
        step()
    with CommDebugMode() as comm:
        step()
    return len(counter.records), comm.get_total_counts()


@pytest.mark.parametrize(
    ("library", "sequence_parallel"),
    [("megatron", True), ("torch_tp", False), ("torch_tp", True), ("upstream-linear", False)],
)
def test_counter_agrees_with_comm_debug_mode(library: str, sequence_parallel: bool) -> None:
    ours, theirs = run_distributed(_counts_both_ways, 2, library, sequence_parallel)[0]
    assert ours == theirs > 0


def test_counter_sees_redistributions_inside_dtensor_ops() -> None:
    run_distributed(_partial_to_replicate_in_an_op, 2)


def _partial_to_replicate_in_an_op() -> None:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    replicated = DTensor.from_local(torch.ones(4), mesh, (Replicate(),))
    partial = DTensor.from_local(torch.ones(4), mesh, (Partial(),))
    with bench_tp.CollectiveCounter() as counter:
        replicated.add_(partial)  # DTensor all-reduces the partial sum inside the op
    assert counter.summary() == {"all_reduce": (1, 4 * _F32)}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_upstream_optimal_plan_mirrors_llama_plan(sequence_parallel: bool) -> None:
    # AttentionHeads on the root only checks the head counts: upstream has no such style
    ours = {
        key: style
        for key, style in llama_plan(sequence_parallel=sequence_parallel).items()
        if not isinstance(style, AttentionHeads)
    }
    theirs = bench_tp.upstream_optimal_plan(sequence_parallel)
    assert theirs.keys() == ours.keys()
    for key, style in ours.items():
        # every argument of ours, compared with upstream's attribute of the same name
        # (upstream also keeps internals such as desired_input_layouts on Colwise/Rowwise)
        mine = {k: v for k, v in vars(style).items() if k != "src_data_rank"}
        # torch_tp's own options, which upstream has no attribute for, are off here
        own = {k: v for k, v in mine.items() if not hasattr(theirs[key], k)}
        assert all(v in (None, False) for v in own.values()), (key, own)
        mine = {k: v for k, v in mine.items() if k not in own}
        other = {k: getattr(theirs[key], k) for k in mine}
        assert type(theirs[key]).__name__ == type(style).__name__, key
        assert other == mine, key


def _bench_as_torchrun_rank(argv: list[str]) -> tuple[int, str]:
    """On a pool rank: run ``bench_tp.py ARGV`` as if launched by torchrun."""
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}
    out = io.StringIO()
    threads = torch.get_num_threads()  # the script sets its own; leave the pool's as it was
    try:
        with mock.patch.dict(os.environ, env), contextlib.redirect_stdout(out):
            status = bench_tp.main(argv)
    finally:
        torch.set_num_threads(threads)
    return status, out.getvalue()


@pytest.mark.slow  # the quick run stays under 2 minutes
def test_script_runs_every_section_at_a_minimal_size() -> None:
    argv = ["--sizes", "tiny", "--steps", "1", "--warmup", "0", "--memory-size", "tiny"]
    argv += ["--parallelize-layers", "1", "--parallelize-repeats", "1", "--by-module"]
    (status, output), (other_status, other) = run_distributed(_bench_as_torchrun_rank, 2, argv)
    assert status == other_status == 0
    assert other == ""  # only rank 0 prints
    for variant in bench_tp.VARIANTS:
        # a row of the timing table and one of the memory table (columns: 2+ spaces apart)
        rows = re.findall(rf"^{re.escape(variant.name)} {{2,}}\S", output, re.MULTILINE)
        assert len(rows) == 2, output
    assert "tiny: dim 64, 4 layers" in output
    assert "megatron+sp:" in output  # the by-module breakdown
    assert "activation memory: tiny (dim 64" in output
    assert "torch_tp ok, upstream ok" in output  # both parallelized the meta model


@pytest.mark.slow  # the quick run stays under 2 minutes
def test_script_markdown_and_filter() -> None:
    argv = ["--sizes", "tiny", "--steps", "1", "--warmup", "0", "--memory-size", "none"]
    argv += ["--skip-parallelize-timing", "--markdown", "--only", "megatron*,torch_tp+sp"]
    (status, output), _ = run_distributed(_bench_as_torchrun_rank, 2, argv)
    assert status == 0
    assert "| variant | ms/step | vs megatron |" in output
    names = [line.split("|")[1].strip() for line in output.splitlines() if line[:2] == "| "]
    assert names == ["variant", "megatron", "megatron+sp", "torch_tp+sp"]


def test_bad_filter_is_refused_before_spawning(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_tp.main(["--only", "nosuch"]) == 2
    assert "matches no variant" in capsys.readouterr().err


def test_cli_lists_bench(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "bench" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_forwards_to_the_script_which_spawns_its_own_ranks() -> None:
    # `python -m torch_tp bench ARGS` runs `python benchmarks/bench_tp.py ARGS`, which spawns
    # the ranks itself: the path users take, at the smallest size
    argv = ["--sizes", "tiny", "--only", "megatron", "--steps", "1", "--warmup", "0"]
    argv += ["--memory-size", "none", "--skip-parallelize-timing"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch_tp", "bench", *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all_reduce×18 (36.0 KiB), all_gather×1 (32.0 KiB)" in proc.stdout


# --- benchmarks/bench_moe.py ------------------------------------------------------------------


def _moe_step_counts(name: str) -> dict[str, object]:
    """On each rank: one training step of bench_moe's variant ``name`` (the MoE Llama, tiny),
    its collectives counted by bench_moe's counter and by CommDebugMode, and its memory."""
    size = bench_moe.SIZES["tiny"]
    variant = next(v for v in bench_moe.VARIANTS if v.name == name)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    models = bench_moe._make_models(size, 0, False)
    model = bench_moe.build_variant(variant, models, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        _loss(model(models.inputs), models.targets).backward()

    with bench_moe.MoECounter() as counter:
        step()
    optimizer.step()
    memory = bench_moe.measure_memory(model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    with CommDebugMode() as comm:
        step()
    return {
        "minimum": bench_moe.is_minimum(variant, counter.records, size.n_layers),
        "split": bench_moe.split_records(counter.records),
        "ours": len(counter.records),
        "comm_debug": {str(op): n for op, n in comm.get_comm_counts().items() if n},
        "expert_share": (memory.expert_params, memory.expert_params_total),
    }


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("tp", marks=pytest.mark.slow),
        pytest.param("ep", marks=pytest.mark.slow),
        "ep+sp",
    ],
)
def test_moe_variants_issue_the_minimal_collectives(name: str) -> None:
    layers = bench_moe.SIZES["tiny"].n_layers
    result = run_distributed(_moe_step_counts, 2, name)[0]
    assert result["minimum"] == "yes", result["split"]
    variant = next(v for v in bench_moe.VARIANTS if v.name == name)
    fwd, bwd = bench_moe.expected_moe(variant.minimum, layers)
    assert {k: c for k, (c, _) in result["split"]["fwd"].items()} == fwd
    assert {k: c for k, (c, _) in result["split"]["bwd"].items()} == bwd
    # CommDebugMode sees every collective the counter sees, the c10d all-to-alls included
    assert sum(result["comm_debug"].values()) == result["ours"]
    if name == "ep+sp":
        # 2 all-to-alls of tokens forward and 2 backward per MoE layer, 1 of counts forward
        assert result["split"]["counts"]["all_to_all(counts)"][0] == layers
        assert result["comm_debug"]["c10d.alltoall_base_"] == 5 * layers
    else:
        assert result["split"]["counts"] == {}
    experts, total = result["expert_share"]
    assert 2 * experts == total > 0  # each rank holds half of the experts' parameters


def _moe_bench_as_torchrun_rank(argv: list[str]) -> tuple[int, str]:
    """On a pool rank: run ``bench_moe.py ARGV`` as if launched by torchrun."""
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}
    out = io.StringIO()
    threads = torch.get_num_threads()
    try:
        with mock.patch.dict(os.environ, env), contextlib.redirect_stdout(out):
            status = bench_moe.main(argv)
    finally:
        torch.set_num_threads(threads)
    return status, out.getvalue()


@pytest.mark.slow
def test_moe_script_quick_mode() -> None:
    # one device, both expert layouts of torch_tp, the Mixtral under torch_tp's sequence
    # parallelism, and a transformers row (which reports its error in the table where
    # transformers cannot run its own TP here)
    names = ("single", "tp", "ep+sp", "hf-single", "hf/torch_tp-tp+sp", "hf-tp")
    argv = ["--quick", "--only", ",".join(names)]
    (status, output), (other_status, other) = run_distributed(_moe_bench_as_torchrun_rank, 2, argv)
    assert status == other_status == 0
    assert other == ""  # only rank 0 prints
    assert "tiny: dim 64, 2 layers" in output
    for name in names:
        # a row of the timing table and one of the memory table (columns: 2+ spaces apart)
        rows = re.findall(rf"^{re.escape(name)} {{2,}}\S", output, re.MULTILINE)
        assert len(rows) == 2, output
    rows: dict[str, str] = {}  # the first row of each name: the timing table's
    for line in output.splitlines():
        if line.strip():
            rows.setdefault(line.split()[0], line)
    assert "yes; CommDebugMode yes" in rows["tp"]
    assert "yes; CommDebugMode yes" in rows["ep+sp"]
    assert "all_to_all(counts)×2" in rows["ep+sp"]
    # plan_for(model, sequence_parallel=True): one gather and one reduce-scatter each way
    assert "yes; CommDebugMode yes" in rows["hf/torch_tp-tp+sp"]
    assert "all_gather×2 (16.0 KiB), reduce_scatter×2 (16.0 KiB)" in rows["hf/torch_tp-tp+sp"]


def test_moe_bad_filter_is_refused_before_spawning(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_moe.main(["--only", "nosuch"]) == 2
    assert "matches no variant" in capsys.readouterr().err
    assert bench_moe.main(["--only", "etp"]) == 2  # the 2-D rows need 4 ranks
    assert "at 4 ranks or more" in capsys.readouterr().err
    assert bench_moe.main(["--world-size", "4", "--ep", "3"]) == 2
    assert "--ep 3 does not divide the 4 ranks" in capsys.readouterr().err


def _ep_tp_gradients(name: str) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """bench_moe's 2-D variant ``name`` at (ep2, tp2): one backward of this rank's micro-batch
    and the benchmark's gradient averaging, against one device's on the whole batch: each
    parameter's full gradient, both ways."""
    from torch.distributed.tensor import DTensor

    variant = next(v for v in bench_moe.VARIANTS_2D if v.name == name)
    mesh = init_device_mesh("cpu", (4,))
    ep_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    models = bench_moe._make_models(bench_moe.SIZES["tiny"], 0, False)
    reference = bench_moe.build_variant(bench_moe.VARIANTS[0], models, mesh)  # "single"
    model = bench_moe.build_variant(variant, models, mesh, ep_tp)
    inputs, targets, data = bench_moe._micro_batch(variant, models, ep_tp)
    assert data is not None and inputs.shape[0] == models.inputs.shape[0] // 2
    _loss(model(inputs), targets).backward()
    bench_moe.sync_dense_gradients(model, data.get_group(), data.size())
    _loss(reference(models.inputs), models.targets).backward()
    expected = dict(reference.named_parameters())
    return [
        (n, p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad, expected[n].grad)
        for n, p in model.named_parameters()
    ]


@pytest.mark.four_ranks
@pytest.mark.parametrize("name", ["etp", "etp+sp"])
def test_moe_ep_tp_rows_average_gradients_as_one_device(name: str) -> None:
    """The 2-D rows train what one device trains on the same global batch: the experts'
    gradients (summed over the ep ranks' tokens) divided by ep, the others averaged over ep."""
    for grads in run_distributed(_ep_tp_gradients, 4, name):
        assert any(".experts." in param for param, _, _ in grads)
        for param, got, expected in grads:
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=param)


@pytest.mark.four_ranks
def test_moe_script_quick_mode_at_four_ranks() -> None:
    """The rows of the 4-rank mode, the 2-D ``(ep, tp)`` ones included, run: every torch_tp
    row issues exactly the minimum in its MoE layers, and every row's first loss (the mean over
    the ep ranks' micro-batches for the 2-D ones) is its one-device model's. (transformers'
    own rows are left out for the suite's time: the benchmark runs them, and its README shows
    them; so is ``hf/torch_tp-tp+sp``, which test_moe_script_quick_mode runs at 2 ranks.)"""
    rows_run = [
        v.name
        for v in bench_moe.variants_for(4, 2)
        if (v.library == "torch_tp" and v.name != "hf/torch_tp-tp+sp")
        or v.name in ("single", "hf-single")
    ]
    argv = ["--quick", "--markdown", "--only", ",".join(rows_run)]
    outputs = run_distributed(_moe_bench_as_torchrun_rank, 4, argv)
    assert [status for status, _ in outputs] == [0] * 4
    output = outputs[0][1]
    assert "MoE benchmark: 4 ranks" in output and "4 heads / 4 kv heads" in output
    rows: dict[str, list[str]] = {}  # the timing table's row of each variant
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 9:
            rows.setdefault(cells[0], cells)
    variants = [v for v in bench_moe.variants_for(4, 2) if v.name in rows_run]
    assert set(rows) - {"variant"} == set(rows_run), output
    assert {"etp", "etp+sp", "hf/torch_tp-etp", "hf/torch_tp-etp+sp"} <= set(rows)
    for variant in variants:
        name, ms, loss_diff, *_, minimum = rows[variant.name]
        if variant.library == "torch_tp":
            assert minimum.startswith("yes;"), rows[variant.name]
        if variant.library != "transformers" or ms != "fails":
            assert float(loss_diff) < 1e-5, rows[variant.name]
    assert "all_to_all(counts)×2" in rows["etp"][5]  # one per MoE layer, apart


@pytest.mark.slow
def test_pipeline_script_quick_mode() -> None:
    """Every variant runs at a tiny size; the pipelined rows hold fewer parameters per rank
    than pp=1 (half the model), and 1F1B keeps fewer activations alive than GPipe."""
    args = bench_pipeline.parse(["--quick"])
    rows = {row.variant: row for row in bench_pipeline.bench(args)}
    assert list(rows) == ["pp=1", "gpipe", "1f1b", "interleaved"]
    assert rows["pp=1"].bubble == 0 and rows["1f1b"].bubble == pytest.approx(1 / 5)
    assert rows["interleaved"].bubble == pytest.approx(1 / 9)
    assert all(row.median_ms > 0 and row.saved_bytes > 0 for row in rows.values())
    assert rows["gpipe"].state_bytes < 0.6 * rows["pp=1"].state_bytes
    assert rows["1f1b"].saved_bytes < rows["gpipe"].saved_bytes
    text = bench_pipeline.table(list(rows.values()), args, markdown=True)
    assert text.count("\n| ") == 5  # the header and four rows


def test_pipeline_bad_variant_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_pipeline.parse(["--variants", "zero-bubble"])
    assert "unknown variants ['zero-bubble']" in capsys.readouterr().err


@pytest.mark.slow
def test_transformers_script_quick_mode() -> None:
    """Both libraries' TP at a tiny size: every row matches one device, and torch_tp issues
    fewer all-reduces than transformers' own TP (or transformers' row says why it cannot
    run here)."""
    pytest.importorskip("transformers")
    args = bench_transformers.parse(["--quick"])
    rows = {(r.family, r.library): r for r in bench_transformers.bench(args)}
    assert set(rows) == {
        (f, lib) for f in ("llama", "mixtral") for lib in ("torch_tp", "transformers")
    }
    for (family, library), row in rows.items():
        if library == "transformers" and row.error:
            continue  # the table reports it
        assert row.loss_diff is not None and row.loss_diff < 1e-5, (family, library)
    assert not rows["llama", "torch_tp"].error
    reduces = rows["llama", "torch_tp"].collectives
    # 2 layers: 2 forward + 2 backward each, + 2, + 1 of two numbers (the embedding's ids
    # agreed in range on every rank)
    assert "allreduce_ 11" in reduces, reduces
    assert "| llama | torch_tp |" in bench_transformers.table(list(rows.values()), args, True)


def _meta_init_child_in_this_process(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """What ``subprocess.run`` does for bench_meta_init's child command (``python
    bench_meta_init.py --one ...``), run in this process: its ranks are the shared pool's
    instead of a fresh process spawning its own (seconds each)."""
    assert command[:2] == [sys.executable, bench_meta_init.__file__], command
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench_meta_init.main(command[2:])
    return subprocess.CompletedProcess(command, 0, out.getvalue(), "")


@pytest.mark.slow
def test_meta_init_script_quick_mode() -> None:
    """Both models go meta -> parallelize -> materialize -> load_pretrained at a tiny size,
    each rank holding half the shards; the table prints a row each. bench() builds each
    model's child command and reads its row back as in a real run; only the child runs here."""
    pytest.importorskip("transformers")
    args = bench_meta_init.parse(["--quick"])
    with mock.patch.object(subprocess, "run", _meta_init_child_in_this_process):
        rows = {row.model: row for row in bench_meta_init.bench(args)}
    assert list(rows) == ["llama", "hf-llama"]
    for row in rows.values():
        assert 0 < row.shard_mib < 0.6 * row.checkpoint_mib and row.largest_mib > 0, row
        assert row.peak_mib == row.peak_mib or not os.access("/proc/self/clear_refs", os.W_OK)
    text = bench_meta_init.table(list(rows.values()), args, markdown=True)
    assert text.count("\n| ") == 3  # the header and two rows


@pytest.mark.slow  # writes two checkpoints, then loads and saves each with both libraries
def test_hf_checkpoint_script_tiny(tmp_path: Path) -> None:
    """Both libraries load and save both tiny Hub-layout checkpoints at TP=2 (torch_tp also
    loads with ``mmap=True``), each torch_tp rank reading about half of the checkpoint's
    bytes; the table has a row each and the goals."""
    pytest.importorskip("transformers")
    argv = ["--size", "tiny", "--in-process", "--dir", str(tmp_path)]
    args = bench_hf_checkpoint.parse(argv)
    rows = {(r.model, r.library): r for r in bench_hf_checkpoint.bench(args)}
    libraries = ("torch_tp", "torch_tp+mmap", "transformers")
    assert list(rows) == [(m, lib) for m in ("llama", "mixtral") for lib in libraries]
    for model in ("llama", "mixtral"):
        for library in libraries[:2]:
            row = rows[model, library]
            assert not row.error and row.write_s is not None, (model, library, row.error)
            assert bool(row.save_s) == (library == "torch_tp"), (model, row.save_error)
            shares = [read / row.checkpoint.total_bytes for read in row.read]
            assert shares == pytest.approx([0.5, 0.5], abs=0.05), (model, library, shares)
    text = bench_hf_checkpoint.table(list(rows.values()), args, markdown=True)
    assert text.count("\n| ") == 7  # the header and six rows
    assert len(re.findall(r": (not )?met\b", text)) == 10  # 6 memory goals, 4 load-time goals


# --- benchmarks/bench_context.py --------------------------------------------------------------

import bench_context  # noqa: E402


def _context_bench_as_torchrun_rank(argv: list[str]) -> tuple[int, str]:
    """On a pool rank: run ``bench_context.py ARGV`` as if launched by torchrun."""
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}
    out = io.StringIO()
    threads = torch.get_num_threads()
    try:
        with mock.patch.dict(os.environ, env), contextlib.redirect_stdout(out):
            status = bench_context.main(argv)
    finally:
        torch.set_num_threads(threads)
    return status, out.getvalue()


@pytest.mark.slow  # spawns nothing, but runs five variants on the pool's two ranks
def test_context_script_quick_mode() -> None:
    """Every cp row computes one device's loss (float32 rounding) and sends exactly the ring
    volume ``torch_tp._ring.ring_volume`` predicts, bytes and messages, both passes; the
    attention of a cp=2 rank saves at most ~0.6 of one device's for backward."""
    argv = ["--quick", "--markdown"]
    (status, output), (other_status, other) = run_distributed(
        _context_bench_as_torchrun_rank, 2, argv
    )
    assert status == other_status == 0
    assert other == ""  # only rank 0 prints
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in output.splitlines()
        if line.startswith("| ") and not line.startswith("| variant")
    ]
    names = [v.name for v in bench_context.variants_for(2)]
    timing, memory = rows[: len(names)], rows[len(names) :]
    assert [r[0] for r in timing] == [r[0] for r in memory] == names, output
    for name, _, _, loss_diff, sent, theory, match, fsdp in timing:
        assert float(loss_diff) < 1e-5, (name, loss_diff)
        if name.startswith("cp="):
            assert match == "yes" and sent == theory, (name, sent, theory)
            assert "reduce_scatter" in fsdp, (name, fsdp)  # FSDP2's gradients, apart
    for name, _, share, *_ in memory:
        if name.startswith("cp="):
            assert float(share) < 0.65, (name, share)
    assert "SDPA kernel:" in output


def test_context_bad_arguments_are_refused_before_spawning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench_context.main(["--only", "nosuch"]) == 2
    assert "matches no variant" in capsys.readouterr().err
    assert bench_context.main(["--world-size", "1"]) == 2
    assert "at least 2 ranks" in capsys.readouterr().err


# --- benchmarks/bench_lora.py -----------------------------------------------------------------

import bench_lora  # noqa: E402


@pytest.mark.slow  # five models per rank, two timed rounds each
def test_lora_script_quick_mode() -> None:
    """Every row runs at a tiny size (transformers' own TP, where PEFT's adapters do not run
    on it, says why): the LoRA step under torch_tp gives one device's losses with exactly the
    collectives of the same model without adapters (a row-parallel adapter's partial sum
    rides in its base's all-reduce), and each rank holds less of the adapter than one device."""
    pytest.importorskip("peft")
    args = bench_lora.parse(["--quick"])
    rows = {row.variant: row for row in bench_lora.bench(args)}
    assert list(rows) == list(bench_lora.VARIANTS)
    single, lora, full = rows["one device"], rows["torch_tp"], rows["torch_tp full FT"]
    for row in (single, lora, full):
        assert not row.error, (row.variant, row.error)
        assert len(row.times_ms) == args.steps, row
        assert len(row.losses) == args.warmup + 1 + args.steps, row  # + the counted step
    assert single.collectives == "none"
    # 2 layers: 7 forward, 5 backward, with adapters or without; the logits gathered once
    assert lora.collectives == full.collectives == "_allgather_base_ 1, allreduce_ 11"
    torch.testing.assert_close(lora.losses, single.losses, rtol=1e-5, atol=1e-5)
    # float32 adapter bytes per layer (hidden 32, kv 16, MLP 64, r 8), r * (in + out) on one
    # device: q 64, k 48, v 48, o 64, gate 96, up 96, down 96; at TP=2 the column-parallel
    # ones hold half of lora_B (q 48, k 40, v 40, gate 64, up 64), the row-parallel ones
    # half of lora_A (o 48, down 64)
    assert single.trained_bytes == 2 * 8 * 512 * 4
    assert lora.trained_bytes == 2 * 8 * 368 * 4
    hf = rows["transformers"]
    text = bench_lora.table(list(rows.values()), args, markdown=True)
    assert text.count("\n| ") == 1 + len(rows)  # the header and a row each
    if hf.error:
        assert f"| transformers | - | does not run: {hf.error} |" in text
    else:
        assert len(hf.losses) == args.warmup + 1 + args.steps, hf


def test_lora_bad_variant_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_lora.parse(["--only", "torch_tp,nosuch"])
    assert "unknown variants ['nosuch']" in capsys.readouterr().err


def test_forward_check_script_quick_mode() -> None:
    """The reference Llama and a transformers Llama at a tiny size, the check on and off: a
    row each of three timed phases, each a positive number of seconds on and off, and their
    step ratio."""
    args = bench_forward_check.parse(["--quick"])
    rows = bench_forward_check.bench(args)
    assert [row[:2] for row in rows] == [["llama", "1"], ["hf-llama", "1"]], rows
    for row in rows:
        for cell in row[2:5]:
            on, off = (float(x) for x in cell.split(" / "))
            assert on > 0 and off > 0, row
        assert float(row[5]) > 0, row


@pytest.mark.slow  # four transformers Llamas per rank, each generating
def test_generate_script_quick_mode() -> None:
    """Greedy decoding at a tiny size: every row makes one device's tokens; torch_tp's
    collectives per token are what the dry-run report predicts, and one more than the
    hand-written Megatron decode's (the vocabulary-parallel embedding's agreed check)."""
    args = bench_generate.parse(["--quick"])
    rows = {r["row"]: r for r in bench_generate.bench(args)}
    assert set(rows) == set(bench_generate.ROWS), rows
    for name in ("one device", "torch_tp", "megatron"):
        assert rows[name]["same"], rows[name]
        # one round of 3 tokens: per token is the difference of two noisy timings
        assert rows[name]["prefill_ms"] > 0 and math.isfinite(rows[name]["token_ms"]), rows[name]
    assert rows["transformers"].get("same", True), rows["transformers"]
    assert rows["one device"]["collectives"] == {}, rows["one device"]
    ours = sum(rows["torch_tp"]["collectives"].values())
    assert ours == rows["torch_tp"]["predicted"], rows["torch_tp"]
    assert ours == sum(rows["megatron"]["collectives"].values()) + 1, rows
    assert "per token ms" in bench_generate.table(list(rows.values()), args)


@pytest.mark.slow  # a transformers Llama compiled for training and for decoding, per rank
def test_compile_script_finds_one_graph_and_no_recompile_under_tp() -> None:
    """A transformers Llama at a tiny size at TP=2: one graph, no graph break, guards counted
    by kind, and no graph compiled after the first training step, nor after the first
    decode position with a static cache."""
    args = bench_compile.parse(["--dim", "32", "--vocab", "64", "--steps", "2", "--decode", "2"])
    ours = run_distributed(bench_compile._rank, args.tp, "hf-llama", True, args)[0]
    assert (ours["graphs"], ours["breaks"]) == (1, 0), ours
    assert ours["step_recompiles"] == ours["decode_recompiles"] == 0, ours
    assert sum(ours["kinds"].values()) == ours["guards"] > 0, ours
