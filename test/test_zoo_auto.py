"""The transformers zoo planned by :func:`torch_tp.plans.auto.auto`, at TP=2.

The same architectures, tiny models and checks as ``test/test_zoo.py`` (sharded as the
plan's contracts say, with the parameter bytes per rank the report predicts; logits, loss,
every gradient and 8 greedy and 8 sampled ``generate`` tokens against one device), with the
plan inferred from the model's structure (``auto(model, tp_degree=2)``) instead of
transformers' own. An architecture ``auto`` refuses is recorded as a failure with the
refusal's first line; one it plans must pass. The results live in
``test/zoo_auto_status.json`` (with each architecture's kind, dense or mixture-of-experts,
and what ``auto`` left replicated); the test compares the live results with the file, as
test_zoo does, the kind and the modules left replicated exactly too: an attention ``auto``
stops sharding fails it by its counts and bytes even where the values still match. Rewrite
it with::

    TORCH_TP_ZOO_UPDATE=1 python -m pytest test/test_zoo_auto.py

and render it as a markdown table with ``python test/test_zoo_auto.py``. To work on a few
architectures, name them: ``TORCH_TP_ZOO_ONLY=olmo2,qwen3_next`` runs (and compares, or
rewrites the entries of) those only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import test_zoo
import torch
from test_zoo import DOES_NOT_BUILD, FAIL, PASS, UPDATE_ENV, WORLD_SIZE
from torch import nn

STATUS_FILE = Path(__file__).with_name("zoo_auto_status.json")
TIMEOUT = test_zoo.TIMEOUT
DENSE, MOE = "dense", "moe"
# compared exactly with the recorded values: test_zoo's, the kind, and the modules auto()
# left whole
EXACT = (*test_zoo.EXACT, "kind", "replicated")


def _kind(model: nn.Module) -> str:
    """``"moe"`` where a block holds experts (stacked 3-D weights, or a list named
    ``experts``), else ``"dense"``."""
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in ("experts", "expert"):
            return MOE
        if any(p.ndim == 3 for p in module.parameters(recurse=False)) and "expert" in name:
            return MOE
    return DENSE


def _auto_plan(model: nn.Module) -> dict:
    from torch_tp.plans.auto import auto

    return auto(model, tp_degree=WORLD_SIZE)


def _check(model_type: str) -> dict[str, Any]:
    """test_zoo's check of one architecture, on every rank, with ``auto`` as the plan."""
    import warnings

    result = test_zoo._check(model_type, _auto_plan)
    if result["status"] == DOES_NOT_BUILD:
        return result
    import transformers

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(test_zoo.tiny_config(model_type))
        result["kind"] = _kind(model)
        if result["status"] == PASS:
            _auto_plan(model)  # the modules it leaves replicated, as its warning names them
    replicated = sorted({path for w in caught for path in getattr(w.message, "modules", ())})
    if replicated:
        result["replicated"] = replicated
    return result


# --------------------------------------------------------------------------- the file


def _load() -> dict[str, Any]:
    if not STATUS_FILE.exists():
        return {}
    return json.loads(STATUS_FILE.read_text())


def _counts(models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    counts = test_zoo.status_counts(models)
    for kind in (DENSE, MOE):
        built = [e for e in models.values() if e.get("kind") == kind]
        counts[f"{kind}_pass"] = sum(e["status"] == PASS for e in built)
        counts[f"{kind}_built"] = len(built)
    return counts


def _write(results: dict[str, dict[str, Any]]) -> None:
    about = (
        "torch_tp.plans.auto.auto(model, tp_degree=2) at TP=2 against one device, for "
        "every causal LM of the transformers below that declares a base_model_tp_plan "
        "(the models and checks of test/test_zoo.py); 'replicated' lists the modules "
        f"auto left whole on every rank; written by {UPDATE_ENV}=1 python -m pytest "
        f"test/test_zoo_auto.py. {test_zoo.FIELDS}"
    )
    test_zoo.write_status(STATUS_FILE, about, results, _counts)


def markdown(data: dict[str, Any] | None = None) -> str:
    """The status file as a markdown table: one row per architecture."""
    data = _load() if data is None else data
    counts = data.get("counts", {})
    lines = [
        f"transformers {data.get('transformers')}, torch {data.get('torch')}, TP=2, plan by "
        f"auto(): {counts.get(PASS, 0)} pass, {counts.get(FAIL, 0)} fail, "
        f"{counts.get(DOES_NOT_BUILD, 0)} do not build at tiny size; dense "
        f"{counts.get('dense_pass', 0)}/{counts.get('dense_built', 0)}, MoE "
        f"{counts.get('moe_pass', 0)}/{counts.get('moe_built', 0)}.",
        "",
        "| model_type | kind | status | parameters sharded / replicated / whole "
        "| parameter bytes per rank | max logits / gradient difference, or reason |",
        "|---|---|---|---|---|---|",
    ]
    labels = {PASS: "passes", FAIL: "fails", DOES_NOT_BUILD: "does not build"}
    for model_type, entry in data.get("models", {}).items():
        detail = test_zoo.difference_cell(entry)
        if entry["status"] == PASS and entry.get("replicated"):
            detail += f" (replicated: {', '.join(entry['replicated'])})"
        cells = [f"`{model_type}`", entry.get("kind", ""), labels[entry["status"]]]
        cells += [*test_zoo.sharding_cells(entry), detail]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the tests


@pytest.mark.slow
def test_zoo_auto_matches_status_file():
    pytest.importorskip("transformers")
    from torch_tp.testing import RankError, RankTimeout, run_distributed

    selected = test_zoo.selected()
    results = {}
    for model_type in selected:
        try:
            ranks = run_distributed(_check, WORLD_SIZE, model_type, timeout=TIMEOUT)
            results[model_type] = ranks[0]
        except RankTimeout:
            results[model_type] = {"status": FAIL, "reason": f"hangs (over {TIMEOUT:.0f} s)"}
        except RankError as error:
            results[model_type] = {"status": FAIL, "reason": test_zoo.rank_error_reason(error)}
    data = _load()
    recorded = data.get("models", {})
    if os.environ.get(UPDATE_ENV):
        _write({**recorded, **results} if len(selected) < len(test_zoo.zoo()) else results)
        return
    import transformers

    changes = []
    names = set(results) | (set(recorded) if len(selected) == len(test_zoo.zoo()) else set())
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
        f"the zoo under auto() differs from {STATUS_FILE.name} ({versions}; if that is what "
        f"you meant, rewrite it with `{UPDATE_ENV}=1 python -m pytest test/test_zoo_auto.py`):"
        "\n  " + "\n  ".join(changes)
    )


def test_status_file_is_consistent():
    data = _load()
    assert data, f"{STATUS_FILE.name} is missing: the status file is part of the test"
    assert data["counts"] == _counts(data["models"])
    assert not test_zoo.recorded_problems(data["models"])


def test_markdown_table():
    data = {
        "transformers": "5.0",
        "torch": "2.13",
        "counts": {PASS: 1, FAIL: 1, DOES_NOT_BUILD: 0},
        "models": {
            "llama": {
                "status": PASS,
                "kind": DENSE,
                "replicated": ["model.layers.*.mlp"],
                **test_zoo._SHARDED,
                **test_zoo._DIFFS,
            },
            "x": {"status": FAIL, "kind": MOE, "reason": "ValueError: a | b"},
        },
    }
    assert markdown(data).splitlines()[-2:] == [
        "| `llama` | dense | passes | 16 / 0 / 5 | 83,200 of 165,120 | 1.3e-15 / 2.0e-16 "
        "(replicated: model.layers.*.mlp) |",
        "| `x` | moe | fails |  |  | ValueError: a \\| b |",
    ]


if __name__ == "__main__":
    sys.stdout.write(markdown())
