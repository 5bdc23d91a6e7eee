"""The jitted engine step: one ragged forward over the page pool, then sampling of one token per row."""

import functools

import jax
from flax import nnx

from paxkv.sampler import SamplingArrays, sample
from paxkv.step_inputs import StepInputs


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def engine_step(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    kv_caches: list[jax.Array],  # num_layers x [num_pages, page_size, 2K, H]
    inputs: StepInputs,
    sampling: SamplingArrays,  # S rows
    token_counts: jax.Array | None,  # i32[S, vocab] generated-token counts, only when a row has penalties
    prompt_mask: jax.Array | None,  # bool[S, vocab] prompt tokens, only when a row has a repetition penalty
    suppress: jax.Array | None,  # bool[S, vocab] tokens a row may not produce yet (min_tokens)
) -> tuple[jax.Array, jax.Array, list[jax.Array]]:  # (i32[S] tokens, f32[S] logprobs, kv_caches)
    """Write the batch's K/V, compute each row's last-token logits, and sample.

    A plain jax.jit over (graphdef, state) with the pool donated, so updates happen in place.

    Args:
      graphdef, state: the split model (graphdef static).
      kv_caches: the page pools, donated.
      inputs: the padded ragged batch.
      sampling: per-row sampling settings, seeds and positions.
      token_counts, prompt_mask, suppress: optional per-row vocabulary arrays (None compiles them away).
    """
    model = nnx.merge(graphdef, state)
    hidden, kv_caches = model(inputs.tokens, inputs.positions, kv_caches, inputs.metadata)
    logits = model.logits(hidden[inputs.logits_indices])  # f32[S, vocab]
    tokens, logprobs = sample(logits, sampling, token_counts, prompt_mask=prompt_mask, suppress=suppress)
    return tokens, logprobs, kv_caches


def num_step_compilations() -> int:
    """How many distinct programs engine_step has compiled in this process."""
    return engine_step._cache_size()
