"""What a compiled XLA program launches, read from its text (``compiled.as_text()``).

``entry_ops`` counts the instructions of the entry computation by opcode, leaving out those
that launch nothing (parameters, constants, tuples and their elements, bitcasts). On a GPU
each fusion, custom call (a GEMM) or copy there is one kernel launch, so on a small step the
counts say where launch time goes; XLA:CPU fuses differently, so compare programs compiled for
the same platform only.
"""

from __future__ import annotations

import re
from collections import Counter

_TRIVIAL = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast"})
# `%name = shape opcode(`, where the shape may be a tuple `(f32[2]{0}, s32[])`
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?\S+\s+=\s+(?:\([^()]*\)|\S+)\s+([a-z][\w-]*)\(")


def entry_ops(hlo_text: str) -> Counter:
    """Opcode -> count over the ENTRY computation of ``hlo_text``, trivial ones left out."""
    counts: Counter = Counter()
    inside = False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY "):
            inside = True
        elif inside and line.startswith("}"):
            break
        elif inside and (match := _INSTRUCTION.match(line)) and match[1] not in _TRIVIAL:
            counts[match[1]] += 1
    return counts


def summary(counts: Counter) -> str:
    """``"119 fusions, 131 ops (fusion 119, custom-call 8, ...)"``."""
    ops = ", ".join(f"{op} {n}" for op, n in counts.most_common())
    return f"{counts['fusion']} fusions, {sum(counts.values())} ops ({ops})"
