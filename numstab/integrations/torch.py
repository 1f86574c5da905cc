"""Public import path of ``numstab.frameworks.torch.grad_scaler``.

The code lives there, with the rest of its framework's code; this module IS that module
(every name, private ones included, resolves as before)."""

import sys

from numstab.frameworks.torch import grad_scaler as _module

sys.modules[__name__] = _module
