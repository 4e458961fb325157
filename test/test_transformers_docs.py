"""docs/transformers.md is generated where it states facts: the table of transformers' plan
names comes from torch_tp's registry, the zoo's status from ``test/zoo_status.json`` and
``test/zoo_auto_status.json``. The tests check that the page says what those say; rewrite
its generated sections with::

    python test/test_transformers_docs.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import test_zoo
import test_zoo_auto

from torch_tp import _names
from torch_tp.registry import STYLE_REGISTRY

PAGE = Path(__file__).resolve().parents[1] / "docs" / "transformers.md"
SECTIONS = ("names", "zoo", "zoo-auto")


def _first_sentence(style: object) -> str:
    doc = " ".join((type(style).__doc__ or "").split())
    return doc.split(". ")[0].rstrip(".") + "."


def names_table() -> str:
    """Every plan name transformers 5.x writes, and the legacy 4.x ones: the torch_tp style
    it stands for (from the registry), or why it is not supported."""
    lines = ["| name | torch_tp style | what it does |", "|---|---|---|"]
    for name in STYLE_REGISTRY.names():
        style = _names.style_from_name(name)
        if not type(style).__module__.startswith("torch_tp."):
            continue  # a user's style, registered by whoever imported it (tests do)
        lines.append(f"| `{name}` | `{style!r}` | {_first_sentence(style)} |")
    for name, why in _names.UNSUPPORTED_NAMES.items():
        lines.append(f"| `{name}` | not supported | {why} |")
    return "\n".join(lines) + "\n"


def render() -> dict[str, str]:
    return {
        "names": names_table(),
        "zoo": test_zoo.markdown(),
        "zoo-auto": test_zoo_auto.markdown(),
    }


def _section(text: str, name: str) -> str:
    match = re.search(
        rf"<!-- generated:{name}:begin -->\n(.*?)<!-- generated:{name}:end -->", text, re.S
    )
    assert match, f"docs/transformers.md has no generated section {name!r}"
    return match.group(1)


def write() -> None:
    text = PAGE.read_text(encoding="utf-8")
    for name, body in render().items():
        old = _section(text, name)
        text = text.replace(
            f"<!-- generated:{name}:begin -->\n{old}",
            f"<!-- generated:{name}:begin -->\n{body}",
        )
    PAGE.write_text(text, encoding="utf-8")


def test_the_page_says_what_the_registry_and_the_status_files_say():
    text = PAGE.read_text(encoding="utf-8")
    for name, body in render().items():
        assert _section(text, name) == body, (
            f"docs/transformers.md's {name!r} section is stale: run python "
            "test/test_transformers_docs.py"
        )


def test_every_name_transformers_uses_is_in_the_table():
    table = names_table()
    used = [
        "colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_rep",
        "rowwise_split_input", "packed_colwise", "packed_rowwise", "embedding_rowwise",
        "embedding_colwise", "sequence_parallel", "replicate", "replicated_with_grad_allreduce",
        "all_reduce", "local_params", "mla_kv_a_proj", "moe_tp_experts", "moe_identity_expert",
        "grouped_gemm", "ep_dispatch_experts", "ep_router", "local_colwise", "local_rowwise",
        "local_packed_rowwise", "local", "gather",
    ]  # fmt: skip
    assert [n for n in used if f"| `{n}` |" not in table] == []


if __name__ == "__main__":
    write()
    sys.stdout.write(f"rewrote {PAGE}\n")
