"""The native greedy-token kernel (pallas_kernels/cpu_greedy_token.cc) against its jnp reference and jnp.argmax, and
the engine's sampling program's use of it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import greedy_tokens_cpu, greedy_tokens_reference
from pallas_kernels.native_library import native_kernel_error
from paxkv.execution.sampler import SamplingArrays
from paxkv.execution.step import StepBatch, sample_step
from paxkv.scheduling.sampling_params import SamplingParams
from paxkv.scheduling.stopping import NONFINITE_TOKEN

pytestmark = pytest.mark.skipif(native_kernel_error() is not None, reason=f"no native kernels: {native_kernel_error()}")

MARKER = -7


def _cases(seed: int, rows: int, vocab: int) -> np.ndarray:  # f32[rows, vocab]
    """Random logits with the rows that matter planted: ties for the maximum, the maximum first and last, NaN,
    +inf, -inf, a row of -inf, and a row of one repeated value."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    plants = [
        lambda row: row.__setitem__([vocab // 3, vocab - 1], 9.0),  # a tie: the first of the two wins
        lambda row: row.__setitem__(0, 9.0),
        lambda row: row.__setitem__(vocab - 1, 9.0),
        lambda row: row.__setitem__(vocab // 2, np.nan),
        lambda row: row.__setitem__(vocab // 2, np.inf),
        lambda row: row.__setitem__(vocab - 1, -np.inf),
        lambda row: row.__setitem__(slice(None), -np.inf),
        lambda row: row.__setitem__(slice(None), 0.25),
    ]
    for row, plant in zip(logits, plants, strict=False):
        plant(row)
    return logits


# Vocabularies with and without a vector tail (16 and 8 lanes), SmolLM2's and Llama 2's, and a single token.
@pytest.mark.parametrize("rows, vocab", [(8, 49152), (9, 32000), (8, 37), (8, 100), (3, 1), (1, 16), (40, 1000)])
def test_every_row_matches_the_reference_and_argmax_exactly(rows, vocab):
    logits = _cases(rows * vocab, rows, vocab)
    native = np.asarray(jax.jit(greedy_tokens_cpu, static_argnums=1)(logits, MARKER))
    reference = np.asarray(jax.jit(greedy_tokens_reference, static_argnums=1)(logits, MARKER))
    np.testing.assert_array_equal(native, reference)
    finite = np.isfinite(logits).all(axis=-1)
    np.testing.assert_array_equal(native[finite], np.argmax(logits[finite], axis=-1))
    assert (native[~finite] == MARKER).all()
    if rows >= 8 and vocab > 2:  # the planted rows
        assert native[0] == vocab // 3 and native[1] == 0 and native[2] == vocab - 1
        assert list(native[3:7]) == [MARKER] * 4 and native[7] == 0


def test_logits_that_are_not_rows_are_refused():
    with pytest.raises(ValueError, match=r"logits \[S, V\]"):
        greedy_tokens_cpu(jnp.zeros((2, 3, 4)), MARKER)


def _sampling_text(greedy_only: bool, suppress: bool, native: bool = True) -> str:
    """The sampling program's lowered text for 4 rows of a 100-token vocabulary."""
    rows, vocab = 4, 100
    params = [SamplingParams(temperature=0.0)] * rows
    arrays = jax.tree.map(lambda a: jnp.asarray(a)[None], SamplingArrays.from_params(params, [0] * rows, [0] * rows))
    batch = StepBatch(
        inputs=None,
        sampling=arrays,
        token_counts=None,
        prompt_mask=None,
        suppress=jnp.zeros((1, rows, vocab), bool) if suppress else None,
    )
    logits = jnp.zeros((1, rows, vocab), jnp.float32)
    return sample_step.lower(logits, batch, False, greedy_only, native).as_text()


def test_the_sampling_program_takes_the_kernel_only_for_plain_greedy_rows():
    assert "paxkv_cpu_greedy_tokens" in _sampling_text(greedy_only=True, suppress=False)
    assert "paxkv_cpu_greedy_tokens" not in _sampling_text(greedy_only=False, suppress=False)
    assert "paxkv_cpu_greedy_tokens" not in _sampling_text(greedy_only=True, suppress=True)  # min_tokens: jnp


def test_a_program_for_a_model_without_the_native_kernels_never_takes_the_kernel():
    # A CPU process compiling for a TPU (execution.aot), or a model asked for attention_impl="xla": the backend is
    # "cpu" in both, so only the model's own resolved kernels may decide.
    assert "paxkv_cpu_greedy_tokens" not in _sampling_text(greedy_only=True, suppress=False, native=False)


def test_a_nonfinite_greedy_row_samples_the_marker_beside_finite_rows():
    rows, vocab = 3, 64
    logits = np.random.default_rng(1).standard_normal((1, rows, vocab)).astype(np.float32)
    logits[0, 1, 5] = np.nan
    params = [SamplingParams(temperature=0.0)] * rows
    arrays = jax.tree.map(lambda a: jnp.asarray(a)[None], SamplingArrays.from_params(params, [0] * rows, [0] * rows))
    batch = StepBatch(inputs=None, sampling=arrays, token_counts=None, prompt_mask=None, suppress=None)
    tokens = np.asarray(sample_step(jnp.asarray(logits), batch, False, True, True).tokens[0])
    assert tokens[1] == NONFINITE_TOKEN
    np.testing.assert_array_equal(tokens[[0, 2]], np.argmax(logits[0, [0, 2]], axis=-1))


def test_an_engine_samples_natively_only_where_its_model_runs_the_native_kernels(word_level_llama):
    from paxkv import LLM

    engine = dict(num_pages=16, page_size=8, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    tokens = {}
    for impl in ("xla", "auto"):
        llm = LLM(word_level_llama, attention_impl=impl, **engine)
        assert llm.engine.runner.native == (impl == "auto" and native_kernel_error() is None)
        tokens[impl] = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [8]], greedy, use_tqdm=False)]
    assert tokens["xla"] == tokens["auto"]
