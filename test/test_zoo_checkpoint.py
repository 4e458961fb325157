"""The transformers zoo's checkpoints, as transformers itself writes them, in and out of torch_tp.

For every architecture of ``test/test_zoo.py``'s zoo (the causal LMs whose config declares a
tensor-parallel plan, the same tiny models, float64 where they run in it, built by
``test_zoo.build``):

1. transformers' own ``model.save_pretrained(dir)`` writes the single-device model (weights
   A; a few architectures, :data:`SMALL_SHARDS`, with a small ``max_shard_size``, so that
   sharded checkpoints and their index are covered too);
2. on 2 ranks, the same architecture with other weights (B), parallelized with
   ``plan_for(model)`` at TP=2, loads ``dir`` with :func:`torch_tp.checkpoint.load_pretrained`:
   its logits must equal those of transformers' ``AutoModelForCausalLM.from_pretrained(dir)``
   on one device (within the zoo's tolerance for the architecture), and each rank must read
   exactly the elements it holds (the safetensors reads counted);
3. where the config declares an expert-parallel plan, the same with
   ``expert_parallel_plan(model)`` (EP=2);
4. the model with weights A, parallelized at TP=2 (and at EP=2 where step 3 runs), written
   by :func:`torch_tp.checkpoint.save_pretrained`, must hold what transformers' ``save_pretrained``
   wrote in step 1: the same keys, shapes and dtypes in the safetensors files and the same
   values.

Where transformers' own round trip does not give back the model it wrote (gemma's
``embed_scale`` buffer, computed in float64 by ``from_pretrained`` but in float32 and cast
by the zoo's builder; HunYuan-MoE's router, which ``from_pretrained`` builds in float32),
by what no checkpoint holds, the logits are compared with the model it wrote instead, and
the entry's ``reference`` says why. A copy with other weights that gives the same logits
fails the check (it could not catch a tensor the load misses).

What each architecture does is recorded in ``test/zoo_checkpoint_status.json`` (the status,
and for a failure the first line of each step's error or what differs), and the test compares
the live results with the file, as test_zoo does (numbers in the reasons masked). Rewrite it
with::

    TORCH_TP_ZOO_UPDATE=1 python -m pytest test/test_zoo_checkpoint.py -m slow

(``TORCH_TP_ZOO_ONLY=mixtral,gpt_neox`` runs, compares or rewrites those only), and render
it as a markdown table with ``python test/test_zoo_checkpoint.py``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import test_zoo
import torch
from test_zoo import DOES_NOT_BUILD, FAIL, PASS, SEQ, UPDATE_ENV, VOCAB, WORLD_SIZE
from torch import nn

STATUS_FILE = Path(__file__).with_name("zoo_checkpoint_status.json")
# the quick run's representatives (about 1.2 s each): a dense model whose checkpoint renames
# a tensor (embed_out), and Mixtral's per-expert experts (w1/w2/w3 under block_sparse_moe,
# merged on load, split on save; TP and EP); qwen3_moe's layout is the same merge under
# other names and runs in the slow sweep
QUICK = ("gpt_neox", "mixtral")
# written by transformers with a small max_shard_size: several files and an index
SMALL_SHARDS = ("deepseek_v3", "gpt_neox", "llama", "mixtral", "nemotron_h", "qwen3_moe")
SHARD_SIZE = "20KB"
# architectures per run_distributed call (the per-call overhead is small against a model's
# checks, but a batch that hangs is re-run one architecture at a time)
BATCH = 10
TIMEOUT = test_zoo.TIMEOUT
# each step's outcome, per architecture: "yes" or what went wrong (the first line of its
# error, the logits difference, the elements read, what the files differ by)
STEPS = ("tp_load", "ep_load", "save", "ep_save")
# compared exactly with the recorded values
EXACT = ("dtype", "tolerance", "expert_parallel", "sharded_checkpoint", "reference")


def _first_line(error: BaseException) -> str:
    """The error's type and first line, and its second where the first ends in a colon
    (``CheckpointError``'s first line only says which directory and model)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2] if lines and lines[0].endswith(":") else lines[:1])
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(error).__name__}: {text}".strip()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _other_weights(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with other weights (seed B): every floating parameter and
    persistent buffer moved, so that a tensor the load misses shows in the logits."""
    other = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for value in other.state_dict(keep_vars=True).values():
            if value.is_floating_point():
                value.add_(torch.randn_like(value) * 0.1)
    return other


def _local_elements(model: nn.Module) -> int:
    """The elements this rank holds of every tensor of the state dict (tied ones once)."""
    held = {
        id(v): (v.to_local() if hasattr(v, "to_local") else v).numel()
        for v in model.state_dict(keep_vars=True).values()
    }
    return sum(held.values())


def _load_and_run(
    model: nn.Module, plan: dict[str, Any], directory: Path, ids: torch.Tensor
) -> tuple[torch.Tensor, int, int]:
    """``model`` with other weights, parallelized by ``plan`` (``model``'s) at TP=2, loaded
    from ``directory`` by torch_tp: its logits (gathered), the elements this rank read and
    the elements it holds."""
    from helpers import safetensors_reads, tp_mesh

    from torch_tp import parallelize_module
    from torch_tp.checkpoint import load_pretrained

    other = _other_weights(model)
    parallel = parallelize_module(other, tp_mesh(), plan)
    held = _local_elements(parallel)
    with safetensors_reads() as reads:
        load_pretrained(parallel, directory)
    read = sum(sum(v) for v in reads.values())
    with torch.no_grad():
        logits = _full(parallel(input_ids=ids, use_cache=False).logits)
    return logits, read, held


def _headers(directory: Path) -> dict[str, tuple[list[int], str, Path]]:
    """Every tensor of a ``save_pretrained`` directory: its shape, dtype and file."""
    from safetensors import safe_open

    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                found[key] = (list(piece.get_shape()), piece.get_dtype(), path)
    return found


def _few(keys: set[str] | list[str]) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")


def compare_saved(ours: Path, theirs: Path) -> str:
    """How torch_tp's ``save_pretrained`` directory ``ours`` differs from transformers'
    ``theirs`` (keys, shapes, dtypes, values), or ``""`` where it does not."""
    from safetensors import safe_open

    mine, want = _headers(ours), _headers(theirs)
    if not want:
        return f"transformers wrote no safetensors file in {theirs}"
    problems = []
    extra, missing = set(mine) - set(want), set(want) - set(mine)
    if extra:
        problems.append(f"{len(extra)} keys transformers does not write ({_few(extra)})")
    if missing:
        problems.append(f"not {len(missing)} keys transformers writes ({_few(missing)})")
    shapes = [k for k in set(mine) & set(want) if mine[k][0] != want[k][0]]
    if shapes:
        k = sorted(shapes)[0]
        problems.append(f"{len(shapes)} other shapes ({k}: {mine[k][0]}, not {want[k][0]})")
    dtypes = [k for k in set(mine) & set(want) if mine[k][1] != want[k][1]]
    if dtypes:
        k = sorted(dtypes)[0]
        problems.append(f"{len(dtypes)} other dtypes ({k}: {mine[k][1]}, not {want[k][1]})")
    values = []
    for key in sorted(set(mine) & set(want)):
        if key in shapes or key in dtypes:
            continue
        with safe_open(str(mine[key][2]), framework="pt") as a:
            with safe_open(str(want[key][2]), framework="pt") as b:
                if not torch.equal(a.get_tensor(key), b.get_tensor(key)):
                    values.append(key)
    if values:
        problems.append(f"{len(values)} other values ({_few(values)})")
    return ("torch_tp writes " + "; ".join(problems)) if problems else ""


def _why_from_pretrained_differs(model: nn.Module, loaded: nn.Module) -> str:
    """What differs between the model transformers wrote and what its ``from_pretrained``
    reads back: the buffers and the parameters' dtypes."""
    mine, theirs = dict(model.named_buffers()), dict(loaded.named_buffers())
    buffers = [k for k in mine if k in theirs and not torch.equal(mine[k], theirs[k])]
    theirs = dict(loaded.named_parameters())
    dtypes = [k for k, p in model.named_parameters() if k in theirs and theirs[k].dtype != p.dtype]
    why = [f"buffers {_few(buffers)}"] if buffers else []
    why += [f"parameters in another dtype {_few(dtypes)}"] if dtypes else []
    return (
        f"from_pretrained differs from the model it wrote ({'; '.join(why) or 'unknown'}): "
        "compared with the model it wrote"
    )


def _check(model_type: str, root: str) -> dict[str, Any]:
    """One architecture's four steps, on every rank (see the module's docstring)."""
    import torch.distributed as dist
    import transformers
    from helpers import tp_mesh

    from torch_tp import parallelize_module
    from torch_tp.checkpoint import save_pretrained
    from torch_tp.plans.hf import expert_parallel_plan, plan_for

    start = time.perf_counter()
    transformers.utils.logging.disable_progress_bar()
    rank = dist.get_rank()
    torch.manual_seed(0)
    ids = torch.randint(2, VOCAB, (2, SEQ))
    theirs = Path(root) / model_type / "transformers"
    ours = Path(root) / model_type / "torch_tp"
    shard = SHARD_SIZE if model_type in SMALL_SHARDS else "50GB"
    # 1. transformers writes the single-device model (rank 0), and reads it back (each rank)
    error = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = test_zoo.build(model_type)  # weights A (seed 0)
            if rank == 0:
                model.save_pretrained(theirs, max_shard_size=shard)
    except Exception as caught:
        error = caught
    errors = [None] * dist.get_world_size()  # every rank stops if one could not build or write
    dist.all_gather_object(errors, None if error is None else _first_line(error))
    if any(errors):
        return {"status": DOES_NOT_BUILD, "reason": next(e for e in errors if e)}
    dtype = next(model.parameters()).dtype
    tol = test_zoo.tolerance(model_type, str(dtype).removeprefix("torch."))
    result: dict[str, Any] = {"status": FAIL, "dtype": str(dtype).removeprefix("torch.")}
    if "why" in tol:
        result["tolerance"] = tol
    tol = {"rtol": tol["rtol"], "atol": tol["atol"]}
    result["sharded_checkpoint"] = (theirs / "model.safetensors.index.json").exists()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = transformers.AutoModelForCausalLM.from_pretrained(
                theirs, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
            ).eval()
            with torch.no_grad():
                expected = reference(input_ids=ids, use_cache=False).logits
    except Exception as caught:
        return {"status": DOES_NOT_BUILD, "reason": f"from_pretrained: {_first_line(caught)}"}
    problems = []
    with torch.no_grad():
        unloaded = _other_weights(model)(input_ids=ids, use_cache=False).logits
        written = model(input_ids=ids, use_cache=False).logits
    if test_zoo._used(written, expected, tol) > 1:
        # transformers' own round trip differs from the model it wrote, by what no checkpoint
        # holds (a buffer computed in float64 rather than float32, a parameter it builds in
        # float32): torch_tp loads into the model as built, so that model is the reference
        result["reference"] = _why_from_pretrained_differs(model, reference)
        expected = written
    if test_zoo._used(unloaded, expected, tol) <= 1:
        problems.append("harness: other weights give the same logits (the check cannot fail)")
    # 2. and 3. load at TP=2 (plan_for) and EP=2 (expert_parallel_plan)
    plans = {"tp": plan_for}
    result["expert_parallel"] = bool(getattr(model.config, "base_model_ep_plan", None))
    if result["expert_parallel"]:
        plans["ep"] = expert_parallel_plan
    made: dict[str, Any] = {}  # each plan made once (plan_for's shape check costs 0.6 s)

    def plan(name: str) -> dict[str, Any]:
        if name not in made:
            made[name] = plans[name](model)
        return made[name]

    for name in plans:
        found = []
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                logits, read, held = _load_and_run(model, plan(name), theirs, ids)
        except Exception as caught:
            found.append(f"{name} load: {_first_line(caught)}")
        else:
            used = test_zoo._used(logits, expected, tol)
            diff = test_zoo._max_diff(logits, expected)
            result[f"{name}_max_logits_diff"] = float(f"{diff:.2e}")
            result[f"{name}_tolerance_used"] = float(f"{used:.2e}")
            if used > 1:
                found.append(f"{name} logits differ by {diff:.1e}")
            if read != held:
                found.append(f"{name} rank {rank} read {read} elements, holds {held}")
        # the step's outcome: "yes", or what went wrong
        result[f"{name}_load"] = "; ".join(found) or "yes"
        problems += found
    # 4. torch_tp writes the model with weights A at TP=2 (and EP=2)
    for name in plans:
        out = ours.with_name(f"{ours.name}_{name}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                parallel = parallelize_module(copy.deepcopy(model), tp_mesh(), plan(name))
                save_pretrained(parallel, out, max_shard_size=shard)
            saved = compare_saved(out, theirs) if rank == 0 else ""
        except Exception as caught:
            saved = _first_line(caught)
        saved = f"{name} save: {saved}" if saved else ""
        result["save" if name == "tp" else f"{name}_save"] = saved or "yes"
        if saved:
            problems.append(saved)
    if problems:
        result["reason"] = "; ".join(problems)
    else:
        result["status"] = PASS
    for key in ("reason", *STEPS):  # the same text whichever directory the run wrote in
        if key in result:
            result[key] = result[key].replace(root, "<dir>")
    # the largest share of the tolerance a load's logits used (at most 1 to pass)
    shares = [v for k, v in result.items() if k.endswith("_tolerance_used")]
    if shares:
        result["tolerance_used"] = max(shares)
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def _check_many(model_types: list[str], root: str) -> list[dict[str, Any]]:
    """:func:`_check` of several architectures, in one call on every rank."""
    return [_check(model_type, root) for model_type in model_types]


def _merged(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One entry from every rank's: rank 0's, with another rank's problems added (its reads,
    its failures)."""
    entry = dict(ranks[0])
    reasons = [entry.get("reason", "")]
    for other in ranks[1:]:
        for step in STEPS:
            if entry.get(step) == "yes" and other.get(step, "yes") != "yes":
                entry[step] = other[step]
        for part in other.get("reason", "").split("; "):
            if part and part not in "; ".join(reasons):
                reasons.append(part)
        if other["status"] != PASS and entry["status"] == PASS:
            entry["status"] = other["status"]
    reason = "; ".join(r for r in reasons if r)
    if reason:
        entry["reason"] = reason
    return entry


def run(model_types: list[str], root: Path) -> dict[str, dict[str, Any]]:
    """Every architecture of ``model_types`` checked on 2 ranks, :data:`BATCH` per call; a
    batch that fails as a whole (a rank died or hung) is re-run one architecture at a time."""
    from torch_tp.testing import RankError, RankTimeout, run_distributed

    results = {}
    for i in range(0, len(model_types), BATCH):
        batch = model_types[i : i + BATCH]
        try:
            ranks = run_distributed(
                _check_many, WORLD_SIZE, batch, str(root), timeout=TIMEOUT * len(batch)
            )
            for j, model_type in enumerate(batch):
                results[model_type] = _merged([r[j] for r in ranks])
            continue
        except (RankError, RankTimeout):
            pass
        for model_type in batch:
            try:
                ranks = run_distributed(_check, WORLD_SIZE, model_type, str(root), timeout=TIMEOUT)
                results[model_type] = _merged(ranks)
            except RankTimeout:
                results[model_type] = {"status": FAIL, "reason": f"hangs (over {TIMEOUT:.0f} s)"}
            except RankError as error:
                results[model_type] = {"status": FAIL, "reason": test_zoo.rank_error_reason(error)}
    return results


# --------------------------------------------------------------------------- the file


def _load() -> dict[str, Any]:
    if not STATUS_FILE.exists():
        return {}
    return json.loads(STATUS_FILE.read_text())


def _write(results: dict[str, dict[str, Any]]) -> None:
    about = (
        "each architecture of test/test_zoo.py written by transformers' save_pretrained, "
        "loaded by torch_tp.checkpoint.load_pretrained at TP=2 (plan_for) and, where the "
        "config declares one, EP=2 (expert_parallel_plan), logits against transformers' "
        "from_pretrained on one device (tp_/ep_max_logits_diff, tolerance_used: at most 1 "
        "to pass), each rank reading the elements it holds; then written by torch_tp's "
        "save_pretrained at TP=2 (and EP=2) and compared with transformers' files (keys, "
        f"shapes, dtypes, values); written by {UPDATE_ENV}=1 python -m pytest "
        "test/test_zoo_checkpoint.py -m slow"
    )
    test_zoo.write_status(STATUS_FILE, about, results)


def markdown(data: dict[str, Any] | None = None) -> str:
    """The status file as a markdown table: one row per architecture."""
    data = _load() if data is None else data
    counts = data.get("counts", {})
    lines = [
        f"transformers {data.get('transformers')}, torch {data.get('torch')}: "
        f"{counts.get(PASS, 0)} pass, {counts.get(FAIL, 0)} fail, "
        f"{counts.get(DOES_NOT_BUILD, 0)} do not build at tiny size.",
        "",
        "| model_type | status | loads at TP=2 (logits difference) "
        "| loads at EP=2 (logits difference) | saves what transformers saves (TP=2 / EP=2) |",
        "|---|---|---|---|---|",
    ]
    labels = {PASS: "passes", FAIL: "fails", DOES_NOT_BUILD: "does not build"}
    for model_type, entry in data.get("models", {}).items():
        cells = [f"`{model_type}`", labels[entry["status"]]]
        if entry["status"] == DOES_NOT_BUILD:
            cells += [entry.get("reason", ""), "", ""]
        else:
            for step in ("tp", "ep"):
                outcome = entry.get(f"{step}_load", "no EP plan" if step == "ep" else "")
                if outcome == "yes":
                    outcome += f" ({entry[f'{step}_max_logits_diff']:.1e})"
                cells.append(outcome)
            saves = [entry[k] for k in ("save", "ep_save") if k in entry]
            cells.append(" / ".join(saves))
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the tests


def _compare(results: dict[str, dict[str, Any]], complete: bool) -> None:
    data = _load()
    recorded = data.get("models", {})
    if os.environ.get(UPDATE_ENV):
        _write(results if complete else {**recorded, **results})
        return
    import transformers

    changes = []
    names = set(results) | (set(recorded) if complete else set())
    for model_type in sorted(names):
        live, old = results.get(model_type), recorded.get(model_type)
        if live is None:
            changes.append(f"{model_type}: recorded, but no longer in transformers' zoo")
        elif old is None:
            changes.append(f"{model_type}: new, {live['status']} {live.get('reason', '')}")
        else:
            found = test_zoo.differences(live, old, EXACT)
            changes += [f"{model_type}: {change}" for change in found]
    versions = (
        f"recorded with transformers {data.get('transformers')} and torch {data.get('torch')}, "
        f"run with transformers {transformers.__version__} and torch {torch.__version__}"
    )
    assert not changes, (
        f"the zoo's checkpoints differ from {STATUS_FILE.name} ({versions}; if that is what you "
        f"meant, rewrite it with `{UPDATE_ENV}=1 python -m pytest test/test_zoo_checkpoint.py "
        "-m slow`):\n  " + "\n  ".join(changes)
    )


@pytest.mark.slow
def test_zoo_checkpoints_match_status_file(tmp_path):
    pytest.importorskip("transformers")
    chosen = test_zoo.selected()
    _compare(run(chosen, tmp_path), complete=len(chosen) == len(test_zoo.zoo()))


def test_representative_checkpoints_match_status_file(tmp_path):
    """The quick run's share: :data:`QUICK`, against their entries in the status file."""
    pytest.importorskip("transformers")
    _compare(run(list(QUICK), tmp_path), complete=False)


def test_status_file_is_consistent():
    data = _load()
    assert data, f"{STATUS_FILE.name} is missing: the status file is part of the test"
    models = data["models"]
    assert data["counts"] == test_zoo.status_counts(models)
    for model_type, entry in models.items():
        if entry["status"] == PASS:
            assert entry["tolerance_used"] <= 1, model_type
            assert ("ep_tolerance_used" in entry) == entry["expert_parallel"], model_type


def test_compare_saved_names_what_differs(tmp_path):
    from safetensors.torch import save_file

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    save_file({"x": torch.zeros(2, 3), "y": torch.ones(2)}, str(a / "model.safetensors"))
    assert compare_saved(a, a) == ""
    save_file(
        {"x": torch.zeros(3, 2), "y": torch.ones(2, dtype=torch.float64), "z": torch.ones(1)},
        str(b / "model.safetensors"),
    )
    assert compare_saved(b, a) == (
        "torch_tp writes 1 keys transformers does not write (z); 1 other shapes (x: [3, 2], not "
        "[2, 3]); 1 other dtypes (y: F64, not F32)"
    )
    save_file({"x": torch.ones(2, 3), "y": torch.ones(2)}, str(b / "model.safetensors"))
    assert compare_saved(b, a) == "torch_tp writes 1 other values (x)"


def test_markdown_table():
    data = {
        "transformers": "5.0",
        "torch": "2.13",
        "counts": {PASS: 1, FAIL: 1, DOES_NOT_BUILD: 1},
        "models": {
            "llama": {"status": PASS, "tp_load": "yes", "tp_max_logits_diff": 1.2e-15,
                      "save": "yes"},
            "mixtral": {"status": FAIL, "tp_load": "tp load: KeyError: a | b",
                        "ep_load": "yes", "ep_max_logits_diff": 0.0, "save": "yes"},
            "x": {"status": DOES_NOT_BUILD, "reason": "ValueError: c"},
        },
    }  # fmt: skip
    assert markdown(data).splitlines()[-3:] == [
        "| `llama` | passes | yes (1.2e-15) | no EP plan | yes |",
        "| `mixtral` | fails | tp load: KeyError: a \\| b | yes (0.0e+00) | yes |",
        "| `x` | does not build | ValueError: c |  |  |",
    ]


if __name__ == "__main__":
    sys.stdout.write(markdown())
