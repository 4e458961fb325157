"""Hugging Face directories that are damaged, hostile or replaced while being read
(``torch_tp.checkpoint.load_pretrained``, 2 ranks, transformers' Llama at TP=2): each is read
exactly or refused with ``CheckpointError`` naming the file and key, on every rank, with the
model unchanged (every tensor compared with a copy taken before). A key held by two files, an
index entry leaving the directory, a FIFO for a shard, every malformed index, ranks reading
different checkpoints, a directory replaced mid-load; ``model.safetensors`` beside an index
loads what transformers' ``from_pretrained`` loads; lossy conversions warn."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers import tp_mesh

transformers = pytest.importorskip("transformers")

from test_hf_checkpoint import SHARD, _model  # noqa: E402

from torch_tp import parallelize_module  # noqa: E402
from torch_tp.checkpoint import CheckpointError, full_state_dict, load_pretrained  # noqa: E402
from torch_tp.plans.hf import plan_for  # noqa: E402
from torch_tp.testing import run_distributed  # noqa: E402

INDEX = "model.safetensors.index.json"
EMBED = "model.embed_tokens.weight"


def _saved(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A sharded Llama checkpoint as transformers writes it; its state dict."""
    model = _model("llama", seed=seed)
    model.save_pretrained(path, max_shard_size=SHARD)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _parallel(seed: int = 1):
    model = _model("llama", seed=seed)
    parallelize_module(model, tp_mesh(), plan_for(model))
    return model


def _refused(path: str, mmap: bool = False) -> str:
    """Load ``path`` on every rank: it must raise ``CheckpointError``, leaving every tensor as
    it was. The message."""
    model = _parallel()
    before = {k: v.clone() for k, v in full_state_dict(model).items()}
    with pytest.raises(CheckpointError) as error:
        load_pretrained(model, path, mmap=mmap)
    after = full_state_dict(model)
    assert sorted(after) == sorted(before)
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    return str(error.value)


def _loaded(path: str, mmap: bool = False) -> dict[str, torch.Tensor]:
    model = _parallel()
    load_pretrained(model, path, mmap=mmap)
    return {k: v.clone() for k, v in full_state_dict(model).items()}


def _index(path: Path) -> dict:
    return json.loads((path / INDEX).read_text())


def _file_of(path: Path, key: str) -> Path:
    return path / _index(path)["weight_map"][key]


def _rewrite(file: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(file))
    change(state)
    save_file(state, str(file), metadata={"format": "pt"})


# ------------------------------------------------------------------ a key in two files


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "copy"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.float16], ids=["int32", "float16"])
def test_a_key_in_two_files_with_another_dtype_is_refused(dtype, mmap, tmp_path):
    """The file the index names holds the embedding in another dtype, a later file the
    float32 original: on main the headers' dtype came from the later file, the bytes from
    the index's (an int32 copy mapped as float32 garbage)."""
    _saved(tmp_path)
    named = _file_of(tmp_path, EMBED)
    last = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    assert named != last
    original = {}

    def cast(state):
        original[EMBED] = state[EMBED].clone()
        state[EMBED] = (state[EMBED] * 1000).to(dtype)

    _rewrite(named, cast)
    _rewrite(last, lambda state: state.update(original))
    for message in run_distributed(_refused, 2, str(tmp_path), mmap):
        assert f"'{EMBED}'" in message, message
        assert named.name in message and last.name in message, message
        assert str(dtype) in message and "torch.float32" in message, message


def test_a_key_in_two_files_with_another_shape_is_refused(tmp_path):
    _saved(tmp_path)
    named = _file_of(tmp_path, EMBED)
    last = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    original = {}

    def shorten(state):
        original[EMBED] = state[EMBED].clone()
        state[EMBED] = state[EMBED][:-1].clone()

    _rewrite(named, shorten)
    _rewrite(last, lambda state: state.update(original))
    for message in run_distributed(_refused, 2, str(tmp_path)):
        assert f"'{EMBED}'" in message and named.name in message and last.name in message
        assert "[63, 32]" in message and "[64, 32]" in message, message


# ------------------------------------------------------------------ what the index names


def test_a_fifo_for_a_shard_is_refused_not_waited_on(tmp_path):
    """A FIFO blocks ``open()`` until someone writes to it: on main every rank waited there
    (the harness's timeout ends it; a test that fails, not one that hangs)."""
    _saved(tmp_path / "sharded")
    fifo = _file_of(tmp_path / "sharded", EMBED)
    fifo.unlink()
    os.mkfifo(fifo)
    for message in run_distributed(_refused, 2, str(tmp_path / "sharded"), timeout=60):
        assert fifo.name in message and "not a regular file" in message, message
    single = tmp_path / "single"
    _model("llama").save_pretrained(single)
    (single / "model.safetensors").unlink()
    os.mkfifo(single / "model.safetensors")
    for message in run_distributed(_refused, 2, str(single), timeout=60):
        assert "model.safetensors" in message and "not a regular file" in message, message


def _point_outside(checkpoint: Path, elsewhere: Path, absolute: bool) -> tuple[str, list[str]]:
    """Move the embedding's file out of ``checkpoint`` and point the index at it there."""
    index = _index(checkpoint)
    name = index["weight_map"][EMBED]
    elsewhere.mkdir()
    shutil.move(checkpoint / name, elsewhere / name)
    entry = str(elsewhere / name) if absolute else f"../{elsewhere.name}/{name}"
    keys = sorted(k for k, v in index["weight_map"].items() if v == name)
    index["weight_map"].update(dict.fromkeys(keys, entry))
    (checkpoint / INDEX).write_text(json.dumps(index))
    return entry, keys


def _hub_cache(source: Path, cache: Path) -> Path:
    """``source`` laid out as the Hub's cache holds it: each file in ``blobs/`` under its
    hash, the snapshot's entries symlinks ``../../blobs/<hash>``. The snapshot's path."""
    import hashlib

    snapshot = cache / "models--org--tiny" / "snapshots" / ("0" * 40)
    blobs = cache / "models--org--tiny" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in source.iterdir():
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, blobs / digest)
        (snapshot / file.name).symlink_to(f"../../blobs/{digest}")
    return snapshot


@pytest.mark.parametrize("absolute", [False, True], ids=["dotdot", "absolute"])
def test_index_entries_outside_the_directory_are_refused_cache_symlinks_load(absolute, tmp_path):
    expected = _saved(tmp_path / "good")
    snapshot = _hub_cache(tmp_path / "good", tmp_path / "cache")
    for state in run_distributed(_loaded, 2, str(snapshot), True):
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    hostile = tmp_path / "hostile"
    shutil.copytree(tmp_path / "good", hostile)
    entry, keys = _point_outside(hostile, tmp_path / "outside", absolute)
    for message in run_distributed(_refused, 2, str(hostile)):
        assert INDEX in message and repr(entry) in message, message
        assert f"'{EMBED}'" in message and "outside the directory" in message, message


def test_model_safetensors_beside_an_index_loads_what_transformers_loads(tmp_path):
    """transformers 5.23's ``from_pretrained`` looks for ``model.safetensors`` first and reads
    the index only without it; so does ``load_pretrained``."""
    _saved(tmp_path, seed=0)  # the shards and their index
    single = tmp_path / "single"
    _model("llama", seed=2).save_pretrained(single)  # another model, in one file
    shutil.move(single / "model.safetensors", tmp_path / "model.safetensors")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).state_dict()
    assert not torch.equal(theirs[EMBED], _model("llama", seed=0).state_dict()[EMBED])
    for state in run_distributed(_loaded, 2, str(tmp_path)):
        for name, value in theirs.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"weight_map": ["a", "b"]}', "'weight_map' is a list"),
        ('{"weight_map": null}', "'weight_map' is null"),
        ('[{"weight_map": {}}]', "is a list, not an object"),
        ('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested"),
        ('{"weight_map": {"model.norm.weight": 3}}', "'model.norm.weight' -> 3"),
    ],
    ids=["list", "null", "top-level-list", "deeply-nested", "number"],
)
def test_a_malformed_index_is_refused_naming_it(text, expected, tmp_path):
    _saved(tmp_path)
    (tmp_path / INDEX).write_text(text)
    for message in run_distributed(_refused, 2, str(tmp_path)):
        assert INDEX in message and expected in message, message


# ------------------------------------------------------------------ conversions


def _load_warned(path: str) -> tuple[list[str], dict]:
    model = _parallel()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        load_pretrained(model, path)
    messages = [str(w.message) for w in record if "loss of precision" in str(w.message)]
    return messages, {k: v.clone() for k, v in full_state_dict(model).items()}


def test_a_lossy_conversion_warns_and_a_lossless_one_does_not(tmp_path):
    """int32 (integers past 2**24) into float32 warns as float32 into bfloat16 does; int16
    into float32 (every value exact) does not."""
    _saved(tmp_path)
    norm = "model.norm.weight"
    _rewrite(_file_of(tmp_path, EMBED), lambda s: s.update({EMBED: s[EMBED].mul(1e8).int()}))
    _rewrite(_file_of(tmp_path, norm), lambda s: s.update({norm: s[norm].mul(1e3).short()}))
    for messages, _ in run_distributed(_load_warned, 2, str(tmp_path)):
        assert len(messages) == 1, messages
        assert f"{EMBED} (torch.int32 to torch.float32)" in messages[0], messages
        assert norm not in messages[0], messages


# ------------------------------------------------------------------ replaced directories


def _publish(new: str, final: Path) -> None:
    """Publish a copy of ``new`` as ``final`` in the steps ``save_pretrained`` takes: whole
    beside it, the old one moved aside, the new one renamed in, the old one deleted."""
    partial, old = final.with_name(final.name + ".partial"), final.with_name(final.name + ".old")
    shutil.copytree(new, partial)
    os.rename(final, old)
    os.rename(partial, final)
    shutil.rmtree(old)


def _load_while_replaced(path: str, new: str, headers: int) -> dict[str, torch.Tensor] | str:
    """Load ``path`` (one tensor at a time) while a new checkpoint (``new``) is published
    over it as ``save_pretrained`` publishes one (:func:`_publish`). Rank 0 publishes when
    it opens a file for its second tensor, after reading the first; rank 1 waits for that
    before reading its first. The full state dict after the load, or the error's message."""
    import safetensors
    import torch.distributed as dist

    import torch_tp.checkpoint.hf as hf

    real_open, readers = safetensors.safe_open, hf._READERS
    final = Path(path)
    published = final.with_name("published")
    opened = [0]

    def opening(*args, **kwargs):
        opened[0] += 1  # the files' headers first, then one open per tensor read
        if dist.get_rank() == 0 and opened[0] == headers + 2:
            _publish(new, final)
            published.touch()
        if dist.get_rank() == 1 and opened[0] == headers + 1:
            for _ in range(300):  # a rank 0 that fails first leaves this wait in 30 s
                if published.exists():
                    break
                time.sleep(0.1)
        return real_open(*args, **kwargs)

    model = _parallel()
    before = {k: v.clone() for k, v in full_state_dict(model).items()}
    safetensors.safe_open, hf._READERS = opening, 1
    try:
        load_pretrained(model, path)
    except CheckpointError as exc:
        after_state = full_state_dict(model)
        for name, value in before.items():
            assert torch.equal(after_state[name], value), name
        return str(exc)
    finally:
        safetensors.safe_open, hf._READERS = real_open, readers
    return {k: v.clone() for k, v in full_state_dict(model).items()}


def test_a_directory_replaced_while_loading_is_read_whole_or_refused(tmp_path):
    """The directory is replaced by a publish between two tensors' reads: each rank reads
    the version it opened, whole: the old one (a rank slow enough to open the new one would
    be refused, with its peer). On main each file was opened again by path for each
    tensor: every rank returned a mix of the two (rank 0's first tensor old, the rest new)."""
    old = _saved(tmp_path / "latest", seed=0)
    new = _saved(tmp_path / "next", seed=2)
    files = len(list((tmp_path / "latest").glob("*.safetensors")))
    args = (str(tmp_path / "latest"), str(tmp_path / "next"), files)
    results = run_distributed(_load_while_replaced, 2, *args)
    if all(isinstance(r, str) for r in results):
        for message in results:
            assert re.search("did not read the same checkpoint|replaced", message), message
        return
    for state in results:  # every rank opened the old one before it was replaced
        assert isinstance(state, dict), results
        mixed = [k for k in old if not torch.equal(state[k], old[k])]
        assert not mixed, f"{mixed} not the old checkpoint's ({len(old)} tensors)"
        assert any(not torch.equal(old[k], new[k]) for k in old)


def _load_own(paths: list[str], refused: bool):
    import torch.distributed as dist

    return (_refused if refused else _loaded)(paths[dist.get_rank()])


def test_ranks_given_different_checkpoints_refuse_together(tmp_path):
    """Rank 0 reads directory A, rank 1 directory B of the same keys and shapes: refused on
    both (on main, a mixture loaded without a word). A copy of A (other inodes, other
    times) is the same checkpoint: it loads."""
    expected = _saved(tmp_path / "a", seed=0)
    _saved(tmp_path / "b", seed=2)
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for message in run_distributed(_load_own, 2, paths, True):
        assert "the ranks did not read the same checkpoint" in message, message
        assert "rank 0" in message and "rank 1" in message, message
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    for state in run_distributed(_load_own, 2, [paths[0], str(tmp_path / "copy")], False):
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


def test_messages_name_the_file(tmp_path):
    """The duplicate's message, on one device, in full (the regular expression of each
    case above checks its parts)."""
    _saved(tmp_path)
    named = _file_of(tmp_path, EMBED)
    last = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    _rewrite(last, lambda s: s.update({EMBED: torch.zeros(64, 32)}))
    model = _model("llama", seed=1)
    with pytest.raises(CheckpointError) as error:
        load_pretrained(model, tmp_path)
    assert re.search(
        rf"'{re.escape(EMBED)}' is in more than one file: {named.name} \(the index's; "
        rf"torch.float32 \[64, 32\]\), {last.name} \(torch.float32 \[64, 32\]\)",
        str(error.value),
    ), str(error.value)
