"""Public import path of ``numstab.frameworks.keras.losses``.

The code lives there, with the rest of its framework's code; this module IS that module
(every name, private ones included, resolves as before)."""

import sys

from numstab.frameworks.keras import losses as _module

sys.modules[__name__] = _module
