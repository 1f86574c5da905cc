"""The devices torch sees (imports torch)."""

from __future__ import annotations


def devices() -> list[str]:
    import torch

    found = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        found.append("mps")
    return found
