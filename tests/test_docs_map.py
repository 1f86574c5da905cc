"""docs/semantics.md opens with a map of every section; it must name each heading (with the
link GitHub makes for it). ``python tests/test_docs_map.py`` prints the map to paste."""

from __future__ import annotations

import re
from pathlib import Path

SEMANTICS = Path(__file__).resolve().parents[1] / "docs" / "semantics.md"
START, END = "<!-- map -->", "<!-- /map -->"


def headings(text: str) -> list[tuple[int, str]]:
    """(level, title) of every ``##`` and ``###`` heading outside code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(##+) (.*)", line)) and len(m.group(1)) <= 3:
            out.append((len(m.group(1)), m.group(2).strip()))
    return out


def slug(title: str) -> str:
    """GitHub's anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def render(text: str) -> str:
    seen: dict[str, int] = {}
    lines = []
    for level, title in headings(text):
        if title == "Map":  # the map's own heading
            continue
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchor = base if n == 0 else f"{base}-{n}"
        indent = "" if level == 2 else "  "
        lines.append(f"{indent}- [{title}](#{anchor})")
    return "\n".join(lines)


def test_map_lists_every_section():
    text = SEMANTICS.read_text()
    assert START in text and END in text, "docs/semantics.md lost its map markers"
    body = text.split(START)[1].split(END)[0].strip()
    outside = text.split(START)[0] + text.split(END)[1]
    assert body == render(outside), "the map is stale: run python tests/test_docs_map.py"


if __name__ == "__main__":
    text = SEMANTICS.read_text()
    if START in text:
        text = text.split(START)[0] + text.split(END)[1]
    print(render(text))
