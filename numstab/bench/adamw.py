"""AdamW written once over backend arrays, so every framework runs the very same formula.

    t = count + 1
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p - lr * ((m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps) + wd * p)

This is torch.optim.AdamW's update (decoupled decay ``p *= 1 - lr * wd``, then the Adam step,
eps added to the bias-corrected sqrt(v)) and optax.adamw's (``eps_root=0``, decay added to the
update and multiplied by the learning rate), up to rounding. keras.optimizers.AdamW differs:
it adds eps to the *uncorrected* sqrt(v) (``lr * sqrt(1 - b2**t) / (1 - b1**t) * m /
(sqrt(v) + eps)``), an effective eps of ``eps * sqrt(1 - b2**t)``; that is why the benchmark
does not use the native optimizers. Weight decay applies to every parameter.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

Array = Any


class AdamWState(NamedTuple):
    count: Array  # int32 0-d: applied steps
    mu: dict[str, Array]
    nu: dict[str, Array]


def adamw_update(
    be: Any,
    params: dict[str, Array],
    grads: dict[str, Array],
    state: AdamWState,
    lr: Array,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> tuple[dict[str, Array], AdamWState]:
    """One AdamW step on float32 params/grads; ``be`` is the numstab backend of the arrays."""
    count = state.count + 1
    t = be.cast(count, "float32")
    correction1 = 1.0 - be.exp(t * math.log(beta1))
    correction2 = 1.0 - be.exp(t * math.log(beta2))
    new_params, mu, nu = {}, {}, {}
    for name, p in params.items():
        g = grads[name]
        mu[name] = beta1 * state.mu[name] + (1.0 - beta1) * g
        nu[name] = beta2 * state.nu[name] + (1.0 - beta2) * (g * g)
        adam = (mu[name] / correction1) / (be.sqrt(nu[name] / correction2) + eps)
        new_params[name] = p - lr * (adam + weight_decay * p)
    return new_params, AdamWState(count, mu, nu)
