"""LoadedModel, and the steps every loader shares: an abstract model, a filled state, a tokenizer check."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from models.config import ModelConfig
from models.errors import CheckpointError
from models.generation_config import GenerationConfig
from models.llama import Llama
from models.packed_weights import pack_projections_in_place, panels_pay_here
from models.paged_forward import PagedSequence, greedy_generate
from models.sharding import state_shardings
from models.tokenizer import Tokenizer
from pallas_kernels import bf16_panels_pay


@dataclasses.dataclass
class LoadedModel:
    """A model ready to run: config, tokenizer, generation defaults and the split NNX model."""

    config: ModelConfig
    tokenizer: Tokenizer | None
    generation_config: GenerationConfig
    graphdef: nnx.GraphDef
    state: nnx.State
    source: str
    load_seconds: float = 0.0
    mesh: jax.sharding.Mesh | None = None  # the mesh the parameters were placed on, if any
    quantization: str | None = None  # "int8" where models.load quantized the projections (packed_weights)

    @property
    def model(self) -> Llama:
        """The merged NNX module (a fresh view over the same arrays)."""
        return nnx.merge(self.graphdef, self.state)

    def pack_for_native_matmul(self, mesh: jax.sharding.Mesh | None = None) -> bool:
        """Store the f32 projection weights as the native CPU matmul's panels, in place of their [K, N] arrays (the
        state's variables are updated, one weight at a time), where that pays (models.packed_weights.panels_pay_here);
        whether they are stored so now. bf16 weights under f32 activations become bf16 panels where the CPU has
        AVX-512 BF16 and no AMX (pallas_kernels.bf16_panels_pay). An engine does this when it starts;
        models.packed_weights.unpacked_state gives the plain arrays back.

        Args:
          mesh: the mesh the model will run on, or None for one device.
        """
        model = self.model
        if not panels_pay_here(model.native_matmul, mesh if mesh is not None else self.mesh):
            return False
        pack_projections_in_place(self.state, bf16=model.compute_dtype == jnp.float32 and bf16_panels_pay())
        return True

    def score(self, token_ids, *, page_size: int = 16) -> np.ndarray:  # f32[T, vocab]
        """Logits at every position of a prompt, computed through a temporary page pool.

        Args:
          token_ids: the prompt, at least one token.
          page_size: tokens per page of the temporary pool.
        """
        if len(token_ids) == 0:
            raise ValueError("score() needs at least one token; the prompt is empty")
        sequence = PagedSequence(self.graphdef, self.state, self.config, max_tokens=len(token_ids), page_size=page_size)
        return sequence.feed(token_ids)

    def greedy_generate(self, prompt_ids, max_new_tokens: int, *, stop_at_eos: bool = True) -> list[int]:
        """Greedy completion of one prompt over a private page pool (no engine).

        Args:
          prompt_ids: the prompt's token ids.
          max_new_tokens: the most tokens to generate.
          stop_at_eos: stop after the checkpoint's end-of-sequence token.
        """
        stop = self.generation_config.eos_token_ids if stop_at_eos else ()
        return greedy_generate(
            self.graphdef, self.state, self.config, list(prompt_ids), max_new_tokens, stop_token_ids=stop
        )


def abstract_model(config: ModelConfig, model_kwargs: dict) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and its state as ShapeDtypeStructs, without allocating weights."""
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=None, **model_kwargs))
    return nnx.split(abstract)


def build_state(
    abstract_state: nnx.State,
    params: dict[tuple, np.ndarray],
    mesh: jax.sharding.Mesh | None,
    sharding_rules: dict[str, str | None] | None,
) -> nnx.State:
    """Fill an abstract state with arrays, cast to each variable's dtype, placed on the mesh if given."""
    shardings = state_shardings(abstract_state, mesh, sharding_rules) if mesh is not None else None
    values = {}
    for path, variable in nnx.to_flat_state(abstract_state):
        target = variable.get_value()
        array = np.asarray(params[path]).astype(target.dtype)
        if array.shape != target.shape:
            raise CheckpointError(f"{'/'.join(map(str, path))}: got shape {array.shape}, expected {target.shape}")
        values[path] = jax.device_put(array, shardings[path]) if shardings else jnp.asarray(array)
    state = abstract_state
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(values))
    return state


def check_tokenizer_file(path: str, require_tokenizer: bool) -> None:
    """Fail before reading any weights when a required tokenizer is absent."""
    if require_tokenizer and not os.path.exists(os.path.join(path, "tokenizer.json")):
        raise CheckpointError(
            f"{path} has no tokenizer (tokenizer.json); copy the model's tokenizer.json and "
            "tokenizer_config.json into it, or load weights only (prompts then given as token ids): "
            "--skip_tokenizer_init on the command line, LLM(skip_tokenizer_init=True), or "
            "models.load(require_tokenizer=False)"
        )
