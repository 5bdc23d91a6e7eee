"""Test setup: CPU only, 8 fake host devices, quick compiles, and a compilation cache for CLI subprocesses only."""

import os

import pytest

# Must be set before jax initializes its backends. The tests' time goes mostly to XLA:CPU compiling many
# small programs: LLVM's optimization level 0 compiles them about a fifth faster (same HLO, same math).
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_force_host_platform_device_count=8",
        "--xla_backend_optimization_level=0",
    ]
).strip()

from paxkv.compilation_cache import ENV_VAR, MIN_SECONDS_ENV_VAR, default_cache_dir  # noqa: E402

# The test processes themselves run without JAX's persistent cache: jaxlib 0.10.2's XLA:CPU segfaults now
# and then serializing an executable into it, and a long-lived process that compiles hundreds of programs
# hit that in every full run (four runs, in four different modules). The CLI subprocesses the tests start
# (each compiles a few programs) keep it, in one folder per xdist worker: JAX's cache has no lock, and two
# workers compiling one program into one folder can read each other's half-written entries.
os.environ[ENV_VAR] = os.path.join(default_cache_dir(), "tests-" + os.environ.get("PYTEST_XDIST_WORKER", "main"))
os.environ.setdefault(MIN_SECONDS_ENV_VAR, "2")


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
