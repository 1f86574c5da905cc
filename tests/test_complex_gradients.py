"""Complex parameters (the Fourier weights of a spectral layer, as in a Fourier Neural
Operator): the global norm, clipping and the training guard take complex gradients by |z|,
as torch's ``clip_grad_norm_`` and optax's ``clip_by_global_norm`` do (docs/semantics.md §3,
§7.2). Before, ``global_norm`` and the clips refused them, and the torch guard died in
torch's ``linalg.vector_norm: dtype should be complex for complex inputs``."""

from __future__ import annotations

import numpy as np
import pytest

import numstab as ns

RTOL = 2e-6  # float32 sums of a few hundred squares, then a root: a few float32 roundings


def _spectral_model(torch):
    class Spectral(torch.nn.Module):
        """A Fourier layer: the lowest modes of the input times complex weights."""

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(6, 6, dtype=torch.cfloat) * 0.2)
            self.out = torch.nn.Linear(16, 1)

        def forward(self, x):
            modes = torch.fft.rfft(x, dim=-1)[..., :6]
            return self.out(torch.fft.irfft(modes @ self.weight, n=16, dim=-1))

    torch.manual_seed(0)
    return Spectral()


def test_torch_clip_grad_norm_matches_torch_on_complex_gradients():
    torch = pytest.importorskip("torch")
    from numstab.frameworks.torch.clipping import clip_grad_norm_

    ours, theirs = _spectral_model(torch), _spectral_model(torch)
    x = torch.randn(32, 16)
    for model in (ours, theirs):
        model(x).pow(2).mean().mul(1e3).backward()
    norm = clip_grad_norm_(ours.parameters(), 0.5)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
    torch.testing.assert_close(norm, want, rtol=RTOL, atol=0)
    assert norm > 0.5 and ours.weight.grad.dtype == torch.cfloat
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        # torch divides by norm + 1e-6: the grads differ by that epsilon's share
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=0)


@pytest.mark.parametrize("host_every", [1, 4])
def test_torch_guard_trains_a_model_with_complex_weights(host_every):
    torch = pytest.importorskip("torch")
    model = _spectral_model(torch)
    optimizer = torch.optim.Adam(model.parameters(), 1e-2)
    guard = ns.TrainingGuard(host_every=host_every)
    tg = guard.for_torch(model, optimizer)
    x = torch.randn(32, 16)
    norms = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        norms.append(float(torch.linalg.vector_norm(torch.cat([g.abs().flatten() for g in grads]))))
        assert bool(tg.step(loss))
    tg.flush()
    h = tg.history.as_arrays()
    np.testing.assert_allclose(h["grad_norm"], norms, rtol=RTOL)
    last = [float(torch.linalg.vector_norm(p.grad)) for p in model.parameters()]
    np.testing.assert_allclose(h["layer_norms"][-1], last, rtol=RTOL)


def test_optax_clip_zclip_and_guard_on_complex_parameters():
    jax = pytest.importorskip("jax")
    jnp, optax = jax.numpy, pytest.importorskip("optax")
    from numstab.frameworks.jax.guard import guarded_step
    from numstab.frameworks.jax.optax import zclip

    key = jax.random.PRNGKey(0)
    params = {"w": jax.random.normal(key, (6, 6), jnp.complex64) * 0.2, "b": jnp.zeros(6)}

    def loss_fn(p, x):
        y = jnp.fft.irfft(jnp.fft.rfft(x, axis=-1)[..., :6] @ p["w"], n=16, axis=-1)
        return jnp.mean(y**2) + jnp.sum(p["b"] ** 2)

    x = jax.random.normal(jax.random.PRNGKey(1), (32, 16))
    grads = jax.grad(loss_fn)(params, x)
    want = optax.global_norm(grads)
    np.testing.assert_allclose(ns.global_norm(grads), want, rtol=RTOL)
    clipped, _ = jax.jit(lambda g: ns.clip_by_global_norm(g, 0.01))(grads)
    theirs, _ = optax.clip_by_global_norm(0.01).update(grads, None)
    for a, b in zip(jax.tree.leaves(clipped), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)
        assert a.dtype == b.dtype

    zc = zclip(warmup_steps=1)
    updates, _ = zc.update(grads, zc.init(params), params)
    assert updates["w"].dtype == jnp.complex64 and bool(ns.all_finite(updates))

    tx = optax.adam(1e-2)
    guard = ns.TrainingGuard()
    og = guard.for_optax()
    opt_state, w0 = tx.init(params), params["w"]
    gstate = og.init(params, opt_state)
    step = jax.jit(lambda *a: guarded_step(guard, tx, *a))
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    want_norm = optax.global_norm(grads)
    new, opt_state, gstate, decision = step(params, opt_state, gstate, loss, grads)
    params, opt_state, gstate = og.after_step(decision, new, opt_state, gstate)
    assert bool(decision.apply) and params["w"].dtype == jnp.complex64
    assert not np.array_equal(params["w"], w0)
    np.testing.assert_allclose(og.history.as_arrays()["grad_norm"][-1], want_norm, rtol=RTOL)
