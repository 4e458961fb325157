"""The shape check (:func:`torch_tp.shapes.check_shapes`) over the transformers zoo.

Every architecture of ``test/test_zoo.py``, built tiny on the meta device, planned by
:func:`~torch_tp.plans.hf.plan_for` (which runs the check itself and refuses a plan that fails
it) and by :func:`~torch_tp.plans.auto.auto`, whose plan is checked here. The parity of those
plans is what ``test/test_zoo.py`` and ``test/test_zoo_auto.py`` test (``zoo_status.json`` and
``zoo_auto_status.json``): the check must agree with them, flagging no plan that matches one
device. Run with ``-s`` to see what it flags, refuses and cannot trace, and with
``TORCH_TP_ZOO_ONLY=llama,gpt_neox`` for a few architectures only.
"""

from __future__ import annotations

import json
import os
import time
import warnings

import pytest
import test_zoo
import torch


def _shape_check(model_type: str) -> dict[str, str]:
    """What the check says of ``model_type``'s two plans: ``"ok"``, ``"flagged: ..."``,
    ``"cannot trace: ..."``, or ``"refused: ..."`` (by the planner, for another reason)."""
    import transformers

    from torch_tp.plans.auto import auto
    from torch_tp.plans.hf import plan_for
    from torch_tp.shapes import ShapeCheckError, check_shapes

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            test_zoo.tiny_config(model_type),
            attn_implementation="eager",
            experts_implementation="eager",
        )
    model.eval()
    ids = {"input_ids": torch.zeros(2, test_zoo.SEQ, dtype=torch.long)}
    result = {}
    for name, make_plan in (("plan_for", plan_for), ("auto", lambda m: auto(m, tp_degree=2))):
        try:
            plan = make_plan(model)
        except ValueError as error:
            kind = "flagged" if "shape" in str(error) else "refused"
            result[name] = f"{kind}: {test_zoo._first_line(error)}"
            continue
        try:
            problems = check_shapes(model, plan, 2, example_inputs=ids)
        except ShapeCheckError as error:
            result[name] = f"cannot trace: {test_zoo._first_line(error)}"
            continue
        result[name] = f"flagged: {problems[0]}" if problems else "ok"
    return result


def _shape_checks(model_types: list[str]) -> dict[str, dict[str, str]]:
    """On each rank: :func:`_shape_check` of every ``world_size``-th architecture, from this
    rank's index (no communication)."""
    import torch.distributed as dist

    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in model_types[dist.get_rank() :: dist.get_world_size()]:
            try:
                results[model_type] = _shape_check(model_type)
            except Exception as error:  # transformers cannot build it on meta
                results[model_type] = {"build": test_zoo._first_line(error)}
    return results


def _selected() -> list[str]:
    """Every architecture, or those named in ``TORCH_TP_ZOO_ONLY`` (comma-separated)."""
    only = os.environ.get("TORCH_TP_ZOO_ONLY")
    return [m for m in test_zoo.zoo() if not only or m in only.split(",")]


@pytest.mark.slow
def test_shape_check_over_the_zoo_agrees_with_parity():
    pytest.importorskip("transformers")
    parity = {
        "plan_for": json.loads(test_zoo.STATUS_FILE.read_text())["models"],
        "auto": json.loads(test_zoo.STATUS_FILE.with_name("zoo_auto_status.json").read_text())[
            "models"
        ],
    }
    from torch_tp.testing import run_distributed

    start = time.perf_counter()
    selected = _selected()
    # single-process work, shared between the two pooled workers (each checks every other
    # architecture) rather than done here while they wait
    results = {}
    for part in run_distributed(
        _shape_checks, 2, selected, timeout=test_zoo.TIMEOUT * max(1, len(selected))
    ):
        results.update(part)
    results = {m: results[m] for m in selected}  # every architecture, once, in order
    seconds = time.perf_counter() - start
    wrong = []
    for planner in ("plan_for", "auto"):
        outcomes = {m: r.get(planner, "") for m, r in results.items()}
        flagged = {m: o for m, o in outcomes.items() if o.startswith("flagged")}
        print(
            f"{planner}: {sum(o == 'ok' for o in outcomes.values())} ok, {len(flagged)} flagged, "
            f"{sum(o.startswith('cannot') for o in outcomes.values())} not traceable, "
            f"{sum(o.startswith('refused') for o in outcomes.values())} refused "
            f"({len(outcomes)} architectures, {seconds:.0f} s for both planners)"
        )
        for model_type, outcome in outcomes.items():
            if outcome != "ok":
                print(f"  {model_type}: {outcome[:200]}")
        # a plan that matches one device is never flagged
        wrong += [
            f"{planner} {m}: {o}"
            for m, o in flagged.items()
            if parity[planner].get(m, {}).get("status") == test_zoo.PASS
        ]
    assert not wrong, "the shape check flags plans that match one device:\n" + "\n".join(wrong)
