"""A transformers ``Cache`` in a tree (docs §6, §15.1): what a Hugging Face causal LM
returns as its ``cache`` by default (``use_cache=True``).

Before: the cache was a leaf, so ``find_nonfinite``, ``assert_finite`` and
``check_numerics(...).watch`` on ``model(input_ids=..., labels=...)`` raised
``InvalidArgumentError: Expected tree leaves to be an array of numbers. Received: tree
leaves of type DynamicCache``. A cache is read as its tensors now, layer by layer
(``cache.layers[0].keys``); the functions that rebuild a tree still raise a typed error.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import numstab as ns
from numstab import InvalidArgumentError, NonFiniteError
from numstab.tree import leaves_with_paths

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
cache_utils = pytest.importorskip("transformers.cache_utils")

NAN = float("nan")


@pytest.fixture(scope="module")
def output():
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_embd=8, n_layer=2, n_head=2, vocab_size=16, n_positions=8, eos_token_id=None
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 16, (1, 4))
    with torch.no_grad():
        return model(input_ids=ids, labels=ids)


def _cache(out):
    (cache,) = (x for x in out.values() if isinstance(x, cache_utils.Cache))
    return cache


def test_a_model_output_is_read_with_its_cache(output):
    key = next(k for k, x in output.items() if isinstance(x, cache_utils.Cache))
    assert ns.find_nonfinite(output) == [] and ns.assert_finite(output) is None
    with ns.check_numerics(mode="sentinel") as cn:
        cn.watch(output, "out")
    names = [p for p, _ in leaves_with_paths(output)]
    assert names[-4:] == [
        f"[{key!r}].layers[{i}].{kv}" for i in (0, 1) for kv in ("keys", "values")
    ]

    values = _cache(output).layers[1].values
    values[0, 0, 0, 0] = NAN
    try:
        (record,) = ns.find_nonfinite(output)
        assert (record.path, record.nan_count) == (f"{key}.layers[1].values", 1)
        assert [r.path for r in ns.find_nonfinite([output])] == [f"[0][{key!r}].layers[1].values"]
        assert [r.path for r in ns.find_nonfinite(_cache(output))] == [".layers[1].values"]
        with pytest.raises(NonFiniteError) as info:
            ns.assert_finite(output, "out")
        assert info.value.paths == (f"{key}.layers[1].values",)
        with pytest.raises(NonFiniteError), ns.check_numerics(mode="sentinel") as cn:
            cn.watch(output, "out")
    finally:
        values[0, 0, 0, 0] = 0.0


def test_a_cache_is_not_rebuilt(output):
    """Before, the same class of error, as a leaf that is not an array."""
    for fn in (ns.clip_by_global_norm, ns.clip_by_value):
        args = (1.0,) if fn is ns.clip_by_global_norm else (-1.0, 1.0)
        with pytest.raises(InvalidArgumentError, match=r"DynamicCache.*use_cache=False"):
            fn(output, *args)


def test_encoder_decoder_and_linear_attention_caches():
    self_attn = cache_utils.DynamicCache()
    self_attn.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)
    both = cache_utils.EncoderDecoderCache(self_attn, cache_utils.DynamicCache())
    assert [p for p, _ in leaves_with_paths(both)] == [
        ".self_attention_cache.layers[0].keys",
        ".self_attention_cache.layers[0].values",
    ]
    layer = cache_utils.LinearAttentionLayer()
    layer.conv_states[0] = torch.tensor([1.0, NAN])
    (record,) = ns.find_nonfinite(cache_utils.Cache(layers=[layer]))
    assert (record.path, record.nan_count) == (".layers[0].conv_states[0]", 1)


def test_transformers_imported_after_numstab_walked_trees():
    """numstab never imports transformers; a cache type seen later is still opened."""
    code = (
        "import sys, torch, numstab as ns\n"
        "ns.tree.flatten({'a': torch.ones(2), 'b': [object()]})\n"
        "assert 'transformers' not in sys.modules\n"
        "from transformers.cache_utils import DynamicCache\n"
        "c = DynamicCache(); c.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2) / 0, 0)\n"
        "print([r.path for r in ns.find_nonfinite({'c': c})])\n"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['c.layers[0].values']"
