"""What the data firewall needs from torch's data loading."""

from __future__ import annotations

import torch.utils.data as torch_data
from torch.utils.data import default_collate

__all__ = ["default_collate", "in_worker"]


def in_worker() -> bool:
    """True inside a DataLoader worker process (looked up at each call, as torch's own
    helpers do)."""
    return torch_data.get_worker_info() is not None
