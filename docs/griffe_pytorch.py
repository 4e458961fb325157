"""Griffe extension: read PyTorch-style docstrings as the Google style that griffe parses.

Used by ``mkdocs.yml`` only; nothing in ``torch_tp`` imports it. The code base writes its
docstrings the way PyTorch does (``Args:`` items with ``name (type):`` headers, Sphinx roles
such as ``:class:`DTensor```, ``Example::`` blocks, ``.. note::``). Griffe's Google parser
reads most of that, but not all of it:

* a role inside a parameter type (``module (:class:`nn.Module`):``) has a colon, which ends
  the parameter name early; a type wrapped onto a second line is cut in two;
* ``Example::`` is not a section title, so the example renders as a paragraph;
* ``.. note::`` is reStructuredText and renders as literal text.

This extension rewrites each docstring before it is parsed: roles become code spans (plain
names inside a parameter type), wrapped parameter headers are joined, ``Example::`` becomes an
``Examples:`` section (a fenced block when it holds no ``>>>`` lines), ``.. note::`` and its
kin become Google admonitions, reST links become Markdown links, and ``xdoctest`` directives
are dropped.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

try:
    import griffe
except ImportError:  # without the docs extra the converter still works (and is tested)
    griffe = None

# :class:`X`, :func:`~a.b.f`, :meth:`text <a.b.C.m>`, :py:class:`X`, ...
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|exc|data|obj|const|ref):`([^`]+)`")
_EXAMPLE = re.compile(r"(Examples?)::\s*")
_DIRECTIVE = re.compile(r"\.\. (note|warning|tip|important|caution|seealso)::\s*(.*)")
_PARAM_SECTION = re.compile(
    r"(Args|Arguments|Params|Parameters|Keyword Args|Keyword Arguments|Other Parameters"
    r"|Attributes):\s*",
    re.IGNORECASE,
)
_XDOCTEST = re.compile(r">>>\s*#\s*xdoctest:")
# `text <https://...>`__ (an anonymous reST hyperlink)
_LINK = re.compile(r"`([^`<]+?)\s*<([^`>]+)>`__?")
_TITLES = {"seealso": "See also"}


def _role_target(text: str) -> str:
    """The name a role displays: ``text`` of ``text <target>``, last part of ``~a.b.c``."""
    explicit = re.fullmatch(r"(.*?)\s*<(.+)>", text)
    if explicit:
        return explicit.group(1)
    if text.startswith("~"):
        return text[1:].rsplit(".", 1)[-1]
    return text.lstrip("!")


def _plain_roles(text: str) -> str:
    return _ROLE.sub(lambda m: _role_target(m.group(1)), text)


def _code_roles(text: str) -> str:
    return _ROLE.sub(lambda m: f"`{_role_target(m.group(1))}`", text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _block(lines: list[str], start: int, indent: int) -> int:
    """Index just past the lines from ``start`` that are blank or indented deeper."""
    end = start
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return end


def _plain_type(header: str) -> str:
    """Unroll the roles inside the ``(type)`` of a parameter header, and only there."""
    start = header.index("(")
    depth = 0
    for end in range(start, len(header)):
        depth += {"(": 1, ")": -1}.get(header[end], 0)
        if depth == 0:
            return header[:start] + _plain_roles(header[start : end + 1]) + header[end + 1 :]
    return header


def _join_param_headers(lines: list[str]) -> list[str]:
    """Join parameter headers whose ``(type)`` wraps, and unroll roles in the type."""
    out: list[str] = []
    i = 0
    section_indent: int | None = None
    item_indent: int | None = None
    while i < len(lines):
        line = lines[i]
        if line.strip():
            if _PARAM_SECTION.fullmatch(line.strip()):
                section_indent, item_indent = _indent(line), None
                out.append(line)
                i += 1
                continue
            if section_indent is not None and _indent(line) <= section_indent:
                section_indent = item_indent = None
            elif section_indent is not None:
                if item_indent is None:
                    item_indent = _indent(line)
                if _indent(line) == item_indent and re.match(r"\s*\*{0,2}\w+\s*\(", line):
                    while line.count("(") > line.count(")") and i + 1 < len(lines):
                        i += 1
                        line = f"{line.rstrip()} {lines[i].strip()}"
                    line = _plain_type(line)
        out.append(line)
        i += 1
    return out


def _rewrite_blocks(lines: list[str]) -> list[str]:
    """Turn ``Example::`` and ``.. note::`` blocks into Google sections."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        indent = _indent(line)
        pad = " " * indent
        example = _EXAMPLE.fullmatch(line.strip())
        directive = _DIRECTIVE.fullmatch(line.strip())
        if example:
            end = _block(lines, i + 1, indent)
            body = textwrap.dedent("\n".join(lines[i + 1 : end])).strip("\n").split("\n")
            body = [b for b in body if not _XDOCTEST.match(b.strip())]
            if not any(b.lstrip().startswith(">>>") for b in body):
                body = ["```python", *body, "```"]
            out.append(f"{pad}Examples:")
            out.extend(f"{pad}    {b}" if b.strip() else "" for b in body)
            i = end
        elif directive:
            kind, first = directive.groups()
            end = _block(lines, i + 1, indent)
            rest = textwrap.dedent("\n".join(lines[i + 1 : end])).strip("\n")
            body = [first] if first else []
            body += rest.split("\n") if rest else []
            out.append(f"{pad}{_TITLES.get(kind, kind.capitalize())}:")
            out.extend(f"{pad}    {b}" if b.strip() else "" for b in body)
            i = end
        else:
            out.append(line)
            i += 1
    return out


def pytorch_to_google(text: str) -> str:
    """Rewrite one PyTorch-style docstring into the Google style griffe parses."""
    lines = _join_param_headers(text.split("\n"))
    lines = _rewrite_blocks(lines)
    return _LINK.sub(r"[\1](\2)", _code_roles("\n".join(lines)))


if griffe is not None:

    class PyTorchDocstrings(griffe.Extension):
        """Apply :func:`pytorch_to_google` to every docstring griffe loads."""

        def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
            if obj.docstring is not None:
                obj.docstring.value = pytorch_to_google(obj.docstring.value)
