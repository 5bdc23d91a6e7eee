"""The one way every entry point (LLM, the batch command line, the server) loads a model and starts an engine."""

import sys

from models import CheckpointError
from paxkv.config import EngineConfig, LoadConfig
from paxkv.core.engine import Engine
from paxkv.entrypoints.compilation_cache import enable_compilation_cache
from paxkv.parallel.mesh import load_on_mesh


def load_engine(model, engine_config: EngineConfig, load_config: LoadConfig) -> Engine:
    """Load `model` on the engine config's mesh and start an Engine over it; models.load's errors pass through.

    Args:
      model: anything models.load accepts; None is the embedded SmolLM2.
      engine_config: the engine's pool, budgets and mesh.
      load_config: the weights' dtype and quantization, the attention implementation, and whether a tokenizer is
        needed.
    """
    loaded = load_on_mesh(
        model,
        engine_config.mesh_shape,
        dtype=load_config.dtype,
        quantization=load_config.quantization,
        attention_impl=load_config.attention_impl,
        allow_nonfinite_weights=load_config.allow_nonfinite_weights,
        require_tokenizer=not load_config.skip_tokenizer_init,
    )
    return Engine(loaded, engine_config)


def start_command_line_engine(
    model, engine_config: EngineConfig, load_config: LoadConfig, compilation_cache_dir: str | None
) -> Engine:
    """The command lines' start (paxkv and paxkv serve): the compilation cache on, then load_engine; a missing or
    corrupt checkpoint, or a config the model cannot take, exits with `paxkv: <the problem>`, not a traceback.

    Args:
      model, engine_config, load_config: as load_engine takes them.
      compilation_cache_dir: the --compilation_cache_dir flag (None: the default folder).
    """
    enable_compilation_cache(compilation_cache_dir)
    try:
        return load_engine(model, engine_config, load_config)
    except (CheckpointError, ValueError) as e:
        sys.exit(f"paxkv: {e}")
