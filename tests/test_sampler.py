"""The batched sampler: greedy exactness, seeded batch-invariant draws, filtering support and statistics."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import first_argmax
from paxkv.execution.sampler import (
    SamplingArrays,
    apply_penalties,
    filtered_logits,
    gumbel_max,
    row_keys,
    sample,
    top_logprobs,
)
from paxkv.scheduling.sampling_params import SamplingParams

sample_jit = jax.jit(sample)
top_logprobs_jit = jax.jit(top_logprobs, static_argnums=1)

# A known distribution over 8 tokens, stored in shuffled token order so that the sampler's sorted order and
# token ids differ (catches index-mapping mistakes).
PROBS_SORTED = np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.03, 0.02])
TOKEN_OF_RANK = np.array([5, 2, 7, 0, 3, 6, 1, 4])  # token id of the r-th most likely token
PROBS = np.zeros(8)
PROBS[TOKEN_OF_RANK] = PROBS_SORTED
NUM_DRAWS = 2000


def _draw(params: SamplingParams, probs: np.ndarray = PROBS, num: int = NUM_DRAWS) -> np.ndarray:
    """`num` tokens from log(probs) with one seed and positions 0..num-1, as one jitted batch."""
    arrays = SamplingArrays.from_params([params] * num, positions=list(range(num)))
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(probs, jnp.float32)), (num, len(probs)))
    tokens, _ = sample_jit(logits, arrays)
    return np.asarray(tokens)


def _check_frequencies(tokens: np.ndarray, expected: np.ndarray):
    """Tokens with expected probability 0 never appear; the others match within 5 binomial sigmas.

    Each token's count is Binomial(N, q), with mean N*q and standard deviation sqrt(N*q*(1-q)). A 5-sigma band
    fails by chance with probability about 6e-7 per token under the normal approximation; for the rarest
    tokens here the exact binomial tail is larger but still small (q = 0.02, N*q = 40: 2.6e-6; q = 0.0022 in
    the temperature test, N*q = 4.3: 4.7e-5). The seed is fixed, so the test is deterministic anyway. A wrong
    support or renormalization shifts some count by far more (q = 0.46 vs 0.30 at N = 2000 is 320 draws, 15
    sigmas).
    """
    counts = np.bincount(tokens, minlength=len(expected))
    assert np.all(counts[expected == 0] == 0), f"tokens outside the support were drawn: {counts}"
    n = len(tokens)
    sigma = np.sqrt(n * expected * (1 - expected))
    assert np.all(np.abs(counts - n * expected) <= 5 * sigma + 1e-9), (counts, n * expected)


def _renormalized(keep_ranks: int, probs_sorted: np.ndarray = PROBS_SORTED) -> np.ndarray:
    """Expected token probabilities when only the `keep_ranks` most likely tokens stay."""
    expected_sorted = np.where(np.arange(len(probs_sorted)) < keep_ranks, probs_sorted, 0.0)
    expected = np.zeros(len(probs_sorted))
    expected[TOKEN_OF_RANK] = expected_sorted / expected_sorted.sum()
    return expected


def test_unfiltered_sampling_matches_distribution():
    _check_frequencies(_draw(SamplingParams(seed=11)), PROBS)


def test_temperature_sharpens_distribution():
    # Temperature 0.5 squares the probabilities before renormalizing: softmax(log p / 0.5) = p^2 / sum(p^2).
    expected = PROBS**2 / np.sum(PROBS**2)
    _check_frequencies(_draw(SamplingParams(seed=12, temperature=0.5)), expected)


def test_top_k_restricts_support():
    # top_k = 3 keeps the three most likely tokens, renormalized: 0.30, 0.20, 0.15 over 0.65.
    _check_frequencies(_draw(SamplingParams(seed=13, top_k=3)), _renormalized(3))


def test_top_p_restricts_support():
    # Cumulative sorted mass: 0.30, 0.50, 0.65, 0.77, ... The smallest prefix with mass >= 0.6 is three tokens.
    _check_frequencies(_draw(SamplingParams(seed=14, top_p=0.6)), _renormalized(3))
    # top_p = 0.25 < p_max: only the top token stays.
    tokens = _draw(SamplingParams(seed=15, top_p=0.25))
    assert np.all(tokens == TOKEN_OF_RANK[0])


def test_top_p_applies_after_top_k():
    # top_k = 4 renormalizes to 0.30, 0.20, 0.15, 0.12 over 0.77: masses 0.390, 0.649, 0.844, 1.0. top_p = 0.8
    # then keeps three tokens (mass before the fourth, 0.844, is not < 0.8); over the full distribution it
    # would have kept five (0.77 < 0.8).
    _check_frequencies(_draw(SamplingParams(seed=16, top_k=4, top_p=0.8)), _renormalized(3))


def test_min_p_removes_unlikely_tokens():
    # min_p = 0.3: the threshold is 0.3 * p_max = 0.09, so 0.10 and up stay (five tokens), 0.08 and below go.
    _check_frequencies(_draw(SamplingParams(seed=17, min_p=0.3)), _renormalized(5))
    # min_p = 1 keeps only the most likely token.
    assert np.all(_draw(SamplingParams(seed=18, min_p=1.0), num=64) == TOKEN_OF_RANK[0])


def _sorted_filter_reference(scaled: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The filters as a stable descending sort defines them (numpy, float64 masses): which tokens stay. bool[V]."""
    order = np.argsort(-scaled, kind="stable")  # descending, ties in token-id order
    ranked = scaled[order].astype(np.float64)
    keep = np.arange(len(scaled)) < (len(scaled) if top_k <= 0 else top_k)
    probs = np.where(keep, np.exp(ranked - ranked[0]), 0.0)
    probs /= probs.sum()
    if top_p < 1.0:
        keep &= np.cumsum(probs) - probs < top_p
    keep &= ranked >= ranked[0] + (np.log(min_p) if min_p > 0 else -np.inf)
    kept = np.zeros(len(scaled), bool)
    kept[order] = keep
    return kept


@pytest.mark.parametrize("case", range(6))
def test_filters_keep_what_a_stable_sort_keeps(case):
    """Random rows, some with many exact ties (logits on a coarse grid) and -inf entries, against the sort."""
    rng = np.random.default_rng(case)
    rows, vocab = 24, 300
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 3
    logits[::2] = np.round(logits[::2])  # a few distinct values: ties at every boundary
    logits[rng.random(size=logits.shape) < 0.1] = -np.inf
    params = [
        SamplingParams(
            seed=row,
            temperature=float(rng.choice([0.5, 1.0, 1.7])),
            top_k=int(rng.choice([-1, 1, 5, 40, 299])),
            top_p=float(rng.choice([1.0, 0.3, 0.9, 0.999])),
            min_p=float(rng.choice([0.0, 0.05, 0.5])),
        )
        for row in range(rows)
    ]
    arrays = SamplingArrays.from_params(params, positions=[0] * rows)
    kept = np.asarray(jax.jit(filtered_logits)(jnp.asarray(logits), arrays))
    for row, p in enumerate(params):
        scaled = logits[row] / np.float32(p.temperature)
        expected = _sorted_filter_reference(scaled, p.top_k, p.top_p, p.min_p) & np.isfinite(scaled)
        np.testing.assert_array_equal(np.isfinite(kept[row]), expected, err_msg=f"row {row}: {p}")
        np.testing.assert_allclose(kept[row][expected], scaled[expected], rtol=1e-6)  # XLA may divide by 1/T


def test_greedy_rows_are_exact_argmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, 1000)).astype(np.float32) * 4
    logits[3, [10, 20]] = 100.0  # a tie: argmax takes the first
    params = [SamplingParams(temperature=0.0 if row % 2 else 0.9, seed=row, top_k=5) for row in range(8)]
    arrays = SamplingArrays.from_params(params, positions=[7] * 8)
    tokens, logprobs = sample_jit(jnp.asarray(logits), arrays)
    greedy_rows = [1, 3, 5, 7]
    np.testing.assert_array_equal(np.asarray(tokens)[greedy_rows], np.argmax(logits, axis=-1)[greedy_rows])
    assert int(tokens[3]) == 10
    # A greedy row's log-prob is taken under the (penalized) logits at temperature 1.
    expected = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)[jnp.arange(8), jnp.argmax(logits, axis=-1)]
    np.testing.assert_allclose(np.asarray(logprobs)[greedy_rows], np.asarray(expected)[greedy_rows], rtol=1e-6)
    # An all-greedy batch (the fast path) gives the same argmax.
    all_greedy = SamplingArrays.from_params([SamplingParams(temperature=0.0)] * 8, positions=[0] * 8)
    np.testing.assert_array_equal(np.asarray(sample_jit(jnp.asarray(logits), all_greedy)[0]), np.argmax(logits, -1))


def test_first_argmax_and_gumbel_max_are_jaxs_own():
    """The two-reduction argmax picks what jnp.argmax picks (first of tied maxima, first NaN, 0 for a row of -inf),
    and the Gumbel-max draw is jax.random.categorical's, key for key."""
    rng = np.random.default_rng(3)
    values = rng.integers(-3, 3, (64, 37)).astype(np.float32)  # many ties
    values[rng.random(values.shape) < 0.1] = -np.inf
    values[rng.random(values.shape) < 0.02] = np.nan
    values[5] = -np.inf
    values[6, [4, 9]] = np.nan
    assert np.isnan(values).any(axis=-1).sum() >= 3
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(values))), np.asarray(jnp.argmax(values, -1)))
    arrays = SamplingArrays.from_params([SamplingParams(temperature=1.0, seed=row) for row in range(16)], [9] * 16)
    logits = jnp.asarray(rng.normal(size=(16, 500)).astype(np.float32))
    keys = row_keys(arrays)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(gumbel_max)(keys, logits)), np.asarray(jax.vmap(jax.random.categorical)(keys, logits))
    )


def test_sampled_logprob_is_under_final_distribution():
    # top_k = 2 leaves 0.30 and 0.20; the drawn token's log-prob is log(p / 0.5).
    params = SamplingParams(seed=3, top_k=2)
    arrays = SamplingArrays.from_params([params] * 16, positions=list(range(16)))
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS, jnp.float32)), (16, 8))
    tokens, logprobs = sample_jit(logits, arrays)
    np.testing.assert_allclose(np.asarray(logprobs), np.log(PROBS[np.asarray(tokens)] / 0.5), rtol=1e-5)


def test_seeded_sampling_is_reproducible():
    params = SamplingParams(seed=42, temperature=1.0)
    arrays = SamplingArrays.from_params([params] * 64, positions=list(range(64)))
    logits = jnp.zeros((64, 1000), jnp.float32)  # uniform: every draw is pure noise
    first, _ = sample_jit(logits, arrays)
    second, _ = sample_jit(logits, arrays)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    assert len(set(np.asarray(first).tolist())) > 32, "positions must give different draws"
    other_seed = SamplingArrays.from_params([params] * 64, positions=list(range(64)), seeds=[43] * 64)
    assert not np.array_equal(np.asarray(first), np.asarray(sample_jit(logits, other_seed)[0]))


def test_sampling_is_independent_of_batch_composition():
    rng = np.random.default_rng(1)
    vocab = 512
    targets = [
        SamplingParams(seed=1234, temperature=0.8, top_k=50, top_p=0.9),
        SamplingParams(seed=7, temperature=1.3, min_p=0.01, repetition_penalty=1.2, presence_penalty=0.5),
        SamplingParams(seed=2**40 + 5, temperature=1.0),
    ]
    target_logits = rng.normal(size=(len(targets), vocab)).astype(np.float32) * 3
    target_counts = rng.integers(0, 3, size=(len(targets), vocab)).astype(np.int32)
    positions = [17, 300, 5]

    # Each target alone (B = 1).
    alone = [
        sample_jit(
            jnp.asarray(target_logits[i : i + 1]),
            SamplingArrays.from_params([targets[i]], [positions[i]]),
            jnp.asarray(target_counts[i : i + 1]),
        )
        for i in range(len(targets))
    ]

    # Each target at row 5 of 8, among random neighbours with other seeds and settings.
    for i, target in enumerate(targets):
        batch_logits = rng.normal(size=(8, vocab)).astype(np.float32) * 3
        batch_counts = rng.integers(0, 3, size=(8, vocab)).astype(np.int32)
        batch_logits[5], batch_counts[5] = target_logits[i], target_counts[i]
        neighbours = [SamplingParams(seed=int(s), temperature=0.7, top_p=0.95) for s in rng.integers(0, 1000, 8)]
        params = neighbours[:5] + [target] + neighbours[6:]
        batch_positions = [int(p) for p in rng.integers(0, 1000, 8)]
        batch_positions[5] = positions[i]
        tokens, logprobs = sample_jit(
            jnp.asarray(batch_logits),
            SamplingArrays.from_params(params, batch_positions),
            jnp.asarray(batch_counts),
        )
        assert int(tokens[5]) == int(alone[i][0][0])
        np.testing.assert_allclose(float(logprobs[5]), float(alone[i][1][0]), rtol=1e-5, atol=1e-6)

    # All targets together, in reverse order, padded to B = 4 (the padding row is greedy).
    order = [2, 1, 0]
    tokens, _ = sample_jit(
        jnp.asarray(np.concatenate([target_logits[order], np.zeros((1, vocab), np.float32)])),
        SamplingArrays.from_params([targets[j] for j in order], [positions[j] for j in order], batch_size=4),
        jnp.asarray(np.concatenate([target_counts[order], np.zeros((1, vocab), np.int32)])),
    )
    np.testing.assert_array_equal(np.asarray(tokens)[:3], [int(alone[j][0][0]) for j in order])


def test_penalties_hand_worked():
    # logits [2.0, -1.0, 0.5, 3.0]; generated counts [1, 2, 0, 0]; token 2 is in the prompt only.
    # repetition 2.0, frequency 0.25, presence 0.5:
    #   token 0: seen, positive: 2.0 / 2 = 1.0;   then - 0.25 * 1 - 0.5 = 0.25
    #   token 1: seen, negative: -1.0 * 2 = -2.0; then - 0.25 * 2 - 0.5 = -3.0
    #   token 2: prompt only (repetition only): 0.5 / 2 = 0.25; not generated, so no frequency/presence
    #   token 3: unseen: 3.0
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    arrays = SamplingArrays.from_params([params], positions=[0], seeds=[0])
    logits = jnp.array([[2.0, -1.0, 0.5, 3.0]])
    counts = jnp.array([[1, 2, 0, 0]], jnp.int32)
    prompt_mask = jnp.array([[False, False, True, False]])
    out = apply_penalties(logits, arrays, counts, prompt_mask)
    np.testing.assert_array_equal(np.asarray(out), [[0.25, -3.0, 0.25, 3.0]])
    # Without the prompt mask, token 2 is unseen and keeps 0.5.
    np.testing.assert_array_equal(np.asarray(apply_penalties(logits, arrays, counts)), [[0.25, -3.0, 0.5, 3.0]])
    # Neutral settings leave the logits unchanged.
    neutral = SamplingArrays.from_params([SamplingParams()], positions=[0], seeds=[0])
    np.testing.assert_array_equal(np.asarray(apply_penalties(logits, neutral, counts, prompt_mask)), logits)


def test_penalties_steer_greedy_choice():
    # logits [3.0, 2.9]; token 0 generated 4 times. frequency 0.1: 3.0 - 0.4 = 2.6 < 2.9, so token 1 wins.
    logits = jnp.array([[3.0, 2.9], [3.0, 2.9]])
    counts = jnp.array([[4, 0], [4, 0]], jnp.int32)
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.1), SamplingParams(temperature=0.0)]
    tokens, _ = sample_jit(logits, SamplingArrays.from_params(params, positions=[0, 0]), counts)
    np.testing.assert_array_equal(np.asarray(tokens), [1, 0])


def test_suppress_masks_tokens():
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS, jnp.float32)), (256, 8))
    suppress = jnp.zeros((256, 8), bool).at[:, TOKEN_OF_RANK[0]].set(True)
    params = [SamplingParams(temperature=0.0)] + [SamplingParams(seed=5)] * 255
    tokens, _ = sample_jit(logits, SamplingArrays.from_params(params, list(range(256))), suppress=suppress)
    assert int(tokens[0]) == TOKEN_OF_RANK[1]
    assert not np.any(np.asarray(tokens) == TOKEN_OF_RANK[0])


def test_jit_matches_eager():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(4, 64)).astype(np.float32))
    counts = jnp.asarray(rng.integers(0, 2, size=(4, 64)).astype(np.int32))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(seed=1, top_k=10),
        SamplingParams(seed=2, top_p=0.5, repetition_penalty=1.5),
        SamplingParams(seed=3, min_p=0.2, frequency_penalty=-0.5),
    ]
    arrays = SamplingArrays.from_params(params, positions=[3, 4, 5, 6])
    traces = []

    def traced_sample(*args):
        traces.append(1)  # runs once per trace, i.e. once per compilation
        return sample(*args)

    local_jit = jax.jit(traced_sample)
    eager = sample(logits, arrays, counts)
    jitted = local_jit(logits, arrays, counts)
    np.testing.assert_array_equal(np.asarray(eager[0]), np.asarray(jitted[0]))
    np.testing.assert_allclose(np.asarray(eager[1]), np.asarray(jitted[1]), rtol=1e-5)
    # The same compiled function serves other settings of the same shapes: settings are data, not constants.
    other = SamplingArrays.from_params([SamplingParams(seed=9, temperature=2.0)] * 4, positions=[0, 1, 2, 3])
    local_jit(logits, other, counts)
    assert len(traces) == 1


def test_greedy_only_is_the_general_path_on_greedy_rows():
    """sample(greedy_only=True), which compiles only the argmax, gives an all-greedy batch the general path's tokens
    and log-probabilities, penalties and suppressed tokens included; all_greedy says when a batch qualifies."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(4, 64)).astype(np.float32))
    counts = jnp.asarray(rng.integers(0, 3, size=(4, 64)).astype(np.int32))
    suppress = jnp.zeros((4, 64), bool).at[:, jnp.argmax(logits, axis=-1)].set(True)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, presence_penalty=-0.7, seed=4),
    ]
    arrays = SamplingArrays.from_params(params, positions=[3, 4, 5], batch_size=4)
    assert arrays.all_greedy()
    general = sample(logits, arrays, counts, suppress=suppress)
    greedy = jax.jit(functools.partial(sample, greedy_only=True))(logits, arrays, counts, suppress=suppress)
    np.testing.assert_array_equal(np.asarray(greedy[0]), np.asarray(general[0]))
    np.testing.assert_allclose(np.asarray(greedy[1]), np.asarray(general[1]), rtol=1e-6)
    assert not SamplingArrays.from_params([*params, SamplingParams(temperature=0.5, seed=1)], [0] * 4).all_greedy()


def test_top_logprobs():
    logits = jnp.log(jnp.asarray(PROBS, jnp.float32))[None] + 5.0  # a shift does not change log-probs
    ids, values = top_logprobs_jit(logits, 3)
    np.testing.assert_array_equal(np.asarray(ids), [TOKEN_OF_RANK[:3]])
    np.testing.assert_allclose(np.asarray(values), [np.log(PROBS_SORTED[:3])], rtol=1e-5)


def test_from_params_padding_and_seeds():
    params = [SamplingParams(seed=2**32 + 7, top_k=-1), SamplingParams(temperature=0.0)]
    arrays = SamplingArrays.from_params(params, positions=[10, 11], batch_size=4)
    assert arrays.batch_size == 4
    np.testing.assert_array_equal(arrays.seeds, [7, 0, 0, 0])  # seeds are taken mod 2**32
    np.testing.assert_array_equal(arrays.positions, [10, 11, 0, 0])
    np.testing.assert_array_equal(arrays.temperature, [1.0, 0.0, 0.0, 0.0])  # padding rows are greedy
    np.testing.assert_array_equal(arrays.top_k, [0, 0, 0, 0])
    np.testing.assert_array_equal(arrays.repetition_penalty, [1.0] * 4)
    overridden = SamplingArrays.from_params(params, positions=[10, 11], seeds=[None, 99])
    np.testing.assert_array_equal(overridden.seeds, [7, 99])


def test_from_params_errors():
    with pytest.raises(ValueError, match=r"row 0 samples \(temperature 1.0\) but has no seed"):
        SamplingArrays.from_params([SamplingParams()], positions=[0])
    with pytest.raises(ValueError, match="batch_size 1 is smaller than the 2 rows"):
        SamplingArrays.from_params([SamplingParams(seed=1)] * 2, positions=[0, 0], batch_size=1)
    with pytest.raises(ValueError, match="got 1 positions for 2 rows"):
        SamplingArrays.from_params([SamplingParams(seed=1)] * 2, positions=[0])
    with pytest.raises(ValueError, match="got 3 seeds for 2 rows"):
        SamplingArrays.from_params([SamplingParams(seed=1)] * 2, positions=[0, 0], seeds=[1, 2, 3])


def test_sampling_arrays_is_a_pytree():
    arrays = SamplingArrays.from_params([SamplingParams(seed=1)], positions=[0])
    leaves, treedef = jax.tree_util.tree_flatten(arrays)
    assert len(leaves) == 9
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(rebuilt), leaves, strict=True))
    moved = jax.tree_util.tree_map(jnp.asarray, arrays)
    assert isinstance(moved, SamplingArrays) and moved.seeds.dtype == jnp.uint32
