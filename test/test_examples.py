"""The scripts in examples/ run under torchrun on CPU (gloo), with tiny sizes and few steps.

Starting ranks costs more than the scripts do, so one ``torchrun --standalone`` with 4 ranks
runs all three, one after the other, as ``python script.py args`` would (``runpy`` with
``__name__ == "__main__"``). The process group outlives each script: the driver turns their
final ``destroy_process_group()`` into a no-op and destroys it itself at the end. Then it
leaves without the interpreter's teardown (``os._exit``): torch's own teardown at exit, after
the work is done and every group destroyed, now and then aborts a rank ("terminate called
without an active exception"; about 1 run in 10 here, on torch 2.15.0, as in
``benchmarks/bench_tp.py``'s ranks before they did the same).
"""

from __future__ import annotations

import os
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


@pytest.mark.slow
def test_examples_run_under_torchrun(tmp_path):
    runs = [
        [str(EXAMPLES / "tp_1d.py"), "--steps", "2"],
        [str(EXAMPLES / "fsdp2_tp.py"), "--tp", "2", "--steps", "2", "--checkpointing"],
        [str(EXAMPLES / "checkpoint_round_trip.py"), "--dir", str(tmp_path), "--steps", "1"],
    ]
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER.format(runs=runs)), encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks are on this machine
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=4", str(driver)]
    proc = subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT,
    )
    output = proc.stdout
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


def test_examples_have_a_docstring_with_the_command():
    for script in ("tp_1d.py", "fsdp2_tp.py", "checkpoint_round_trip.py"):
        text = (EXAMPLES / script).read_text(encoding="utf-8")
        assert "torchrun --nproc-per-node" in text and f"examples/{script}" in text, script
