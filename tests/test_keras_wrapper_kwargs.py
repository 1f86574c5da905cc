"""numstab's Keras optimizer wrappers refuse a Keras optimizer argument they do not take with
``InvalidArgumentError`` naming it (§10.3, §13.5), as ``ZClipOptimizer`` already did: before,
``AGCOptimizer`` and ``LossScaleOptimizer`` raised Python's ``TypeError`` for
``gradient_accumulation_steps=2``."""

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")
if keras.backend.backend() != "tensorflow":
    pytest.skip("Keras runs another backend in this process", allow_module_level=True)

from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.integrations.keras import LossScaleOptimizer  # noqa: E402
from numstab.integrations.keras_clipping import AGCOptimizer, ZClipOptimizer  # noqa: E402


@pytest.mark.parametrize("wrapper", [AGCOptimizer, LossScaleOptimizer, ZClipOptimizer])
@pytest.mark.parametrize("keyword", ["gradient_accumulation_steps", "weight_decay"])
def test_a_keras_optimizer_argument_is_a_typed_error(wrapper, keyword):
    with pytest.raises(InvalidArgumentError, match=rf"Received: {keyword}=2"):
        wrapper(keras.optimizers.Adam(), **{keyword: 2})


def test_the_message_names_the_wrapper_arguments_and_why():
    with pytest.raises(
        InvalidArgumentError,
        match=r"AGCOptimizer \(inner_optimizer, clip_factor.*"
        r"per-micro-batch",
    ):
        AGCOptimizer(keras.optimizers.Adam(), gradient_accumulation_steps=2)
