"""Griffe extension for the API reference: reST markup in jaxamp's docstrings.

jaxamp's docstrings are Google style with a little reST: Sphinx roles
(``:func:`amp```), double-backtick literals and ``Text::`` literal blocks. This
extension rewrites them into Markdown before mkdocstrings parses them: a role
naming a ``jaxamp`` name listed on the API page becomes a cross-reference to
its entry there, any other role a code span; a ``Text::`` block becomes a fenced
Python block; ``Example:`` (Napoleon's alias) becomes the ``Examples:`` section.
Double-backtick literals are already code spans in Markdown.
"""

from __future__ import annotations

import re
from pathlib import Path

import griffe

_ROOT = Path(__file__).resolve().parents[2]
_ROLE = re.compile(r":(?:func|class|data|meth|attr|mod|obj|exc):`~?([^`]+)`")
_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)
_LITERAL_INTRO = re.compile(r"^(?P<indent>\s*)(?P<text>\S.*?)::\s*$")


def _documented_names() -> frozenset[str]:
    """Names with an entry on the API page: only those can be link targets (a
    public name missing there fails tests/test_docs.py, not the build)."""
    text = (_ROOT / "docs" / "api.md").read_text()
    return frozenset(re.findall(r"^::: jaxamp\.(\w+)\s*$", text, re.M))


_DOCUMENTED = _documented_names()


def _role(match: re.Match[str]) -> str:
    name = match.group(1).removeprefix("jaxamp.")
    if name in _DOCUMENTED:
        return f"[`{name}`][jaxamp.{name}]"
    return f"`{match.group(1)}`"


def _fence_literal_blocks(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _LITERAL_INTRO.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        indent = len(m["indent"])
        j = i + 1
        block: list[str] = []
        while j < len(lines) and (
            not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent
        ):
            block.append(lines[j])
            j += 1
        while block and not block[-1].strip():
            block.pop()
        body = [b for b in block if b.strip()]
        if not body:
            out.append(lines[i])
            i += 1
            continue
        cut = min(len(b) - len(b.lstrip()) for b in body)
        pad = " " * indent
        out.append(f"{pad}{m['text']}:")
        out.append("")
        out.append(f"{pad}```python")
        out.extend(pad + b[cut:] if b.strip() else "" for b in block if b is not None)
        out.append(f"{pad}```")
        out.append("")
        i = j
    return "\n".join(out)


class RstRoles(griffe.Extension):
    """Rewrite reST roles and literal blocks of every docstring into Markdown."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is None:
            return
        text = _ROLE.sub(_role, obj.docstring.value)
        text = _EXAMPLE.sub(r"\1Examples:", text)  # Napoleon's alias
        obj.docstring.value = _fence_literal_blocks(text)
