"""The scripts in examples/ run under torchrun on CPU (gloo), with tiny sizes and few steps.

Starting ranks costs more than the scripts do, so one ``torchrun --standalone`` with 4 ranks
runs the first three, one after the other, as ``python script.py args`` would (``runpy`` with
``__name__ == "__main__"``). The process group outlives each script: the driver turns their
final ``destroy_process_group()`` into a no-op and destroys it itself at the end. Then it
leaves without the interpreter's teardown (``os._exit``): torch's own teardown at exit, after
the work is done and every group destroyed, now and then aborts a rank ("terminate called
without an active exception"; about 1 run in 10 here, on torch 2.15.0, as in
``benchmarks/bench_tp.py``'s ranks before they did the same). The 3-D example needs 8 ranks
and runs in a torchrun of its own, through the same driver.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT = 300

DRIVER = """
import os, runpy, sys
import torch.distributed as dist

destroy = dist.destroy_process_group
dist.destroy_process_group = lambda *args, **kwargs: None  # the next script needs the group
for script, *args in {runs!r}:
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    dist.barrier()
    if dist.get_rank() == 0:
        print("finished", script, flush=True)
destroy()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


# A line of a warning: Python's (``UserWarning: ...``, ``FutureWarning: ...``) or the logging
# module's as torch and torchrun print it (``[rank0]:W1125 23:00:03.629000 ...``).
_WARNING_LINE = re.compile(r"\w*Warning: |^(\[rank\d+\]:)?W\d{4} ", re.M)


def _warnings(stderr: str) -> list[str]:
    """The lines of ``stderr`` that are warnings, each once, with how often they came."""
    lines = [line for line in stderr.splitlines() if _WARNING_LINE.search(line)]
    # the same warning from every rank: tell it once, without the rank and the time
    counts: dict[str, int] = {}
    for line in lines:
        key = re.sub(r"^(\[rank\d+\]:)?W\d{4} [\d:.]+ \d+ ", "", line)
        counts[key] = counts.get(key, 0) + 1
    return [f"{n} x {line}" for line, n in counts.items()]


def _torchrun(tmp_path, runs: list[list[str]], nproc: int) -> subprocess.CompletedProcess:
    """Run ``runs`` (each ``[script, *args]``) one after the other in one ``torchrun
    --standalone`` of ``nproc`` ranks, through DRIVER. The examples print no warning: a
    newcomer reads one as a bug (stderr is checked for warning lines)."""
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER.format(runs=runs)), encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks are on this machine
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={nproc}", str(driver)]
    return subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


@pytest.mark.slow
def test_examples_run_under_torchrun(tmp_path):
    runs = [
        [str(EXAMPLES / "tp_1d.py"), "--steps", "2"],
        [str(EXAMPLES / "fsdp2_tp.py"), "--tp", "2", "--steps", "2", "--checkpointing"],
        [str(EXAMPLES / "checkpoint_round_trip.py"), "--dir", str(tmp_path), "--steps", "1"],
    ]
    proc = _torchrun(tmp_path, runs, 4)
    output = proc.stdout + proc.stderr
    expected = [
        "finished " + runs[0][0],
        "finished " + runs[1][0],
        "[dp=2, tp=2] step 0: loss",
        "[dp=1, tp=4] step 1: loss",
        "round trip OK",
        "finished " + runs[2][0],
    ]
    missing = [line for line in expected if line not in output]
    assert proc.returncode == 0 and not missing, (
        f"torchrun exited with {proc.returncode}, missing {missing}:\n{output[-5000:]}"
    )
    assert output.count("step 1: loss") >= 2, output  # tp_1d and fsdp2_tp trained
    assert (tmp_path / "dcp" / "step-1" / ".metadata").is_file()
    assert (tmp_path / "model.safetensors").is_file()
    assert not _warnings(proc.stderr), "\n".join(["the examples warned:", *_warnings(proc.stderr)])


def test_examples_have_a_docstring_with_the_command():
    scripts = ("tp_1d.py", "fsdp2_tp.py", "checkpoint_round_trip.py", "pipeline_3d.py")
    for script in (*scripts, "lora_finetune.py"):
        text = (EXAMPLES / script).read_text(encoding="utf-8")
        assert "torchrun --nproc-per-node" in text and f"examples/{script}" in text, script


@pytest.mark.slow
def test_pipeline_3d_example_trains_like_one_device(tmp_path):
    """examples/pipeline_3d.py under torchrun, 8 ranks as (pp=2, dp=2, tp=2), two steps: the
    losses it prints and the checkpoint it saves, loaded on one device, equal a single-device
    run of the same job (same seed, same global batches, AdamW, clipping at 1.0)."""
    import importlib.util

    import torch

    from torch_tp.checkpoint import load
    from torch_tp.models import Llama, LlamaConfig

    script = EXAMPLES / "pipeline_3d.py"
    sizes = {"dim": 32, "layers": 4, "batch": 4, "seq": 8}
    args = [f"--{k}={v}" for k, v in sizes.items()]
    args += ["--steps=2", "--microbatches=2", f"--checkpoint-dir={tmp_path / 'dcp'}"]
    proc = _torchrun(tmp_path, [[str(script), *args]], 8)
    output = proc.stdout
    assert proc.returncode == 0, (output + proc.stderr)[-5000:]
    assert not _warnings(proc.stderr), "\n".join(["the example warned:", *_warnings(proc.stderr)])
    printed = [
        float(line.split("loss ")[1].split(",")[0])
        for line in output.splitlines()
        if line.startswith("[pp=2, dp=2, tp=2] step ")
    ]
    assert len(printed) == 2, output[-5000:]
    assert (tmp_path / "dcp" / "step-2" / ".metadata").is_file()

    # the same job on one device: the script's own data
    spec = importlib.util.spec_from_file_location("pipeline_3d", script)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    config = LlamaConfig(dim=32, n_layers=4, n_heads=4, max_seq_len=8)
    reference = Llama(config)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    losses = []
    for step in range(2):
        tokens = example.global_batch(step, 2 * sizes["batch"], sizes["seq"], config.vocab_size)
        loss = example.loss_fn(reference(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    torch.testing.assert_close(printed, losses, rtol=1e-5, atol=1e-6)
    torch.manual_seed(5)  # other weights: the load must replace them all
    loaded = Llama(config)
    load(tmp_path / "dcp", loaded, step=2, rng=False)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_lora_example_trains_like_one_device(tmp_path):
    """examples/lora_finetune.py under torchrun, 2 ranks, in both orders (parallelize then
    get_peft_model, and --peft-first): the losses it prints (dropout on) are those of the
    same PEFT model trained on one device, and the adapter it saves is PEFT's files, which
    the script itself loads on one device and checks against the parallel model's logits."""
    import importlib.util

    pytest.importorskip("peft")
    import torch
    from peft import get_peft_model

    script = EXAMPLES / "lora_finetune.py"
    sizes = ["--steps", "3", "--dim", "32", "--batch", "2", "--seq", "8"]
    runs = [
        [str(script), *sizes, "--out", str(tmp_path / "tp-first")],
        [str(script), *sizes, "--peft-first", "--out", str(tmp_path / "peft-first")],
    ]
    proc = _torchrun(tmp_path, runs, 2)
    output = proc.stdout
    assert proc.returncode == 0, (output + proc.stderr)[-5000:]
    assert not _warnings(proc.stderr), "\n".join(["the example warned:", *_warnings(proc.stderr)])
    assert output.count("loaded on one device, it gives the same logits") == 2, output[-5000:]
    for order in ("tp-first", "peft-first"):
        files = sorted(p.name for p in (tmp_path / order).iterdir())
        assert files == ["README.md", "adapter_config.json", "adapter_model.safetensors"], files
    printed = [
        float(line.split("loss ")[1].split(",")[0])
        for line in output.splitlines()
        if line.startswith("step ")
    ]
    assert len(printed) == 6, output[-5000:]

    # the same job on one device, with the script's own model and adapter configuration
    spec = importlib.util.spec_from_file_location("lora_finetune", script)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.parse(sizes)
    model = get_peft_model(example.base_model(args, "cpu"), example.lora_config())
    torch.manual_seed(1)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    model.train()
    losses = []
    for _ in range(args.steps):
        tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # printed with 6 decimals
    torch.testing.assert_close(printed, losses + losses, rtol=0, atol=2e-6)
