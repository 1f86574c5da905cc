"""PyTorch integration, public import path: the drop-in ``GradScaler``, ``clip_grad_norm_``,
the adaptive clippers ``ZClip`` and ``agc_``, and ``reduction_group`` (their code lives in
``numstab/frameworks/torch/``)."""

from numstab.frameworks.torch.clipping import ZClip, agc_, clip_grad_norm_
from numstab.frameworks.torch.distributed import reduction_group
from numstab.frameworks.torch.grad_scaler import GradScaler

__all__ = ["GradScaler", "ZClip", "agc_", "clip_grad_norm_", "reduction_group"]
