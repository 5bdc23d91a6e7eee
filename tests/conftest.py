"""Test setup: CPU only, 8 fake host devices, quick compiles, a compilation cache folder per worker."""

import gc
import os
import sys

import pytest
from subprocess_env import COMPILE_FLAGS

# Must be set before jax initializes its backends: 8 host devices for the mesh tests, and quick compiles.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8", COMPILE_FLAGS]
).strip()


def _write_bytecode_of_what_loads() -> None:
    """Let this process, and every process it starts, write the bytecode of each module it imports.

    CI machines set PYTHONDONTWRITEBYTECODE, under which every process a full run starts (its two workers and at
    least 58 more: the command line, the scripts and their workers) would compile each module it imports from
    source: 12 s to import jax, flax, torch, transformers, orbax and paxkv, against 5.5 s from bytecode. The
    test install does not compile every installed package ahead (uv's --compile-bytecode: 23.5 s of a 33 s
    install); the run writes what it uses the first time it is used (about 8 s more, once, for that set), and the
    processes after read it.
    """
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


_write_bytecode_of_what_loads()

import jax  # noqa: E402

from paxkv.entrypoints.compilation_cache import (  # noqa: E402
    ENV_VAR,
    MIN_SECONDS_ENV_VAR,
    default_cache_dir,
    enable_compilation_cache,
)

# JAX's persistent cache, one folder per xdist worker (the CLI subprocesses the tests start inherit it):
# JAX's cache has no lock, and two workers compiling one program into one folder can read each other's
# half-written entries. It matters: every module loads its own model (SmolLM2 in several), whose step
# programs jit cannot reuse but the cache can. Only compilations of 2 s or more are worth writing.
os.environ[ENV_VAR] = os.path.join(default_cache_dir(), "tests-" + os.environ.get("PYTEST_XDIST_WORKER", "main"))
os.environ.setdefault(MIN_SECONDS_ENV_VAR, "2")
enable_compilation_cache()


# The modules that take longest, longest first (one worker's seconds in a full run on 2026-12-03: 139, 131, 69,
# 47, 44, 42, 38, 36, 35, 34, 33, 27, 24; every other module under 20). xdist hands whole files to the two workers
# (--dist loadfile) in collection order (--no-loadscope-reorder, pyproject.toml), so these start first and the
# short ones fill in at the end. In xdist's own order (most tests first) one worker idled the last 23 s of a run.
LONGEST_MODULES = (
    "test_aot_compile",
    "test_scripts",
    "test_attention_kernels",
    "test_cli",
    "test_batch_jobs",
    "test_speculative",
    "test_tensor_parallel",
    "test_cpu_native_attention",
    "test_reference_attention",
    "test_smollm2",
    "test_multihost",
    "test_llm",
    "test_preemption",
)


def pytest_collection_modifyitems(items):
    """Put the LONGEST_MODULES' tests first, in that order; within a module, and after them, order is kept."""
    rank = {name: index for index, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(os.path.basename(item.nodeid.split("::")[0])[:-3], len(rank)))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each module, so a worker's memory maps stay far below the limit.

    XLA:CPU maps each compiled kernel's code and data into their own memory regions (about three maps per
    kernel) and keeps them while the executable lives, which jit's caches make forever. A test worker
    compiles thousands of kernels: one had 47,000 maps two thirds of the way through a full run, against
    Linux's default vm.max_map_count of 65,530, and at the limit mmap fails and XLA segfaults compiling or
    serializing a program (which crashed a worker in each of five full runs, in whichever test was compiling
    then). jax.clear_caches() releases them (measured: 200 compiles +675 maps, cleared -596).
    """
    yield
    jax.clear_caches()
    gc.collect()


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


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(make_tiny_llama, tmp_path_factory):
    """A folder holding make_tiny_llama(**overrides) saved by transformers, written once per worker per overrides.

    tiny_llama_checkpoint() is TINY_LLAMA itself; most engine tests take engine_llama_checkpoint.
    """
    saved = {}

    def checkpoint(seed: int = 0, **overrides):
        key = (seed, tuple(sorted(overrides.items())))
        if key not in saved:
            path = tmp_path_factory.mktemp("tiny_llama")
            make_tiny_llama(seed, **overrides).save_pretrained(path)
            saved[key] = path
        return saved[key]

    return checkpoint


@pytest.fixture(scope="session")
def engine_llama_checkpoint(tiny_llama_checkpoint):
    """The engine tests' tiny Llama: a 512-token context, and weights large enough that greedy ties are rare."""
    return tiny_llama_checkpoint(max_position_embeddings=512, initializer_range=0.1)


# The word-level vocabulary of word_level_llama: "w0" ... "w252" after three specials.
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]


@pytest.fixture(scope="session")
def word_level_llama(tmp_path_factory, make_tiny_llama):
    """A folder the CLI loads in a second: a tiny Llama (4 KV heads) with a word-level tokenizer over WORDS."""
    import json

    import tokenizers

    directory = tmp_path_factory.mktemp("word_level_llama")
    make_tiny_llama(num_attention_heads=8, num_key_value_heads=4, initializer_range=0.1).save_pretrained(directory)
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return directory


# The chat template of add_byte_level_tokenizer's models: "role: content" lines, then "assistant:".
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def with_byte_level_tokenizer(checkpoint, folder):
    """A copy of the model folder `checkpoint` (vocabulary 256) in `folder`, given a byte-level tokenizer (token
    id = byte) and CHAT_TEMPLATE; returns `folder`."""
    import json
    import shutil

    import tokenizers

    # GPT-2's byte-to-character map, which the ByteLevel pre-tokenizer applies: token id = byte value.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE({c: b for b, c in chars.items()}, []))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    shutil.copytree(checkpoint, folder)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return folder
