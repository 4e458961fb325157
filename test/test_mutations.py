"""The mutation check (``test/mutations.py``): its list of deliberate bugs is well formed and
current, CONTRIBUTING.md lists exactly those, and (slow) each one fails its named tests."""

from __future__ import annotations

import dataclasses
import re

import pytest
from mutations import MUTATIONS, ROOT, Result, apply, check_list, markdown_table, run

_BEGIN = "<!-- mutations:begin (python test/mutations.py --table) -->"
_END = "<!-- mutations:end -->"


def test_every_mutation_names_its_text_once_and_existing_tests():
    assert len(MUTATIONS) >= 12
    assert check_list() == []


def test_the_list_refuses_text_that_moved():
    moved = [dataclasses.replace(MUTATIONS[0], old=MUTATIONS[0].old + "  # moved")]
    (problem,) = check_list(mutations=moved)
    assert "occurs 0 times" in problem and MUTATIONS[0].name in problem


def test_only_a_failed_test_catches_and_text_must_be_there_once(tmp_path):
    # pytest's exit codes: 1 a test failed; 2-5 collection or import error, internal error,
    # usage error, no tests: they prove nothing about the mutation
    verdicts = {code: Result(MUTATIONS[0], code, 0.0, "").caught for code in range(-1, 6)}
    assert verdicts == {-1: False, 0: False, 1: True, 2: False, 3: False, 4: False, 5: False}
    mutation = MUTATIONS[0]
    (tmp_path / mutation.file).parent.mkdir(parents=True)
    (tmp_path / mutation.file).write_text(mutation.old * 2)
    with pytest.raises(ValueError, match="occurs 2 times"):
        apply(mutation, tmp_path)
    (tmp_path / mutation.file).write_text(f"a\n{mutation.old}\nb\n")
    apply(mutation, tmp_path)
    assert (tmp_path / mutation.file).read_text() == f"a\n{mutation.new}\nb\n"


def test_contributing_lists_the_mutations():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    found = re.search(re.escape(_BEGIN) + r"\n(.*?)\n" + re.escape(_END), text, re.S)
    assert found, f"CONTRIBUTING.md has no table between {_BEGIN!r} and {_END!r}"
    assert found.group(1) == markdown_table(), (
        "the mutations table of CONTRIBUTING.md differs from test/mutations.py: paste the "
        "output of `python test/mutations.py --table`"
    )


@pytest.mark.slow
@pytest.mark.mutations  # its own CI step: `python -m pytest -m mutations`
@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_every_mutation_is_caught(mutation):
    # one test per mutation, which pytest's two workers share out
    result = run(mutation, timeout=300)
    assert result.caught, f"{mutation.name}: {result.verdict}\n{result.output[-2000:]}"
