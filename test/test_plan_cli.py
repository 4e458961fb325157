"""``python -m torch_tp plan``: a transformers model from its files, and a reader that stops early.

The report's own contents are tested in test_report.py; here, what the command line adds:
``--model`` taking a transformers ``config.json`` or checkpoint directory (built on the meta
device from the configuration alone, never downloaded), and ``plan ... | head`` ending quietly.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torch_tp.__main__ import main as cli

ROOT = Path(__file__).resolve().parents[1]


def _tiny_llama_dir(path: Path) -> Path:
    """A transformers checkpoint directory holding only the config.json of a tiny Llama."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    config.save_pretrained(path)
    return path


def test_plan_takes_a_transformers_checkpoint_directory(tmp_path, capsys):
    directory = _tiny_llama_dir(tmp_path / "tiny-llama")
    # the model's own plan (plan_for) by default
    status = cli(["plan", "--model", str(directory), "--tp", "2", "--seq-len", "16"])
    out, err = capsys.readouterr()
    assert status == 0, err + out
    assert out.startswith("Plan report: LlamaForCausalLM, 90.43K parameters, TP degree 2"), out
    assert re.search(r'model\.layers\.\*\.self_attn\.q_proj +2 +"colwise"', out), out
    assert re.search(r'lm_head +1 +"colwise_gather_output"', out), out
    assert "Problems\n  none found" in out, out
    assert sorted(p.name for p in directory.iterdir()) == ["config.json"]  # nothing written


@pytest.mark.slow  # a second report of the same model
def test_plan_takes_a_transformers_config_json_under_auto(tmp_path, capsys):
    config = _tiny_llama_dir(tmp_path / "tiny-llama") / "config.json"
    status = cli(["plan", "--model", str(config), "--plan", "auto", "--tp", "2", "--seq-len", "16"])
    out, err = capsys.readouterr()
    assert status == 0, err + out
    assert out.startswith("Plan report: LlamaForCausalLM"), out
    assert "AttentionHeads(" in out and "Problems\n  none found" in out, out


def test_plan_model_path_errors_name_the_path(tmp_path, capsys):
    status = cli(["plan", "--model", str(tmp_path), "--tp", "2"])  # no config.json in it
    _, err = capsys.readouterr()
    assert status == 2 and f"{tmp_path} has no config.json" in err, err
    missing = tmp_path / "missing" / "config.json"
    status = cli(["plan", "--model", str(missing), "--tp", "2"])
    _, err = capsys.readouterr()
    assert status == 2 and f"no such file: {missing}" in err, err
    assert "Traceback" not in err


@pytest.mark.slow  # imports T5
def test_a_family_without_a_causal_lm_head_is_built_as_its_base_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    from torch_tp.cli.plan import _build_model

    transformers.T5Config(
        d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, vocab_size=64
    ).save_pretrained(tmp_path)
    model = _build_model(str(tmp_path), 16)
    assert type(model).__name__ == "T5Model"
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.slow  # a process of its own
def test_plan_into_a_closed_pipe_exits_quietly(tmp_path):
    """``python -m torch_tp plan ... | head``: the reader closes the pipe before the report is
    written. No traceback; the report's own exit status (0: no problem found)."""
    directory = _tiny_llama_dir(tmp_path / "tiny-llama")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [sys.executable, "-m", "torch_tp", "plan", "--model", str(directory), "--tp", "2"]
    command += ["--seq-len", "16"]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()  # as `head` does once it has its lines, here before the first
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 0, stderr
    assert stderr == "", stderr
