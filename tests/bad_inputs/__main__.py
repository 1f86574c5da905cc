"""``python -m tests.bad_inputs [backends]``: run the matrix and print cases x backends."""

from __future__ import annotations

import sys

from tests.bad_inputs.runner import run_all, summary_table

if __name__ == "__main__":
    backends = sys.argv[1].split(",") if len(sys.argv) > 1 else None
    results = run_all(backends)
    print(summary_table(results))
    sys.exit(0 if all(r["ok"] for per in results.values() for r in per.values()) else 1)
