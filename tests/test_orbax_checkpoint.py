"""Orbax checkpoints: save a tiny HF Llama, restore it bit for bit, onto a mesh, and in bfloat16."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
import torch
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
from models.orbax_checkpoint import MARKER, save_orbax

TOKENS = [5, 17, 200, 3, 99, 42, 255, 0, 128, 64, 7]
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]

# Expected placement of each parameter (keyed by its last path element) on a ("data", "model") mesh
# under DEFAULT_SHARDING_RULES, when every split dimension divides the "model" axis.
SPECS = {
    "embed": P("model", None),  # [vocab, embed]
    "lm_head": P(None, "model"),  # [embed, vocab]
    "q_proj": P(None, "model", None),  # [embed, q_heads, head_dim]
    "k_proj": P(None, "model", None),  # [embed, kv_heads, head_dim]
    "v_proj": P(None, "model", None),
    "o_proj": P("model", None, None),  # [q_heads, head_dim, embed]
    "gate": P(None, "model"),  # [embed, mlp]
    "up": P(None, "model"),
    "down": P("model", None),  # [mlp, embed]
    "weight": P(None),  # RMSNorm [embed]: replicated
}


def flat_params(loaded) -> dict[tuple, jax.Array]:
    """Path -> array for every leaf of the model state."""
    return {path: variable.get_value() for path, variable in nnx.to_flat_state(loaded.state)}


def write_tiny_llama(directory, make_tiny_llama) -> None:
    """The shared tiny Llama with every weight random (norms too) and a word-level tokenizer."""
    model = make_tiny_llama(bos_token_id=1, eos_token_id=2)
    with torch.no_grad():
        for parameter in model.parameters():  # norms too, so no leaf is a constant
            parameter.copy_(0.1 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


@pytest.fixture(scope="module")
def original(tmp_path_factory, make_tiny_llama):
    """The tiny model loaded from its HF folder."""
    directory = tmp_path_factory.mktemp("tiny_llama")
    write_tiny_llama(directory, make_tiny_llama)
    return models.load(directory, require_tokenizer=False)


@pytest.fixture(scope="module")
def orbax_dir(original, tmp_path_factory):
    """The tiny model saved as an orbax checkpoint."""
    directory = tmp_path_factory.mktemp("tiny_orbax") / "checkpoint"
    save_orbax(original, str(directory))
    return directory


@pytest.fixture(scope="module")
def mesh():
    """A 2x2 ("data", "model") mesh over four of the host CPU devices."""
    return jax.make_mesh(
        (2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:4]
    )


def test_save_writes_marker_and_refuses_to_overwrite(original, orbax_dir):
    """The checkpoint folder carries its marker, and saving into it again is refused."""
    assert (orbax_dir / MARKER).is_file()
    with pytest.raises(FileExistsError, match="empty output folder"):
        save_orbax(original, str(orbax_dir))


def test_restore_is_identical(original, orbax_dir):
    """Every parameter, the config, the generation config, the tokenizer and the logits survive bit for bit."""
    restored = models.load(orbax_dir)
    assert restored.config == original.config
    assert restored.generation_config == original.generation_config
    assert restored.source == str(orbax_dir)
    before, after = flat_params(original), flat_params(restored)
    assert sorted(after) == sorted(before)
    assert len(before) == 3 + 2 * 9  # embed, final norm, lm_head + 9 per layer
    for path, value in before.items():
        assert after[path].dtype == value.dtype == jnp.float32, path
        np.testing.assert_array_equal(np.asarray(after[path]), np.asarray(value), err_msg=str(path))
    text = "w3 w250 <s> nothere w17"
    assert restored.tokenizer.encode(text) == original.tokenizer.encode(text) == [6, 253, 1, 0, 20]
    np.testing.assert_array_equal(restored.score(TOKENS), original.score(TOKENS))


def test_restore_onto_mesh(original, orbax_dir, mesh):
    """Restoring with a mesh places each parameter on the NamedSharding its logical axes give, split for real."""
    restored = models.load(orbax_dir, mesh=mesh)
    before = flat_params(original)
    for path, array in flat_params(restored).items():
        spec = SPECS[path[-1]]
        assert array.sharding == NamedSharding(mesh, spec), path
        assert len(array.addressable_shards) == 4, path
        shard_shape = list(array.shape)
        for dim, axis in enumerate(spec):
            if axis == "model":
                shard_shape[dim] //= 2
        assert array.addressable_shards[0].data.shape == tuple(shard_shape), path
        assert array.sharding.is_fully_replicated == ("model" not in spec), path
        np.testing.assert_array_equal(np.asarray(array), np.asarray(before[path]), err_msg=str(path))
    np.testing.assert_allclose(restored.score(TOKENS), original.score(TOKENS), rtol=1e-5, atol=1e-5)


def test_restore_replicates_dims_the_mesh_does_not_divide(original, orbax_dir):
    """On a 4-way "model" axis the 2 KV heads cannot be split, so k/v projections are replicated."""
    wide = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    restored = models.load(orbax_dir, mesh=wide)
    params, before = flat_params(restored), flat_params(original)
    attention = ("layers", 0, "attention")
    assert params[attention + ("q_proj",)].sharding.spec == P(None, "model", None)
    assert params[attention + ("q_proj",)].addressable_shards[0].data.shape == (64, 1, 16)
    for name in ("k_proj", "v_proj"):
        array = params[attention + (name,)]
        assert array.sharding.spec == P(None, None, None)
        assert array.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(array), np.asarray(before[attention + (name,)]))


def test_restore_in_bfloat16(original, orbax_dir):
    """dtype="bfloat16" restores every parameter as bf16, equal to the f32 original cast to bf16."""
    restored = models.load(orbax_dir, dtype="bfloat16")
    before = flat_params(original)
    for path, array in flat_params(restored).items():
        assert array.dtype == jnp.bfloat16, path
        expected = np.asarray(before[path]).astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(array).view(np.uint16), expected.view(np.uint16), err_msg=str(path))
    logits = restored.score(TOKENS)
    assert logits.dtype == np.float32 and np.all(np.isfinite(logits))
