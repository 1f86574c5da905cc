"""Framework integrations: numstab's functional core inside each framework's training loop.

Import the submodule of your framework (``numstab.integrations.torch``, ``.optax``,
``.keras``); this package imports none of them.
"""
