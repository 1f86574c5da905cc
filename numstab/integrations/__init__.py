"""Framework integrations: numstab's functional core inside each framework's training loop.

Import the submodule of your framework (``numstab.frameworks.torch.grad_scaler``, ``.optax``,
``.keras``); this package imports none of them.
"""
