"""Run every case on one backend: ``python -m tests.bad_inputs.worker BACKEND OUT.jsonl``.

One JSON line per case, written and flushed before the next case starts, so a crash of the
process is pinned on the case that was running (the first case without a line).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def outcome(case, ctx) -> dict:
    """``ok`` and what happened: ``raised`` (class, message), ``returned`` or ``raw``."""
    import numstab
    from numstab import errors
    from tests.bad_inputs.ctx import Raises

    numstab.set_backend(None)
    try:
        result = case.call(ctx)
    except errors.NumstabError as exc:
        got = {"kind": "raised", "error": type(exc).__name__, "message": str(exc)[:400]}
        if isinstance(case.expect, Raises):
            right_class = isinstance(exc, case.expect.error)
            named = case.expect.argument in str(exc)
            got["ok"] = right_class and named
            got["why"] = (
                ""
                if got["ok"]
                else (
                    "wrong error class" if not right_class else "message does not name the argument"
                )
            )
        else:
            got.update(ok=False, why="a valid input raised")
        return got
    except Exception as exc:  # a raw framework or Python error: always a failure
        tail = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return {
            "kind": "raw",
            "error": type(exc).__name__,
            "message": tail[:400],
            "ok": False,
            "why": "not a NumstabError",
        }
    finally:
        numstab.set_backend(None)
    if isinstance(case.expect, Raises):
        return {"kind": "returned", "ok": False, "why": "no error (silent result)"}
    try:
        ok = bool(case.expect.check(result, ctx))
    except Exception as exc:
        return {"kind": "returned", "ok": False, "why": f"check failed: {exc!r}"[:400]}
    return {"kind": "returned", "ok": ok, "why": "" if ok else "wrong valid result"}


def main(backend: str, out_path: str) -> None:
    from tests.bad_inputs.cases import all_cases
    from tests.bad_inputs.ctx import Ctx

    ctx = Ctx(backend)
    with open(out_path, "w") as out:
        for case in all_cases():
            row = {"case": case.id, "backend": backend, **outcome(case, ctx)}
            out.write(json.dumps(row) + "\n")
            out.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
