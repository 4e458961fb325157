"""Benchmark loading and saving a Hugging Face checkpoint at real sizes at TP=2: torch_tp
against transformers' own tensor parallelism.

The script makes, once, two checkpoints of about 2 GB (random bfloat16 weights) with
transformers' own ``save_pretrained(dir, max_shard_size="500MB")``, so they are sharded and
named as the Hub has them: a ~1.1B-parameter Llama (TinyLlama's shapes) and a Mixtral of the
same size (8 experts, 6 layers; the Hub's per-expert ``block_sparse_moe.experts.N.w1/w2/w3``
keys, which transformers writes itself). They are cached under ``--dir``. Each is then
loaded at TP=2 on this machine's processes (gloo on CPU), each library in fresh ranks:

* ``torch_tp``: build the model on the meta device, ``parallelize_module(model, mesh,
  plan_for(model))``, ``torch_tp.materialize(model)``,
  ``torch_tp.checkpoint.load_pretrained(model, dir)``;
* ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir, tp_plan="auto",
  dtype=torch.bfloat16)`` (its own tensor parallelism; it needs ``accelerate``).

and saved back from the TP=2 model (``torch_tp.checkpoint.save_pretrained(model, out)``; for
``layout=`` where that keyword exists, both layouts; transformers' ``model.save_pretrained
(out)``). Per row: seconds (the max over ranks, from a barrier), the peak resident memory
of a rank (Linux's ``VmHWM``, reset just before; file pages mapped by safetensors count, as
any monitor would count them), the interpreter's baseline (``VmRSS`` just before loading,
after the imports), the rank's shards and the model's largest tensor, and the bytes each
rank read from the safetensors files (every ``safe_open(...).get_slice(...)[...]`` /
``get_tensor`` counted: elements read x element size), as a fraction of the checkpoint's.
A row that cannot run says why (``refused: ...``) instead of failing the script.

Example::

    $ python benchmarks/bench_hf_checkpoint.py            # ~2 GB checkpoints (made once)
    $ python benchmarks/bench_hf_checkpoint.py --small    # ~50 MB: a quick check
    $ python benchmarks/bench_hf_checkpoint.py --models llama --markdown
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import inspect
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Benchmark the working tree's torch_tp.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torch_tp.testing import device_type, run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import render  # noqa: E402

MODELS = ("llama", "mixtral")
# torch_tp+mmap: load_pretrained(mmap=True), parameters kept as copy-on-write views of the files
# where a rank's part is one range of them, as transformers' from_pretrained keeps them
LIBRARIES = ("torch_tp", "torch_tp+mmap", "transformers")
_MB = 10**6  # as transformers' max_shard_size="500MB" counts

# the checkpoints' shapes per size: (config keywords, max_shard_size)
SIZES: dict[str, dict[str, tuple[dict[str, int], str]]] = {
    "default": {  # ~2.2 GB and ~2.0 GB
        "llama": (
            dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
            "500MB",
        ),
        "mixtral": (
            dict(hidden_size=2048, intermediate_size=2816, num_hidden_layers=6,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                 num_local_experts=8, num_experts_per_tok=2),
            "500MB",
        ),
    },
    "small": {  # ~52 MB and ~54 MB
        "llama": (
            dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=8000),
            "10MB",
        ),
        "mixtral": (
            dict(hidden_size=512, intermediate_size=704, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=8000,
                 num_local_experts=8, num_experts_per_tok=2),
            "10MB",
        ),
    },
    "tiny": {  # a smoke test: ~0.2 MB, a few shards
        "llama": (
            dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
            "50KB",
        ),
        "mixtral": (
            dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                 num_local_experts=4, num_experts_per_tok=2),
            "50KB",
        ),
    },
}  # fmt: skip


@dataclass(frozen=True)
class Checkpoint:
    model: str
    directory: str
    files: int
    total_bytes: int  # the tensors' bytes, as the index's total_size counts them
    largest_bytes: int  # the model's largest single tensor (its own layout, whole)


@dataclass
class Row:
    model: str
    library: str
    checkpoint: Checkpoint
    load_s: float | None = None
    write_s: float | None = None  # the first in-place write of every parameter, after the load
    peak: list[float] = field(default_factory=list)  # per rank, bytes
    baseline: list[float] = field(default_factory=list)
    shards: list[float] = field(default_factory=list)
    read: list[float] = field(default_factory=list)
    save_s: dict[str, float] = field(default_factory=dict)  # layout ("" default) -> s
    save_peak: dict[str, float] = field(default_factory=dict)  # max over ranks, bytes
    save_keys: dict[str, bool] = field(default_factory=dict)  # the checkpoint's key set?
    phases: dict[str, float] = field(default_factory=dict)  # torch_tp's load, max over ranks
    load_runs: list[float] = field(default_factory=list)  # with --repeats: every run's load_s
    error: str = ""
    save_error: str = ""

    def goal(self, rank: int) -> float:
        """Issue 25's bound on rank ``rank``'s peak RSS."""
        return 1.2 * (self.shards[rank] + self.checkpoint.largest_bytes) + self.baseline[rank]

    @property
    def worst(self) -> int:
        """The rank whose peak is the largest share of its goal."""
        return max(range(len(self.peak)), key=lambda r: self.peak[r] / self.goal(r))


# --------------------------------------------------------------------------- the checkpoints


def _config(model: str, size: str):
    import transformers

    shapes, _ = SIZES[size][model]
    cls = transformers.LlamaConfig if model == "llama" else transformers.MixtralConfig
    return cls(**shapes, tie_word_embeddings=False, dtype="bfloat16")


def _meta_model(config):
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _make(model: str, size: str, directory: Path) -> None:
    """Random bfloat16 weights, written by transformers' own ``save_pretrained``."""
    import transformers

    config = _config(model, size)
    module = _meta_model(config)
    module.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            if param.ndim == 1:  # norms
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    module.save_pretrained(partial, max_shard_size=SIZES[size][model][1])
    stamp = {"shapes": SIZES[size][model], "transformers": transformers.__version__}
    (partial / "bench.json").write_text(json.dumps(stamp))
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)


def _checkpoint(model: str, args: argparse.Namespace) -> Checkpoint:
    """The cached checkpoint of ``model`` at ``args.size``, made if missing or made with
    other shapes (in a child process, so this one stays small, unless ``--in-process``)."""
    import transformers

    directory = Path(args.dir) / f"{model}-{args.size}"
    stamp = {"shapes": SIZES[args.size][model], "transformers": transformers.__version__}
    try:
        cached = json.loads((directory / "bench.json").read_text()) == json.loads(json.dumps(stamp))
    except (OSError, ValueError):
        cached = False
    if not cached:
        directory.parent.mkdir(parents=True, exist_ok=True)
        print(f"making {directory} (once) ...", file=sys.stderr, flush=True)
        if args.in_process:
            _make(model, args.size, directory)
        else:
            child = [sys.executable, __file__, "--make", model, "--size", args.size]
            _child(child + ["--dir", str(args.dir)])
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        meta = json.loads(index.read_text())
        total, files = meta["metadata"]["total_size"], len(set(meta["weight_map"].values()))
    else:
        total, files = (directory / "model.safetensors").stat().st_size, 1
    state = _meta_model(_config(model, args.size)).state_dict()
    largest = max(t.numel() * t.element_size() for t in state.values())
    return Checkpoint(model, str(directory), files, int(total), largest)


def _keys(directory: str | Path) -> set[str]:
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as file:
        return set(file.keys())


# --------------------------------------------------------------------------- measuring a rank


def _status() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024  # kB -> bytes
    return out


def _reset_peak() -> float:
    """Reset VmHWM to the current resident size (Linux); the resident size now."""
    gc.collect()
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status()["VmRSS"]


class _Counted:
    """A ``safe_open`` handle whose reads are added up (bytes)."""

    lock = threading.Lock()
    total = 0

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __enter__(self):
        self._real.__enter__()
        return self

    def __exit__(self, *exc):
        return self._real.__exit__(*exc)

    @classmethod
    def add(cls, tensor: torch.Tensor) -> torch.Tensor:
        with cls.lock:
            cls.total += tensor.numel() * tensor.element_size()
        return tensor

    def get_tensor(self, name):
        return self.add(self._real.get_tensor(name))

    def get_slice(self, name):
        return _CountedSlice(self._real.get_slice(name))


class _CountedSlice:
    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __getitem__(self, index):
        return _Counted.add(self._real[index])


@contextlib.contextmanager
def _count_reads() -> Iterator[type[_Counted]]:
    """Count the bytes read through ``safetensors.safe_open`` by anything imported so far
    (``from safetensors import safe_open`` included) or later (``safetensors.safe_open``)."""
    import safetensors

    real = safetensors.safe_open
    patched = [m for m in list(sys.modules.values()) if getattr(m, "safe_open", None) is real]
    _Counted.total = 0
    for module in patched:
        module.safe_open = lambda *a, **k: _Counted(real(*a, **k))
    try:
        yield _Counted
    finally:
        for module in patched:
            module.safe_open = real


def _local_bytes(module: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}.values()
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:200]


def _layouts() -> list[str]:
    """torch_tp's ``save_pretrained`` layouts to time: the default, and ``"model"`` where
    the ``layout=`` keyword exists."""
    from torch_tp.checkpoint import save_pretrained

    if "layout" in inspect.signature(save_pretrained).parameters:
        return ["", "model"]
    return [""]


def _preload(checkpoint: Checkpoint) -> None:
    """Import, before the baseline is taken, what either library imports lazily while
    loading (the model's module, transformers' loading and TP code, torch_tp's), so that
    neither library's peak counts its imports."""
    import importlib

    import transformers

    config = transformers.AutoConfig.from_pretrained(checkpoint.directory)
    transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    for name in (
        "transformers.core_model_loading",
        "transformers.conversion_mapping",
        "transformers.integrations.tensor_parallel",
        "transformers.distributed.tensor_parallel",
        "torch_tp.checkpoint",
        "torch_tp.plans.hf",
        "torch_tp.checkpoint._hf_conversion",
    ):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


@contextlib.contextmanager
def _quiet_torchrun_env() -> Iterator[None]:
    """No warnings or progress bars, and the environment variables torchrun sets: transformers'
    ``tp_plan="auto"`` takes its TP size from ``WORLD_SIZE`` (without it, it loads the whole
    model on every rank, silently). All put back afterwards (the ranks may be a shared pool)."""
    import transformers.utils.logging as hf_logging

    world, rank = str(dist.get_world_size()), str(dist.get_rank())
    env = {"WORLD_SIZE": world, "RANK": rank, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}
    saved = {k: os.environ.get(k) for k in env}
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    os.environ.update(env)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _rank(library: str, checkpoint: Checkpoint, out: str, layouts: list[str]) -> dict:
    """On every rank: load ``checkpoint`` at TP=world size, then save it back; the
    measurements of this rank."""
    with _quiet_torchrun_env():
        return _load_and_save(library, checkpoint, out, layouts)


def _load_and_save(library: str, checkpoint: Checkpoint, out: str, layouts: list[str]) -> dict:
    import transformers

    import torch_tp
    from torch_tp.checkpoint import load_pretrained, save_pretrained
    from torch_tp.plans.hf import plan_for

    world = dist.get_world_size()
    _preload(checkpoint)
    result: dict = {"error": "", "save_error": "", "save_s": {}, "save_peak": {}, "phases": {}}
    model = None
    baseline = _reset_peak()
    dist.barrier()
    start = time.perf_counter()
    try:
        with _count_reads() as counted:
            if library.startswith("torch_tp"):
                phases = result["phases"]

                def step(name: str) -> None:
                    phases[name] = time.perf_counter() - start - sum(phases.values())

                config = transformers.AutoConfig.from_pretrained(checkpoint.directory)
                with torch.device("meta"):
                    model = transformers.AutoModelForCausalLM.from_config(
                        config, dtype=torch.bfloat16
                    )
                mesh = torch.distributed.device_mesh.init_device_mesh(device_type(), (world,))
                step("meta model")
                plan = plan_for(model)
                step("plan_for")
                torch_tp.parallelize_module(model, mesh, plan)
                step("parallelize_module")
                torch_tp.materialize(model)
                step("materialize")
                load_pretrained(model, checkpoint.directory, mmap=library == "torch_tp+mmap")
                step("load_pretrained")
            else:
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    checkpoint.directory, tp_plan="auto", dtype=torch.bfloat16
                )
                if getattr(model, "_tp_size", None) != world:
                    raise RuntimeError(f"transformers did not shard the model over {world} ranks")
    except Exception as error:  # noqa: BLE001 - reported in the table
        result["error"] = _first_line(error)
    seconds = time.perf_counter() - start
    result.update(
        load_s=seconds,
        peak=_status()["VmHWM"],
        baseline=baseline,
        read=counted.total,
        shards=0 if result["error"] else _local_bytes(model),
    )
    if result["error"]:
        return result
    # the first write of every parameter (an optimizer step writes them all): where a mapped
    # file's page is first written, it is copied
    dist.barrier()
    start = time.perf_counter()
    with torch.no_grad():
        for param in model.parameters():
            (param.to_local() if isinstance(param, DTensor) else param).mul_(1)
    result["write_s"] = time.perf_counter() - start
    # one untimed save first: a process's first save was 2-3 s slower here, whichever call
    # made it (Llama, torch_tp's two layouts swapped: the second was the faster each time)
    saves = [(False, layouts[0])] if layouts else []
    for timed, layout in saves + [(True, layout) for layout in layouts]:
        target = os.path.join(out, f"{library}-{layout or 'default'}")
        _reset_peak()
        dist.barrier()
        start = time.perf_counter()
        try:
            if library == "torch_tp":
                kwargs = {"layout": layout} if layout else {}
                save_pretrained(model, target, max_shard_size="500MB", **kwargs)
            else:
                model.save_pretrained(target, max_shard_size="500MB")
        except Exception as error:  # noqa: BLE001 - reported in the table
            result["save_error"] = _first_line(error)
            break
        if timed:
            result["save_s"][layout] = time.perf_counter() - start
            result["save_peak"][layout] = _status()["VmHWM"]
        dist.barrier()  # rank 0 has written it
        if dist.get_rank() == 0:
            keys = _keys(target) == _keys(checkpoint.directory)
            result.setdefault("save_keys", {})[layout] = keys
            shutil.rmtree(target, ignore_errors=True)
    return result


def _measure(model: str, library: str, checkpoint: Checkpoint, args: argparse.Namespace) -> Row:
    """One row, in the ranks of this process (fresh ones: see :func:`bench`)."""
    if args.no_save or library == "torch_tp+mmap":  # saves as torch_tp: not measured twice
        layouts: list[str] = []
    else:
        layouts = _layouts() if library == "torch_tp" else [""]
    row = Row(model, library, checkpoint)
    with tempfile.TemporaryDirectory(dir=args.dir) as out:
        try:
            results = run_distributed(
                _rank, args.tp, library, checkpoint, out, layouts, timeout=args.timeout
            )
        except Exception as error:  # noqa: BLE001 - a rank died or hung: reported
            row.error = _first_line(error)
            return row
    row.error = "; ".join(sorted({r["error"] for r in results if r["error"]}))
    row.save_error = "; ".join(sorted({r["save_error"] for r in results if r["save_error"]}))
    row.load_s = max(r["load_s"] for r in results)
    row.write_s = max(r.get("write_s", 0.0) for r in results)
    for name in ("peak", "baseline", "shards", "read"):
        setattr(row, name, [float(r[name]) for r in results])
    for layout in results[0]["save_s"]:
        if all(layout in r["save_s"] for r in results):
            row.save_s[layout] = max(r["save_s"][layout] for r in results)
            row.save_peak[layout] = max(r["save_peak"][layout] for r in results)
    row.save_keys = results[0].get("save_keys", {})
    row.phases = {k: max(r["phases"].get(k, 0.0) for r in results) for k in results[0]["phases"]}
    return row


def _child(command: list[str]) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[1:])} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def _one(model: str, library: str, checkpoint: Checkpoint, args: argparse.Namespace) -> Row:
    if args.in_process:
        return _measure(model, library, checkpoint, args)
    child = [sys.executable, __file__, "--one", model, library, "--tp", str(args.tp)]
    child += ["--dir", str(args.dir), "--timeout", str(args.timeout)]
    child += ["--no-save"] if args.no_save else []
    child += ["--checkpoint", json.dumps(dataclasses.asdict(checkpoint))]
    data = json.loads(_child(child).strip().splitlines()[-1])
    data["checkpoint"] = Checkpoint(**data["checkpoint"])
    return Row(**data)


def _merge(runs: list[Row]) -> Row:
    """Repeated measurements of one row: median seconds, the largest peaks."""
    runs = [r for r in runs if not r.error] or runs[:1]  # a failed run says only why
    row = runs[0]
    if row.error or len(runs) == 1:
        return row
    row.load_runs = [r.load_s for r in runs]
    row.load_s = statistics.median(row.load_runs)
    row.write_s = statistics.median(r.write_s or 0.0 for r in runs)
    row.peak = [max(r.peak[i] for r in runs) for i in range(len(row.peak))]
    for layout in row.save_s:
        row.save_s[layout] = statistics.median(r.save_s.get(layout, math.nan) for r in runs)
        row.save_peak[layout] = max(r.save_peak.get(layout, 0.0) for r in runs)
    row.phases = {k: statistics.median(r.phases[k] for r in runs) for k in row.phases}
    return row


def bench(args: argparse.Namespace) -> list[Row]:
    """One row per (model, library), each measured in fresh processes (as a job starts):
    how much freed memory the C allocator keeps resident depends on what the process did
    before, which a second measurement in the same ranks would inherit. With
    ``args.in_process``, everything runs in this process and its pool of ranks instead
    (seconds at a tiny size; the memory columns are then only indicative). With
    ``args.repeats``, every row is measured that many times, the rows interleaved."""
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    checkpoints = {model: _checkpoint(model, args) for model in args.models}
    runs: dict[tuple[str, str], list[Row]] = {}
    for repeat in range(args.repeats):
        for model in args.models:
            for library in args.libraries:
                print(f"measuring {model} / {library} ({repeat + 1}/{args.repeats}) ...",
                      file=sys.stderr, flush=True)  # fmt: skip
                row = _one(model, library, checkpoints[model], args)
                runs.setdefault((model, library), []).append(row)
    return [_merge(rows) for rows in runs.values()]


# --------------------------------------------------------------------------- the table


def _mb(n: float) -> str:
    return f"{n / _MB:.0f}" if n >= 10 * _MB else f"{n / _MB:.2f}"


def _save(row: Row, layout: str) -> str:
    if row.error:
        return "-"
    if layout not in row.save_s:
        return f"fails: {row.save_error}" if row.save_error and layout == "" else "-"
    keys = row.save_keys.get(layout)
    note = "" if keys is None else (" (Hub keys)" if keys else " (other keys)")
    return f"{row.save_s[layout]:.1f}{note}"


def table(rows: list[Row], args: argparse.Namespace, markdown: bool = False) -> str:
    header = [
        "model",
        "library",
        "load s",
        "first write s",
        "peak RSS/rank MB",
        "baseline MB",
        "shards + largest MB",
        "goal RSS MB",
        "ratio",
        "read/rank MB (share)",
        "save s",
        'save s, layout="model"',
        "save peak RSS/rank MB",
    ]
    body = []
    for r in rows:
        if r.error:
            body.append([r.model, r.library, f"refused: {r.error}"] + ["-"] * (len(header) - 3))
            continue
        w = r.worst
        shares = " / ".join(f"{x / r.checkpoint.total_bytes:.2f}" for x in r.read)
        body.append(
            [
                r.model,
                r.library,
                f"{r.load_s:.1f}"
                + (f" ({min(r.load_runs):.1f}-{max(r.load_runs):.1f})" if r.load_runs else ""),
                f"{r.write_s:.1f}" if r.write_s is not None else "-",
                _mb(r.peak[w]),
                _mb(r.baseline[w]),
                f"{_mb(r.shards[w])} + {_mb(r.checkpoint.largest_bytes)}",
                _mb(r.goal(w)),
                f"{r.peak[w] / r.goal(w):.2f}",
                f"{_mb(max(r.read))} ({shares})",
                _save(r, ""),
                _save(r, "model") if r.library == "torch_tp" else "-",
                _mb(max(r.save_peak.values())) if r.save_peak else "-",
            ]
        )
    ckpts = {r.model: r.checkpoint for r in rows}
    sizes = ", ".join(
        f"{m} {c.total_bytes / 10**9:.2f} GB in {c.files} files" for m, c in ckpts.items()
    )
    title = (
        f"TP={args.tp} (gloo, CPU, {args.tp} processes); checkpoints written by transformers' "
        f"save_pretrained, bfloat16: {sizes}"
    )
    return render(title, header, body, markdown) + "\n\n" + "\n".join(_goals(rows))


def _goals(rows: list[Row]) -> list[str]:
    """Issue 25's two goals, met or not, per torch_tp row (and the memory one for all)."""
    peers = {r.model: r for r in rows if r.library == "transformers" and not r.error}
    lines = ["Goals (issue 25):"]
    for r in rows:
        if r.error:
            lines.append(f"- {r.model} / {r.library}: not measured ({r.error})")
            continue
        w = r.worst
        memory = "met" if r.peak[w] <= r.goal(w) else "not met"
        text = (
            f"- {r.model} / {r.library}: peak RSS per rank {_mb(r.peak[w])} MB <= 1.2 x "
            f"(shards + largest tensor) + baseline = {_mb(r.goal(w))} MB: {memory}"
        )
        peer = peers.get(r.model)
        if r.library != "transformers":
            if peer is None:
                text += "; load time vs transformers: no transformers row to compare with"
            else:
                fast = "met" if r.load_s <= peer.load_s else "not met"
                text += f"; load time {r.load_s:.1f} s <= transformers' {peer.load_s:.1f} s: {fast}"
        lines.append(text)
    for r in rows:
        if r.phases and not r.error:
            steps = ", ".join(f"{k} {v:.2f} s" for k, v in r.phases.items())
            lines.append(f"- {r.model} / {r.library} load, by step (max over ranks): {steps}")
    lines.append(
        "- load s: max over ranks, from a barrier to the model loaded (torch_tp: config, meta "
        "model, parallelize_module, materialize, load_pretrained; transformers: from_pretrained)"
        "; with --repeats, the median (the range) over fresh processes, and the largest peaks"
        ". first write s: every parameter of a rank written in place once after the load (as "
        "an optimizer step does), max over ranks: a page of a mapped file (transformers; "
        "torch_tp+mmap) is copied then, so load s + first write s compares loads that copy "
        "with loads that map. save s: after one untimed save. peak RSS: VmHWM of the rank "
        "after the load (the worst rank against its goal; mapped pages count once touched), "
        "reset after the imports; baseline: VmRSS then. read: bytes "
        "returned by safetensors reads per rank "
        "(share of the checkpoint's tensor bytes, rank 0 / rank 1). largest: the model's "
        "largest tensor, whole. save peak RSS: VmHWM during the save, max over ranks, reset "
        "before it (the loaded model included). MB = 10^6 bytes. The checkpoint files are in "
        "the page cache (written or read before): disk speed is not measured."
    )
    return lines


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument(
        "--dir",
        default=os.path.join(tempfile.gettempdir(), "torch_tp_bench_hf_checkpoint"),
        help="where the checkpoints are cached (and saves written, then deleted)",
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--small", action="store_true", help="~50 MB checkpoints (--size small)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument(
        "--repeats", type=int, default=1, help="measure every row N times (median seconds)"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per measurement")
    parser.add_argument(
        "--no-save",
        action="store_true",
        help="load only (transformers' save gathers the whole model on every rank: ~6 GB "
        "per rank at the default size)",
    )
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="measure every row in this process's ranks (fast; memory only indicative)",
    )
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--make", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.small:
        args.size = "small"
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.libraries = [m.strip() for m in args.libraries.split(",") if m.strip()]
    for kind, names, known in (
        ("models", args.models, MODELS),
        ("libraries", args.libraries, LIBRARIES),
    ):
        unknown = [n for n in names if n not in known]
        if unknown:
            parser.error(f"unknown {kind} {unknown}; choose from {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse(argv)
    if args.make:  # a child of _checkpoint()
        _make(args.make, args.size, Path(args.dir) / f"{args.make}-{args.size}")
        return ""
    if args.one:  # a child of bench(): one row, as JSON
        checkpoint = Checkpoint(**json.loads(args.checkpoint))
        row = _measure(*args.one, checkpoint, args)
        text = json.dumps(dataclasses.asdict(row))
        print(text)
        return text
    text = table(bench(args), args, markdown=args.markdown)
    print(text)
    return text


if __name__ == "__main__":
    main()
