"""Hugging Face checkpoint directories in and out (``torch_tp.checkpoint.load_pretrained``,
``save_pretrained``): transformers' Llama, GPT-2 (tied embeddings, packed ``c_attn``),
Qwen3-MoE (per-expert checkpoint keys, stacked experts in the model) and Mixtral (the Hub's
``block_sparse_moe.experts.<e>.w1/w2/w3``, renamed and merged by transformers' conversion
mapping), at TP=2, EP=2 and FSDP2 x TP, against the single-device model, with the bytes each
rank reads counted; damaged Hub checkpoints refused on every rank by file and key."""

from __future__ import annotations

import pytest
import torch
from helpers import safetensors_reads, tp_mesh

transformers = pytest.importorskip("transformers")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from torch_tp import parallelize_module  # noqa: E402
from torch_tp.checkpoint import (  # noqa: E402
    CheckpointError,
    full_state_dict,
    load_pretrained,
    save_pretrained,
)
from torch_tp.plans.hf import expert_parallel_plan, plan_for  # noqa: E402
from torch_tp.testing import device_type, run_distributed  # noqa: E402

SHARD = 40_000  # bytes: several files


def _model(family: str, seed: int = 0):
    common = {"vocab_size": 64, "attn_implementation": "eager"}
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, **common)
    elif family == "llama":
        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False, **common,
        )  # fmt: skip
    elif family == "mixtral":
        config = transformers.MixtralConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            tie_word_embeddings=False, **common,
        )  # fmt: skip
    else:
        config = transformers.Qwen3MoeConfig(
            hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
            tie_word_embeddings=False, **common,
        )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _saved(family: str, path: str) -> dict[str, torch.Tensor]:
    model = _model(family)
    model.save_pretrained(path, max_shard_size=SHARD)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _load(
    family: str, path: str, fsdp: bool, ep: bool = False, sp: bool = False
) -> tuple[dict, dict]:
    """The model with other weights, parallelized, loaded from ``path``: its full state
    dict, and the elements each tensor's reads took on this rank."""
    model = _model(family, seed=1)
    if sp:  # the norms replicated DTensors, the routers too
        parallelize_module(model, tp_mesh(), plan_for(model, sequence_parallel=True))
    elif ep:
        parallelize_module(model, tp_mesh(), expert_parallel_plan(model))
    elif fsdp:
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan_for(model))
        for block in model.model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        parallelize_module(model, tp_mesh(), plan_for(model))
    # this rank's elements of every tensor the checkpoint holds once (tied weights once)
    mine = {
        id(v): (v.to_local() if hasattr(v, "to_local") else v).numel()
        for v in model.state_dict(keep_vars=True).values()
    }
    with safetensors_reads() as reads:
        load_pretrained(model, path)
    return full_state_dict(model), {k: sum(v) for k, v in reads.items()}, sum(mine.values())


@pytest.mark.parametrize(
    ("family", "ep", "sp"),
    [
        ("llama", False, False),
        pytest.param("gpt2", False, False, marks=pytest.mark.slow),
        pytest.param("moe", False, False, marks=pytest.mark.slow),
        ("mixtral", False, False),
        pytest.param("mixtral", True, False, marks=pytest.mark.slow),
        pytest.param("mixtral", False, True, marks=pytest.mark.slow),
    ],
    ids=["llama", "gpt2", "moe", "mixtral", "mixtral-ep", "mixtral-sp"],
)
def test_load_pretrained_reads_each_ranks_slices(family, ep, sp, tmp_path):
    expected = _saved(family, str(tmp_path))
    results = run_distributed(_load, 2, family, str(tmp_path), False, ep, sp)
    for state, reads, mine in results:
        assert sorted(state) == sorted(expected)
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
        # each rank read exactly its slices: the sharded tensors' halves, the others whole
        assert sum(reads.values()) == mine
        assert mine < 0.8 * sum(v.numel() for v in expected.values())
    if family == "moe":  # each rank: half the rows of every expert's gate, up and down
        expert = "model.layers.0.mlp.experts.1.gate_proj.weight"
        assert results[0][1][expert] == 16 * 32 // 2
    if family == "mixtral":
        reads = results[1][1]
        w1 = "model.layers.0.block_sparse_moe.experts.{}.w1.weight"
        if ep:  # rank 1 holds experts 2 and 3, whole, and reads nothing of the others
            assert reads[w1.format(3)] == 64 * 32 and w1.format(1) not in reads
        else:  # half the rows of every expert's w1 (gate) and w3 (up), half w2's columns
            assert reads[w1.format(1)] == reads[w1.replace("w1", "w2").format(0)] == 64 * 32 // 2


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_load_pretrained_into_fsdp2_and_tp(family, tmp_path):
    expected = _saved(family, str(tmp_path))
    for state, reads, mine in run_distributed(_load, 4, family, str(tmp_path), True):
        assert sum(reads.values()) == mine
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


def _refused(path: str, family: str = "llama") -> str:
    model = _model(family, seed=1)
    parallelize_module(model, tp_mesh(), plan_for(model))
    before = full_state_dict(model)
    with pytest.raises(CheckpointError) as error:
        load_pretrained(model, path)
    after = full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing changed
    return str(error.value)


def test_a_renamed_key_is_refused_by_name_and_nothing_changes(tmp_path):
    from safetensors.torch import load_file, save_file

    _saved("llama", str(tmp_path))
    for path in tmp_path.glob("model-*.safetensors"):
        state = load_file(str(path))
        if "model.norm.weight" in state:
            state["model.final_norm.weight"] = state.pop("model.norm.weight")
            save_file(state, str(path), metadata={"format": "pt"})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(index.read_text().replace("model.norm.weight", "model.final_norm.weight"))
    for message in run_distributed(_refused, 2, str(tmp_path)):
        assert "'model.norm.weight'" in message and "'model.final_norm.weight'" in message


def _save(family: str, path: str, fsdp: bool) -> None:
    model = _model(family)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan_for(model))
        fully_shard(model, mesh=mesh["dp"])
    else:
        parallelize_module(model, tp_mesh(), plan_for(model))
    save_pretrained(model, path, max_shard_size=SHARD)


def _headers(directory) -> dict[str, tuple]:
    """Every key of a checkpoint directory's safetensors files: its shape and dtype."""
    from safetensors import safe_open

    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as file:
            for key in file.keys():
                found[key] = (
                    tuple(file.get_slice(key).get_shape()),
                    file.get_slice(key).get_dtype(),
                )
    return found


@pytest.mark.parametrize(
    ("family", "world_size"),
    [
        ("llama", 2),
        pytest.param("gpt2", 2, marks=pytest.mark.slow),
        pytest.param("moe", 2, marks=pytest.mark.slow),
        ("mixtral", 2),
        pytest.param("llama", 4, marks=pytest.mark.slow),
    ],
)
def test_save_pretrained_loads_with_from_pretrained(family, world_size, tmp_path):
    run_distributed(_save, world_size, family, str(tmp_path / "out"), world_size == 4)
    # the keys, shapes and dtypes transformers' own save_pretrained writes
    _model(family).save_pretrained(tmp_path / "theirs", max_shard_size=SHARD)
    ours, theirs = _headers(tmp_path / "out"), _headers(tmp_path / "theirs")
    assert ours == theirs, sorted(set(ours.items()) ^ set(theirs.items()))
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "config.json" in files and not (tmp_path / "out.partial").exists()
    if family != "gpt2":
        assert "model.safetensors.index.json" in files  # several shards
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), attn_implementation="eager"
    ).eval()
    expected = _model(family)
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0, msg=name)
    ids = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(loaded(ids).logits, expected(ids).logits, rtol=0, atol=0)


def test_max_shard_size_reads_transformers_sizes_and_refuses_others(tmp_path):
    from transformers.utils.hub import convert_file_size_to_int

    from torch_tp.checkpoint.hf import _shard_bytes

    for size in ("5GB", "100KB", "5GiB", "500MB", "3MiB", "7KiB", "8Mb", "2gb", 12345):
        assert _shard_bytes(size) == convert_file_size_to_int(size), size
    model = _model("llama")
    for bad in ("5 gigabytes", "1.5GB", "GB", -1, 0, True, 5.0, None):
        with pytest.raises(ValueError, match="max_shard_size"):
            save_pretrained(model, tmp_path / "out", max_shard_size=bad)
    assert list(tmp_path.iterdir()) == []  # nothing written
    save_pretrained(model, tmp_path / "out", max_shard_size="40KB")  # several files
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1


def test_a_pickle_only_directory_is_refused_naming_the_file(tmp_path):
    model = _model("llama")  # as transformers 4 wrote it with safe_serialization=False
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    found = ["pytorch_model.bin"]
    with pytest.raises(CheckpointError) as info:
        load_pretrained(_model("llama", seed=1), tmp_path)
    message = str(info.value)
    assert repr(str(tmp_path / found[0])) in message, message
    assert "save_pretrained(" in message and "safe_serialization=True" in message, message


def test_save_pretrained_replaces_a_checkpoint_and_leaves_nothing_beside(tmp_path):
    out = tmp_path / "out"
    save_pretrained(_model("llama"), out)
    save_pretrained(_model("llama", seed=1), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    model = _model("llama")
    load_pretrained(model, out)
    for name, value in _model("llama", seed=1).state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0, msg=name)


def _save_in_model_layout(path: str) -> None:
    model = _model("mixtral")
    parallelize_module(model, tp_mesh(), plan_for(model))
    save_pretrained(model, path, layout="model")


def test_save_pretrained_in_the_models_own_layout(tmp_path):
    run_distributed(_save_in_model_layout, 2, str(tmp_path / "out"))
    expected = _model("mixtral")
    assert set(_headers(tmp_path / "out")) == set(expected.state_dict())  # stacked experts
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="layout must be one of 'transformers', 'model'"):
        save_pretrained(expected, tmp_path / "other", layout="hub")
    assert not (tmp_path / "other").exists()


def _damage(directory, change: str) -> None:
    """One kind of damage to a Mixtral checkpoint as transformers writes it (several files)."""
    import json

    from safetensors.torch import load_file, save_file

    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    key = "model.layers.1.block_sparse_moe.experts.{}.{}.weight"
    target = key.format(1 if change == "missing" else 2, "w3")
    path = directory / index["weight_map"][target]
    if change == "truncated":
        path.write_bytes(path.read_bytes()[:-64])
        return
    state = load_file(str(path))
    if change == "missing":
        del state[target], index["weight_map"][target]
        index_path.write_text(json.dumps(index))
    elif change == "misshaped":
        state[target] = state[target][:-1]
    elif change == "typed":
        state[target] = state[target].half()
    elif change == "unlisted":  # the index lists a key no file holds
        index["weight_map"]["model.layers.1.block_sparse_moe.experts.9.w3.weight"] = path.name
        index_path.write_text(json.dumps(index))
        return
    save_file(state, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            "missing",
            r"'\.experts\.\*\.w3\.weight' keys are numbered \[0, 2, 3\], not 0 to 2: "
            r"'model\.layers\.1\.block_sparse_moe\.experts\.1\.w3\.weight' missing",
        ),
        (
            "misshaped",
            r"must have one shape: .*experts\.2\.w3\.weight' \(model-\d+-of-\d+\.safetensors\) "
            r"has \[63, 32\], the others \[64, 32\]",
        ),
        (
            "typed",
            r"must have one dtype: .*experts\.2\.w3\.weight' \(model-\d+-of-\d+\.safetensors\) "
            r"has torch\.float16, the others torch\.float32",
        ),
        ("truncated", "is not a readable safetensors file"),
        ("unlisted", r"lists key\(s\) its files do not hold: 'model\.layers\.1\.block_sparse_moe"),
    ],
    ids=["missing", "misshaped", "typed", "truncated", "unlisted"],
)
def test_a_damaged_hub_checkpoint_is_refused_on_every_rank(change, expected, tmp_path):
    import re

    _model("mixtral").save_pretrained(tmp_path, max_shard_size=SHARD)
    _damage(tmp_path, change)
    for message in run_distributed(_refused, 2, str(tmp_path), "mixtral"):
        assert re.search(expected, message, re.S), message
        if change in ("misshaped", "typed"):  # the key, its file, the conversion
            assert re.search(r"experts\.2\.w3\.weight' \(model-\d+-of-\d+\.safetensors\)", message)
            assert "WeightConverter(['.experts.*.w1.weight', '.experts.*.w3.weight']" in message
        if change == "truncated":
            assert "model-0000" in message, message


def test_a_loaded_model_is_saved_in_its_checkpoints_layout_as_transformers_does(tmp_path):
    hub, stacked = tmp_path / "hub", tmp_path / "stacked"
    _model("mixtral").save_pretrained(hub)  # per-expert keys
    save_pretrained(_model("mixtral"), stacked, layout="model")  # the model's stacked names
    for source in (hub, stacked):
        ours = _model("mixtral", seed=1)
        load_pretrained(ours, source)
        save_pretrained(ours, tmp_path / f"ours_{source.name}")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(source))
        theirs.save_pretrained(tmp_path / f"theirs_{source.name}")
        written = _headers(tmp_path / f"ours_{source.name}")
        assert written == _headers(tmp_path / f"theirs_{source.name}") == _headers(source)
    fresh = _model("mixtral")
    save_pretrained(fresh, tmp_path / "fresh")
    assert not hasattr(fresh, "_weight_conversions")  # chosen for the save only


def _file_backed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory lies in a mapping of a ``.safetensors`` file."""
    pointer = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(".safetensors"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= pointer < end:
                    return True
    return False


def _load_mapped(path: str, dtype: torch.dtype) -> tuple[dict, set, dict]:
    """Load into a TP model with ``mmap=True`` and take an SGD step: the full state dict,
    the parameters backed by the checkpoint's files (on this rank), and the full state dict
    after the step, beside the same step after a load that copies."""
    from torch.distributed.tensor import DTensor

    from torch_tp import _torch_compat as compat

    states, mapped = [], set()
    for mmap in (True, False):
        model = _model("llama", seed=1).to(dtype)
        parallelize_module(model, tp_mesh(), plan_for(model))
        load_pretrained(model, path, mmap=mmap)
        if mmap:
            loaded = {k: v.clone() for k, v in full_state_dict(model).items()}
            for name, p in model.named_parameters():
                if _file_backed(compat.local_tensor(p) if isinstance(p, DTensor) else p):
                    mapped.add(name)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model(torch.arange(16).view(2, 8)).logits.square().mean().backward()
        optimizer.step()
        states.append(full_state_dict(model))
    torch.testing.assert_close(states[0], states[1], rtol=0, atol=0)
    return loaded, mapped, states[0]


def _replace_mapped(path: str) -> tuple[dict, dict]:
    """Load with ``mmap=True``, then save the model over the directory it maps (the old
    files are unlinked under the mapping): the model's state dict after, and a fresh load
    of what was written."""
    model = _model("llama", seed=1)
    parallelize_module(model, tp_mesh(), plan_for(model))
    load_pretrained(model, path, mmap=True)
    save_pretrained(model, path, max_shard_size=SHARD)
    after = full_state_dict(model)
    again = _model("llama", seed=2)
    parallelize_module(again, tp_mesh(), plan_for(again))
    load_pretrained(again, path)
    return after, full_state_dict(again)


def _bytes(path) -> dict:
    return {f.name: f.read_bytes() for f in sorted(path.glob("*.safetensors"))}


def test_load_pretrained_mmap_maps_the_files_copy_on_write(tmp_path):
    """``mmap=True``: each tensor a rank holds as one range of its file (q, k, v, gate and up
    rows, the replicated norms, the embedding's and head's rows) is a view of the file,
    mapped; row-parallel shards (columns) are copied; the values are the checkpoint's, an
    optimizer step matches the one after a copying load, and the files are not written. A
    model of another dtype than the checkpoint's maps nothing. ``save_pretrained`` may
    replace the directory a model maps: the model keeps its values."""
    expected = _saved("llama", str(tmp_path))
    files = _bytes(tmp_path)
    rowwise = ("o_proj", "down_proj")
    rows = {n for n in expected if not any(r in n for r in rowwise)}
    for loaded, mapped, _ in run_distributed(_load_mapped, 2, str(tmp_path), torch.float32):
        for name, value in expected.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
        assert mapped == rows
    assert _bytes(tmp_path) == files  # copy-on-write: the step changed no file
    for loaded, mapped, _ in run_distributed(_load_mapped, 2, str(tmp_path), torch.bfloat16):
        assert mapped == set()
        for name, value in expected.items():
            torch.testing.assert_close(loaded[name], value.to(torch.bfloat16), msg=name)
    for after, again in run_distributed(_replace_mapped, 2, str(tmp_path)):
        torch.testing.assert_close(after, expected, rtol=0, atol=0)
        torch.testing.assert_close(again, expected, rtol=0, atol=0)


def _load_swapping(path: str) -> list[str]:
    """Load into a TP model while holding a view of one parameter's memory: the view's
    parameter is copied into (the view sees the loaded values), the others take the staged
    buffers as their memory (no second copy); every value is the checkpoint's."""
    from torch.distributed.tensor import DTensor

    from torch_tp import _torch_compat as compat

    def memory(p):
        return compat.local_tensor(p) if isinstance(p, DTensor) else p

    model = _model("llama", seed=1)
    parallelize_module(model, tp_mesh(), plan_for(model))
    params = dict(model.named_parameters())
    before = {n: memory(p).data_ptr() for n, p in params.items()}
    held = memory(params["model.norm.weight"]).detach().view(-1)
    load_pretrained(model, path)
    torch.testing.assert_close(held, memory(params["model.norm.weight"]).view(-1))
    moved = [n for n, p in params.items() if memory(p).data_ptr() != before[n]]
    assert "model.norm.weight" not in moved
    return moved


def test_load_pretrained_hands_its_buffers_to_the_model(tmp_path):
    expected = _saved("llama", str(tmp_path))
    for moved in run_distributed(_load_swapping, 2, str(tmp_path)):
        assert len(moved) == len(expected) - 1, moved
    # the values are the checkpoint's: test_load_pretrained_reads_each_ranks_slices
