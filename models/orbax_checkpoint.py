"""Orbax checkpoints of a LoadedModel: save once, restore straight onto mesh shardings."""

import json
import os

import jax
from flax import nnx

from models.config import ModelConfig
from models.errors import CheckpointError
from models.generation_config import GenerationConfig
from models.loaded_model import LoadedModel, abstract_model, check_tokenizer_file
from models.packed_weights import unpacked_state
from models.sharding import restore_target, state_shardings
from models.tokenizer import Tokenizer

MARKER = "paxkv_checkpoint.json"
PARAMS_DIR = "params"
FORMAT_VERSION = 1
CHUNK_BYTES = 4 << 20


def save_orbax(loaded, directory: str) -> None:
    """Write params (orbax), config, generation config and tokenizer into `directory`.

    Args:
      loaded: a models.LoadedModel.
      directory: the output folder; it must not already hold a checkpoint.
    """
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    params_dir = os.path.join(directory, PARAMS_DIR)
    if os.path.exists(params_dir):
        raise FileExistsError(f"{params_dir} already exists; choose an empty output folder")
    import orbax.checkpoint as ocp  # here, not at import: it costs every run 0.4 s, and few load orbax

    params = nnx.to_pure_dict(unpacked_state(loaded.state))  # checkpoints hold weights in their own shapes
    # Chunks of at most CHUNK_BYTES, so a restore onto a mesh reads only the chunks its own shards cover
    # (one chunk per array would make every host read, and hold, whole arrays).
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), params)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(params_dir, params, save_args=save_args)
    checkpointer.wait_until_finished()
    if loaded.tokenizer is not None:
        loaded.tokenizer.save(directory)
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": loaded.source,
        "config": loaded.config.to_dict(),
        "generation_config": loaded.generation_config.to_dict(),
    }
    # Written last: its presence marks a complete checkpoint.
    with open(os.path.join(directory, MARKER), "w") as f:
        json.dump(manifest, f, indent=2)


def load_orbax(directory: str, model_kwargs: dict, *, mesh=None, sharding_rules=None, require_tokenizer=True):
    """Restore a checkpoint written by save_orbax, onto `mesh` shardings when given.

    Each device reads only its own shards, so no host holds the whole model at once.

    Args:
      directory: the checkpoint folder.
      model_kwargs: param_dtype, compute_dtype and attention_impl for the model.
      mesh: optional device mesh; default: the first device.
      sharding_rules: logical axis -> mesh axis.
      require_tokenizer: fail when the folder has no tokenizer.json.
    """
    try:
        with open(os.path.join(directory, MARKER)) as f:
            manifest = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{directory}/{MARKER} is corrupt ({e}); re-run scripts/convert_checkpoint.py") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{directory} has checkpoint format {manifest.get('format_version')}, this paxkv reads "
            f"{FORMAT_VERSION}; re-run scripts/convert_checkpoint.py"
        )
    if not {"config", "generation_config"} <= manifest.keys():
        raise CheckpointError(
            f"{directory}/{MARKER} lacks the model config; the checkpoint is incomplete, "
            "re-run scripts/convert_checkpoint.py"
        )
    config = ModelConfig.from_dict(manifest["config"])
    check_tokenizer_file(directory, require_tokenizer)
    graphdef, abstract_state = abstract_model(config, model_kwargs)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = {path: device for path, _ in nnx.to_flat_state(abstract_state)}
    else:
        shardings = state_shardings(abstract_state, mesh, sharding_rules)
    target = restore_target(abstract_state, shardings)
    try:
        import orbax.checkpoint as ocp  # see save_orbax

        restored = ocp.StandardCheckpointer().restore(os.path.join(directory, PARAMS_DIR), target)
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(
            f"cannot restore orbax params from {directory} ({e}); re-run scripts/convert_checkpoint.py"
        ) from None
    nnx.replace_by_pure_dict(abstract_state, restored)
    tokenizer = Tokenizer.from_hf_dir(directory) if os.path.exists(os.path.join(directory, "tokenizer.json")) else None
    return LoadedModel(
        config=config,
        tokenizer=tokenizer,
        generation_config=GenerationConfig.from_dict(manifest["generation_config"]),
        graphdef=graphdef,
        state=abstract_state,
        source=directory,
    )
