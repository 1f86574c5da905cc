"""What a compiled XLA program launches, read from its text (``compiled.as_text()``).

``entry_ops`` counts the instructions of the entry computation by opcode, leaving out those
that launch nothing (parameters, constants, tuples and their elements, bitcasts). On a GPU
each fusion, custom call (a GEMM) or copy there is one kernel launch, so on a small step the
counts say where launch time goes; XLA:CPU fuses differently, so compare programs compiled for
the same platform only. ``big_ops`` lists the launches that touch a buffer of at least a given
size (the passes over the logits of a loss, say): where two programs of the same work differ
only in launches on small buffers, their time on big inputs is the same.
"""

from __future__ import annotations

import math
import re
from collections import Counter

_TRIVIAL = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast"})
# `%name = shape opcode(`, where the shape may be a tuple `(f32[2]{0}, s32[])`: name, shape,
# opcode; the operands follow, up to the first `)`
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(\S+)\s+=\s+(\([^()]*\)|\S+)\s+([a-z][\w-]*)\(")
_DIMS = re.compile(r"[a-z]\w*\[([\d,]*)\]")


def entry_ops(hlo_text: str) -> Counter:
    """Opcode -> count over the ENTRY computation of ``hlo_text``, trivial ones left out."""
    counts: Counter = Counter()
    for line in _entry_lines(hlo_text):
        if (match := _INSTRUCTION.match(line)) and match[3] not in _TRIVIAL:
            counts[match[3]] += 1
    return counts


def _entry_lines(hlo_text: str) -> list[str]:
    """The lines of the ENTRY computation's body."""
    lines, inside = [], False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY "):
            inside = True
        elif inside and line.startswith("}"):
            break
        elif inside:
            lines.append(line)
    return lines


def _elements(shape: str) -> int:
    """The largest array's element count in ``f32[1024,8192]{1,0}`` or a tuple of shapes."""
    return max(
        (math.prod(int(d) for d in dims.split(",") if d) for dims in _DIMS.findall(shape)),
        default=0,
    )


def big_ops(hlo_text: str, min_elements: int) -> list[str]:
    """The opcodes, in order, of the entry computation's launches (``entry_ops``' kind) that
    write or read a buffer of at least ``min_elements`` elements."""
    sizes: dict[str, int] = {}
    big = []
    for line in _entry_lines(hlo_text):
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, shape, op = match.groups()
        operands = line[match.end() :].split(")", 1)[0]
        sizes[name] = _elements(shape)
        if op in _TRIVIAL:
            continue
        touched = [sizes.get(o.strip().lstrip("%"), 0) for o in operands.split(",")]
        if max([sizes[name], *touched]) >= min_elements:
            big.append(op)
    return big


def summary(counts: Counter) -> str:
    """``"119 fusions, 131 ops (fusion 119, custom-call 8, ...)"``."""
    ops = ", ".join(f"{op} {n}" for op, n in counts.most_common())
    return f"{counts['fusion']} fusions, {sum(counts.values())} ops ({ops})"
