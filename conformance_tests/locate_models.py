"""One small transformer-ish network (embed -> 2 blocks -> norm_f -> head) with identical
NumPy weights in torch, Keras 3 and plain JAX, for locate_nonfinite conformance and the
benchmark. Layer names are the same everywhere: "embed", "blocks.1.attn.v",
"blocks.0.norm1", "blocks.1.mlp.fc1", "norm_f", "head".

Planted faults (``fault=``):
- ``"inf_weight"``: ``blocks.1.attn.v`` weight[0, 0] = inf (forward, that layer);
- ``"zero_div"``: ``blocks.0.norm1`` has eps = 0, so the all-zero padding row of the
  embedding (token 0) gives 0/0 there; inputs without token 0 stay finite;
- ``"fp16_backward"``: ``blocks.1.mlp.fc1`` computes in float16; its forward is finite,
  but with the large loss scale of ``loss_fn(scale=LOSS_SCALE)`` its backward overflows.
"""

from __future__ import annotations

import numpy as np

VOCAB, DIM, HIDDEN, BLOCKS = 11, 8, 16, 2
LOSS_SCALE = 2.0**27
FAULT_LAYER = {
    "inf_weight": "blocks.1.attn.v",
    "zero_div": "blocks.0.norm1",
    "fp16_backward": "blocks.1.mlp.fc1",
}
FAULT_PHASE = {"inf_weight": "forward", "zero_div": "forward", "fp16_backward": "backward"}


def weights(
    fault: str | None = None,
    seed: int = 0,
    *,
    vocab: int = VOCAB,
    dim: int = DIM,
    hidden: int = HIDDEN,
) -> dict:
    """Nested dict of float32 NumPy weights; Linear weights are (in, out). The builders
    read the sizes from the weights (the benchmark uses larger ones)."""
    rng = np.random.default_rng(seed)

    def linear(n_in, n_out):
        return {
            "w": rng.normal(0, n_in**-0.5, (n_in, n_out)).astype(np.float32),
            "b": rng.normal(0, 0.1, (n_out,)).astype(np.float32),
        }

    def norm():
        return {"g": (1 + rng.normal(0, 0.1, (dim,))).astype(np.float32), "eps": 1e-6}

    embed = rng.normal(0, 1, (vocab, dim)).astype(np.float32)
    embed[0] = 0.0  # padding row
    params = {
        "embed": {"w": embed},
        "blocks": [
            {
                "norm1": norm(),
                "attn": {k: linear(dim, dim) for k in ("q", "k", "v", "proj")},
                "norm2": norm(),
                "mlp": {"fc1": linear(dim, hidden), "fc2": linear(hidden, dim)},
            }
            for _ in range(BLOCKS)
        ],
        "norm_f": norm(),
        "head": linear(dim, vocab),
    }
    if fault == "inf_weight":
        params["blocks"][1]["attn"]["v"]["w"][0, 0] = np.inf
    elif fault == "zero_div":
        params["blocks"][0]["norm1"]["eps"] = 0.0
    return params


def fp16_layers(fault: str | None) -> set[str]:
    return {"blocks.1.mlp.fc1"} if fault == "fp16_backward" else set()


def tokens(
    with_padding: bool, batch: int = 2, seq: int = 5, seed: int = 1, vocab: int = VOCAB
) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, (batch, seq)).astype(np.int32)
    if with_padding:
        ids[1, -1] = 0
    return ids


def targets(batch: int = 2, seq: int = 5, seed: int = 2, vocab: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, (batch, seq, vocab)).astype(np.float32)


# -- torch -------------------------------------------------------------------------------
def torch_model(params: dict, fault: str | None = None):
    import torch
    from torch import nn

    half = fp16_layers(fault)

    class Linear(nn.Linear):
        def __init__(self, p, fp16):
            super().__init__(*p["w"].shape)
            with torch.no_grad():
                self.weight.copy_(torch.from_numpy(p["w"].T.copy()))
                self.bias.copy_(torch.from_numpy(p["b"]))
            self.fp16 = fp16

        def forward(self, x):
            if self.fp16:
                return nn.functional.linear(x.half(), self.weight.half(), self.bias.half()).float()
            return super().forward(x)

    class RMSNorm(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.g = nn.Parameter(torch.from_numpy(p["g"]))
            self.eps = p["eps"]

        def forward(self, x):
            return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.g

    class Attention(nn.Module):
        def __init__(self, p, name):
            super().__init__()
            for k in ("q", "k", "v", "proj"):
                setattr(self, k, Linear(p[k], f"{name}.{k}" in half))

        def forward(self, x):
            q, k, v = self.q(x), self.k(x), self.v(x)
            att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
            return self.proj(att @ v)

    class MLP(nn.Module):
        def __init__(self, p, name):
            super().__init__()
            self.fc1 = Linear(p["fc1"], f"{name}.fc1" in half)
            self.fc2 = Linear(p["fc2"], f"{name}.fc2" in half)

        def forward(self, x):
            return self.fc2(torch.tanh(self.fc1(x)))

    class Block(nn.Module):
        def __init__(self, p, name):
            super().__init__()
            self.norm1, self.norm2 = RMSNorm(p["norm1"]), RMSNorm(p["norm2"])
            self.attn = Attention(p["attn"], name + ".attn")
            self.mlp = MLP(p["mlp"], name + ".mlp")

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(*params["embed"]["w"].shape)
            with torch.no_grad():
                self.embed.weight.copy_(torch.from_numpy(params["embed"]["w"]))
            self.blocks = nn.ModuleList(
                Block(p, f"blocks.{i}") for i, p in enumerate(params["blocks"])
            )
            self.norm_f = RMSNorm(params["norm_f"])
            self.head = Linear(params["head"], False)

        def forward(self, ids):
            x = self.embed(ids.long())
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm_f(x))

    return Model()


def torch_loss(logits, targets):
    """``scale * mean(logits * t)`` with ``targets = (t, scale)`` (one function object for
    every fault, so JAX compiles once per model)."""
    t, scale = targets
    return scale * (logits * t).mean()


# -- Keras 3 (TensorFlow backend) ----------------------------------------------------------
def keras_model(params: dict, fault: str | None = None, *, sep: str = "."):
    """Keras 3 layers named as torch's modules (``blocks.1.attn.v``); ``sep="_"`` names the
    blocks ``blocks_1`` instead, for Keras on torch, whose parameter names cannot hold dots."""
    import keras
    from keras import ops

    half = fp16_layers(fault)

    class Linear(keras.layers.Layer):
        def __init__(self, p, fp16, **kw):
            super().__init__(**kw)
            self.p, self.fp16 = p, fp16

        def build(self, shape):
            self.w = self.add_weight(shape=self.p["w"].shape, name="kernel")
            self.b = self.add_weight(shape=self.p["b"].shape, name="bias")

        def load(self):
            self.w.assign(self.p["w"])
            self.b.assign(self.p["b"])

        def call(self, x):
            if self.fp16:
                y = ops.matmul(ops.cast(x, "float16"), ops.cast(self.w, "float16"))
                return ops.cast(y + ops.cast(self.b, "float16"), "float32")
            return ops.matmul(x, self.w) + self.b

    class RMSNorm(keras.layers.Layer):
        def __init__(self, p, **kw):
            super().__init__(**kw)
            self.p, self.eps = p, p["eps"]

        def build(self, shape):
            self.g = self.add_weight(shape=self.p["g"].shape, name="g")

        def load(self):
            self.g.assign(self.p["g"])

        def call(self, x):
            return x / ops.sqrt(ops.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.g

    class Attention(keras.layers.Layer):
        def __init__(self, p, path, **kw):
            super().__init__(**kw)
            self.q, self.k, self.v, self.proj = (
                Linear(p[k], f"{path}.{k}" in half, name=k) for k in ("q", "k", "v", "proj")
            )

        def call(self, x):
            q, k, v = self.q(x), self.k(x), self.v(x)
            att = ops.matmul(q, ops.transpose(k, (0, 2, 1))) / q.shape[-1] ** 0.5
            att = ops.softmax(att, axis=-1)
            return self.proj(ops.matmul(att, v))

    class MLP(keras.layers.Layer):
        def __init__(self, p, path, **kw):
            super().__init__(**kw)
            self.fc1 = Linear(p["fc1"], f"{path}.fc1" in half, name="fc1")
            self.fc2 = Linear(p["fc2"], f"{path}.fc2" in half, name="fc2")

        def call(self, x):
            return self.fc2(ops.tanh(self.fc1(x)))

    class Block(keras.layers.Layer):
        def __init__(self, p, path, **kw):
            super().__init__(**kw)
            self.norm1 = RMSNorm(p["norm1"], name="norm1")
            self.attn = Attention(p["attn"], path + ".attn", name="attn")
            self.norm2 = RMSNorm(p["norm2"], name="norm2")
            self.mlp = MLP(p["mlp"], path + ".mlp", name="mlp")

        def call(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class Embed(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=params["embed"]["w"].shape, name="embeddings")

        def load(self):
            self.w.assign(params["embed"]["w"])

        def call(self, ids):
            return ops.take(self.w, ids, axis=0)

    class Model(keras.Model):
        def __init__(self):
            super().__init__(name="model")
            self.embed = Embed(name="embed")
            self.blocks = [
                Block(p, f"blocks.{i}", name=f"blocks{sep}{i}")
                for i, p in enumerate(params["blocks"])
            ]
            self.norm_f = RMSNorm(params["norm_f"], name="norm_f")
            self.head = Linear(params["head"], False, name="head")

        def call(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm_f(x))

    model = Model()
    model(np.zeros((1, 2), np.int32))  # build, then set the weights
    for sub in model._flatten_layers(include_self=False):
        if hasattr(sub, "load"):
            sub.load()
    return model


def tf_loss(logits, targets):
    import tensorflow as tf

    t, scale = targets
    return scale * tf.reduce_mean(logits * t)


# -- plain JAX with numstab.locate.jax.layer ------------------------------------------------
def jax_model(fault: str | None = None):
    """(model(params, ids), params as jax arrays). eps values stay static Python floats."""
    import jax.numpy as jnp

    from numstab.frameworks.jax.locate import layer

    half = fp16_layers(fault)

    def linear(fp16):
        def fn(p, x):
            if fp16:
                y = x.astype(jnp.float16) @ p["w"].astype(jnp.float16) + p["b"].astype(jnp.float16)
                return y.astype(jnp.float32)
            return x @ p["w"] + p["b"]

        return fn

    def rmsnorm(p, x):
        return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + p["eps"]) * p["g"]

    def attention(path):
        def fn(p, x):
            q, k, v = (layer(n, linear(f"{path}.{n}" in half), p[n], x) for n in ("q", "k", "v"))
            att = jax_softmax(q @ jnp.swapaxes(k, -1, -2) / q.shape[-1] ** 0.5)
            return layer("proj", linear(f"{path}.proj" in half), p["proj"], att @ v)

        return fn

    def mlp(path):
        def fn(p, x):
            h = jnp.tanh(layer("fc1", linear(f"{path}.fc1" in half), p["fc1"], x))
            return layer("fc2", linear(f"{path}.fc2" in half), p["fc2"], h)

        return fn

    def block(path):
        def fn(p, x):
            x = x + layer(
                "attn", attention(path + ".attn"), p["attn"], layer("norm1", rmsnorm, p["norm1"], x)
            )
            return x + layer(
                "mlp", mlp(path + ".mlp"), p["mlp"], layer("norm2", rmsnorm, p["norm2"], x)
            )

        return fn

    def embed(p, ids):
        return p["w"][ids]

    blocks = [block(f"blocks.{i}") for i in range(BLOCKS)]

    def model(params, ids):
        x = layer("embed", embed, params["embed"], ids)
        for i, fn in enumerate(blocks):
            x = layer(f"blocks.{i}", fn, params["blocks"][i], x)
        return layer(
            "head", linear(False), params["head"], layer("norm_f", rmsnorm, params["norm_f"], x)
        )

    return model


def jax_softmax(x):
    import jax

    return jax.nn.softmax(x, axis=-1)


def jax_params(params: dict):
    """NumPy weights as jax arrays (eps stays a Python float: a static hyperparameter)."""
    import jax.numpy as jnp

    def convert(node):
        if isinstance(node, dict):
            return {k: convert(v) for k, v in node.items()}
        if isinstance(node, list):
            return [convert(v) for v in node]
        return jnp.asarray(node) if isinstance(node, np.ndarray) else node

    return convert(params)


def jax_loss(logits, targets):
    import jax.numpy as jnp

    t, scale = targets
    return scale * jnp.mean(logits * t)


# -- Equinox and Flax NNX: the same network as modules (their own layer names) --------------
def _jnp_linear(x, w, b, fp16):
    import jax.numpy as jnp

    if fp16:
        return (x.astype(jnp.float16) @ w.astype(jnp.float16) + b.astype(jnp.float16)).astype(
            jnp.float32
        )
    return x @ w + b


def _jnp_attention(q, k, v):
    import jax.numpy as jnp

    return jax_softmax(q @ jnp.swapaxes(k, -1, -2) / q.shape[-1] ** 0.5) @ v


def equinox_model(params: dict, fault: str | None = None):
    """Equinox modules; names are field paths: ``blocks[1].attn.v``."""
    import equinox as eqx
    import jax.numpy as jnp

    half = fp16_layers(fault)

    class Linear(eqx.Module):
        w: jnp.ndarray
        b: jnp.ndarray
        fp16: bool = eqx.field(static=True)

        def __call__(self, x):
            return _jnp_linear(x, self.w, self.b, self.fp16)

    class RMSNorm(eqx.Module):
        g: jnp.ndarray
        eps: float = eqx.field(static=True)

        def __call__(self, x):
            return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.g

    class Attention(eqx.Module):
        q: Linear
        k: Linear
        v: Linear
        proj: Linear

        def __call__(self, x):
            return self.proj(_jnp_attention(self.q(x), self.k(x), self.v(x)))

    class MLP(eqx.Module):
        fc1: Linear
        fc2: Linear

        def __call__(self, x):
            return self.fc2(jnp.tanh(self.fc1(x)))

    class Block(eqx.Module):
        norm1: RMSNorm
        attn: Attention
        norm2: RMSNorm
        mlp: MLP

        def __call__(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class Embed(eqx.Module):
        w: jnp.ndarray

        def __call__(self, ids):
            return self.w[ids]

    class Model(eqx.Module):
        embed: Embed
        blocks: list
        norm_f: RMSNorm
        head: Linear

        def __call__(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm_f(x))

    def linear(p, name):
        return Linear(jnp.asarray(p["w"]), jnp.asarray(p["b"]), name in half)

    def norm(p):
        return RMSNorm(jnp.asarray(p["g"]), p["eps"])

    def block(p, name):
        attn = Attention(
            *(linear(p["attn"][k], f"{name}.attn.{k}") for k in ("q", "k", "v", "proj"))
        )
        mlp = MLP(
            linear(p["mlp"]["fc1"], f"{name}.mlp.fc1"), linear(p["mlp"]["fc2"], f"{name}.mlp.fc2")
        )
        return Block(norm(p["norm1"]), attn, norm(p["norm2"]), mlp)

    return Model(
        Embed(jnp.asarray(params["embed"]["w"])),
        [block(p, f"blocks.{i}") for i, p in enumerate(params["blocks"])],
        norm(params["norm_f"]),
        linear(params["head"], "head"),
    )


def nnx_model(params: dict, fault: str | None = None):
    """Flax NNX modules; names are attribute paths: ``blocks.1.attn.v``, as in torch."""
    import jax.numpy as jnp
    from flax import nnx

    half = fp16_layers(fault)

    class Linear(nnx.Module):
        def __init__(self, p, fp16):
            self.w, self.b, self.fp16 = (
                nnx.Param(jnp.asarray(p["w"])),
                nnx.Param(jnp.asarray(p["b"])),
                fp16,
            )

        def __call__(self, x):
            return _jnp_linear(x, self.w[...], self.b[...], self.fp16)

    class RMSNorm(nnx.Module):
        def __init__(self, p):
            self.g, self.eps = nnx.Param(jnp.asarray(p["g"])), p["eps"]

        def __call__(self, x):
            return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.g[...]

    class Attention(nnx.Module):
        def __init__(self, p, name):
            for k in ("q", "k", "v", "proj"):
                setattr(self, k, Linear(p[k], f"{name}.{k}" in half))

        def __call__(self, x):
            return self.proj(_jnp_attention(self.q(x), self.k(x), self.v(x)))

    class MLP(nnx.Module):
        def __init__(self, p, name):
            self.fc1 = Linear(p["fc1"], f"{name}.fc1" in half)
            self.fc2 = Linear(p["fc2"], f"{name}.fc2" in half)

        def __call__(self, x):
            return self.fc2(jnp.tanh(self.fc1(x)))

    class Block(nnx.Module):
        def __init__(self, p, name):
            self.norm1, self.norm2 = RMSNorm(p["norm1"]), RMSNorm(p["norm2"])
            self.attn, self.mlp = Attention(p["attn"], name + ".attn"), MLP(p["mlp"], name + ".mlp")

        def __call__(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class Embed(nnx.Module):
        def __init__(self, w):
            self.w = nnx.Param(jnp.asarray(w))

        def __call__(self, ids):
            return self.w[...][ids]

    class Model(nnx.Module):
        def __init__(self):
            self.embed = Embed(params["embed"]["w"])
            self.blocks = nnx.List(Block(p, f"blocks.{i}") for i, p in enumerate(params["blocks"]))
            self.norm_f = RMSNorm(params["norm_f"])
            self.head = Linear(params["head"], False)

        def __call__(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm_f(x))

    return Model()


def linen_model(params: dict, fault: str | None = None):
    """A bound Flax linen module; names are linen scope names: ``blocks_1.attn.v``."""
    import flax.linen as nn
    import jax.numpy as jnp

    half = fp16_layers(fault)

    given = nn.initializers.zeros_init()  # only for shapes: the weights are bound below
    dim, vocab = params["embed"]["w"].shape[1], params["embed"]["w"].shape[0]
    hidden = params["blocks"][0]["mlp"]["fc1"]["w"].shape[1]

    class Linear(nn.Module):
        features: int
        fp16: bool = False

        @nn.compact
        def __call__(self, x):
            w = self.param("w", given, (x.shape[-1], self.features))
            return _jnp_linear(x, w, self.param("b", given, (self.features,)), self.fp16)

    class RMSNorm(nn.Module):
        eps: float

        @nn.compact
        def __call__(self, x):
            g = self.param("g", given, (x.shape[-1],))
            return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * g

    class Attention(nn.Module):
        where: str

        def setup(self):
            self.q, self.k, self.v, self.proj = (
                Linear(dim, f"{self.where}.{k}" in half) for k in ("q", "k", "v", "proj")
            )

        def __call__(self, x):
            return self.proj(_jnp_attention(self.q(x), self.k(x), self.v(x)))

    class MLP(nn.Module):
        where: str

        def setup(self):
            self.fc1 = Linear(hidden, f"{self.where}.fc1" in half)
            self.fc2 = Linear(dim, f"{self.where}.fc2" in half)

        def __call__(self, x):
            return self.fc2(jnp.tanh(self.fc1(x)))

    class Block(nn.Module):
        where: str
        eps1: float
        eps2: float

        def setup(self):
            self.norm1, self.norm2 = RMSNorm(self.eps1), RMSNorm(self.eps2)
            self.attn, self.mlp = Attention(self.where + ".attn"), MLP(self.where + ".mlp")

        def __call__(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class Embed(nn.Module):
        @nn.compact
        def __call__(self, ids):
            return self.param("w", given, (vocab, dim))[ids]

    class Model(nn.Module):
        def setup(self):
            self.embed = Embed()
            self.blocks = [
                Block(f"blocks.{i}", p["norm1"]["eps"], p["norm2"]["eps"])
                for i, p in enumerate(params["blocks"])
            ]
            self.norm_f = RMSNorm(params["norm_f"]["eps"])
            self.head = Linear(vocab)

        def __call__(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm_f(x))

    def arrays(tree):
        if isinstance(tree, dict):
            return {k: arrays(v) for k, v in tree.items() if k != "eps"}
        return jnp.asarray(tree)

    variables = {
        "embed": arrays(params["embed"]),
        **{f"blocks_{i}": arrays(p) for i, p in enumerate(params["blocks"])},
        "norm_f": arrays(params["norm_f"]),
        "head": arrays(params["head"]),
    }
    return Model().bind({"params": variables})


# -- the model's own code: the layer "" (torch's root module) -------------------------------
#: case -> what the model's own code does (outside any sub-module call)
ROOT_CASES = {
    "after_child": "log(a(x) - 100): NaN made by the model after a clean sub-module",
    "no_children": "x * w, no sub-module: a NaN input reaches the model's output",
    "own_param_grad": "a(x) + sqrt(w - 1), w = 1: the model's own parameter gradient is inf",
}


def _root_code(case: str, ops, h, w, out: str):
    """What the model computes itself, from ``h`` (``a(x)``, or ``x`` without "a")."""
    if case == "after_child":
        y = ops.log(h - 100)
    elif case == "no_children":
        y = h * w
    else:
        y = h + ops.sqrt(w - 1)
    return {"array": y, "tuple": (h, y), "dict": {"h": h, "y": y}}[out]


def root_net(library: str, case: str, out: str = "array", *, own: bool | None = None):
    """The same network in ``library`` (torch, equinox, nnx, linen or plain jax): the
    sub-module "a" (a 3 -> 3 Linear, weights 1, bias 0) unless ``case == "no_children"``,
    then the model's own code (``_root_code``) with its own parameter ``w = ones(3)`` where
    the case has one. The model is the class ``Net``; the plain JAX function ``net`` has no
    parameter of its own (a constant ``w = 2.0``), nor has torch's with ``own=False``."""
    child = case != "no_children"
    if own is None:
        own = case != "after_child" and library != "jax"
    builders = {"torch": _torch_root, "equinox": _equinox_root, "nnx": _nnx_root}
    builders.update(linen=_linen_root, jax=_jax_root)
    return builders[library](case, out, child, own)


def _torch_root(case, out, child, own):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            if child:
                self.a = torch.nn.Linear(3, 3)
                torch.nn.init.ones_(self.a.weight)
                torch.nn.init.zeros_(self.a.bias)
            if own:
                self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            w = self.w if own else 2.0
            return _root_code(case, torch, self.a(x) if child else x, w, out)

    return Net()


def _equinox_root(case, out, child, own):
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    class Net(eqx.Module):
        a: eqx.nn.Linear | None
        w: jax.Array | None

        def __call__(self, x):
            return _root_code(case, jnp, self.a(x) if child else x, self.w, out)

    a = None
    if child:
        a = eqx.nn.Linear(3, 3, key=jax.random.key(0))
        a = eqx.tree_at(lambda m: (m.weight, m.bias), a, (jnp.ones((3, 3)), jnp.zeros(3)))
    return Net(a, jnp.ones(3) if own else None)


def _nnx_root(case, out, child, own):
    import jax.numpy as jnp
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self):
            if child:
                ones, zeros = nnx.initializers.ones, nnx.initializers.zeros
                self.a = nnx.Linear(3, 3, kernel_init=ones, bias_init=zeros, rngs=nnx.Rngs(0))
            if own:
                self.w = nnx.Param(jnp.ones(3))

        def __call__(self, x):
            w = self.w.value if own else None
            return _root_code(case, jnp, self.a(x) if child else x, w, out)

    return Net()


def _linen_root(case, out, child, own):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class Net(nn.Module):
        def setup(self):
            if child:
                self.a = nn.Dense(3, kernel_init=nn.initializers.ones)
            if own:
                self.w = self.param("w", nn.initializers.ones, (3,))

        def __call__(self, x):
            w = self.w if own else None
            return _root_code(case, jnp, self.a(x) if child else x, w, out)

    x = jnp.ones(3)
    return Net().bind(Net().init(jax.random.key(0), x))


def _jax_root(case, out, child, own):
    import jax.numpy as jnp

    from numstab.frameworks.jax.locate import layer

    p = {"w": jnp.ones((3, 3)), "b": jnp.zeros(3)}

    def linear(p, x):
        return x @ p["w"] + p["b"]

    def net(x):
        return _root_code(case, jnp, layer("a", linear, p, x) if child else x, 2.0, out)

    return net
