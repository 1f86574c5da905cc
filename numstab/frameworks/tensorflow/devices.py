"""The devices TensorFlow sees (imports TensorFlow)."""

from __future__ import annotations


def devices() -> list[str]:
    import tensorflow as tf

    return [d.name.replace("/physical_device:", "") for d in tf.config.list_physical_devices()]
