"""The one place where conformance tolerances live: (rtol, atol) per dtype.

numstab computes losses in float32 whatever the input dtype, so loss VALUES are compared at
float32 tolerance for every input dtype. GRADIENTS come back in the input dtype, so they are
compared at that dtype's resolution.
"""

from __future__ import annotations

VALUE = {
    "float16": (2e-5, 2e-5),
    "bfloat16": (2e-5, 2e-5),
    "float32": (2e-5, 2e-5),
    "float64": (1e-12, 1e-12),
}
GRADIENT = {
    "float16": (2e-3, 1e-4),
    "bfloat16": (1.6e-2, 1e-3),
    "float32": (2e-5, 1e-6),
    "float64": (1e-12, 1e-12),
}

# Agreement with the frameworks' own losses where semantics coincide (float32 inputs).
NATIVE = (1e-6, 1e-6)
