"""What the data firewall needs from torch's data loading."""

from __future__ import annotations

from torch.utils.data import default_collate, get_worker_info

__all__ = ["default_collate", "in_worker"]


def in_worker() -> bool:
    """True inside a DataLoader worker process."""
    return get_worker_info() is not None
