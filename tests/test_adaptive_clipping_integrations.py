"""ZClip against the real ``zclip`` package (torch), AGC against the real
``optax.adaptive_grad_clip``, and the torch / optax integrations."""

from __future__ import annotations

import numpy as np
import pytest

from numstab.errors import InvalidArgumentError


def _spiky_grads(steps=40, seed=7):
    """Per step: a (3, 4) weight gradient (torch layout) and a (3,) bias gradient, global
    norm ~0.5 (under zclip's max_grad_norm=1) with spikes at 30, 33, 34 and in the warmup."""
    rng = np.random.default_rng(seed)
    for i in range(steps):
        s = 0.15 * (1 + 0.1 * rng.normal()) * {5: 6, 30: 15, 33: 40, 34: 40}.get(i, 1)
        yield rng.normal(0, s, (3, 4)).astype(np.float32), rng.normal(0, s, 3).astype(np.float32)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"max_grad_norm": None, "clip_option": "mean"}, {"mode": "percentile", "alpha": 0.9}],
)
def test_torch_zclip_matches_the_zclip_package(kwargs):
    import torch
    import zclip

    from numstab.integrations.torch import ZClip

    ref_model, model = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    ref, ours = zclip.ZClip(**kwargs), ZClip(**kwargs)
    clipped = 0
    for w, b in _spiky_grads():
        for m in (ref_model, model):
            m.weight.grad, m.bias.grad = torch.tensor(w), torch.tensor(b)
        ref_norm = ref.step(ref_model)
        norm = ours.step(model)
        assert isinstance(norm, torch.Tensor) and norm.dtype == torch.float32
        np.testing.assert_allclose(float(norm), ref_norm, rtol=1e-6)
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-8)
        clipped += not np.allclose(model.weight.grad.numpy(), w)
        if ref.initialized:
            np.testing.assert_allclose(float(ours.state.mean), ref.mean, rtol=1e-5)
            np.testing.assert_allclose(float(ours.state.var), ref.var, rtol=1e-4)
    assert clipped >= 3
    # the state round-trips
    again = ZClip(**kwargs)
    again.load_state_dict(ours.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(again.state, ours.state, strict=True))
    # a foreign dict, or one of a ZClip with another warmup, is refused (was a TypeError)
    for bad, match in [({"x": 1}, "with the keys"), ([1], "with the keys")]:
        with pytest.raises(InvalidArgumentError, match=match):
            again.load_state_dict(bad)
    with pytest.raises(InvalidArgumentError, match="warmup_steps=7"):
        ZClip(**kwargs, warmup_steps=7).load_state_dict(ours.state_dict())


def test_optax_zclip_under_jit_matches_the_zclip_package():
    import jax
    import jax.numpy as jnp
    import optax
    import torch
    import zclip

    from numstab.integrations.optax import zclip as zclip_tx

    tx = optax.chain(zclip_tx(), optax.sgd(1.0))
    params = {"b": jnp.zeros(3), "w": jnp.zeros((4, 3))}
    state = tx.init(params)
    update = jax.jit(tx.update)
    ref, model = zclip.ZClip(), torch.nn.Linear(4, 3)
    for w, b in _spiky_grads():
        model.weight.grad, model.bias.grad = torch.tensor(w), torch.tensor(b)
        ref.step(model)
        updates, state = update({"b": jnp.asarray(b), "w": jnp.asarray(w.T)}, state)
        np.testing.assert_allclose(-updates["w"], model.weight.grad.numpy().T, rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(-updates["b"], model.bias.grad.numpy(), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(float(state[0].mean), ref.mean, rtol=1e-5)


def _agc_tree(rng):
    return {
        "conv": rng.normal(0, 1, (3, 3, 2, 4)).astype(np.float32),
        "dense": rng.normal(0, 1, (5, 3)).astype(np.float32),
        "bias": rng.normal(0, 1, (3,)).astype(np.float32),
        "scale": np.float32(0.5),
    }


def test_optax_agc_matches_optax_adaptive_grad_clip_under_jit():
    import jax
    import jax.numpy as jnp
    import optax

    from numstab.integrations.optax import agc

    rng = np.random.default_rng(0)
    params = jax.tree.map(jnp.asarray, _agc_tree(rng))
    ours, ref = (
        optax.chain(agc(), optax.adam(1e-2)),
        optax.chain(optax.adaptive_grad_clip(0.01), optax.adam(1e-2)),
    )
    s1, s2 = ours.init(params), ref.init(params)

    @jax.jit
    def step(s1, s2, grads):
        return ours.update(grads, s1, params), ref.update(grads, s2, params)

    for i in range(3):
        grads = jax.tree.map(
            lambda x, s=0.02 * (i + 1): jnp.asarray(rng.normal(0, s, np.shape(x)), jnp.float32),
            params,
        )
        (u1, s1), (u2, s2) = step(s1, s2, grads)
        for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)
    with pytest.raises(InvalidArgumentError, match="params"):
        agc().update(grads, optax.EmptyState(), None)


def test_torch_agc_is_optax_on_transposed_weights():
    """torch puts the output axis first: agc_ (layout "oi") on a Linear/Conv2d weight equals
    optax's AGC on the same weight in JAX's (in, out) / HWIO layout."""
    import jax.numpy as jnp
    import optax
    import torch

    from numstab.integrations.torch import agc_

    rng = np.random.default_rng(2)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4, 3))
    grads = {}
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        g = (rng.normal(0, 0.02, shape) * rng.choice([0.1, 10.0], shape)).astype(np.float32)
        p.grad = torch.tensor(g)
        grads[name] = g
    agc_(model)
    to_io = {4: (2, 3, 1, 0), 2: (1, 0), 1: (0,)}
    params = {
        n: jnp.asarray(p.detach().numpy().transpose(to_io[p.ndim]))
        for n, p in model.named_parameters()
    }
    want, _ = optax.adaptive_grad_clip(0.01).update(
        {n: jnp.asarray(g.transpose(to_io[g.ndim])) for n, g in grads.items()},
        optax.EmptyState(),
        params,
    )
    changed = 0
    for name, p in model.named_parameters():
        np.testing.assert_allclose(
            p.grad.numpy(),
            np.asarray(want[name]).transpose(np.argsort(to_io[p.ndim])),
            rtol=1e-5,
            atol=1e-9,
        )
        changed += not np.array_equal(p.grad.numpy(), grads[name])
    assert changed > 0


def test_torch_zclip_fp16_grads_norm_in_float32():
    """float16 gradients whose squares overflow float16: the norm is still right."""
    import torch

    from numstab.integrations.torch import ZClip

    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    p.grad = torch.tensor([300.0, 400.0], dtype=torch.float16)
    zc = ZClip(warmup_steps=1)
    norm = zc.step([p])
    assert float(norm) == pytest.approx(500.0)
    np.testing.assert_allclose(p.grad.float().numpy(), [0.6, 0.8], rtol=1e-3)  # to max_grad_norm=1
    assert p.grad.dtype == torch.float16


def test_agc_pairs_leaves_by_path_not_position():
    """jax.jit returns dicts with sorted keys: a gradient dict in another key order than the
    params must still meet its own parameter."""
    from numstab.adaptive_clipping import AGC

    params = {"w": np.full((4, 2), 1.0, np.float32), "b": np.full(2, 100.0, np.float32)}
    grads = {"b": np.full(2, 5.0, np.float32), "w": np.full((4, 2), 5.0, np.float32)}
    out = AGC(clip_factor=0.1).clip(grads, params)
    assert list(out) == ["b", "w"]
    np.testing.assert_array_equal(out["b"], grads["b"])  # |g|=7.1 < 0.1 * 141: untouched
    np.testing.assert_allclose(np.linalg.norm(out["w"], axis=0), [0.2, 0.2], rtol=1e-6)
    with pytest.raises(InvalidArgumentError, match="no parameter at \\['x'\\]"):
        AGC().clip({"x": grads["b"]}, {"b": params["b"]})
