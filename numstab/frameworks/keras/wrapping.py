"""What numstab's Keras optimizer wrappers share (imports ``keras`` only)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from numstab.errors import InvalidArgumentError


def built_variables(optimizer: Any, trainable_variables: Sequence[Any] | None) -> list:
    """Build ``optimizer`` on its first ``apply`` (as Keras' own optimizers do) and return the
    variables this call applies to: ``trainable_variables``, or those it was built on."""
    if not optimizer.built:
        if trainable_variables is None:
            raise InvalidArgumentError(
                "Expected trainable_variables on the first call (the optimizer is not "
                "built). Received: trainable_variables=None"
            )
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(list(trainable_variables))
        optimizer.built = True
    if trainable_variables is None:
        return list(optimizer._trainable_variables)
    return list(trainable_variables)
