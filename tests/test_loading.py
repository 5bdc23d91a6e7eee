"""models.load on HF folders: sharded safetensors, and placement straight onto a device mesh."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import models


@pytest.fixture(scope="module")
def tiny_llama(make_tiny_llama):
    """A tiny random Llama as transformers builds it."""
    return make_tiny_llama()


def _flat(loaded):
    return {path: np.asarray(variable.get_value()) for path, variable in nnx.to_flat_state(loaded.state)}


def test_sharded_safetensors_load_like_one_file(tiny_llama, tmp_path):
    tiny_llama.save_pretrained(tmp_path / "single")
    tiny_llama.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    single = _flat(models.load(tmp_path / "single", require_tokenizer=False))
    sharded = _flat(models.load(tmp_path / "sharded", require_tokenizer=False))
    assert single.keys() == sharded.keys()
    for path in single:
        np.testing.assert_array_equal(sharded[path], single[path], err_msg=str(path))


def test_hf_folder_loads_onto_a_mesh(tiny_llama_checkpoint):
    folder = tiny_llama_checkpoint()
    mesh = jax.make_mesh(
        (2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:4]
    )
    plain = models.load(folder, require_tokenizer=False)
    on_mesh = models.load(folder, mesh=mesh, require_tokenizer=False)
    expected = {"q_proj": P(None, "model", None), "o_proj": P("model", None, None), "down": P("model", None)}
    plain_values = _flat(plain)
    for path, variable in nnx.to_flat_state(on_mesh.state):
        array = variable.get_value()
        if path[-1] in expected:
            assert array.sharding.spec == expected[path[-1]], path
            assert (
                array.addressable_shards[0].data.shape[expected[path[-1]].index("model")] * 2
                == array.shape[expected[path[-1]].index("model")]
            )
        np.testing.assert_array_equal(np.asarray(array), plain_values[path], err_msg=str(path))
    ids = np.arange(1, 20)
    np.testing.assert_allclose(on_mesh.score(ids), plain.score(ids), rtol=1e-5, atol=1e-5)
