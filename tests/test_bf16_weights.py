"""bf16 weights under f32 activations (the CPU's mixed mode): products read the weights as stored, the KV pool stays
f32, and the logits follow the f32 model's within bf16's rounding."""

import jax
import jax.numpy as jnp
import numpy as np

import models
from models.layers import project
from paxkv.config import EngineConfig
from paxkv.core.engine import Engine


def test_a_single_row_gives_the_row_of_a_two_row_product():
    """project pads one row to two for bf16 weights (XLA:CPU's one-row bf16 matmul is its slow path)."""
    x = jax.random.normal(jax.random.key(0), (2, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (64, 96), jnp.float32).astype(jnp.bfloat16)
    one, two = project("TD,DF->TF", x[:1], w), project("TD,DF->TF", x, w)
    assert one.shape == (1, 96) and one.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(one), np.asarray(two[:1]), rtol=1e-6, atol=1e-6)
    # The product is bf16 x bf16 with f32 accumulation: exactly the f32 product of the rounded operands.
    rounded = x.astype(jnp.bfloat16).astype(jnp.float32) @ w.astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(two), np.asarray(rounded), rtol=1e-5, atol=1e-5)


def test_bf16_weights_keep_an_f32_pool_and_follow_the_f32_logits(engine_llama_checkpoint):
    f32 = models.load(engine_llama_checkpoint, require_tokenizer=False)
    bf16 = models.load(engine_llama_checkpoint, dtype="bfloat16", require_tokenizer=False)
    assert {leaf.dtype for leaf in jax.tree.leaves(bf16.state)} == {jnp.dtype(jnp.bfloat16)}
    config = dict(num_pages=16, page_size=8, max_num_seqs=2, max_num_batched_tokens=32)
    # "auto" is the activations' dtype, f32 on CPU: K and V are computed in f32, so the pool keeps them so.
    assert Engine(bf16, EngineConfig(**config)).pool.dtype == np.float32
    assert Engine(bf16, EngineConfig(**config, kv_cache_dtype="bfloat16")).pool.dtype == jnp.bfloat16

    prompt = list(range(3, 40))
    logits = {}
    for name, loaded in (("f32", f32), ("bf16", bf16)):
        sequence = models.PagedSequence(loaded.graphdef, loaded.state, loaded.config, max_tokens=48, page_size=8)
        logits[name] = np.concatenate([sequence.feed(prompt), sequence.feed([7])])  # a prefill, then one decode row
    # bf16 keeps 8 significant bits (relative rounding 2^-9 per operand); through 2 layers the logits move by a few
    # times that, far below their spread.
    relative = np.linalg.norm(logits["bf16"] - logits["f32"]) / np.linalg.norm(logits["f32"])
    assert relative < 2**-5, relative
    agree = np.mean(np.argmax(logits["bf16"], -1) == np.argmax(logits["f32"], -1))
    assert agree >= 0.9, agree
