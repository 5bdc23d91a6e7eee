"""Test setup: CPU only, 8 fake host devices, a persistent compilation cache folder per worker."""

import os

import pytest

# Must be set before jax initializes its backends.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from paxkv.compilation_cache import (  # noqa: E402
    ENV_VAR,
    MIN_SECONDS_ENV_VAR,
    default_cache_dir,
    enable_compilation_cache,
)

# JAX's persistent cache, one folder per xdist worker (subprocesses inherit it): JAX's cache has no lock,
# and two workers compiling one program into one folder can read each other's half-written entries.
# It matters: every test module loads its own model, whose step programs jit cannot reuse but the
# persistent cache can.
os.environ[ENV_VAR] = os.path.join(default_cache_dir(), "tests-" + os.environ.get("PYTEST_XDIST_WORKER", "main"))
# Only compilations of 2 s or more (the models' step programs): jaxlib 0.10.2 segfaults now and then serializing
# an executable for the cache, so the many quick ones are not written (see enable_compilation_cache).
os.environ.setdefault(MIN_SECONDS_ENV_VAR, "2")
enable_compilation_cache()


# The tiny Llama most model tests share: 2 layers, hidden 64, 4 query and 2 KV heads, vocab 256.
TINY_LLAMA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    intermediate_size=128,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="session")
def make_tiny_llama():
    """Build a random transformers LlamaForCausalLM (eval mode) from TINY_LLAMA plus overrides."""

    def make(seed: int = 0, **overrides):
        import torch
        import transformers

        torch.manual_seed(seed)
        config = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})
        return transformers.LlamaForCausalLM(config).eval()

    return make
